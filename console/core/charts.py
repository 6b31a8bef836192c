"""Plotly time-series charts for console pages, as HTML fragments. Pages load plotly.js once
(``{% url 'plotly-js' %}``, served from the installed plotly package: no CDN), so fragments
carry no library. Called by page views while rendering (blocking, pure: no queries); an
empty series gives an empty-state paragraph instead of an empty chart."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from html import escape
from typing import Any

Series = Sequence[tuple[datetime, float]]

# One colour per request path, the same on every page.
PATH_COLOURS = {"remote": "#1f6feb", "local": "#2da44e", "fallback": "#d29922"}


def _html(fig: Any) -> str:
    return str(
        fig.to_html(
            full_html=False,
            include_plotlyjs=False,
            config={"responsive": True, "displaylogo": False},
        )
    )


def empty_chart(title: str, hint: str) -> str:
    """The empty state of a chart: its title and what would fill it."""
    return (
        f'<div class="chart-empty"><strong>{escape(title)}</strong>'
        f'<p class="muted">No data yet. {escape(hint)}</p></div>'
    )


def time_chart(
    *,
    title: str,
    lines: dict[str, Series],
    y_title: str,
    hint: str,
    limits: dict[str, float] | None = None,
    step: bool = False,
    from_zero: bool = False,
    height: int = 260,
    events: Sequence[tuple[datetime, str]] = (),
) -> str:
    """Lines over time (one per key of ``lines``), with optional horizontal limit lines
    (``{"ceiling": 0.7}``) and vertical event markers (``[(at, "v12")]``: config versions, so
    "the link changed" and "the configuration changed" are one look). A line named after a
    path (``remote``, ``local p99``) takes that path's colour, dashed for p99. ``hint`` says
    where the data comes from when there is none."""
    if not any(lines.values()):
        return empty_chart(title, hint)
    import plotly.graph_objects as go  # heavy import, only for pages that draw

    fig = go.Figure()
    for name, points in lines.items():
        if not points:
            continue
        fig.add_trace(
            go.Scatter(
                x=[at for at, _ in points],
                y=[value for _, value in points],
                name=name,
                mode="lines+markers" if len(points) < 60 else "lines",
                line={
                    "shape": "hv" if step else "linear",
                    "color": PATH_COLOURS.get(name.split(" ")[0]),
                    "dash": "dot" if name.endswith(" p99") else "solid",
                },
                marker={"size": 4},
            )
        )
    for label, value in (limits or {}).items():
        fig.add_hline(
            y=value,
            line={"dash": "dash", "color": "#cf222e"},
            annotation_text=label,
            annotation_position="top left",
        )
    first = min((at for points in lines.values() for at, _ in points), default=None)
    for at, label in events:
        if first is not None and at >= first:  # only events inside the charted window
            fig.add_vline(x=at, line={"dash": "dot", "color": "#8250df", "width": 1})
            fig.add_annotation(
                x=at, y=1, yref="paper", text=label, showarrow=False, yanchor="bottom",
                font={"size": 10, "color": "#8250df"},
            )  # fmt: skip
    fig.update_layout(
        title={"text": title, "font": {"size": 14}},
        yaxis_title=y_title,
        yaxis_rangemode="tozero" if from_zero else "normal",
        height=height,
        margin={"l": 55, "r": 15, "t": 40, "b": 35},
        legend={"orientation": "h", "y": -0.2},
        template="plotly_white",
    )
    return _html(fig)


def xy_chart(
    *,
    title: str,
    lines: dict[str, tuple[Sequence[float], Sequence[float]]],
    x_title: str,
    y_title: str,
    log_x: bool = False,
    log_y: bool = False,
    height: int = 320,
    step: bool = False,
) -> str:
    """Lines of (x, y) points, e.g. KV bytes against prompt tokens; ``step`` draws each value
    flat until the next x (hourly prices)."""
    import plotly.graph_objects as go

    fig = go.Figure()
    for name, (xs, ys) in lines.items():
        fig.add_trace(
            go.Scatter(
                x=list(xs),
                y=list(ys),
                name=name,
                mode="lines+markers",
                line={"shape": "hv" if step else "linear"},
            )
        )
    fig.update_layout(
        title={"text": title, "font": {"size": 14}},
        xaxis_title=x_title,
        yaxis_title=y_title,
        xaxis_type="log" if log_x else "linear",
        yaxis_type="log" if log_y else "linear",
        height=height,
        margin={"l": 60, "r": 15, "t": 40, "b": 40},
        legend={"orientation": "h", "y": -0.25},
        template="plotly_white",
    )
    return _html(fig)

"""Plotly chart of the recorded-traffic cost comparison (``console.schedules.recorded``), as an
HTML fragment for the tidal page. Pure (no Django, no queries): takes the dict
``selectors.tidal_recorded_cost`` returns. The page loads plotly.js once
(``{% url 'plotly-js' %}``), so the fragment carries no library; no recorded traffic gives the
empty-state paragraph instead of a chart."""

from __future__ import annotations

import math
from datetime import datetime
from typing import Any

from console.core.charts import _html, empty_chart

TITLE = "Cost per million tokens by hour, recorded traffic"
SCHEDULED = "with the schedule"
STATIC = "without the schedule"


def _money(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def recorded_cost_chart(answer: dict[str, Any]) -> str:
    """Cost per million tokens of each recorded hour with and without the schedule (hours
    without a sample are gaps in both lines: ``None``, never joined), and the remote instances
    the schedule held (bars, right axis). The title carries the two totals."""
    if answer["empty"]:
        return empty_chart(
            TITLE,
            "The gateway scrape records requests per second by path while the deployment "
            "serves (orchestrator.telemetry.collect_gateways).",
        )
    import plotly.graph_objects as go  # heavy import, only for pages that draw

    hours = answer["hours"]
    # Plotly has no time zones: plot the schedule's wall clock (the axis names the zone).
    x = [datetime.fromisoformat(h["hour_start"]).replace(tzinfo=None) for h in hours]
    fig = go.Figure()
    fig.add_trace(
        go.Bar(
            x=x,
            y=[h["scheduled"]["remote_instances"] for h in hours],
            name="remote instances held",
            yaxis="y2",
            marker={"color": "#d0d7de"},
            opacity=0.6,
        )
    )
    for key, name, colour in (
        ("scheduled", SCHEDULED, "#1f6feb"),
        ("static", STATIC, "#cf222e"),
    ):
        fig.add_trace(
            go.Scatter(
                x=x,
                y=[h[key]["cost_per_million_tokens"] for h in hours],
                name=name,
                mode="lines+markers" if len(hours) <= 48 else "lines",
                connectgaps=False,
                line={"shape": "hv", "color": colour},
                marker={"size": 4},
            )
        )
    top = max((h["scheduled"]["remote_instances"] for h in hours), default=0) or 1
    totals = answer["totals"]
    title = (
        f"{TITLE}: {_money(totals['scheduled']['cost_per_million_tokens'])} with, "
        f"{_money(totals['static']['cost_per_million_tokens'])} without"
    )
    fig.update_layout(
        title={"text": title, "font": {"size": 14}},
        xaxis={"title": f"hour ({answer['window']['timezone']})"},
        yaxis={"title": "cost / M tokens", "rangemode": "tozero"},
        yaxis2={
            "title": "remote instances",
            "overlaying": "y",
            "side": "right",
            "range": [0, top * 1.1],
            "dtick": max(1, math.ceil(top / 5)),  # whole instances
            "showgrid": False,
        },
        height=320,
        margin={"l": 60, "r": 60, "t": 40, "b": 40},
        legend={"orientation": "h", "y": -0.25},
        template="plotly_white",
        bargap=0.1,
    )
    return _html(fig)

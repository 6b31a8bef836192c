"""The drill report's timeline chart: requests per second by path over the drill, with the
fault window shaded and the recovery moment marked. Called by the report page while rendering
(blocking, pure: reads only the report's stored ``timeline``, no queries)."""

from __future__ import annotations

from typing import Any

from console.core.charts import PATH_COLOURS, _html, empty_chart

TITLE = "Requests by path"
# Aim for about this many buckets whatever the drill's length, so long drills stay readable.
TARGET_BUCKETS = 120


def bucket_counts(timeline: dict[str, Any]) -> tuple[float, dict[str, list[tuple[float, float]]]]:
    """Requests per second by path, per bucket of the timeline's rows (each row stands for
    ``sampled_every`` requests). Returns the bucket width (s) and ``{path: [(t, rate)]}``;
    failed requests form their own ``failed`` series whatever path they took."""
    columns = timeline.get("columns") or []
    rows = timeline.get("rows") or []
    if not rows or "t" not in columns or "path" not in columns:
        return 1.0, {}
    at, path_at, outcome_at = columns.index("t"), columns.index("path"), columns.index("outcome")
    weight = float(timeline.get("sampled_every") or 1)
    end = max(float(row[at]) for row in rows)
    width = max(1.0, round(end / TARGET_BUCKETS))
    counts: dict[str, dict[int, float]] = {}
    for row in rows:
        path = str(row[path_at] or "none") if row[outcome_at] == "ok" else "failed"
        bucket = counts.setdefault(path, {})
        index = int(float(row[at]) // width)
        bucket[index] = bucket.get(index, 0.0) + weight
    buckets = int(end // width) + 1
    series = {
        path: [(i * width, by_bucket.get(i, 0.0) / width) for i in range(buckets)]
        for path, by_bucket in sorted(counts.items())
    }
    return width, series


def timeline_chart(timeline: dict[str, Any]) -> str:
    """The stacked requests-by-path chart (HTML fragment), or an empty state."""
    width, series = bucket_counts(timeline)
    if not series:
        return empty_chart(TITLE, "The drill's report step stores one row per request.")
    import plotly.graph_objects as go  # heavy import, only when a report has a timeline

    fig = go.Figure()
    for path, points in series.items():
        fig.add_trace(
            go.Scatter(
                x=[t for t, _ in points],
                y=[rate for _, rate in points],
                name=path,
                mode="lines",
                stackgroup="paths",
                line={"shape": "hv", "color": PATH_COLOURS.get(path, "#cf222e")},
            )
        )
    marks = timeline.get("marks") or {}
    if marks.get("injected") is not None and marks.get("restored") is not None:
        fig.add_vrect(
            x0=marks["injected"],
            x1=marks["restored"],
            fillcolor="#cf222e",
            opacity=0.12,
            line_width=0,
            annotation_text="fault",
            annotation_position="top left",
        )
    if marks.get("recovered") is not None:
        fig.add_vline(
            x=marks["recovered"],
            line={"dash": "dash", "color": PATH_COLOURS["remote"]},
            annotation_text="remote again",
            annotation_position="top right",
        )
    fig.update_layout(
        title={"text": f"{TITLE} (per second, {width:g} s buckets)", "font": {"size": 14}},
        xaxis_title="seconds since load started",
        yaxis_title="requests / s",
        height=300,
        margin={"l": 55, "r": 15, "t": 40, "b": 40},
        legend={"orientation": "h", "y": -0.25},
        template="plotly_white",
    )
    return _html(fig)

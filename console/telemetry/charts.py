"""Charts of one subject's history (a node, a link): one query for every series, one chart
per ``ChartSpec``. Called by page views while rendering (blocking)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime

from django.db import models

from console.core.charts import time_chart
from console.telemetry.selectors import series_by_label


@dataclass(frozen=True)
class ChartSpec:
    """A chart: ``lines`` maps each line's label to the metric name it draws."""

    title: str
    lines: dict[str, str]
    y_title: str
    limits: dict[str, float] = field(default_factory=dict)
    step: bool = False
    from_zero: bool = False


def history_charts(
    *,
    subject: models.Model,
    since: datetime,
    hint: str,
    specs: list[ChartSpec],
    events: Sequence[tuple[datetime, str]] = (),
) -> list[str]:
    """The charts of ``specs`` over ``subject``'s samples since ``since``; ``hint`` says what
    records them (shown by charts that have no data); ``events`` are marked on every chart."""
    wanted = sorted({name for spec in specs for name in spec.lines.values()})
    data = series_by_label(subject=subject, names=wanted, since=since)
    return [
        time_chart(
            title=spec.title,
            lines={label: data.get((name, ""), []) for label, name in spec.lines.items()},
            y_title=spec.y_title,
            hint=hint,
            limits=spec.limits,
            step=spec.step,
            from_zero=spec.from_zero,
            events=events,
        )
        for spec in specs
    ]

"""Reads of telemetry: a series for charts, the latest value, simple aggregates for gates."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from django.db import models
from django.db.models import Avg, Count, Max, Min

from console.telemetry.models import MetricSample
from console.telemetry.services import subject_key


def series(
    *,
    subject: models.Model,
    name: str,
    since: datetime | None = None,
    until: datetime | None = None,
    labels: dict[str, Any] | None = None,
    limit: int = 5000,
) -> list[tuple[datetime, float]]:
    """(time, value) pairs in time order, the most recent ``limit`` of them."""
    subject_type, subject_id = subject_key(subject)
    qs = MetricSample.objects.filter(subject_type=subject_type, subject_id=subject_id, name=name)
    if since is not None:
        qs = qs.filter(at__gte=since)
    if until is not None:
        qs = qs.filter(at__lt=until)
    if labels:
        qs = qs.filter(**{f"labels__{key}": value for key, value in labels.items()})
    rows = list(qs.order_by("-at", "-id").values_list("at", "value")[:limit])
    rows.reverse()
    return rows


def latest(*, subject: models.Model, name: str) -> tuple[datetime, float] | None:
    subject_type, subject_id = subject_key(subject)
    return (
        MetricSample.objects.filter(subject_type=subject_type, subject_id=subject_id, name=name)
        .order_by("-at", "-id")
        .values_list("at", "value")
        .first()
    )


def summary(
    *, subject: models.Model, name: str, since: datetime, until: datetime | None = None
) -> dict[str, float | int | None]:
    """count / min / max / mean of a series over a window (None values when it is empty)."""
    subject_type, subject_id = subject_key(subject)
    qs = MetricSample.objects.filter(
        subject_type=subject_type, subject_id=subject_id, name=name, at__gte=since
    )
    if until is not None:
        qs = qs.filter(at__lt=until)
    return qs.aggregate(count=Count("id"), min=Min("value"), max=Max("value"), mean=Avg("value"))

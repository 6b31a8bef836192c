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


def series_by_label(
    *,
    subject: models.Model,
    names: list[str],
    label: str | None = None,
    since: datetime | None = None,
    limit: int = 5000,
) -> dict[tuple[str, str], list[tuple[datetime, float]]]:
    """Several series of one subject in one query, keyed by ``(name, labels[label])``
    (``label`` None: keyed by ``(name, "")``), each in time order, the most recent ``limit``
    samples overall. For pages that draw a chart per metric and a line per path."""
    subject_type, subject_id = subject_key(subject)
    qs = MetricSample.objects.filter(
        subject_type=subject_type, subject_id=subject_id, name__in=names
    )
    if since is not None:
        qs = qs.filter(at__gte=since)
    rows = list(qs.order_by("-at", "-id").values_list("name", "labels", "at", "value")[:limit])
    grouped: dict[tuple[str, str], list[tuple[datetime, float]]] = {}
    for name, labels, at, value in reversed(rows):
        key = str((labels or {}).get(label, "")) if label else ""
        grouped.setdefault((name, key), []).append((at, value))
    return grouped


def latest_many(
    *,
    subject_type: str,
    subject_ids: list[str],
    names: list[str],
    since: datetime | None = None,
) -> dict[tuple[str, str, str], float]:
    """The latest value of each ``name`` (and each ``path`` label) for many subjects of one
    type, in one query: ``(subject_id, name, path) -> value``. For overview cards."""
    if not subject_ids:
        return {}
    rows = (
        MetricSample.objects.filter(
            subject_type=subject_type, subject_id__in=subject_ids, name__in=names
        )
        .filter(**({"at__gte": since} if since is not None else {}))
        .order_by("subject_id", "name", "-at", "-id")
        .values_list("subject_id", "name", "labels", "value")
    )
    found: dict[tuple[str, str, str], float] = {}
    for subject_id, name, labels, value in rows:
        key = (subject_id, name, str((labels or {}).get("path", "")))
        found.setdefault(key, value)
    return found


def sums_by_path(
    *, subject_type: str, subject_ids: list[str], name: str, since: datetime
) -> dict[tuple[str, str], float]:
    """The sum of ``name``'s samples since ``since`` per subject and ``path`` label, in one
    query: ``(subject_id, path) -> sum``. Rates sampled at a steady period sum to a mix over the
    window (the overview's path mix "last hour"), which a latest value of zero after the
    traffic stopped would hide."""
    if not subject_ids:
        return {}
    rows = (
        MetricSample.objects.filter(
            subject_type=subject_type, subject_id__in=subject_ids, name=name, at__gte=since
        )
        .values_list("subject_id", "labels", "value")
        .order_by()
    )
    found: dict[tuple[str, str], float] = {}
    # One row per sample: a deployment scraped every 30 s has 360 of them an hour.
    for subject_id, labels, value in rows:
        key = (subject_id, str((labels or {}).get("path", "")))
        found[key] = found.get(key, 0.0) + value
    return found

"""Writes of telemetry samples, and their retention."""

from __future__ import annotations

import math
from collections.abc import Iterable
from datetime import datetime, timedelta
from typing import Any

from django.db import models
from django.utils import timezone

from console.telemetry.models import MetricSample


def subject_key(subject: models.Model) -> tuple[str, str]:
    return subject._meta.label_lower, str(subject.pk)


def sample_record(
    *,
    subject: models.Model,
    name: str,
    value: float,
    labels: dict[str, Any] | None = None,
    at: datetime | None = None,
) -> MetricSample | None:
    """Record one observation; a non-finite value (NaN, inf) is dropped, not stored."""
    if not math.isfinite(value):
        return None
    subject_type, subject_id = subject_key(subject)
    return MetricSample.objects.create(
        subject_type=subject_type,
        subject_id=subject_id,
        name=name,
        value=float(value),
        labels=labels or {},
        at=at or timezone.now(),
    )


def samples_record_many(
    *,
    subject: models.Model,
    values: dict[str, float],
    labels: dict[str, Any] | None = None,
    at: datetime | None = None,
) -> int:
    """Record several metrics of one subject observed at the same time; returns how many."""
    subject_type, subject_id = subject_key(subject)
    when = at or timezone.now()
    rows: Iterable[MetricSample] = (
        MetricSample(
            subject_type=subject_type,
            subject_id=subject_id,
            name=name,
            value=float(v),
            labels=labels or {},
            at=when,
        )
        for name, v in values.items()
        if v is not None and math.isfinite(v)
    )
    return len(MetricSample.objects.bulk_create(list(rows)))


def samples_prune(*, older_than: timedelta, now: datetime | None = None) -> int:
    """Delete samples older than the retention window (a beat job calls this)."""
    cutoff = (now or timezone.now()) - older_than
    deleted, _ = MetricSample.objects.filter(at__lt=cutoff).delete()
    return deleted

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


#: Request traces are kept this long (they are for following recent requests, not history).
TRACE_RETENTION = timedelta(days=7)


def trace_record_batch(*, node: Any, traces: Iterable[dict[str, Any]]) -> int:
    """Store a batch of validated trace documents shipped by the gateway on ``node``. The
    gateway's wall-clock ``started_at`` is moved onto the console's clock by the node's
    clock skew (node clock minus console clock, from its heartbeats; none known: as sent).
    Traces older than :data:`TRACE_RETENTION` are pruned. Returns how many were stored."""
    from console.telemetry.models import RequestTrace

    skew = node.clock_skew_ms
    rows = []
    for doc in traces:
        started = doc["started_at"]
        if skew is not None:
            started -= timedelta(milliseconds=skew)
        rows.append(
            RequestTrace(
                request_id=doc["request_id"],
                node=node,
                started_at=started,
                path=doc.get("path") or "",
                outcome=doc.get("outcome") or "",
                total_ms=doc.get("total_ms"),
                skew_ms=skew,
                document={**doc, "started_at": doc["started_at"].isoformat()},
            )
        )
    RequestTrace.objects.bulk_create(rows)
    RequestTrace.objects.filter(received_at__lt=timezone.now() - TRACE_RETENTION).delete()
    return len(rows)

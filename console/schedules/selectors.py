"""Reads of tidal schedules: the recorded traffic and applications of a window, priced with
and without the schedule (``console.schedules.recorded``). No writes.

Callers: ``GET /api/tidal-schedules/{id}/recorded-cost/``, the tidal page and the planner
page. Blocking; a handful of queries per schedule, whatever the window's length (the request
rates are averaged per hour and path in Postgres, not loaded sample by sample)."""

from __future__ import annotations

import zoneinfo
from datetime import UTC, datetime, timedelta
from typing import Any

from django.db.models import Avg, Count, DateTimeField, ExpressionWrapper, F
from django.db.models.fields.json import KT
from django.db.models.functions import TruncHour
from django.utils import timezone

from console.deployments.choices import PoolRole
from console.deployments.models import Pool
from console.schedules.choices import FINAL_OUTCOMES
from console.schedules.models import TidalApplication, TidalSchedule
from console.schedules.policy import TidalInputs
from console.schedules.recorded import (
    SOURCE_APPLIED,
    SOURCE_HELD,
    SOURCE_STATIC,
    CostInputs,
    RecordedHour,
    compare,
)
from console.schedules.services import local_hour, tidal_inputs
from console.telemetry import names
from console.telemetry.models import MetricSample
from console.telemetry.services import subject_key

DEFAULT_DAYS = 7
MAX_DAYS = 31


def static_remote_instances(schedule: TidalSchedule) -> int:
    """The deployment's remote instances without the schedule: every node of its prefill pool
    at the schedule's remote site (held all day); the scenario's ``remote.instances`` when the
    deployment has no such pool."""
    pool = Pool.objects.filter(
        deployment_id=schedule.deployment_id, role=PoolRole.PREFILL, site_id=schedule.remote_site_id
    ).first()
    if pool is not None:
        return pool.nodes.count()
    return int(schedule.scenario.get("remote", {}).get("instances", 0) or 0)


def _held(row: TidalApplication) -> int:
    """Remote instances an applied row ran: the nodes of ``scale.run`` (fewer than the plan's
    count when nodes were lost), else the plan's count."""
    run = (row.scale or {}).get("run")
    if isinstance(run, list):
        return len(run)
    return int((row.plan or {}).get("remote_instances", 0) or 0)


def _share(row: TidalApplication) -> int | None:
    value = (row.after or {}).get("remote_share_percent")
    return int(value) if isinstance(value, int | float) else None


def _rates(schedule: TidalSchedule, since: datetime, until: datetime) -> dict[datetime, Any]:
    """``hour start (UTC) -> ({path: mean requests/s}, samples)`` for the hours with samples.

    Binned in UTC, shifted by the zone's offset within the hour (30 min for India): the
    schedule's hours start on those instants whatever the date, so a day whose clock goes back
    keeps its two 02:00 hours apart (truncating in the zone would merge them)."""
    subject_type, subject_id = subject_key(schedule.deployment)
    offset = since.astimezone(zoneinfo.ZoneInfo(schedule.timezone)).utcoffset() or timedelta()
    shift = timedelta(seconds=-int(offset.total_seconds()) % 3600)
    rows = (
        MetricSample.objects.filter(
            subject_type=subject_type,
            subject_id=subject_id,
            name=names.REQUESTS,
            at__gte=since,
            at__lt=until,
        )
        .annotate(
            hour=TruncHour(
                ExpressionWrapper(F("at") - shift, output_field=DateTimeField()), tzinfo=UTC
            ),
            path=KT("labels__path"),
        )
        .values("hour", "path")
        .annotate(mean=Avg("value"), n=Count("id"))
        .order_by()
    )
    found: dict[datetime, Any] = {}
    for row in rows:
        key = row["hour"].astimezone(UTC) + shift
        rates, samples = found.get(key, ({}, 0))
        rates[row["path"] or ""] = float(row["mean"])
        found[key] = (rates, samples + row["n"])
    return found


def tidal_recorded_cost(
    *,
    schedule: TidalSchedule,
    days: int = DEFAULT_DAYS,
    static_instances: int | None = None,
    now: datetime | None = None,
    inputs: TidalInputs | None = None,
) -> dict[str, Any]:
    """The last ``days`` whole schedule-local hours before ``now``: recorded traffic priced as
    the schedule ran it and with the deployment's static remote instances (``static_instances``
    overrides the count; ``inputs``: the schedule's ``tidal_inputs`` when the caller has them).
    ``ValidationError`` naming the field when the schedule's stored inputs do not parse;
    ``ValueError`` from ``recorded.check_inputs``."""
    inputs = inputs or tidal_inputs(schedule)
    # In UTC: arithmetic on zone-aware datetimes is wall-clock arithmetic (wrong across DST).
    until = local_hour(schedule, now or timezone.now()).astimezone(UTC)
    since = until - timedelta(days=days)
    static = static_remote_instances(schedule) if static_instances is None else static_instances
    rates = _rates(schedule, since, until)
    applications = {
        row.hour_start.astimezone(UTC): row
        for row in TidalApplication.objects.filter(
            schedule=schedule, hour_start__gte=since, hour_start__lt=until
        )
    }
    last = (
        TidalApplication.objects.filter(
            schedule=schedule, hour_start__lt=since, outcome__in=FINAL_OUTCOMES
        )
        .order_by("-hour_start")
        .first()
    )
    zone = zoneinfo.ZoneInfo(schedule.timezone)
    hours: list[RecordedHour] = []
    at = since
    while at < until:
        row = applications.get(at)
        if row is not None and row.outcome in FINAL_OUTCOMES:
            last, source = row, SOURCE_APPLIED
        else:
            source = SOURCE_HELD if last is not None else SOURCE_STATIC
        found = rates.get(at)
        hours.append(
            RecordedHour(
                hour_start=at.astimezone(zone),
                rates_by_path=found[0] if found else None,
                samples=found[1] if found else 0,
                remote_instances=_held(last) if last is not None else static,
                source=source,
                outcome=row.outcome if row is not None else None,
                remote_share_percent=_share(last) if last is not None else None,
            )
        )
        at += timedelta(hours=1)
    s = inputs.scenario
    return compare(
        CostInputs(
            hours=hours,
            remote_prices=list(inputs.remote_prices),
            local_prices=list(inputs.local_prices),
            gpus_per_instance=inputs.gpus_per_instance,
            local_instances=s.local_instances,
            static_remote_instances=static,
            tokens_per_request=float(s.lengths.mean + s.decode.output_tokens),
            window={
                "days": days,
                "since": since.astimezone(zone).isoformat(),
                "until": until.astimezone(zone).isoformat(),
                "timezone": schedule.timezone,
                "schedule": schedule.pk,
                "deployment": {"id": schedule.deployment_id, "name": schedule.deployment.name},
            },
        )
    )

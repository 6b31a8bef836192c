"""Tidal schedule writes, the what-if plan and the beat's hourly apply.

Callers: the API and admin (CRUD, what-if), the beat task ``orchestrator.schedules.apply_tidal``
(``tidal_apply_due``). Blocking, one transaction per write; invalid input raises
``ValidationError`` naming the field (400). The hourly apply changes the deployment only
through ``console.deployments.services`` (so a config snapshot and an audit entry are written),
never overrides a kill switch that is on or a canary in progress, and is idempotent per hour
(one ``TidalApplication`` row per schedule and schedule-local hour). It acts only on an
``active`` deployment: while the deployment workflow runs, its steps own the settings.
"""

from __future__ import annotations

import logging
import math
import zoneinfo
from datetime import datetime
from typing import Any

from django.core.exceptions import ValidationError
from django.db import transaction
from django.utils import timezone

from console.core.crud import Actor, audited_create, audited_delete, audited_update
from console.deployments.choices import DeploymentState, PoolRole
from console.deployments.models import Deployment, Pool
from console.deployments.services import deployment_update
from console.inventory.choices import NodeStatus
from console.inventory.models import Site
from console.planner.errors import PlannerInputError
from console.planner.inputs import parse_scenario
from console.planner.selectors import scenario_resolve
from console.runs.choices import RunState
from console.runs.models import WorkflowRun
from console.schedules.choices import FINAL_OUTCOMES, ApplicationOutcome
from console.schedules.models import SitePriceTable, TidalApplication, TidalSchedule
from console.schedules.policy import HOURS, TidalInputs, day_plan, hour_plan

logger = logging.getLogger(__name__)

CANARY_KIND = "canary"  # WorkflowRun.kind of the canary workflow (checked by name)
ACTIVE_RUN_STATES = (RunState.PENDING, RunState.RUNNING)
MAX_PRICE = 1e6
# Remote instances per hour at most: the policy runs one planner search per count (~15 ms
# each at 1,000 thresholds), so this bounds a what-if to a few seconds.
MAX_CAPACITY = 256
MAX_DEMAND = 1e6  # requests/s


def validate_hourly(value: Any, field: str, *, integer: bool, maximum: float) -> list[Any]:
    """24 finite values >= 0 (integers for counts), else ``ValidationError`` on ``field``."""
    if not isinstance(value, list) or len(value) != HOURS:
        raise ValidationError({field: [f"Must be a list of {HOURS} values (hours 0-23)."]})
    out: list[Any] = []
    for hour, item in enumerate(value):
        ok_type = isinstance(item, int) if integer else isinstance(item, int | float)
        if isinstance(item, bool) or not ok_type:
            kind = "an integer" if integer else "a number"
            raise ValidationError({f"{field}[{hour}]": [f"Must be {kind}."]})
        if not (math.isfinite(item) and 0 <= item <= maximum):
            raise ValidationError({f"{field}[{hour}]": [f"Must be between 0 and {maximum:g}."]})
        out.append(item)
    return out


def _scenario_check(body: Any, field: str = "scenario") -> None:
    try:
        resolved, _ = scenario_resolve(body)
        parse_scenario(resolved)
    except PlannerInputError as exc:
        raise ValidationError(
            {f"{field}.{exc.field}" if exc.field else field: [exc.message]}
        ) from None


# --- price tables ---------------------------------------------------------------------------


def _price_fields(fields: dict[str, Any]) -> dict[str, Any]:
    if "gpu_hour_prices" in fields:
        fields["gpu_hour_prices"] = validate_hourly(
            fields["gpu_hour_prices"], "gpu_hour_prices", integer=False, maximum=MAX_PRICE
        )
    if fields.get("energy_prices_kwh"):
        fields["energy_prices_kwh"] = validate_hourly(
            fields["energy_prices_kwh"], "energy_prices_kwh", integer=False, maximum=MAX_PRICE
        )
    return fields


@transaction.atomic
def price_table_create(*, actor: Actor, **fields: Any) -> SitePriceTable:
    """Give a site its hourly price table (one per site)."""
    if "gpu_hour_prices" not in fields:
        raise ValidationError({"gpu_hour_prices": ["This field is required."]})
    return audited_create(actor=actor, model=SitePriceTable, fields=_price_fields(fields))


@transaction.atomic
def price_table_update(*, actor: Actor, table: SitePriceTable, **fields: Any) -> SitePriceTable:
    """Change a site's hourly prices."""
    fields.pop("site", None)  # a table belongs to its site for good
    table, _ = audited_update(actor=actor, instance=table, fields=_price_fields(fields))
    return table


@transaction.atomic
def price_table_delete(*, actor: Actor, table: SitePriceTable) -> None:
    """Remove a table; the site's flat ``gpu_hour_price`` applies again."""
    audited_delete(actor=actor, instance=table)


def site_hourly_prices(site: Site) -> list[float]:
    """24 prices per GPU-hour for ``site``: its table, else its flat price every hour."""
    table = SitePriceTable.objects.filter(site=site).first()
    if table is None:
        return [float(site.gpu_hour_price)] * HOURS
    return [table.gpu_hour_price(h) for h in range(HOURS)]


# --- schedules ------------------------------------------------------------------------------


def _schedule_fields(fields: dict[str, Any], current: TidalSchedule | None) -> dict[str, Any]:
    if "scenario" in fields:
        _scenario_check(fields["scenario"])
    if "capacity" in fields:
        fields["capacity"] = validate_hourly(
            fields["capacity"], "capacity", integer=True, maximum=MAX_CAPACITY
        )
    if fields.get("demand_rps"):
        fields["demand_rps"] = validate_hourly(
            fields["demand_rps"], "demand_rps", integer=False, maximum=MAX_DEMAND
        )
    remote = fields.get("remote_site", current.remote_site if current else None)
    local = fields.get("local_site", current.local_site if current else None)
    if remote is not None and local is not None and remote.pk == local.pk:
        raise ValidationError({"remote_site": ["Must differ from local_site."]})
    return fields


@transaction.atomic
def tidal_schedule_create(*, actor: Actor, **fields: Any) -> TidalSchedule:
    """Create a deployment's tidal schedule (one per deployment; disabled unless asked)."""
    for name in ("scenario", "remote_site", "local_site"):
        if name not in fields:
            raise ValidationError({name: ["This field is required."]})
    return audited_create(actor=actor, model=TidalSchedule, fields=_schedule_fields(fields, None))


@transaction.atomic
def tidal_schedule_update(*, actor: Actor, schedule: TidalSchedule, **fields: Any) -> TidalSchedule:
    """Change a schedule (enable / disable it, prices come from the sites' tables)."""
    fields.pop("deployment", None)
    schedule, _ = audited_update(
        actor=actor, instance=schedule, fields=_schedule_fields(fields, schedule)
    )
    return schedule


@transaction.atomic
def tidal_schedule_delete(*, actor: Actor, schedule: TidalSchedule) -> None:
    """Delete a schedule and its application history (the deployment keeps its settings)."""
    audited_delete(actor=actor, instance=schedule)


def tidal_inputs(schedule: TidalSchedule, overrides: dict[str, Any] | None = None) -> TidalInputs:
    """The policy's inputs for ``schedule``; ``overrides`` (what-if) may replace ``scenario``,
    ``capacity``, ``demand_rps``, ``ttft_limit_ms``, ``rtt_ms``, ``gpus_per_instance``,
    ``remote_prices``, ``local_prices``. ``ValidationError`` naming the field on bad values."""
    o = dict(overrides or {})
    body = o.get("scenario", schedule.scenario)
    try:
        resolved, _ = scenario_resolve(body)
        scenario = parse_scenario(resolved)
    except PlannerInputError as exc:
        raise ValidationError(
            {f"scenario.{exc.field}" if exc.field else "scenario": [exc.message]}
        ) from None
    remote_prices = o.get("remote_prices") or site_hourly_prices(schedule.remote_site)
    local_prices = o.get("local_prices") or site_hourly_prices(schedule.local_site)
    demand = o.get("demand_rps", schedule.demand_rps)
    return TidalInputs(
        scenario=scenario,
        demand_rps=(
            validate_hourly(demand, "demand_rps", integer=False, maximum=MAX_DEMAND)
            if demand
            else None
        ),
        remote_prices=validate_hourly(
            remote_prices, "remote_prices", integer=False, maximum=MAX_PRICE
        ),
        local_prices=validate_hourly(
            local_prices, "local_prices", integer=False, maximum=MAX_PRICE
        ),
        capacity=validate_hourly(
            o.get("capacity", schedule.capacity), "capacity", integer=True, maximum=MAX_CAPACITY
        ),
        gpus_per_instance=int(o.get("gpus_per_instance", schedule.gpus_per_instance)),
        ttft_limit_s=float(o.get("ttft_limit_ms", schedule.ttft_limit_ms)) / 1000.0,
        rtt_s=float(o.get("rtt_ms", schedule.rtt_ms)) / 1000.0,
    )


def tidal_what_if(
    *, schedule: TidalSchedule, overrides: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The 24-hour plan and its cost vs all-local and always-remote (nothing is written)."""
    result = day_plan(tidal_inputs(schedule, overrides))
    result["timezone"] = schedule.timezone
    result["deployment"] = {"id": schedule.deployment_id, "name": schedule.deployment.name}
    return result


# --- the hourly apply -----------------------------------------------------------------------


def local_hour(schedule: TidalSchedule, now: datetime) -> datetime:
    """Start of the schedule-local hour containing ``now`` (aware)."""
    return now.astimezone(zoneinfo.ZoneInfo(schedule.timezone)).replace(
        minute=0, second=0, microsecond=0
    )


def canary_in_progress(deployment: Deployment) -> WorkflowRun | None:
    """The deployment's pending or running canary run, if any."""
    return WorkflowRun.objects.filter(
        kind=CANARY_KIND,
        state__in=ACTIVE_RUN_STATES,
        target_type=deployment._meta.label_lower,
        target_id=str(deployment.pk),
    ).first()


def _scale_intent(schedule: TidalSchedule, instances: int) -> dict[str, Any]:
    """Which remote prefill nodes should run this hour: the first ``instances`` usable nodes
    of the deployment's prefill pool at the remote site (by hostname), the rest stopped.
    Recorded as intent only: the beat job then launches / stops the prefill engine on these
    nodes (``orchestrator.tidalops.carry_out``, which records what the agents answered); the
    console makes no agent call."""
    pool = Pool.objects.filter(
        deployment_id=schedule.deployment_id, role=PoolRole.PREFILL, site=schedule.remote_site
    ).first()
    nodes = list(pool.nodes.order_by("hostname")) if pool else []
    usable = [n for n in nodes if n.status != NodeStatus.LOST]
    run = usable[:instances]
    stop = [n for n in nodes if n not in run]
    return {
        "remote_instances": instances,
        "pool": pool.pk if pool else None,
        "run": [n.hostname for n in run],
        "stop": [n.hostname for n in stop],
        "short_by": max(0, instances - len(run)),
        "agent_calls": "pending: the beat job carries out this intent on the agents",
    }


def _share_waits_for_join(deployment: Deployment, scale: dict[str, Any], share: float) -> bool:
    """Whether the hour's higher remote share must wait for its engines: it raises the share
    while none of the nodes that should run is in rotation now (all drained, the hour before
    ran no remote instance)."""
    if share <= deployment.remote_share_percent or not scale["run"] or scale["pool"] is None:
        return False
    pool = Pool.objects.get(pk=scale["pool"])
    drained = set(pool.drained_nodes.values_list("hostname", flat=True))
    return all(host in drained for host in scale["run"])


def _record(
    schedule: TidalSchedule,
    hour_start: datetime,
    existing: TidalApplication | None,
    **fields: Any,
) -> TidalApplication:
    if existing is None:
        return TidalApplication.objects.create(
            schedule=schedule, hour_start=hour_start, hour=hour_start.hour, **fields
        )
    for name, value in fields.items():
        setattr(existing, name, value)
    existing.checks += 1
    existing.save()
    return existing


def _current(deployment: Deployment) -> dict[str, Any]:
    return {
        "remote_share_percent": deployment.remote_share_percent,
        "remote_prefill_threshold_tokens": deployment.remote_prefill_threshold_tokens,
        "kill_switch": deployment.kill_switch,
        "config_version": deployment.version,
    }


@transaction.atomic
def tidal_apply_hour(*, schedule_id: int, now: datetime | None = None) -> TidalApplication | None:
    """Apply schedule ``schedule_id``'s plan for the hour containing ``now`` (the beat calls
    this every minute; tests inject ``now``). Returns the hour's row, or None when the
    schedule is disabled or gone. A final row (applied / unchanged) makes this a no-op; a
    skipped or failed one is re-tried and updated."""
    now = now or timezone.now()
    schedule = (
        TidalSchedule.objects.select_for_update()
        .select_related("deployment", "remote_site", "local_site")
        .filter(pk=schedule_id)
        .first()
    )
    if schedule is None or not schedule.enabled:
        return None
    hour_start = local_hour(schedule, now)
    existing = TidalApplication.objects.filter(schedule=schedule, hour_start=hour_start).first()
    if existing is not None and existing.outcome in FINAL_OUTCOMES:
        return existing
    deployment = Deployment.objects.select_for_update().get(pk=schedule.deployment_id)
    before = _current(deployment)
    try:
        plan = hour_plan(tidal_inputs(schedule), hour_start.hour)
    except (ValidationError, ValueError) as exc:
        logger.warning("tidal_plan_failed", extra={"schedule": schedule.pk, "error": str(exc)})
        return _record(
            schedule, hour_start, existing, outcome=ApplicationOutcome.FAILED, error=str(exc)[:2000]
        )
    plan_doc = plan.as_dict()
    if deployment.kill_switch:
        outcome = ApplicationOutcome.SKIPPED_KILL_SWITCH
    elif deployment.state != DeploymentState.ACTIVE:
        outcome = ApplicationOutcome.SKIPPED_INACTIVE
    elif (canary := canary_in_progress(deployment)) is not None:
        outcome = ApplicationOutcome.SKIPPED_CANARY
        plan_doc["canary_run"] = canary.pk
    else:
        outcome = None
    if outcome is not None:
        logger.info(
            "tidal_skipped",
            extra={"schedule": schedule.pk, "hour": hour_start.hour, "why": outcome},
        )
        return _record(
            schedule,
            hour_start,
            existing,
            outcome=outcome,
            plan=plan_doc,
            before=before,
            after=before,
        )
    scale = _scale_intent(schedule, plan.remote_instances)
    share = plan.remote_share_percent
    if _share_waits_for_join(deployment, scale, share):
        # The share goes out once an engine of ``run`` is up and in the gateways' pool
        # (``orchestrator.tidalops``): published now it would send traffic to a site with no
        # instance in rotation, every such request a ``no_remote_site`` fallback meanwhile.
        scale["share"] = {"percent": share, "state": "waiting"}
        share = deployment.remote_share_percent
    settings: dict[str, Any] = {"remote_share_percent": share}
    if plan.remote_share_percent:
        # Nothing remote: the threshold is moot, so the deployment keeps its own.
        settings["remote_prefill_threshold_tokens"] = plan.threshold_tokens
    updated = deployment_update(
        actor=None,
        deployment=deployment,
        reason=f"tidal {hour_start:%H}:00 {schedule.timezone}",
        **settings,
    )
    after = _current(updated)
    previous = (
        TidalApplication.objects.filter(schedule=schedule, outcome__in=FINAL_OUTCOMES)
        .order_by("-hour_start")
        .first()
    )
    scaled = previous is None or previous.plan.get("remote_instances") != plan.remote_instances
    changed = after["config_version"] != before["config_version"] or scaled
    logger.info(
        "tidal_applied",
        extra={
            "schedule": schedule.pk,
            "hour": hour_start.hour,
            "remote_instances": plan.remote_instances,
            "remote_share_percent": plan.remote_share_percent,
            "config_version": after["config_version"],
        },
    )
    return _record(
        schedule,
        hour_start,
        existing,
        outcome=ApplicationOutcome.APPLIED if changed else ApplicationOutcome.UNCHANGED,
        plan=plan_doc,
        before=before,
        after=after,
        config_version=updated.version,
        scale=scale,
        error="",
    )


def tidal_apply_due(*, now: datetime | None = None) -> list[int]:
    """Beat entry point: apply the current hour of every enabled schedule; one schedule's
    failure is logged and does not stop the others. Returns the application ids."""
    done: list[int] = []
    for pk in TidalSchedule.objects.filter(enabled=True).values_list("pk", flat=True):
        try:
            row = tidal_apply_hour(schedule_id=pk, now=now)
        except Exception:  # one bad schedule must not starve the others
            logger.exception("tidal_apply_error", extra={"schedule": pk})
            continue
        if row is not None:
            done.append(row.pk)
    return done

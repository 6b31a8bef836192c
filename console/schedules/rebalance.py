"""Long-timescale rebalancing of the local pool between prefill and decode (the PrfaaS paper's
slow loop): when measured producer throughput (remote + local prefill) and consumer
throughput (decode) are out of balance and the capacity planner's optimum split of the local
instances differs from the current one in the same direction, propose converting local nodes
between the deployment's local prefill pool and its decode pool; apply only when enabled.

Measurements come from telemetry samples about the deployment, averaged over the window:
``prefill_requests_per_second`` (one series per ``labels.path``: remote, local; summed) and
``decode_requests_per_second``. The optimum comes from the deployment's tidal schedule
scenario (``console.planner.model.optimise`` with the current local instance count).

Callers: the beat task ``orchestrator.schedules.propose_rebalance`` (hourly), the API
(``apply`` / ``dismiss`` actions). Blocking; pool changes go through the deployment services
(config snapshot + audit); errors are ``ValidationError`` / ``Conflict`` naming the problem.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from datetime import datetime, timedelta
from typing import Any

from django.core.exceptions import ValidationError
from django.db import transaction
from django.db.models import Avg
from django.utils import timezone

from console.core.api.exceptions import Conflict
from console.core.choices import AuditAction
from console.core.crud import Actor
from console.core.services import audit_record
from console.deployments.choices import PoolRole
from console.deployments.models import Deployment, Pool
from console.deployments.services import pool_create, pool_update
from console.planner.model import optimise
from console.schedules.choices import ProposalState
from console.schedules.models import RebalanceProposal, TidalSchedule
from console.schedules.services import canary_in_progress, tidal_inputs
from console.telemetry.models import MetricSample
from console.telemetry.services import subject_key

logger = logging.getLogger(__name__)

PRODUCER_METRIC = "prefill_requests_per_second"
CONSUMER_METRIC = "decode_requests_per_second"
DEFAULT_WINDOW = timedelta(hours=1)
IMBALANCE_TOLERANCE = 0.15  # producer / consumer within 1 +- this counts as balanced


def measured_throughput(deployment: Deployment, since: datetime, until: datetime) -> dict[str, Any]:
    """Mean producer (summed over paths) and consumer rates over the window; None when a
    side has no samples."""
    subject_type, subject_id = subject_key(deployment)
    base = MetricSample.objects.filter(
        subject_type=subject_type, subject_id=subject_id, at__gte=since, at__lt=until
    )
    by_path: dict[str, float] = {}
    # One series per distinct label set (path, and e.g. site): their means add up.
    for row in base.filter(name=PRODUCER_METRIC).values("labels").annotate(v=Avg("value")):
        path = (row["labels"] or {}).get("path", "all")
        by_path[path] = by_path.get(path, 0.0) + row["v"]
    consumer = base.filter(name=CONSUMER_METRIC).aggregate(v=Avg("value"))["v"]
    return {
        "producer_rps": sum(by_path.values()) if by_path else None,
        "producer_by_path": by_path,
        "consumer_rps": consumer,
        "since": since.isoformat(),
        "until": until.isoformat(),
    }


def _local_pools(deployment: Deployment) -> tuple[Pool, Pool | None]:
    decode = Pool.objects.filter(deployment=deployment, role=PoolRole.DECODE).first()
    if decode is None:
        raise ValidationError({"deployment": ["Has no decode pool: nothing to rebalance."]})
    prefill = Pool.objects.filter(
        deployment=deployment, role=PoolRole.PREFILL, site_id=decode.site_id
    ).first()
    return decode, prefill


def _moves(
    decode: Pool, prefill: Pool | None, current_prefill: int, target: int
) -> list[dict[str, Any]]:
    if target < current_prefill and prefill is not None:
        nodes = list(prefill.nodes.order_by("hostname"))[: current_prefill - target]
        return [
            {"node": n.pk, "hostname": n.hostname, "from": "prefill", "to": "decode"} for n in nodes
        ]
    nodes = list(decode.nodes.order_by("-hostname"))[: target - current_prefill]
    return [
        {"node": n.pk, "hostname": n.hostname, "from": "decode", "to": "prefill"} for n in nodes
    ]


@transaction.atomic
def rebalance_propose(
    *, schedule: TidalSchedule, now: datetime | None = None, window: timedelta = DEFAULT_WINDOW
) -> RebalanceProposal | None:
    """Propose a new split for the schedule's deployment, or None when measured load is
    balanced, unmeasured, or the planner agrees with the current split. An open proposal with
    the same moves is kept; a different one is superseded."""
    now = now or timezone.now()
    deployment = schedule.deployment
    decode, prefill = _local_pools(deployment)
    n_decode = decode.nodes.count()
    n_prefill = prefill.nodes.count() if prefill else 0
    if n_prefill + n_decode == 0:
        return None
    measured = measured_throughput(deployment, now - window, now)
    producer, consumer = measured["producer_rps"], measured["consumer_rps"]
    if not producer or not consumer:
        return None
    ratio = producer / consumer
    measured["ratio"] = ratio
    if abs(ratio - 1) <= IMBALANCE_TOLERANCE:
        return None
    inputs = tidal_inputs(schedule)
    plan, *_ = optimise(replace(inputs.scenario, local_instances=n_prefill + n_decode))
    target = plan.n_prefill
    # Producer ahead of consumer -> decode-bound -> fewer prefill nodes (and vice versa); act
    # only when the planner's optimum points the same way, so noise alone moves nothing.
    if (ratio > 1 and target >= n_prefill) or (ratio < 1 and target <= n_prefill):
        logger.info(
            "rebalance_not_needed",
            extra={"deployment": deployment.pk, "ratio": ratio, "planner_prefill": target},
        )
        return None
    moves = _moves(decode, prefill, n_prefill, target)
    if not moves:
        return None
    open_one = (
        RebalanceProposal.objects.select_for_update()
        .filter(deployment=deployment, state=ProposalState.PROPOSED)
        .first()
    )
    if open_one is not None:
        if open_one.moves == moves:
            return open_one
        open_one.state, open_one.decided_at = ProposalState.SUPERSEDED, now
        open_one.decided_by_label = "rebalance"
        open_one.save(update_fields=["state", "decided_at", "decided_by_label"])
    side = "decode-bound" if ratio > 1 else "prefill-bound"
    reason = (
        f"Measured producer {producer:.3g} req/s vs consumer {consumer:.3g} req/s "
        f"(ratio {ratio:.2f}, {side}); the planner's optimum for {n_prefill + n_decode} local "
        f"instances is {target} prefill / {n_prefill + n_decode - target} decode "
        f"(now {n_prefill} / {n_decode}, {plan.lambda_max:.3g} req/s at the optimum)."
    )
    proposal = RebalanceProposal.objects.create(
        deployment=deployment,
        measured=measured,
        current_split={"n_prefill": n_prefill, "n_decode": n_decode},
        target_split={"n_prefill": target, "n_decode": n_prefill + n_decode - target},
        moves=moves,
        reason=reason,
    )
    logger.info("rebalance_proposed", extra={"deployment": deployment.pk, "proposal": proposal.pk})
    return proposal


@transaction.atomic
def rebalance_apply(*, actor: Actor, proposal: RebalanceProposal) -> RebalanceProposal:
    """Move the proposal's nodes between the local prefill and decode pools (each pool change
    is a new config version). 409 when it is no longer open, a canary is in progress, or the
    pools changed since it was made."""
    locked = RebalanceProposal.objects.select_for_update().get(pk=proposal.pk)
    if locked.state != ProposalState.PROPOSED:
        raise Conflict(f"Proposal {locked.pk} is {locked.state}, not proposed.")
    deployment = locked.deployment
    if canary_in_progress(deployment) is not None:
        raise Conflict("A canary is in progress: apply the proposal after it ends.")
    decode, prefill = _local_pools(deployment)
    decode_nodes = list(decode.nodes.all())
    prefill_nodes = list(prefill.nodes.all()) if prefill else []
    for move in locked.moves:
        source = prefill_nodes if move["from"] == "prefill" else decode_nodes
        node = next((n for n in source if n.pk == move["node"]), None)
        if node is None:
            raise Conflict(f"Node {move['hostname']} is no longer in the {move['from']} pool.")
        source.remove(node)
        (decode_nodes if move["to"] == "decode" else prefill_nodes).append(node)
    pool_update(actor=actor, pool=decode, nodes=decode_nodes)
    if prefill is not None:
        pool_update(actor=actor, pool=prefill, nodes=prefill_nodes)
    elif prefill_nodes:
        pool_create(
            actor=actor,
            deployment=deployment,
            role=PoolRole.PREFILL,
            site=decode.site,
            nodes=prefill_nodes,
        )
    return _decide(actor, locked, ProposalState.APPLIED)


def _decide(actor: Actor, proposal: RebalanceProposal, state: str) -> RebalanceProposal:
    user = actor if actor is not None and actor.is_authenticated else None
    proposal.state = state
    proposal.decided_at = timezone.now()
    proposal.decided_by_label = user.get_username() if user else "rebalance"
    proposal.save(update_fields=["state", "decided_at", "decided_by_label"])
    audit_record(
        actor=actor,
        action=AuditAction.ACTION,
        verb=f"rebalance_{state}",
        instance=proposal,
        after={"state": state, "moves": proposal.moves},
    )
    return proposal


@transaction.atomic
def rebalance_dismiss(*, actor: Actor, proposal: RebalanceProposal) -> RebalanceProposal:
    """Decline an open proposal (409 when it is not open)."""
    locked = RebalanceProposal.objects.select_for_update().get(pk=proposal.pk)
    if locked.state != ProposalState.PROPOSED:
        raise Conflict(f"Proposal {locked.pk} is {locked.state}, not proposed.")
    return _decide(actor, locked, ProposalState.DISMISSED)


def rebalance_due(*, now: datetime | None = None) -> list[int]:
    """Beat entry point: propose for every scheduled deployment; apply where the schedule
    says so. A failure for one deployment is logged and does not stop the others."""
    ids: list[int] = []
    for schedule in TidalSchedule.objects.select_related("deployment"):
        try:
            proposal = rebalance_propose(schedule=schedule, now=now)
            if proposal is not None and schedule.rebalance_auto_apply:
                proposal = rebalance_apply(actor=None, proposal=proposal)
        except (ValidationError, Conflict) as exc:
            logger.warning(
                "rebalance_skipped", extra={"schedule": schedule.pk, "error": str(exc)[:300]}
            )
            continue
        if proposal is not None:
            ids.append(proposal.pk)
    return ids

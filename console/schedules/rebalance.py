"""Long-timescale rebalancing of the local pool between prefill and decode (the PrfaaS paper's
slow loop): when measured producer capacity (remote + local prefill) and consumer capacity
(decode) are out of balance and the capacity planner's optimum split of the local instances
differs from the current one in the same direction, propose converting local nodes between
the deployment's local prefill pool and its decode pool.

Measurements come from telemetry samples about the deployment, averaged over the window:
``prefill_requests_per_second`` (one series per prefill pool, ``labels.path`` remote / local;
summed) and ``decode_requests_per_second`` -- what each side can sustain, measured from its
engines' busy time by ``orchestrator.capacityops``. The optimum comes from the deployment's
tidal schedule scenario (``console.planner.model.optimise`` with the current local instance
count).

Approving (``rebalance_apply``: an operator, or the hourly job with ``rebalance_auto_apply``)
starts a ``rebalance`` run (orchestrator/workflows/rebalance.py) that drains, relaunches and
moves the nodes on the running fleet; its ``join`` step calls ``rebalance_move_nodes`` and its
end ``rebalance_finish``. Callers: the beat task ``orchestrator.schedules.propose_rebalance``
(hourly), the API (``apply`` / ``dismiss`` actions), the workflow. Blocking; pool changes go
through the deployment services (config snapshot + audit); errors are ``ValidationError`` /
``Conflict`` naming the problem.
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
from console.runs import services as run_services
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
    """The nodes to convert, never the last one of a pool (a pool must keep a node: an empty
    one has nothing to route to), so a target of 0 local prefill stops at 1."""
    if target < current_prefill and prefill is not None:
        count = min(current_prefill - target, current_prefill - 1)
        nodes = list(prefill.nodes.order_by("hostname"))[:count]
        return [
            {"node": n.pk, "hostname": n.hostname, "from": "prefill", "to": "decode"} for n in nodes
        ]
    decoders = list(decode.nodes.order_by("-hostname"))
    nodes = decoders[: min(target - current_prefill, len(decoders) - 1)]
    return [
        {"node": n.pk, "hostname": n.hostname, "from": "decode", "to": "prefill"} for n in nodes
    ]


@transaction.atomic
def rebalance_propose(
    *, schedule: TidalSchedule, now: datetime | None = None, window: timedelta = DEFAULT_WINDOW
) -> RebalanceProposal | None:
    """Propose a new split for the schedule's deployment, or None when measured load is
    balanced, unmeasured, or the planner agrees with the current split. An open proposal with
    the same moves is kept; a different one is superseded. Nothing while one is applying."""
    now = now or timezone.now()
    deployment = schedule.deployment
    if RebalanceProposal.objects.filter(
        deployment=deployment, state=ProposalState.APPLYING
    ).exists():
        return None  # the pools are changing: measure again once they have
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
    reached = n_prefill + sum(1 if m["to"] == "prefill" else -1 for m in moves)
    if reached != target:
        reason += f" Each pool keeps a node, so this moves to {reached} prefill."
    target = reached
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


#: The ``rebalance`` workflow's steps, in order (orchestrator/workflows/rebalance.py).
REBALANCE_KIND = "rebalance"
REBALANCE_STEPS = ["check", "drain", "stop", "launch", "join", "verify"]


def check_moves(deployment: Deployment, moves: list[dict[str, Any]]) -> tuple[Pool, Pool | None]:
    """The local (decode, prefill) pools after checking the moves still apply: each node is
    in its source pool, and no pool is left empty (409 naming the pool otherwise)."""
    decode, prefill = _local_pools(deployment)
    members = {
        "decode": set(decode.nodes.values_list("pk", flat=True)),
        "prefill": set(prefill.nodes.values_list("pk", flat=True)) if prefill else set(),
    }
    for move in moves:
        if move["node"] not in members[move["from"]]:
            raise Conflict(f"Node {move['hostname']} is no longer in the {move['from']} pool.")
    for role, nodes in members.items():
        leaving = {m["node"] for m in moves if m["from"] == role}
        if nodes and not nodes - leaving:
            raise Conflict(
                f"Moving {', '.join(m['hostname'] for m in moves if m['from'] == role)} would "
                f"leave the local {role} pool empty; keep at least one node in it."
            )
    return decode, prefill


@transaction.atomic
def rebalance_apply(*, actor: Actor, proposal: RebalanceProposal) -> RebalanceProposal:
    """Approve an open proposal: start its ``rebalance`` run, which drains each node, stops
    its engine, relaunches it in the new role through its agent, moves it to the other pool
    and verifies (orchestrator/workflows/rebalance.py). 409 when the proposal is no longer
    open, a canary or another rebalance is in progress, the pools changed since it was made,
    or a move would leave a pool empty."""
    locked = RebalanceProposal.objects.select_for_update().get(pk=proposal.pk)
    if locked.state != ProposalState.PROPOSED:
        raise Conflict(f"Proposal {locked.pk} is {locked.state}, not proposed.")
    deployment = locked.deployment
    if canary_in_progress(deployment) is not None:
        raise Conflict("A canary is in progress: apply the proposal after it ends.")
    busy = RebalanceProposal.objects.filter(
        deployment=deployment, state=ProposalState.APPLYING
    ).first()
    if busy is not None:
        raise Conflict(f"Proposal {busy.pk} is still being applied to this deployment.")
    check_moves(deployment, locked.moves)
    run = run_services.run_create(
        actor=actor,
        kind=REBALANCE_KIND,
        steps=list(REBALANCE_STEPS),
        target=locked,
        params={"proposal": locked.pk, "deployment": deployment.pk},
    )
    locked.run = run
    locked.save(update_fields=["run"])
    return _decide(actor, locked, ProposalState.APPLYING)


@transaction.atomic
def rebalance_move_nodes(*, proposal: RebalanceProposal) -> int:
    """The rebalance run's ``join``: move the proposal's nodes between the local pools (a
    node leaves its old pool's drained set with it) and return the deployment's config
    version. Idempotent: a node already in its new pool is left there. 409 as
    :func:`check_moves` for a move that no longer applies."""
    deployment = Deployment.objects.get(pk=proposal.deployment_id)
    decode, prefill = _local_pools(deployment)
    source = {"decode": decode, "prefill": prefill}
    pending = [
        m
        for m in proposal.moves
        if source[m["from"]] is not None and source[m["from"]].nodes.filter(pk=m["node"]).exists()
    ]
    if pending:
        decode, prefill = check_moves(deployment, pending)
    decode_nodes = list(decode.nodes.all())
    prefill_nodes = list(prefill.nodes.all()) if prefill else []
    for move in pending:
        source = prefill_nodes if move["from"] == "prefill" else decode_nodes
        node = next(n for n in source if n.pk == move["node"])
        source.remove(node)
        (decode_nodes if move["to"] == "decode" else prefill_nodes).append(node)
        (prefill if move["from"] == "prefill" else decode).drained_nodes.remove(node)
    if pending:
        pool_update(actor=None, pool=decode, nodes=decode_nodes)
        if prefill is not None:
            pool_update(actor=None, pool=prefill, nodes=prefill_nodes)
        else:
            pool_create(
                actor=None,
                deployment=deployment,
                role=PoolRole.PREFILL,
                site=decode.site,
                nodes=prefill_nodes,
                # The same hardware as the decode nodes it came from: their engine settings.
                engine_settings=dict(decode.engine_settings),
            )
    deployment.refresh_from_db()
    return deployment.version


def rebalance_finish(*, proposal_id: int, ok: bool) -> None:
    """The rebalance run's end: its proposal becomes ``applied`` or ``failed`` (a failed one
    whose run an operator retried and that then succeeded: ``applied``)."""
    proposal = RebalanceProposal.objects.get(pk=proposal_id)
    if proposal.state in (ProposalState.APPLYING, ProposalState.FAILED):
        _decide(None, proposal, ProposalState.APPLIED if ok else ProposalState.FAILED)


def _decide(actor: Actor, proposal: RebalanceProposal, state: str) -> RebalanceProposal:
    user = actor if actor is not None and actor.is_authenticated else None
    proposal.state = state
    fields = ["state"]
    if proposal.decided_at is None:  # the decision, not the run's end, names who and when
        proposal.decided_at = timezone.now()
        proposal.decided_by_label = user.get_username() if user else "rebalance"
        fields += ["decided_at", "decided_by_label"]
    proposal.save(update_fields=fields)
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

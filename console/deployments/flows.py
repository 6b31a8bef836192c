"""Starting and steering a deployment's workflows: the eight-step deployment run and the canary
run, plus the writes those workflows make on the deployment (baseline, remote share).

Called by the deployments API (operators) and by the orchestrator's workflow steps (actor
``None``: the system). Blocking. Failures: ``Conflict`` (409) when a workflow of the kind is
already pending or running, or the run is not in a state the verb applies to;
``ValidationError`` naming the field (400). The console never imports workflow code: the step
names live here and the orchestrator's workflow modules check that theirs match.
"""

from __future__ import annotations

from typing import Any

from django.core.exceptions import ValidationError
from django.db import transaction

from console.core.api.exceptions import Conflict
from console.core.choices import AuditAction
from console.core.crud import Actor
from console.core.services import audit_record
from console.deployments.choices import DeploymentState
from console.deployments.models import Deployment
from console.deployments.services import _lock, deployment_transition, snapshot_write
from console.rollouts.services import rollout_plan_for
from console.runs import services as run_services
from console.runs.choices import RunState
from console.runs.models import WorkflowRun

DEPLOY_KIND = "deploy"
CANARY_KIND = "canary"
#: The deployment workflow's steps, in order (orchestrator/workflows/deploy.py implements them).
DEPLOY_STEPS = [
    "capacity_baseline",
    "wan_baseline",
    "remote_prefill",
    "local_decode",
    "kv_link",
    "gateway",
    "verification",
    "canary",
]
_ACTIVE = (RunState.PENDING, RunState.RUNNING)
_TARGET_TYPE = "deployments.deployment"


def canary_step_name(share_percent: int) -> str:
    return f"share_{share_percent}"


def active_run(deployment: Deployment, kind: str) -> WorkflowRun | None:
    """The deployment's pending or running run of ``kind``, if any."""
    return (
        WorkflowRun.objects.filter(
            kind=kind, target_type=_TARGET_TYPE, target_id=str(deployment.pk), state__in=_ACTIVE
        )
        .order_by("-id")
        .first()
    )


def latest_run(deployment: Deployment, kind: str) -> WorkflowRun | None:
    return (
        WorkflowRun.objects.filter(
            kind=kind, target_type=_TARGET_TYPE, target_id=str(deployment.pk)
        )
        .order_by("-id")
        .first()
    )


def _check_params(params: dict[str, Any]) -> dict[str, Any]:
    if not isinstance(params, dict):
        raise ValidationError({"params": ["Must be an object."]})
    lengths = params.get("verify_lengths")
    if lengths is not None and (
        not isinstance(lengths, list)
        or not lengths
        or not all(
            isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= 100_000 for n in lengths
        )
    ):
        raise ValidationError({"verify_lengths": ["A non-empty list of integers in 1..100000."]})
    for key in ("recheck_s", "probe_seconds", "gateway_ready_s", "verify_deadline_s"):
        value = params.get(key)
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 3600
        ):
            raise ValidationError({key: ["A number of seconds in (0, 3600]."]})
    tokens = params.get("verify_max_tokens")
    if tokens is not None and (
        isinstance(tokens, bool) or not isinstance(tokens, int) or not 1 <= tokens <= 4096
    ):
        raise ValidationError({"verify_max_tokens": ["An integer in 1..4096."]})
    tolerance = params.get("verify_logprob_tolerance")
    if tolerance is not None and (
        isinstance(tolerance, bool)
        or not isinstance(tolerance, int | float)
        or not 0 <= tolerance <= 1
    ):
        raise ValidationError({"verify_logprob_tolerance": ["A number in [0, 1]."]})
    return params


@transaction.atomic
def deployment_deploy(
    *, actor: Actor, deployment: Deployment, params: dict[str, Any] | None = None
) -> WorkflowRun:
    """Start the eight-step deployment workflow. 409 while a deployment or canary run of this
    deployment is pending or running, or when the deployment is retired or has no pools."""
    locked = _lock(deployment)
    params = _check_params(dict(params or {}))
    for kind in (DEPLOY_KIND, CANARY_KIND):
        running = active_run(locked, kind)
        if running is not None:
            raise Conflict(f"A {kind} run (#{running.pk}) of {locked.name} is {running.state}.")
    if locked.state == DeploymentState.RETIRED:
        raise Conflict(f"Deployment {locked.name} is retired.")
    if (
        not locked.pools.filter(role="decode").exists()
        or not locked.pools.filter(role="prefill").exists()
    ):
        raise Conflict(f"Deployment {locked.name} needs a decode pool and a prefill pool.")
    if locked.state != DeploymentState.DEPLOYING:
        deployment_transition(actor=actor, deployment=locked, to_state=DeploymentState.DEPLOYING)
    return run_services.run_create(
        actor=actor, kind=DEPLOY_KIND, steps=list(DEPLOY_STEPS), target=locked, params=params
    )


@transaction.atomic
def canary_start(
    *, actor: Actor, deployment: Deployment, params: dict[str, Any] | None = None
) -> WorkflowRun:
    """Start a canary following the deployment's rollout plan (one step per plan step). The
    plan's steps and gates are copied into the run's params, so editing the plan later does
    not change a canary in flight. 409 while another canary runs."""
    locked = _lock(deployment)
    params = _check_params(dict(params or {}))
    running = active_run(locked, CANARY_KIND)
    if running is not None:
        raise Conflict(f"A canary run (#{running.pk}) of {locked.name} is {running.state}.")
    if locked.state == DeploymentState.RETIRED:
        raise Conflict(f"Deployment {locked.name} is retired.")
    plan = rollout_plan_for(locked)
    params["plan"] = {
        "name": plan.name,
        "steps": plan.steps,
        "gates": {
            "ttft_p50_ratio": plan.gate_ttft_p50_ratio,
            "ttft_p99_ratio": plan.gate_ttft_p99_ratio,
            "success_rate_min": plan.gate_success_rate_min,
            "link_utilization_max": plan.gate_link_utilization_max,
        },
    }
    params["paused"] = False
    steps = [canary_step_name(s["share_percent"]) for s in plan.steps]
    return run_services.run_create(
        actor=actor, kind=CANARY_KIND, steps=steps, target=locked, params=params
    )


def _canary(deployment: Deployment) -> WorkflowRun:
    run = active_run(deployment, CANARY_KIND)
    if run is None:
        raise Conflict(f"No canary of {deployment.name} is pending or running.")
    return WorkflowRun.objects.select_for_update().get(pk=run.pk)


@transaction.atomic
def canary_pause(*, actor: Actor, deployment: Deployment) -> WorkflowRun:
    """Hold the canary at its current share: its re-checks keep gating but never advance."""
    run = _canary(deployment)
    run.params = {**run.params, "paused": True}
    run.save(update_fields=["params"])
    audit_record(actor=actor, action=AuditAction.ACTION, verb="canary_pause", instance=run)
    return run


@transaction.atomic
def canary_resume(*, actor: Actor, deployment: Deployment) -> WorkflowRun:
    """Let a paused canary advance again (its current step's hold counts from the resume)."""
    run = _canary(deployment)
    if not run.params.get("paused"):
        raise Conflict(f"Canary run #{run.pk} is not paused.")
    run.params = {**run.params, "paused": False}
    run.save(update_fields=["params"])
    audit_record(actor=actor, action=AuditAction.ACTION, verb="canary_resume", instance=run)
    run_services.run_nudge(run_id=run.pk)
    return run


@transaction.atomic
def canary_abort(*, actor: Actor, deployment: Deployment) -> WorkflowRun:
    """Stop the canary now: remote share back to 0 % in this transaction (the gateways see it
    at their next poll), and the run ends ``canceled`` at its next advance."""
    run = _canary(deployment)
    deployment_set_remote_share(
        actor=actor, deployment=deployment, percent=0, reason=f"canary #{run.pk} aborted"
    )
    return run_services.run_cancel(actor=actor, run=run)


@transaction.atomic
def deployment_set_remote_share(
    *, actor: Actor, deployment: Deployment, percent: int, reason: str
) -> Deployment:
    """Set the canary dial (a new config version when it changes; idempotent). The kill switch
    is untouched: it overrides any share on the data plane."""
    if isinstance(percent, bool) or not isinstance(percent, int) or not 0 <= percent <= 100:
        raise ValidationError({"remote_share_percent": ["An integer between 0 and 100."]})
    locked = _lock(deployment)
    if locked.remote_share_percent == percent:
        return locked
    before = locked.remote_share_percent
    locked.remote_share_percent = percent
    locked.save(update_fields=["remote_share_percent", "updated_at"])
    audit_record(
        actor=actor,
        action=AuditAction.ACTION,
        verb="remote_share",
        instance=locked,
        before={"remote_share_percent": before},
        after={"remote_share_percent": percent, "reason": reason},
    )
    snapshot_write(actor=actor, deployment=locked, reason=reason)
    return locked


@transaction.atomic
def deployment_set_baseline(
    *, actor: Actor, deployment: Deployment, baseline: dict[str, Any]
) -> Deployment:
    """Store the capacity baseline measured by step 1 (not part of the config document)."""
    locked = _lock(deployment)
    locked.baseline = baseline
    locked.save(update_fields=["baseline", "updated_at"])
    audit_record(
        actor=actor, action=AuditAction.ACTION, verb="baseline", instance=locked, after=baseline
    )
    return locked


def deployment_settle(*, deployment: Deployment, to_state: str) -> Deployment:
    """Move the deployment to ``to_state`` unless it is there already (workflow steps call this
    on every execution, so it must be idempotent)."""
    current = Deployment.objects.get(pk=deployment.pk)
    if current.state == to_state:
        return current
    return deployment_transition(actor=None, deployment=current, to_state=to_state)

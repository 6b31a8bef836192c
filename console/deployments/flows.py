"""Starting and steering a deployment's workflows: the eight-step deployment run and the canary
run, plus the writes those workflows make on the deployment (baseline, remote share).

Called by the deployments API (operators) and by the orchestrator's workflow steps (actor
``None``: the system). Blocking. Failures: ``Conflict`` (409) when a workflow of the kind is
already pending or running, or the run is not in a state the verb applies to;
``ValidationError`` naming the field (400). The console never imports workflow code: the step
names live here and the orchestrator's workflow modules check that theirs match.

Operator edits win over automation: the canary writes the remote share only through
``canary_set_share``, which records the config version its write made (``share_version`` in
the run's params). A later version that changed the share was made by someone else (an
operator's edit, a restore): ``canary_share_guard`` then pauses the canary with the reason and
leaves the share as that person set it; ``canary_resume`` accepts the share as it is now and
lets the canary go on."""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import Any

from django.core.exceptions import ValidationError
from django.db import transaction

from console.core.api.exceptions import Conflict
from console.core.choices import AuditAction
from console.core.crud import Actor
from console.core.services import audit_record
from console.deployments.choices import DeploymentState
from console.deployments.models import ConfigSnapshot, Deployment
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
logger = logging.getLogger(__name__)
_ACTIVE = (RunState.PENDING, RunState.RUNNING)
_TARGET_TYPE = "deployments.deployment"
#: The config diff path of the canary dial (``ConfigSnapshot.diff`` keys are dotted paths).
SHARE_PATH = "routing.remote_share_percent"


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
    # The version the canary starts from: a share change in a later version that the canary
    # did not make pauses it (canary_share_guard).
    params["share_version"] = locked.version
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
def canary_pause(*, actor: Actor, deployment: Deployment, reason: str = "") -> WorkflowRun:
    """Hold the canary at its current share: its re-checks keep gating but never advance.
    ``reason`` (shown on the canary page, kept in ``params.pause_reason``) says why when the
    canary paused itself."""
    run = _canary(deployment)
    _pause(actor, run, reason)
    return run


def _pause(actor: Actor, run: WorkflowRun, reason: str) -> None:
    run.params = {**run.params, "paused": True, "pause_reason": reason[:500]}
    run.save(update_fields=["params"])
    audit_record(
        actor=actor,
        action=AuditAction.ACTION,
        verb="canary_pause",
        instance=run,
        after={"reason": reason[:500]} if reason else None,
    )


@transaction.atomic
def canary_resume(*, actor: Actor, deployment: Deployment) -> WorkflowRun:
    """Let a paused canary advance again (its current step's hold counts from the resume,
    and the step sets its share again). A share someone changed while the canary ran is
    accepted as the canary's starting point: only changes after the resume pause it again."""
    run = _canary(deployment)
    if not run.params.get("paused"):
        raise Conflict(f"Canary run #{run.pk} is not paused.")
    locked = _lock(deployment)
    params = {k: v for k, v in run.params.items() if k != "pause_reason"}
    run.params = {**params, "paused": False, "share_version": locked.version}
    run.save(update_fields=["params"])
    audit_record(actor=actor, action=AuditAction.ACTION, verb="canary_resume", instance=run)
    run_services.run_nudge(run_id=run.pk)
    return run


@transaction.atomic
def canary_abort(*, actor: Actor, deployment: Deployment) -> WorkflowRun:
    """Stop the canary now: remote share back to 0 % in this transaction (the gateways see it
    at their next poll), and the run ends ``canceled`` at its next advance."""
    run = _canary(deployment)
    _canary_write(
        actor=actor, run=run, deployment=deployment, percent=0, reason=f"canary #{run.pk} aborted"
    )
    return run_services.run_cancel(actor=actor, run=run)


@dataclass(frozen=True)
class ShareChange:
    """A change of the remote share the canary did not make (the latest, when several)."""

    version: int  # the config version that made it
    expected: int | None  # the share the canary had left (before the first such change)
    found: int | None  # the share now
    author: str  # who made it ("system" for automation)
    reason: str  # the snapshot's reason ("updated", "restore of v3" ...)

    def describe(self) -> str:
        """The pause reason an operator reads."""
        moved = (
            f"{self.expected} % -> {self.found} %"
            if self.expected != self.found
            else f"to another value and back to {self.found} %"
        )
        return (
            f"remote share changed under the canary ({moved}) in config v{self.version} by "
            f"{self.author} ({self.reason}); the canary paused and left it as set. Resume to "
            "let the canary set its step's share again, or cancel the run to keep this share."
        )

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def share_change_since(deployment: Deployment, version: int) -> ShareChange | None:
    """The remote share's change in a config version after ``version``, if any (one query:
    only snapshots whose diff names the share). Other edits -- kill switch, threshold,
    pools, drains -- are not share changes."""
    changes = list(
        ConfigSnapshot.objects.filter(
            deployment=deployment, version__gt=version, diff__has_key=SHARE_PATH
        ).order_by("version")
    )
    if not changes:
        return None
    first, last = changes[0], changes[-1]
    return ShareChange(
        version=last.version,
        expected=first.diff[SHARE_PATH]["from"],
        found=last.diff[SHARE_PATH]["to"],
        author=last.author_label,
        reason=last.reason,
    )


@transaction.atomic
def canary_share_guard(*, run_id: int, deployment: Deployment) -> ShareChange | None:
    """Called by the canary's steps before they act: when someone changed the share since the
    canary's own last write (``params.share_version``), pause the canary with the reason
    and return the change; else None. A paused canary holds and writes nothing, so the
    operator's value stays. A run from before ``share_version`` existed starts tracking now."""
    run = WorkflowRun.objects.select_for_update().get(pk=run_id)
    locked = _lock(deployment)
    since = run.params.get("share_version")
    if since is None:
        run.params = {**run.params, "share_version": locked.version}
        run.save(update_fields=["params"])
        return None
    change = share_change_since(locked, int(since))
    if change is not None and not run.params.get("paused"):
        _pause(None, run, change.describe())
        logger.info(
            "canary_paused_share_changed",
            extra={"run": run.pk, "deployment": locked.pk, **change.as_dict()},
        )
    return change


@transaction.atomic
def canary_set_share(
    *, run_id: int, deployment: Deployment, percent: int, reason: str, guard: bool = True
) -> ShareChange | None:
    """The canary's own write of the remote share. With ``guard`` (a step raising the share)
    the write happens only when nobody changed the share since the canary's last write --
    checked under the deployment's row lock, so an operator's edit is never overwritten --
    else the canary pauses and the change is returned. Without it (rollback, failure: the
    safe state) the write always happens. Either way the run records the version."""
    if guard:
        change = canary_share_guard(run_id=run_id, deployment=deployment)
        if change is not None:
            return change
    run = WorkflowRun.objects.select_for_update().get(pk=run_id)
    _canary_write(actor=None, run=run, deployment=deployment, percent=percent, reason=reason)
    return None


def _canary_write(
    *, actor: Actor, run: WorkflowRun, deployment: Deployment, percent: int, reason: str
) -> None:
    locked = deployment_set_remote_share(
        actor=actor, deployment=deployment, percent=percent, reason=reason
    )
    run.params = {**run.params, "share_version": locked.version}
    run.save(update_fields=["params"])


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

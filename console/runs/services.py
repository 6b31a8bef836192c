"""Every write to runs and steps. State transitions happen here and only here, each guarded.

The orchestrator's tasks call these functions; the API calls ``run_create`` / ``run_cancel`` /
``run_retry``. A step is claimed under a row lock on its run, so two workers can never execute
the same step at once, and a step whose worker died (stale heartbeat) is re-claimed by the
next ``advance`` (the beat job ``resume_stalled`` sends one).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from django.contrib.auth.models import AbstractBaseUser, AnonymousUser
from django.db import models, transaction
from django.utils import timezone

from console.core.api.exceptions import Conflict
from console.core.celery_client import send_task_on_commit
from console.core.choices import AuditAction
from console.core.services import audit_record
from console.runs.choices import RUN_TERMINAL, RunState, StepState
from console.runs.models import StepRun, WorkflowRun

ADVANCE_TASK = "orchestrator.runs.advance_run"
_DONE_STEP_STATES = {StepState.SUCCEEDED, StepState.SKIPPED}


def _now(now: datetime | None) -> datetime:
    return now or timezone.now()


@transaction.atomic
def run_create(
    *,
    actor: AbstractBaseUser | AnonymousUser | None,
    kind: str,
    steps: list[str],
    target: models.Model | None = None,
    params: dict[str, Any] | None = None,
    start: bool = True,
) -> WorkflowRun:
    """Create a run with its steps (all pending) and, with ``start``, queue its first advance."""
    if not steps:
        raise ValueError("steps: a run needs at least one step")
    run = WorkflowRun.objects.create(
        kind=kind,
        target_type=target._meta.label_lower if target is not None else "",
        target_id=str(target.pk) if target is not None else "",
        params=params or {},
        created_by=actor if actor is not None and actor.is_authenticated else None,
    )
    StepRun.objects.bulk_create(
        StepRun(run=run, index=i, name=name) for i, name in enumerate(steps)
    )
    audit_record(
        actor=actor,
        action=AuditAction.CREATE,
        instance=run,
        after={"kind": kind, "steps": steps, "params": run.params},
    )
    if start:
        send_task_on_commit(ADVANCE_TASK, args=[run.pk])
    return run


@dataclass(frozen=True)
class Claim:
    """A step handed to a worker: execute it, then report through step_succeed / step_wait /
    step_fail / run_roll_back."""

    run_id: int
    step_id: int
    index: int
    name: str
    attempt: int
    resumed: bool  # the previous holder died (stale heartbeat) and this is a re-execution


@dataclass(frozen=True)
class NotDue:
    """The current step is waiting; re-check it after ``seconds``."""

    seconds: float


def step_claim_next(
    *, run_id: int, worker: str, stale_after_s: float, now: datetime | None = None
) -> Claim | NotDue | None:
    """Claim the run's next step for ``worker``.

    Returns None when there is nothing to execute now: the run ended (or just ended: canceled,
    or every step done), or another worker holds the current step with a fresh heartbeat."""
    now = _now(now)
    with transaction.atomic():
        run = WorkflowRun.objects.select_for_update().filter(pk=run_id).first()
        if run is None or run.state in RUN_TERMINAL:
            return None
        steps = list(run.steps.order_by("index"))
        step = next((s for s in steps if s.state not in _DONE_STEP_STATES), None)
        if run.cancel_requested:
            _finish_run(run, RunState.CANCELED, now=now, error="canceled by operator")
            if step is not None and step.state in {StepState.PENDING, StepState.RUNNING}:
                step.state, step.finished_at = StepState.CANCELED, now
                step.save(update_fields=["state", "finished_at"])
            return None
        if step is None:
            _finish_run(run, RunState.SUCCEEDED, now=now)
            return None
        resumed = False
        if step.state == StepState.RUNNING:
            if step.wake_at is not None:
                if step.wake_at > now:
                    return NotDue((step.wake_at - now).total_seconds())
            elif step.heartbeat_at is not None and step.heartbeat_at > now - timedelta(
                seconds=stale_after_s
            ):
                return None  # held by a live worker
            else:
                resumed = True
        elif step.state != StepState.PENDING:
            return None  # failed/canceled steps wait for an explicit retry
        if step.state == StepState.PENDING or resumed:
            step.attempt += 1
        if step.started_at is None or step.state == StepState.PENDING:
            step.started_at = now
        step.state = StepState.RUNNING
        step.worker, step.heartbeat_at, step.wake_at = worker, now, None
        step.save(
            update_fields=["state", "attempt", "worker", "heartbeat_at", "wake_at", "started_at"]
        )
        if run.state == RunState.PENDING:
            run.state, run.started_at = RunState.RUNNING, now
            run.save(update_fields=["state", "started_at"])
        return Claim(run.pk, step.pk, step.index, step.name, step.attempt, resumed)


def step_heartbeat(*, step_id: int, worker: str, now: datetime | None = None) -> bool:
    """Refresh the heartbeat of a step this worker holds; False if it no longer holds it."""
    return bool(
        StepRun.objects.filter(
            pk=step_id, state=StepState.RUNNING, worker=worker, wake_at__isnull=True
        ).update(heartbeat_at=_now(now))
    )


def _held_step(step_id: int, worker: str) -> StepRun | None:
    step = StepRun.objects.select_for_update().select_related("run").get(pk=step_id)
    if step.state != StepState.RUNNING or step.worker != worker or step.run.state in RUN_TERMINAL:
        return None  # canceled or taken over meanwhile: drop the result
    return step


def _append_log(step: StepRun, lines: list[str]) -> None:
    if lines:
        step.log_excerpt = ("\n".join([step.log_excerpt, *lines]).strip())[-8000:]


def _record(
    step_id: int,
    worker: str,
    evidence: dict[str, Any],
    log: list[str] | None,
    fields: dict[str, Any],
) -> StepRun | None:
    """Store what a worker reports of the step it holds: ``fields``, its evidence and log
    lines; it no longer holds a heartbeat. None when it no longer holds the step."""
    step = _held_step(step_id, worker)
    if step is None:
        return None
    for name, value in fields.items():
        setattr(step, name, value)
    step.evidence, step.heartbeat_at = evidence, None
    _append_log(step, log or [])
    step.save()
    return step


@transaction.atomic
def step_succeed(
    *,
    step_id: int,
    worker: str,
    evidence: dict[str, Any],
    log: list[str] | None = None,
    now: datetime | None = None,
) -> bool:
    """Record a step's success and queue the next advance."""
    fields = {"state": StepState.SUCCEEDED, "error": "", "finished_at": _now(now)}
    step = _record(step_id, worker, evidence, log, fields)
    if step is None:
        return False
    send_task_on_commit(ADVANCE_TASK, args=[step.run_id])
    return True


@transaction.atomic
def step_wait(
    *,
    step_id: int,
    worker: str,
    seconds: float,
    evidence: dict[str, Any],
    log: list[str] | None = None,
    now: datetime | None = None,
) -> bool:
    """Park a step until a re-check ``seconds`` from now (no worker sleeps meanwhile)."""
    step = _record(
        step_id, worker, evidence, log, {"wake_at": _now(now) + timedelta(seconds=seconds)}
    )
    if step is None:
        return False
    send_task_on_commit(ADVANCE_TASK, args=[step.run_id], countdown=seconds)
    return True


@transaction.atomic
def step_fail(
    *,
    step_id: int,
    worker: str,
    error: str,
    evidence: dict[str, Any],
    log: list[str] | None = None,
    rolled_back: bool = False,
    now: datetime | None = None,
) -> bool:
    """Record a failed step and stop the run: ``failed`` (retryable from this step), or
    ``rolled_back`` when the workflow undid its change."""
    now = _now(now)
    fields = {"state": StepState.FAILED, "error": error[:4000], "finished_at": now}
    step = _record(step_id, worker, evidence, log, fields)
    if step is None:
        return False
    _finish_run(
        step.run,
        RunState.ROLLED_BACK if rolled_back else RunState.FAILED,
        now=now,
        error=f"step {step.index} {step.name}: {error}"[:4000],
    )
    return True


def _finish_run(run: WorkflowRun, state: RunState, *, now: datetime, error: str = "") -> None:
    run.state, run.finished_at, run.error = state, now, error
    run.save(update_fields=["state", "finished_at", "error"])


@transaction.atomic
def run_set_result(*, run_id: int, result: dict[str, Any]) -> None:
    WorkflowRun.objects.filter(pk=run_id).update(result=result)


@transaction.atomic
def run_cancel(*, actor: AbstractBaseUser | AnonymousUser | None, run: WorkflowRun) -> WorkflowRun:
    """Ask a run to stop: it ends ``canceled`` at its next advance (a step executing now finishes
    first and its result is recorded)."""
    run = WorkflowRun.objects.select_for_update().get(pk=run.pk)
    if run.state in RUN_TERMINAL:
        raise Conflict(f"Run is already {run.state}.")
    run.cancel_requested = True
    run.save(update_fields=["cancel_requested"])
    audit_record(actor=actor, action=AuditAction.ACTION, verb="cancel", instance=run)
    send_task_on_commit(ADVANCE_TASK, args=[run.pk])
    return run


@transaction.atomic
def run_retry(
    *,
    actor: AbstractBaseUser | AnonymousUser | None,
    run: WorkflowRun,
    from_index: int | None = None,
) -> WorkflowRun:
    """Restart a failed (or rolled back / canceled) run from a step: that step and the ones after
    it go back to pending, earlier steps keep their evidence."""
    run = WorkflowRun.objects.select_for_update().get(pk=run.pk)
    if run.state not in {RunState.FAILED, RunState.ROLLED_BACK, RunState.CANCELED}:
        raise Conflict(
            f"Only a failed, rolled back or canceled run can be retried; this one is {run.state}."
        )
    steps = list(run.steps.order_by("index"))
    if from_index is None:
        from_index = next(
            (s.index for s in steps if s.state not in _DONE_STEP_STATES), len(steps) - 1
        )
    if not 0 <= from_index < len(steps):
        from django.core.exceptions import ValidationError

        raise ValidationError({"from_step": f"must be between 0 and {len(steps) - 1}"})
    for step in steps[from_index:]:
        if step.error:
            _append_log(step, [f"attempt {step.attempt} failed: {step.error}"])
        step.state, step.error, step.finished_at, step.heartbeat_at, step.wake_at = (
            StepState.PENDING,
            "",
            None,
            None,
            None,
        )
        step.save()
    before = run.state
    run.state, run.error, run.finished_at, run.cancel_requested = RunState.RUNNING, "", None, False
    run.save(update_fields=["state", "error", "finished_at", "cancel_requested"])
    audit_record(
        actor=actor,
        action=AuditAction.ACTION,
        verb="retry",
        instance=run,
        before={"state": before},
        after={"from_step": from_index},
    )
    send_task_on_commit(ADVANCE_TASK, args=[run.pk])
    return run


def runs_stalled(*, stale_after_s: float, now: datetime | None = None) -> list[int]:
    """Ids of runs that should be moving but are not: the current step lost its worker (stale
    heartbeat), its re-check is overdue, or its advance message never arrived (a broker restart
    can lose one). Sending them an advance is always safe: claiming is idempotent."""
    now = _now(now)
    stale = now - timedelta(seconds=stale_after_s)
    stalled = []
    for run in WorkflowRun.objects.filter(
        state__in=[RunState.PENDING, RunState.RUNNING]
    ).prefetch_related("steps"):
        steps = sorted(run.steps.all(), key=lambda s: s.index)
        step = next((s for s in steps if s.state not in _DONE_STEP_STATES), None)
        if step is None or step.state == StepState.PENDING:
            last_move = max(
                [s.finished_at for s in steps if s.finished_at] + [run.started_at or run.created_at]
            )
            if last_move < stale:
                stalled.append(run.pk)
        elif step.state == StepState.RUNNING:
            if step.wake_at is not None:
                if step.wake_at < stale:
                    stalled.append(run.pk)
            elif step.heartbeat_at is None or step.heartbeat_at < stale:
                stalled.append(run.pk)
    return stalled


def run_nudge(*, run_id: int) -> None:
    """Queue an advance of the run now (after commit), e.g. when a paused canary resumes and
    should not wait for its next scheduled re-check. Always safe: claiming is idempotent."""
    send_task_on_commit(ADVANCE_TASK, args=[run_id])

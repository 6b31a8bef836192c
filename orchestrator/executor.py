"""Executes one claimed step: builds its context, keeps its heartbeat fresh while it runs, and
records the outcome through the console's run services (the record of truth)."""

from __future__ import annotations

import logging
import os
import socket
import threading
import traceback
from typing import Any

from django.conf import settings
from django.db import close_old_connections, connection

from console.runs import services
from console.runs.models import StepRun, WorkflowRun
from orchestrator.steps import Done, Fail, RollBack, StepContext, StepResult, Wait
from orchestrator.workflows import workflow_module

log = logging.getLogger("pdbridge.orchestrator")


def worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def stale_after_s() -> float:
    return float(getattr(settings, "PDBRIDGE_STEP_STALE_S", 60.0))


def heartbeat_every_s() -> float:
    return max(stale_after_s() / 4, 0.5)


class _Heartbeat(threading.Thread):
    """Refreshes the step's heartbeat until stopped (its own database connection)."""

    def __init__(self, step_id: int, worker: str) -> None:
        super().__init__(daemon=True, name=f"heartbeat-{step_id}")
        self.step_id, self.worker, self.stopped = step_id, worker, threading.Event()

    def run(self) -> None:
        try:
            while not self.stopped.wait(heartbeat_every_s()):
                services.step_heartbeat(step_id=self.step_id, worker=self.worker)
        finally:
            connection.close()


def execution_key(step: StepRun) -> str:
    """Names one execution of a step: its row and the time it was claimed from ``pending``.
    A resume after a dead worker and a Wait re-check keep ``started_at`` (the step stays
    ``running``); an operator's retry sets the step back to ``pending``, so its claim sets a new
    one."""
    started = step.started_at
    return f"s{step.pk}.{int(started.timestamp() * 1000) if started else 0}"


def advance(run_id: int) -> dict[str, Any]:
    """Claim and execute the run's next step, if any is due. Returns what happened (for logs
    and task results); never raises for a step's failure (that is recorded on the step)."""
    worker = worker_id()
    claim = services.step_claim_next(run_id=run_id, worker=worker, stale_after_s=stale_after_s())
    if claim is None:
        return {"run": run_id, "outcome": "nothing-to-do"}
    if isinstance(claim, services.NotDue):
        return {"run": run_id, "outcome": "not-due", "seconds": claim.seconds}

    run = WorkflowRun.objects.get(pk=claim.run_id)
    steps = {s.name: s for s in run.steps.all()}
    step = steps[claim.name]
    ctx = StepContext(
        run_id=run.pk,
        kind=run.kind,
        target_type=run.target_type,
        target_id=run.target_id,
        params=run.params,
        step_index=claim.index,
        step_name=claim.name,
        attempt=claim.attempt,
        resumed=claim.resumed,
        evidence=dict(step.evidence),
        previous={s.name: s.evidence for s in steps.values() if s.index < claim.index},
        execution=execution_key(step),
    )
    if claim.resumed:
        ctx.log(f"resumed after its worker stopped (attempt {claim.attempt})")
    log.info(
        "step.start run=%s step=%s attempt=%s worker=%s", run.pk, claim.name, claim.attempt, worker
    )
    module = workflow_module(run.kind)
    step_fn = next(s.run for s in module.STEPS if s.name == claim.name)
    heartbeat = _Heartbeat(claim.step_id, worker)
    heartbeat.start()
    try:
        result: StepResult = step_fn(ctx)
    except Exception as exc:  # a step's bug or failure is the step's failure, recorded
        result = Fail(
            f"{type(exc).__name__}: {exc}",
            {**ctx.evidence, "traceback": traceback.format_exc()[-4000:]},
        )
    finally:
        heartbeat.stopped.set()
        heartbeat.join()
    close_old_connections()
    return _record(ctx, claim.step_id, worker, result, module)


def _record(
    ctx: StepContext, step_id: int, worker: str, result: StepResult, module: Any
) -> dict[str, Any]:
    base = {"run": ctx.run_id, "step": ctx.step_name}
    if isinstance(result, Done):
        services.step_succeed(
            step_id=step_id, worker=worker, evidence=result.evidence, log=ctx.log_lines
        )
        log.info("step.done run=%s step=%s", ctx.run_id, ctx.step_name)
        return {**base, "outcome": "done"}
    if isinstance(result, Wait):
        services.step_wait(
            step_id=step_id,
            worker=worker,
            seconds=result.seconds,
            evidence=result.evidence,
            log=ctx.log_lines,
        )
        return {**base, "outcome": "wait", "seconds": result.seconds}
    rolled_back = isinstance(result, RollBack)
    error = result.reason if isinstance(result, RollBack) else result.error
    recorded = services.step_fail(
        step_id=step_id,
        worker=worker,
        error=error,
        evidence=result.evidence,
        log=ctx.log_lines,
        rolled_back=rolled_back,
    )
    log.warning("step.failed run=%s step=%s error=%s", ctx.run_id, ctx.step_name, error)
    on_failure = getattr(module, "on_failure", None)
    if recorded and on_failure is not None and not rolled_back:
        try:
            on_failure(ctx)
        except Exception:
            log.exception("workflow.on_failure_failed run=%s", ctx.run_id)
            StepRun.objects.filter(pk=step_id).update(
                log_excerpt=f"on_failure raised:\n{traceback.format_exc()[-3000:]}"
            )
    return {**base, "outcome": "rolled_back" if rolled_back else "failed", "error": error}

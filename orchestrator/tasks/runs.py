"""Thin tasks over the run executor: ids in, world re-checked, idempotent."""

from __future__ import annotations

from typing import Any

from orchestrator.celery import app


@app.task(name="orchestrator.runs.advance_run", acks_late=True, soft_time_limit=900, time_limit=960)
def advance_run(run_id: int) -> dict[str, Any]:
    """Execute the run's next due step, if any (safe to send any number of times)."""
    from orchestrator.executor import advance

    return advance(run_id)


@app.task(name="orchestrator.runs.resume_stalled", acks_late=True, soft_time_limit=60)
def resume_stalled() -> list[int]:
    """Beat job: send an advance to every run whose worker died or whose message was lost."""
    from console.runs.services import runs_stalled
    from orchestrator.executor import stale_after_s

    run_ids = runs_stalled(stale_after_s=stale_after_s())
    for run_id in run_ids:
        advance_run.delay(run_id)
    return run_ids

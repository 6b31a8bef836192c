"""Runs executed by real Celery worker processes over a real broker and the test database."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from django.test import override_settings

from console.core import celery_client
from console.runs import services
from console.runs.models import WorkflowRun
from tests.support import wait_for

pytestmark = pytest.mark.django_db(transaction=True)


def run_state(run_id: int) -> str:
    return WorkflowRun.objects.get(pk=run_id).state


def journal_lines(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


def test_selfcheck_runs_every_step_with_a_scheduled_recheck(start_worker):
    start_worker()

    run = services.run_create(
        actor=None,
        kind="selfcheck",
        steps=["database", "worker", "scheduled_recheck"],
        params={"recheck_s": 1},
    )

    wait_for(lambda: run_state(run.pk) == "succeeded")
    steps = {s.name: s for s in WorkflowRun.objects.get(pk=run.pk).steps.all()}
    assert steps["database"].evidence["vendor"] in {"postgresql", "sqlite"}
    assert steps["worker"].evidence["pid"] > 0
    assert steps["scheduled_recheck"].evidence["late_by_s"] >= 0
    assert steps["scheduled_recheck"].attempt == 1


def test_failed_step_stops_run_calls_safe_state_hook_and_retry_succeeds(start_worker, tmp_path):
    start_worker()
    journal, cause = tmp_path / "journal", tmp_path / "cause"
    cause.write_text("present")

    run = services.run_create(
        actor=None,
        kind="flaky",
        steps=["prepare", "check"],
        params={"journal": str(journal), "cause": str(cause)},
    )

    wait_for(lambda: run_state(run.pk) == "failed")
    wait_for(lambda: "on_failure step=check" in journal_lines(journal))
    cause.unlink()
    services.run_retry(actor=None, run=WorkflowRun.objects.get(pk=run.pk))
    wait_for(lambda: run_state(run.pk) == "succeeded")
    assert journal_lines(journal) == [
        "prepare attempt=1",
        "check attempt=1",
        "on_failure step=check",
        "check attempt=2",
    ]


def test_gate_failure_ends_rolled_back_with_evidence(start_worker, tmp_path):
    start_worker()

    run = services.run_create(
        actor=None, kind="gated", steps=["prepare", "gate"], params={"journal": str(tmp_path / "j")}
    )

    wait_for(lambda: run_state(run.pk) == "rolled_back")
    gate = WorkflowRun.objects.get(pk=run.pk).steps.get(name="gate")
    assert gate.evidence == {"ttft_p99_ratio": 2.0, "limit": 1.5}
    assert gate.error == "gate failed: ttft_p99 2.0x > 1.5x"


def test_worker_killed_mid_step_is_resumed_without_duplicating_side_effects(start_worker, tmp_path):
    journal, marker = tmp_path / "journal", tmp_path / "marker"
    first = start_worker(stale_s=2)
    run = services.run_create(
        actor=None,
        kind="slow",
        steps=["launch"],
        params={"journal": str(journal), "marker": str(marker), "work_s": 4},
    )
    wait_for(lambda: "launched" in journal_lines(journal))

    first.kill9()
    start_worker(stale_s=2)
    time.sleep(2.5)  # the dead worker's heartbeat goes stale
    from orchestrator.tasks.runs import resume_stalled  # the beat job, sent as a task

    resume_stalled.delay()

    wait_for(lambda: run_state(run.pk) == "succeeded")
    lines = journal_lines(journal)
    assert lines.count("launched") == 1
    execs = [line for line in lines if line.startswith("exec")]
    assert len(execs) == 2
    assert execs[1].startswith("exec attempt=2 resumed=True")
    step = WorkflowRun.objects.get(pk=run.pk).steps.get()
    assert step.attempt == 2
    assert "resumed after its worker stopped" in step.log_excerpt


def test_concurrent_advances_execute_a_step_once(start_worker, tmp_path):
    journal, marker = tmp_path / "journal", tmp_path / "marker"
    start_worker()
    start_worker()
    run = services.run_create(
        actor=None,
        kind="slow",
        steps=["launch"],
        params={"journal": str(journal), "marker": str(marker), "work_s": 1.5},
        start=False,
    )
    from orchestrator.tasks.runs import advance_run

    for _ in range(4):
        advance_run.delay(run.pk)

    wait_for(lambda: run_state(run.pk) == "succeeded")
    time.sleep(0.5)
    execs = [line for line in journal_lines(journal) if line.startswith("exec")]
    assert len(execs) == 1
    assert journal_lines(journal).count("launched") == 1


def test_embedded_filesystem_broker_runs_selfcheck(start_worker, tmp_path):
    var_dir = tmp_path / "fsvar"
    broker = var_dir / "celery" / "broker"
    broker.mkdir(parents=True)
    options = {
        "data_folder_in": str(broker),
        "data_folder_out": str(broker),
        "processed_folder": str(broker),
        "control_folder": str(var_dir / "celery" / "control"),
        "store_processed": False,
    }
    with override_settings(
        CELERY_BROKER_URL="filesystem://", CELERY_BROKER_TRANSPORT_OPTIONS=options
    ):
        celery_client._app.cache_clear()
        try:
            start_worker(broker_url="filesystem://", var_dir=var_dir)
            run = services.run_create(
                actor=None,
                kind="selfcheck",
                steps=["database", "worker", "scheduled_recheck"],
                params={"recheck_s": 0.5},
            )
            wait_for(lambda: run_state(run.pk) == "succeeded")
        finally:
            celery_client._app.cache_clear()

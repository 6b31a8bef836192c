"""The drill beat task and a drill whose gateway is unreachable, run by a real worker."""

from __future__ import annotations

import socket
import time

import pytest
from django.contrib.auth import get_user_model
from django.test import Client

from console.core.choices import Role
from console.core.roles import role_group
from console.drills import services
from console.drills.models import DrillReport
from console.runs.models import WorkflowRun
from orchestrator.tasks.drills import run_scheduled
from tests.orchestrator.two_sites import two_site_deployment
from tests.support import deadline_in


def _dead_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


@pytest.mark.django_db
def test_scheduled_task_starts_the_drill_and_skips_when_one_runs(db):
    drill = services.drill_create(
        actor=None,
        name="weekly",
        deployment=two_site_deployment("127.0.0.1:1", "127.0.0.1:2"),
        kind="link_cut",
        schedule="0 3 * * 1",
    )

    first = run_scheduled.run(drill.pk)
    second = run_scheduled.run(drill.pk)

    report = DrillReport.objects.get()
    assert first == {
        "drill": drill.pk,
        "outcome": "started",
        "report": report.pk,
        "run": report.run_id,
    }
    assert report.trigger == "schedule"
    assert second["outcome"] == "skipped"
    assert "weekly" in second["reason"]
    assert run_scheduled.run(999999) == {"drill": 999999, "outcome": "missing"}


@pytest.mark.django_db(transaction=True)
def test_drill_with_unreachable_gateway_fails_its_first_step_and_aborts_the_report(
    transactional_db, start_worker, monkeypatch, tmp_path
):
    monkeypatch.setenv("PDBRIDGE_CONTROLLER_INSECURE", "true")
    start_worker(var_dir=tmp_path / "var")
    drill = services.drill_create(
        actor=None, name="cut", deployment=two_site_deployment("127.0.0.1:1", "127.0.0.1:2"), kind="link_cut",
        targets={"gateway_url": _dead_url()},
    )  # fmt: skip

    report = services.drill_run(actor=None, drill=drill)

    deadline = deadline_in(60)
    while WorkflowRun.objects.get(pk=report.run_id).state in {"pending", "running"}:
        assert time.monotonic() < deadline, "run did not end"
        time.sleep(0.2)
    # The run is marked failed first; on_failure (which aborts the report) runs right after.
    while DrillReport.objects.get(pk=report.pk).state == "running":
        assert time.monotonic() < deadline, "report was not aborted"
        time.sleep(0.2)
    run = WorkflowRun.objects.get(pk=report.run_id)
    report.refresh_from_db()
    assert run.state == "failed"
    assert run.error.startswith("step 0 start_load: URLError")
    assert report.state == "aborted"
    assert report.error.startswith("step start_load failed: URLError")  # why, not only where
    page = Client()
    page.force_login(get_user_model().objects.create_user("v", password="pw-1-tests"))
    get_user_model().objects.get(username="v").groups.add(role_group(Role.VIEWER))
    html = page.get(f"/drills/reports/{report.pk}/").content.decode()
    assert "Not judged: the drill was aborted (step start_load failed: URLError" in html
    assert not (tmp_path / "var" / "drills" / f"run-{run.pk}" / "loadgen.json").exists()

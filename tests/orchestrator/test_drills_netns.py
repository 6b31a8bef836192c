"""Link-cut and remote-restart drills end to end: a real Celery worker runs the drill workflow
against real agents (one per site, the remote one in its own network namespace), reference
engines, a gateway and ``pdbridge loadgen``; both drills end with a report showing zero failed
client requests, fallback serving the fault window, the breaker opening, traffic back on the
remote path after restore and the verification sample matching."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from console.drills import services
from console.drills.models import DrillReport
from console.runs.models import WorkflowRun
from tests.orchestrator.two_sites import (
    PREFILL_CHILD,
    TwoSites,
    build_models,
    two_site_deployment,
    two_sites,
)
from tests.support import deadline_in, unavailable

pytestmark = [pytest.mark.netns, pytest.mark.slow, pytest.mark.django_db(transaction=True)]

WINDOWS = {"baseline_s": 3, "fault_s": 4, "after_s": 2, "recover_timeout_s": 90}
LOAD = {"concurrency": 3, "mix": "1:150:0.3", "min_prompt_tokens": 80, "max_prompt_tokens": 300,
        "max_tokens": 6}  # fmt: skip


@pytest.fixture(scope="module")
def bed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TwoSites]:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        unavailable("drills need root and iproute2 for the namespace sites")
    models_dir = tmp_path_factory.mktemp("models")
    build_models(models_dir)
    with two_sites(tmp_path_factory.mktemp("bed"), models_dir) as system:
        yield system


@pytest.fixture
def worker(start_worker, monkeypatch, tmp_path: Path):
    monkeypatch.setenv("PDBRIDGE_CONTROLLER_INSECURE", "true")
    return start_worker(var_dir=tmp_path / "var", stale_s=20)


def _run_drill(bed: TwoSites, kind: str) -> tuple[DrillReport, WorkflowRun]:
    drill = services.drill_create(
        actor=None, name=f"drill-{kind.replace('_', '-')}", deployment=two_site_deployment(bed.local_agent.address, bed.remote_agent_address),
        kind=kind, load_profile=LOAD, criteria={"max_time_to_recover_s": 90},
        targets={"gateway_url": bed.gateway_url, "decode_url": bed.decode.url, "model": "tiny",
                 "prefill_child": PREFILL_CHILD, "verify_prompts": [200]},
        **WINDOWS,
    )  # fmt: skip
    report = services.drill_run(actor=None, drill=drill)
    deadline = deadline_in(240)
    while time.monotonic() < deadline:
        run = WorkflowRun.objects.get(pk=report.run_id)
        if run.state not in {"pending", "running"}:
            break
        time.sleep(0.5)
    report.refresh_from_db()
    return report, WorkflowRun.objects.get(pk=report.run_id)


def process_state(pid: int) -> str | None:
    """The process's state letter (``Z``: a zombie), None once it is gone (reaped)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def check_report(report: DrillReport, run: WorkflowRun) -> dict[str, Any]:
    steps = {s.name: s for s in run.steps.all()}
    assert run.state == "succeeded", (run.error, {n: s.log_excerpt for n, s in steps.items()})
    assert report.state == "passed", report.criteria_results
    assert report.failed_requests == 0
    assert report.failures == []
    assert report.total_requests > 0
    assert report.requests["before"].get("remote/ok", 0) > 0
    assert report.requests["during"].get("fallback/ok", 0) > 0
    assert report.requests["after"].get("remote/ok", 0) > 0
    assert report.breaker["ejections"] >= 1
    assert report.time_to_detect_s is not None
    assert report.time_to_recover_s is not None
    assert report.verification["ok"] is True
    assert [(p["path"], p["match"]) for p in report.verification["prompts"]] == [("remote", True)]
    # The sample sent while every prefill site was faulted was served by the fallback and
    # matched the decode engine alone.
    during = report.verification["during"]
    assert (during["path"], during["match"], report.verification["fallback_compared"]) == (
        "fallback", True, 1,
    )  # fmt: skip
    assert all(r["passed"] for r in report.criteria_results)
    assert report.ttft["during"]["fallback"]["n"] > 0
    assert report.timeline["rows"]
    # The run's own record: one load generator, faults injected once with an expiry.
    assert steps["start_load"].attempt == 1
    assert len(steps["inject_fault"].evidence["faults"]) == 1
    summary = steps["collect_load"].evidence["summary"]
    assert summary["failed"] == 0
    assert summary["requests"] == report.total_requests
    # The worker reaped its load generator: gone, not a zombie (#19).
    pid = steps["start_load"].evidence["pid"]
    deadline = deadline_in(30)
    while process_state(pid) is not None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert process_state(pid) is None, f"load generator {pid}: {process_state(pid)}"
    print(
        f"\n{run.kind}: {report.total_requests} requests {report.requests}, 0 failed, "
        f"detect {report.time_to_detect_s} s, recover {report.time_to_recover_s} s"
    )
    return steps


def test_link_cut_drill_reports_zero_failed_requests(bed: TwoSites, worker) -> None:
    report, run = _run_drill(bed, "link_cut")

    steps = check_report(report, run)
    fault = steps["inject_fault"].evidence["faults"][0]
    assert (fault["kind"], fault["target"], fault["mechanism"]) == (
        "link_cut",
        "remote",
        "interface",
    )
    assert bed.link_up()  # the agent lifted the cut at its expiry


def test_remote_restart_drill_reports_zero_failed_requests(bed: TwoSites, worker) -> None:
    before = bed.remote_child()

    report, run = _run_drill(bed, "remote_restart")

    steps = check_report(report, run)
    fault = steps["inject_fault"].evidence["faults"][0]
    assert (fault["kind"], fault["target"]) == ("engine_kill", PREFILL_CHILD)
    after = bed.remote_child()
    assert after["state"] == "running"
    assert after["pid"] != before["pid"]  # a new process: the engine really restarted

"""A link-cut drill started through ``POST /api/drills/`` on the testbed's layout, end to end:
the KV path crosses the remote agent's fault proxy and the decode site's agent has nothing to
cut with (#19: "no fault proxy running for peer site 'remote'"), so the workflow injects the
cut at the remote agent, towards the local site. A real worker, real agents in two network
namespaces, reference engines, a gateway and the load generator; the report shows zero failed
requests, the fallback serving the fault window, traffic back on the remote path and a
remote-path verification sample; the load generator is reaped."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from console.drills.models import DrillReport
from console.runs.models import WorkflowRun
from tests.orchestrator.test_drills_netns import LOAD, WINDOWS, check_report
from tests.orchestrator.two_sites import TwoSites, build_models, two_site_deployment, two_sites
from tests.support import deadline_in, unavailable

pytestmark = [pytest.mark.netns, pytest.mark.slow, pytest.mark.django_db(transaction=True)]


@pytest.fixture(scope="module")
def bed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TwoSites]:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        unavailable("drills need root and iproute2 for the namespace sites")
    models_dir = tmp_path_factory.mktemp("models")
    build_models(models_dir)
    with two_sites(tmp_path_factory.mktemp("bed"), models_dir, fault_proxy=True) as system:
        yield system


@pytest.fixture
def worker(start_worker, monkeypatch, tmp_path: Path):
    monkeypatch.setenv("PDBRIDGE_CONTROLLER_INSECURE", "true")
    return start_worker(var_dir=tmp_path / "var", stale_s=20)


def test_a_link_cut_drill_from_the_api_cuts_at_the_agent_that_owns_the_fault_proxy(
    bed: TwoSites, worker, api_as
) -> None:
    deployment = two_site_deployment(bed.local_agent.address, bed.remote_agent_address)

    response = api_as("operator").post(
        "/api/drills/",
        {
            "name": "cut-testbed", "deployment": deployment.pk, "kind": "link_cut",
            "load_profile": LOAD, "criteria": {"max_time_to_recover_s": 90},
            "targets": {"gateway_url": bed.gateway_url, "decode_url": bed.decode.url,
                        "model": "tiny", "verify_prompts": [200]},
            **WINDOWS,
        },
        format="json",
    )  # fmt: skip

    assert response.status_code == 201, response.json()
    report = DrillReport.objects.get(drill_id=response.json()["id"])
    deadline = deadline_in(300)
    while WorkflowRun.objects.get(pk=report.run_id).state in {"pending", "running"}:
        assert time.monotonic() < deadline, "the drill did not end"
        time.sleep(0.5)
    report.refresh_from_db()
    run = WorkflowRun.objects.get(pk=report.run_id)
    steps = check_report(report, run)
    injected = steps["inject_fault"].evidence
    assert injected["placement"] == "a0"  # the decode agent refused, the remote agent cut
    assert "no fault proxy running for peer site 'remote'" in injected["refused"][0]
    [fault] = injected["faults"]
    assert (fault["node"], fault["kind"], fault["target"], fault["mechanism"]) == (
        "pre-1",
        "link_cut",
        "local",
        "proxy",
    )
    reports = api_as("viewer").get(f"/api/drill-reports/{report.pk}/").json()
    assert reports["state"] == "passed"
    assert reports["failed_requests"] == 0
    assert reports["requests"]["during"].get("fallback/ok", 0) > 0

"""The deploy and canary endpoints: who may call them, what they start, 409s and 400s. The
workflows themselves run in tests/orchestrator/workflows (real worker, agents, engines)."""

from __future__ import annotations

import pytest

from console.deployments.flows import deployment_set_remote_share
from console.deployments.models import Deployment
from console.deployments.services import pool_create
from console.rollouts.services import rollout_plan_create
from console.runs.models import WorkflowRun
from tests.console.factories import NodeFactory, SiteFactory, make_deployment

pytestmark = pytest.mark.django_db


@pytest.fixture
def deployment() -> Deployment:
    dep = make_deployment()
    local, remote = SiteFactory(role="decode"), SiteFactory(role="prefill")
    pool_create(
        actor=None, deployment=dep, role="decode", site=local, nodes=[NodeFactory(site=local)]
    )
    pool_create(
        actor=None, deployment=dep, role="prefill", site=remote, nodes=[NodeFactory(site=remote)]
    )
    return Deployment.objects.get(pk=dep.pk)


def url(dep: Deployment, action: str) -> str:
    return f"/api/deployments/{dep.pk}/{action}/"


def test_operator_starts_the_eight_step_deployment(api_as, deployment):
    response = api_as("operator").post(url(deployment, "deploy"), {}, format="json")

    assert response.status_code == 202, response.data
    run = WorkflowRun.objects.get(pk=response.data["id"])
    assert run.kind == "deploy"
    assert (run.target_type, run.target_id) == ("deployments.deployment", str(deployment.pk))
    assert [s["name"] for s in response.data["steps"]] == [
        "capacity_baseline",
        "wan_baseline",
        "remote_prefill",
        "local_decode",
        "kv_link",
        "gateway",
        "verification",
        "canary",
    ]
    deployment.refresh_from_db()
    assert deployment.state == "deploying"


@pytest.mark.parametrize("role", ["viewer", None])
def test_deploy_needs_an_operator(api_as, deployment, role):
    response = api_as(role).post(url(deployment, "deploy"), {}, format="json")

    assert response.status_code in {401, 403}
    assert not WorkflowRun.objects.exists()


def test_second_deploy_while_one_runs_is_a_conflict(api_as, deployment):
    api = api_as("operator")
    first = api.post(url(deployment, "deploy"), {}, format="json")

    second = api.post(url(deployment, "deploy"), {}, format="json")

    assert first.status_code == 202
    assert second.status_code == 409
    assert f"#{first.data['id']}" in second.data["detail"]


def test_deploy_without_a_prefill_pool_is_a_conflict(api_as):
    dep = make_deployment()

    response = api_as("operator").post(url(dep, "deploy"), {}, format="json")

    assert response.status_code == 409
    assert "prefill pool" in response.data["detail"]


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"verify_lengths": []}, "verify_lengths"),
        ({"verify_lengths": ["x"]}, "verify_lengths"),
        ({"recheck_s": -1}, "recheck_s"),
        ({"probe_seconds": "fast"}, "probe_seconds"),
        ({"gateway_ready_s": 0}, "gateway_ready_s"),
        ({"verify_deadline_s": True}, "verify_deadline_s"),
        ({"verify_max_tokens": 0}, "verify_max_tokens"),
        ({"verify_max_tokens": 2.5}, "verify_max_tokens"),
        ({"verify_logprob_tolerance": -0.1}, "verify_logprob_tolerance"),
        ({"verify_logprob_tolerance": "0"}, "verify_logprob_tolerance"),
    ],
)
def test_bad_params_are_a_400_naming_the_field(api_as, deployment, params, field):
    response = api_as("operator").post(url(deployment, "deploy"), {"params": params}, format="json")

    assert response.status_code == 400
    assert field in response.data
    assert not WorkflowRun.objects.exists()


def test_canary_follows_the_deployment_plan_and_copies_its_gates(api_as, deployment):
    rollout_plan_create(
        actor=None,
        name="fast",
        deployment=deployment,
        steps=[
            {"share_percent": 5, "min_duration_s": 1, "min_requests": 2},
            {"share_percent": 100, "min_duration_s": 0, "min_requests": 0},
        ],
        gate_ttft_p50_ratio=2.0,
    )

    response = api_as("operator").post(url(deployment, "canary"), {}, format="json")

    assert response.status_code == 202
    assert [s["name"] for s in response.data["steps"]] == ["share_5", "share_100"]
    plan = response.data["params"]["plan"]
    assert plan["name"] == "fast"
    assert plan["gates"]["ttft_p50_ratio"] == 2.0
    assert response.data["params"]["paused"] is False


def test_canary_pause_resume_abort(api_as, deployment):
    api = api_as("operator")
    run_id = api.post(url(deployment, "canary"), {}, format="json").data["id"]
    deployment_set_remote_share(actor=None, deployment=deployment, percent=10, reason="step 1")

    paused = api.post(url(deployment, "canary/pause"), format="json")
    resumed = api.post(url(deployment, "canary/resume"), format="json")
    resumed_again = api.post(url(deployment, "canary/resume"), format="json")
    aborted = api.post(url(deployment, "canary/abort"), format="json")

    assert (paused.status_code, paused.data["params"]["paused"]) == (200, True)
    assert (resumed.status_code, resumed.data["params"]["paused"]) == (200, False)
    assert resumed_again.status_code == 409
    assert aborted.status_code == 202
    assert aborted.data["cancel_requested"] is True
    deployment.refresh_from_db()
    assert deployment.remote_share_percent == 0
    assert deployment.snapshots.first().reason == f"canary #{run_id} aborted"


def test_canary_verbs_without_a_canary_are_conflicts(api_as, deployment):
    api = api_as("operator")

    codes = [
        api.post(url(deployment, f"canary/{verb}")).status_code
        for verb in ("pause", "resume", "abort")
    ]

    assert codes == [409, 409, 409]


def test_canary_verbs_need_an_operator(api_as, deployment):
    api_as("operator").post(url(deployment, "canary"), {}, format="json")

    response = api_as("viewer").post(url(deployment, "canary/abort"))

    assert response.status_code == 403


def test_share_edit_during_a_canary_answers_200_with_a_warning(api_as, deployment):
    api = api_as("operator")
    run_id = api.post(url(deployment, "canary"), {}, format="json").data["id"]
    path = f"/api/deployments/{deployment.pk}/"
    etag = api.get(path)["ETag"]

    edited = api.patch(path, {"remote_share_percent": 10}, format="json", HTTP_IF_MATCH=etag)
    other = api.patch(
        path, {"remote_prefill_threshold_tokens": 2048}, format="json", HTTP_IF_MATCH=edited["ETag"]
    )
    api.post(url(deployment, "canary/pause"), format="json")
    while_paused = api.patch(
        path, {"remote_share_percent": 20}, format="json", HTTP_IF_MATCH=other["ETag"]
    )

    assert edited.status_code == 200
    assert edited.data["remote_share_percent"] == 10
    assert edited.data["warnings"] == [
        f"Canary run #{run_id} of {deployment.name} is in progress and drives the remote share: "
        "it pauses at its next re-check and leaves your 10 % as set. Resume it "
        f"(POST /api/deployments/{deployment.pk}/canary/resume/) to let it set its step's "
        f"share again, or cancel the run (POST /api/runs/{run_id}/cancel/) to keep yours."
    ]
    assert other.data["warnings"] == []  # not a share change
    assert while_paused.data["warnings"][0].startswith(f"Canary run #{run_id} of")
    assert "is paused: your 20 % stays" in while_paused.data["warnings"][0]


def test_share_edit_without_a_canary_has_no_warning(api_as, deployment):
    response = api_as("operator").patch(
        f"/api/deployments/{deployment.pk}/", {"remote_share_percent": 10}, format="json"
    )

    assert response.status_code == 200
    assert response.data["warnings"] == []


def test_api_restore_that_moves_the_share_during_a_canary_warns(api_as, deployment):
    api = api_as("operator")
    first = deployment.version
    deployment_set_remote_share(actor=None, deployment=deployment, percent=30, reason="t")
    run_id = api.post(url(deployment, "canary"), {}, format="json").data["id"]

    response = api.post(url(deployment, "restore"), {"version": first}, format="json")

    assert response.status_code == 200
    assert response.data["remote_share_percent"] == 0
    assert f"Canary run #{run_id}" in response.data["warnings"][0]

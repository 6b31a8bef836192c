"""Operator edits win over automation (#44, item 7): a canary whose remote share someone else
changed pauses with the reason instead of overwriting it, and the operator's value stays. Seen
before: an operator set 10 % mid-canary (If-Match, 200); the canary then passed its 50 % step
while actually at 10 % and set 100 %.

The step function is called directly, as a worker would, against the real database; the last
test runs the whole canary in a real Celery worker over the real broker, the operator editing
through the API. No gateway answers here (the canary records it unreachable and holds for
traffic), which is all these tests need: a held step re-checks, and each re-check looks for an
edit."""

from __future__ import annotations

import socket
from collections.abc import Callable
from typing import Any

import pytest

from console.deployments import flows
from console.deployments.models import Deployment
from console.deployments.services import (
    deployment_restore,
    deployment_set_kill_switch,
    deployment_update,
    pool_create,
)
from console.rollouts.services import rollout_plan_create
from console.runs.models import WorkflowRun
from orchestrator.steps import StepContext, Wait
from orchestrator.workflows.canary import share_step
from tests.console.factories import NodeFactory, SiteFactory, make_deployment
from tests.support import wait_for

PLAN = [
    {"share_percent": 10, "min_duration_s": 0, "min_requests": 1},
    {"share_percent": 50, "min_duration_s": 0, "min_requests": 1},
    {"share_percent": 100, "min_duration_s": 0, "min_requests": 1},
]


def closed_port() -> int:
    """A loopback port nothing listens on (the gateway that does not answer)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def make_canary_deployment() -> Deployment:
    """A deployment with a decode pool whose gateway (loopback, closed port) never answers,
    a prefill pool, and a 10 -> 50 -> 100 plan that waits for one remote request per step."""
    dep = make_deployment()
    local, remote = SiteFactory(role="decode"), SiteFactory(role="prefill")
    pool_create(
        actor=None,
        deployment=dep,
        role="decode",
        site=local,
        nodes=[NodeFactory(site=local)],
        engine_settings={"gateway_host": "127.0.0.1", "gateway_port": closed_port()},
    )
    pool_create(
        actor=None, deployment=dep, role="prefill", site=remote, nodes=[NodeFactory(site=remote)]
    )
    rollout_plan_create(actor=None, name=f"plan-{dep.pk}", deployment=dep, steps=PLAN)
    return Deployment.objects.get(pk=dep.pk)


def share(dep: Deployment) -> int:
    return Deployment.objects.get(pk=dep.pk).remote_share_percent


def version(dep: Deployment) -> int:
    return Deployment.objects.get(pk=dep.pk).version


def params(run: WorkflowRun) -> dict[str, Any]:
    return WorkflowRun.objects.get(pk=run.pk).params


def stepper(run: WorkflowRun) -> Callable[[str, dict[str, Any]], Any]:
    """Call step ``name`` of ``run`` as the executor does: the run's params as they are now."""

    def call(name: str, evidence: dict[str, Any]) -> Any:
        current = WorkflowRun.objects.get(pk=run.pk)
        return share_step(
            StepContext(
                run_id=current.pk,
                kind="canary",
                target_type=current.target_type,
                target_id=current.target_id,
                params=current.params,
                step_index=0,
                step_name=name,
                attempt=1,
                resumed=False,
                evidence=evidence,
                previous={},
            )
        )

    return call


@pytest.fixture
def canary(settings: Any) -> tuple[Deployment, WorkflowRun]:
    settings.PDBRIDGE_CONTROLLER_INSECURE = True  # the gateway scrape: plain HTTP, no client cert
    dep = make_canary_deployment()
    return dep, flows.canary_start(actor=None, deployment=dep, params={"recheck_s": 1})


@pytest.mark.django_db
def test_the_canarys_own_writes_and_other_edits_do_not_pause_it(canary, make_user):
    dep, run = canary
    step = stepper(run)

    first = step("share_10", {})
    again = step("share_10", first.evidence)
    # Edits that are not the share: new config versions, but not share changes.
    operator = make_user("operator")
    deployment_update(
        actor=operator,
        deployment=dep,
        expected_version=version(dep),
        remote_prefill_threshold_tokens=1024,
    )
    deployment_set_kill_switch(actor=operator, deployment=dep, enabled=True)
    deployment_set_kill_switch(actor=operator, deployment=dep, enabled=False)
    after_edits = step("share_10", again.evidence)
    next_step = step("share_50", {})

    assert [type(r) for r in (first, again, after_edits, next_step)] == [Wait] * 4
    assert [r.evidence["held"] for r in (first, again, after_edits, next_step)] == [""] * 4
    assert not any("share_changed" in r.evidence for r in (again, after_edits, next_step))
    assert params(run)["paused"] is False
    assert share(dep) == 50
    assert params(run)["share_version"] == version(dep)


@pytest.mark.django_db
def test_operator_share_edit_mid_step_pauses_the_canary_and_keeps_the_value(canary, make_user):
    dep, run = canary
    step = stepper(run)
    first = step("share_10", {})
    held = step("share_50", {})
    assert (share(dep), held.evidence["held"]) == (50, "")
    operator = make_user("operator", username="alice")

    deployment_update(
        actor=operator, deployment=dep, expected_version=version(dep), remote_share_percent=10
    )
    paused = step("share_50", held.evidence)
    still = step("share_50", paused.evidence)

    assert isinstance(paused, Wait)
    assert paused.evidence["held"] == "paused"
    assert "started_at" not in paused.evidence  # the step's hold restarts after a resume
    assert paused.evidence["share_changed"] == {
        "version": version(dep),
        "expected": 50,
        "found": 10,
        "author": "alice",
        "reason": "updated",
    }
    reason = params(run)["pause_reason"]
    assert reason.startswith("remote share changed under the canary (50 % -> 10 %) in config v")
    assert "by alice (updated)" in reason
    assert params(run)["paused"] is True
    assert still.evidence["held"] == "paused"
    assert share(dep) == 10  # the operator's value stays
    assert first.evidence["share_percent"] == 10


@pytest.mark.django_db
def test_an_edit_between_two_steps_is_not_overwritten_by_the_next_step(canary, make_user):
    dep, run = canary
    step = stepper(run)
    step("share_10", {})
    deployment_update(
        actor=make_user("operator"),
        deployment=dep,
        expected_version=version(dep),
        remote_share_percent=30,
    )

    result = step("share_50", {})

    assert result.evidence["held"] == "paused"
    assert (
        result.evidence["share_changed"]["expected"],
        result.evidence["share_changed"]["found"],
    ) == (10, 30)
    assert share(dep) == 30


@pytest.mark.django_db
def test_a_restore_that_changes_the_share_pauses_the_canary_too(canary, make_user):
    dep, run = canary
    step = stepper(run)
    before_canary = version(dep)
    held = step("share_10", {})

    deployment_restore(actor=make_user("operator"), deployment=dep, version=before_canary)
    result = step("share_10", held.evidence)

    assert result.evidence["held"] == "paused"
    assert result.evidence["share_changed"]["reason"] == f"restore of v{before_canary}"
    assert share(dep) == 0


@pytest.mark.django_db
def test_resume_accepts_the_edit_and_the_step_sets_its_share_again(canary, make_user):
    dep, run = canary
    step = stepper(run)
    step("share_10", {})
    operator = make_user("operator")
    deployment_update(
        actor=operator, deployment=dep, expected_version=version(dep), remote_share_percent=5
    )
    paused = step("share_10", {})
    assert paused.evidence["held"] == "paused"

    flows.canary_resume(actor=operator, deployment=dep)
    resumed = step("share_10", paused.evidence)
    again = step("share_10", resumed.evidence)

    assert "pause_reason" not in params(run)
    assert (resumed.evidence["held"], again.evidence["held"]) == ("", "")
    assert share(dep) == 10
    assert params(run)["share_version"] == version(dep)


@pytest.mark.django_db(transaction=True)
def test_operator_edit_during_a_canary_in_a_real_worker(start_worker, make_user, monkeypatch):
    """The observed case end to end: the canary runs in a Celery worker; an operator PATCHes
    the share with the right If-Match (200, and the answer warns that a canary drives it);
    the canary pauses with the reason at its next re-check and the operator's value stays."""
    from rest_framework.test import APIClient

    from console.core.services_tokens import api_token_issue

    monkeypatch.setenv("PDBRIDGE_CONTROLLER_INSECURE", "true")
    start_worker()
    dep = make_canary_deployment()
    api = APIClient()
    _, token = api_token_issue(actor=None, user=make_user("operator", username="bob"))
    api.credentials(HTTP_AUTHORIZATION=f"Token {token}")
    started = api.post(
        f"/api/deployments/{dep.pk}/canary/", {"params": {"recheck_s": 0.5}}, format="json"
    )
    assert started.status_code == 202, started.data
    run = WorkflowRun.objects.get(pk=started.data["id"])

    def step_evidence() -> dict[str, Any]:
        return run.steps.get(name="share_10").evidence

    # The canary set 10 % and re-checks (its own write does not pause it).
    wait_for(lambda: step_evidence().get("checks", 0) >= 2, timeout=60, what="two re-checks")
    assert (share(dep), params(run)["paused"]) == (10, False)

    read = api.get(f"/api/deployments/{dep.pk}/")
    edited = api.patch(
        f"/api/deployments/{dep.pk}/",
        {"remote_share_percent": 3},
        format="json",
        HTTP_IF_MATCH=read["ETag"],
    )

    assert edited.status_code == 200, edited.data
    assert edited.data["remote_share_percent"] == 3
    assert len(edited.data["warnings"]) == 1
    assert f"Canary run #{run.pk}" in edited.data["warnings"][0]
    assert "pauses at its next re-check" in edited.data["warnings"][0]
    wait_for(lambda: params(run).get("paused"), timeout=60, what="the canary pauses")
    assert "(10 % -> 3 %)" in params(run)["pause_reason"]
    assert "by bob (updated)" in params(run)["pause_reason"]
    wait_for(lambda: step_evidence().get("held") == "paused", timeout=30, what="step held")
    assert step_evidence()["share_changed"]["found"] == 3
    # It keeps re-checking while paused and never writes: the share stays the operator's.
    wake = run.steps.get(name="share_10").wake_at
    wait_for(lambda: run.steps.get(name="share_10").wake_at != wake, timeout=30, what="a re-check")
    assert share(dep) == 3
    assert WorkflowRun.objects.get(pk=run.pk).state == "running"
    assert run.steps.get(name="share_50").state == "pending"
    page = api.get(f"/api/deployments/{dep.pk}/")
    assert page.data["remote_share_percent"] == 3
    flows.canary_abort(actor=None, deployment=dep)
    wait_for(lambda: WorkflowRun.objects.get(pk=run.pk).state == "canceled", timeout=60)

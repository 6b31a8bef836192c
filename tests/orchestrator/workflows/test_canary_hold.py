"""A canary step holds — no share change, no gate — while the canary is paused or the kill
switch is on, and its hold restarts when they clear (the step function called directly, as a
worker would, against the real database)."""

from __future__ import annotations

import pytest

from console.deployments import flows
from console.deployments.models import Deployment
from console.deployments.services import deployment_set_kill_switch
from console.runs.models import WorkflowRun
from orchestrator.steps import StepContext, Wait
from orchestrator.workflows.canary import share_step
from tests.console.factories import make_deployment

pytestmark = pytest.mark.django_db


def context(run: WorkflowRun, evidence: dict) -> StepContext:
    return StepContext(
        run_id=run.pk,
        kind="canary",
        target_type=run.target_type,
        target_id=run.target_id,
        params=run.params,
        step_index=0,
        step_name="share_1",
        attempt=1,
        resumed=False,
        evidence=evidence,
        previous={},
    )


@pytest.fixture
def canary() -> tuple[Deployment, WorkflowRun]:
    dep = make_deployment()
    return dep, flows.canary_start(actor=None, deployment=dep, params={"recheck_s": 2})


def test_kill_switch_on_holds_the_step_without_touching_the_share(canary):
    dep, run = canary
    deployment_set_kill_switch(actor=None, deployment=dep, enabled=True)

    result = share_step(context(run, {"started_at": 1.0, "start": {}}))

    assert isinstance(result, Wait)
    assert result.seconds == 2
    assert result.evidence == {"held": "kill switch"}  # the hold restarts afterwards
    dep.refresh_from_db()
    assert (dep.remote_share_percent, dep.kill_switch) == (0, True)


def test_paused_canary_holds_until_resumed(canary):
    dep, run = canary
    flows.canary_pause(actor=None, deployment=dep)

    result = share_step(context(WorkflowRun.objects.get(pk=run.pk), {}))

    assert isinstance(result, Wait)
    assert result.evidence["held"] == "paused"
    dep.refresh_from_db()
    assert dep.remote_share_percent == 0

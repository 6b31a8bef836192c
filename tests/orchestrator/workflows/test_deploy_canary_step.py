"""The deployment's step 8 (``canary``) called directly, as a worker would, against the real
database: a re-check of the same execution follows the canary it started; an operator's retry
of the step (a new execution) after that canary rolled back starts a new canary instead of
reporting the old verdict again (seen on the testbed: 'retrying from step 8' failed at once
with the first canary's gate)."""

from __future__ import annotations

import pytest

from console.deployments import flows
from console.deployments.services import deployment_transition
from console.runs.models import WorkflowRun
from orchestrator.steps import Done, RollBack, StepContext, Wait
from orchestrator.workflows.deploy import canary
from tests.console.factories import make_deployment

pytestmark = pytest.mark.django_db


def context(deployment_id: int, evidence: dict, execution: str) -> StepContext:
    return StepContext(
        run_id=0, kind="deploy", target_type="deployments.deployment",
        target_id=str(deployment_id), params={"canary": {"recheck_s": 1}}, step_index=7,
        step_name="canary", attempt=1, resumed=False, evidence=evidence, previous={},
        execution=execution,
    )  # fmt: skip


def test_a_retry_after_a_rolled_back_canary_starts_a_new_one():
    dep = make_deployment()
    deployment_transition(actor=None, deployment=dep, to_state="deploying")  # as step 1 leaves it
    first = canary(context(dep.pk, {}, "s8.1000"))
    assert isinstance(first, Wait)
    old = first.evidence["canary_run"]
    # A re-check of the same execution follows the same canary.
    assert canary(context(dep.pk, first.evidence, "s8.1000")).evidence["canary_run"] == old

    WorkflowRun.objects.filter(pk=old).update(state="rolled_back", error="gate ttft_p50_ratio")
    verdict = canary(context(dep.pk, first.evidence, "s8.1000"))
    assert isinstance(verdict, RollBack)
    assert f"canary #{old} rolled back" in verdict.reason

    retried = canary(context(dep.pk, verdict.evidence, "s8.2000"))
    assert isinstance(retried, Wait)
    new = retried.evidence["canary_run"]
    assert new != old
    assert retried.evidence["earlier_canaries"] == [old]
    assert flows.active_run(dep, flows.CANARY_KIND).pk == new
    dep.refresh_from_db()
    assert dep.state == "deploying"  # back from failed: the retry is a deployment again

    # The new canary passes: the deployment ends active (a retry of step 8 used to end in
    # "Conflict: A deployment cannot go from failed to active", seen on the netns testbed).
    WorkflowRun.objects.filter(pk=new).update(state="succeeded")
    done = canary(context(dep.pk, retried.evidence, "s8.2000"))
    assert isinstance(done, Done)
    dep.refresh_from_db()
    assert dep.state == "active"

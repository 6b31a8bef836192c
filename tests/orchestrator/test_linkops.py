"""The link probe job's decisions that need no WAN: a deployment in a drill and a link at its
ceiling are not probed (and say why), an agent that does not answer is an error outcome and no
sample, draft deployments are left out. The probe itself, on the namespace testbed, is in
tests/orchestrator/workflows/test_deploy_flow.py."""

from __future__ import annotations

import pytest

from console.deployments.choices import DeploymentState
from console.drills.models import Drill
from console.runs.services import run_create
from console.telemetry import names
from console.telemetry.models import MetricSample
from console.telemetry.services import sample_record
from orchestrator import linkops
from tests.agents.conftest import free_port
from tests.console.conftest import world  # noqa: F401 - fixture (params below: noqa F811)

pytestmark = pytest.mark.django_db


def _serving(world) -> None:  # noqa: F811
    world.deployment.state = DeploymentState.ACTIVE
    world.deployment.save(update_fields=["state"])
    # An agent address where nothing listens: a refused connection, at once.
    world.prefill_node.agent_address = f"127.0.0.1:{free_port()}"
    world.prefill_node.save(update_fields=["agent_address"])


def test_a_deployment_in_a_drill_is_not_probed(world):  # noqa: F811
    _serving(world)
    drill = Drill.objects.create(name="cut", deployment=world.deployment, kind="link_cut")
    run_create(actor=None, kind="drill", steps=["baseline"], target=drill)

    assert linkops.probe_all() == {
        str(world.deployment.pk): {
            "deployment": {"skipped": "a drill of this deployment is running"}
        }
    }


def test_a_link_at_its_ceiling_is_not_probed(world):  # noqa: F811
    _serving(world)
    sample_record(subject=world.link, name=names.LINK_UTILIZATION, value=0.75)

    outcome = linkops.probe_all()[str(world.deployment.pk)]

    assert outcome == {str(world.link.pk): {"skipped": "link busy: utilisation 0.75"}}


def test_an_unreachable_agent_is_an_error_and_no_sample_and_drafts_are_left_out(world):  # noqa: F811
    assert linkops.probe_all() == {}  # still a draft

    _serving(world)
    outcome = linkops.probe_all()[str(world.deployment.pk)][str(world.link.pk)]

    assert "error" in outcome
    assert not MetricSample.objects.filter(name=names.LINK_MEASURED_MBIT_S).exists()
    world.link.refresh_from_db()
    assert world.link.measurement_stale

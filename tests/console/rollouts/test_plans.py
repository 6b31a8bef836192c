"""Rollout plans: step validation naming the item, the default plan and which plan applies."""

from __future__ import annotations

import pytest

from console.rollouts.models import RolloutPlan
from console.rollouts.services import rollout_plan_create, rollout_plan_default, rollout_plan_for

pytestmark = pytest.mark.django_db


def test_default_plan_is_1_10_50_100_and_created_once():
    first = rollout_plan_default()
    second = rollout_plan_default()

    assert first.pk == second.pk
    assert [s["share_percent"] for s in first.steps] == [1, 10, 50, 100]
    assert first.deployment is None


def test_deployment_without_plan_uses_default_and_own_plan_wins(api_as, world):
    api = api_as("operator")
    assert (
        api.get(f"/api/deployments/{world.deployment.pk}/rollout-plan/").json()["name"] == "default"
    )

    created = api.post(
        "/api/rollout-plans/",
        {
            "name": "demo-plan",
            "deployment": world.deployment.pk,
            "steps": [
                {"share_percent": 5, "min_duration_s": 60, "min_requests": 10},
                {"share_percent": 100},
            ],
        },
        format="json",
    )

    assert created.status_code == 201
    assert created.json()["steps"][1] == {
        "share_percent": 100,
        "min_duration_s": 0,
        "min_requests": 0,
    }
    assert rollout_plan_for(world.deployment).name == "demo-plan"
    assert (
        api.get(f"/api/deployments/{world.deployment.pk}/rollout-plan/").json()["name"]
        == "demo-plan"
    )


@pytest.mark.parametrize(
    ("steps", "fragment"),
    [
        ([], "non-empty"),
        ("fast", "non-empty"),
        (
            [{"share_percent": 10}, {"share_percent": 10}, {"share_percent": 100}],
            "steps[1].share_percent",
        ),
        (
            [{"share_percent": 50}, {"share_percent": 10}, {"share_percent": 100}],
            "steps[1].share_percent",
        ),
        ([{"share_percent": 10}, {"share_percent": 50}], "steps[1].share_percent"),
        ([{"share_percent": 0}, {"share_percent": 100}], "steps[0].share_percent"),
        ([{"share_percent": 101}], "steps[0].share_percent"),
        ([{"share_percent": 100, "min_duration_s": -1}], "steps[0].min_duration_s"),
        ([{"share_percent": 100, "min_requests": 1.5}], "steps[0].min_requests"),
        ([{"share_percent": 100, "speed": 3}], "steps[0].speed"),
        ([{"share_percent": True}], "steps[0].share_percent"),
        (["step"], "steps[0]"),
    ],
)
def test_invalid_steps_are_400_naming_the_item(api_as, steps, fragment):
    response = api_as("operator").post(
        "/api/rollout-plans/", {"name": "p", "steps": steps}, format="json"
    )

    assert response.status_code == 400
    assert fragment in str(response.json()["steps"])
    assert not RolloutPlan.objects.filter(name="p").exists()


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("gate_success_rate_min", 0),
        ("gate_success_rate_min", 1.01),
        ("gate_link_utilization_max", 2),
        ("gate_ttft_p99_ratio", 0),
    ],
)
def test_invalid_gate_is_400_naming_it(api_as, field, value):
    response = api_as("operator").post(
        "/api/rollout-plans/", {"name": "p", field: value}, format="json"
    )

    assert response.status_code == 400
    assert field in response.json()


def test_one_plan_per_deployment(api_as, world):
    rollout_plan_create(actor=None, name="a", deployment=world.deployment)

    response = api_as("operator").post(
        "/api/rollout-plans/", {"name": "b", "deployment": world.deployment.pk}, format="json"
    )

    assert response.status_code == 400
    assert "deployment" in response.json()


def test_plan_update_validates_and_is_audited(api_as):
    from console.core.models import AuditLog

    plan = rollout_plan_create(actor=None, name="p")
    api = api_as("operator")

    bad = api.patch(
        f"/api/rollout-plans/{plan.pk}/", {"steps": [{"share_percent": 20}]}, format="json"
    )
    good = api.patch(
        f"/api/rollout-plans/{plan.pk}/",
        {"steps": [{"share_percent": 20}, {"share_percent": 100}]},
        format="json",
    )

    assert bad.status_code == 400
    assert good.status_code == 200
    entry = AuditLog.objects.get(object_type="rollouts.rolloutplan", action="update")
    assert len(entry.before["steps"]) == 4
    assert len(entry.after["steps"]) == 2

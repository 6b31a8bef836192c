"""The rollout plan pages and form: an operator creates and edits a plan (steps and gates)
through the page, with the API's checks and audit entry; a bad step comes back on that
step's input with nothing written; an added step row comes from the server; viewers see no
form and a crafted POST is 403; the deployment page links the plan its canary uses."""

from __future__ import annotations

from typing import Any

from console.core.models import AuditLog
from console.rollouts import services
from console.rollouts.models import RolloutPlan


def _post(world: Any | None, steps: list[tuple[str, str, str]], **overrides: str) -> dict:
    body: dict[str, Any] = {
        "name": "careful",
        "deployment": str(world.deployment.pk) if world else "",
        "gate_ttft_p50_ratio": "1.1",
        "gate_ttft_p99_ratio": "1.3",
        "gate_success_rate_min": "0.995",
        "gate_link_utilization_max": "0.6",
        "step_share_percent": [s[0] for s in steps],
        "step_min_duration_s": [s[1] for s in steps],
        "step_min_requests": [s[2] for s in steps],
    }
    body.update(overrides)
    return body


STEPS = [("1", "300", "200"), ("10", "600", "2000"), ("50", "900", "5000"), ("100", "", "")]


def test_operator_creates_a_plan_and_lands_on_its_page(client_as, world):
    client = client_as("operator")

    form = client.get(f"/rollouts/new/?deployment={world.deployment.pk}").content.decode()
    response = client.post("/rollouts/new/", _post(world, STEPS))

    assert form.count('name="step_share_percent"') == 4  # the guide's 1 -> 10 -> 50 -> 100
    plan = RolloutPlan.objects.get(name="careful")
    assert response.status_code == 302
    assert response["Location"] == f"/rollouts/{plan.pk}/"
    assert plan.deployment == world.deployment
    assert plan.steps == [
        {"share_percent": 1, "min_duration_s": 300, "min_requests": 200},
        {"share_percent": 10, "min_duration_s": 600, "min_requests": 2000},
        {"share_percent": 50, "min_duration_s": 900, "min_requests": 5000},
        {"share_percent": 100, "min_duration_s": 0, "min_requests": 0},
    ]
    gates = (plan.gate_ttft_p50_ratio, plan.gate_ttft_p99_ratio)
    assert gates == (1.1, 1.3)
    assert (plan.gate_success_rate_min, plan.gate_link_utilization_max) == (0.995, 0.6)
    page = client.get(response["Location"]).content.decode()
    assert "Rollout plan careful created." in page
    assert "5000" in page
    entry = AuditLog.objects.get(object_type="rollouts.rolloutplan", object_id=str(plan.pk))
    assert entry.action == "create"
    assert entry.actor == response.wsgi_request.user
    # The deployment page's link goes to this plan.
    deployment = client.get(f"/deployments/{world.deployment.pk}/").content.decode()
    assert f'href="/rollouts/?deployment={world.deployment.pk}"' in deployment
    assert client.get(f"/rollouts/?deployment={world.deployment.pk}")["Location"] == (
        f"/rollouts/{plan.pk}/"
    )


def test_operator_edits_a_plan_removing_a_step(client_as, world):
    plan = services.rollout_plan_create(actor=None, name="shared-a")
    client = client_as("operator")

    form = client.get(f"/rollouts/{plan.pk}/edit/").content.decode()
    response = client.post(
        f"/rollouts/{plan.pk}/edit/",
        _post(None, [("5", "60", "50"), ("100", "0", "0")], name="shared-a"),
    )

    assert 'value="shared-a"' in form
    assert response.status_code == 302
    plan.refresh_from_db()
    assert [s["share_percent"] for s in plan.steps] == [5, 100]
    assert plan.deployment is None
    entry = AuditLog.objects.filter(object_type="rollouts.rolloutplan").latest("id")
    assert entry.action == "update"
    assert [s["share_percent"] for s in entry.before["steps"]] == [1, 10, 50, 100]


def test_a_bad_step_is_named_on_its_row_and_nothing_is_created(client_as, world):
    client = client_as("operator")
    steps = [("10", "60", "10"), ("5", "60", "10"), ("100", "", "")]

    response = client.post("/rollouts/new/", _post(world, steps))

    html = response.content.decode()
    assert response.status_code == 400
    assert "steps[1].share_percent: shares must be strictly increasing." in html
    assert 'data-field="step_share_percent"' in html  # on the row's input
    assert html.count('name="step_share_percent"') == 3  # the rows typed stay
    assert not RolloutPlan.objects.exists()
    assert not AuditLog.objects.filter(object_type="rollouts.rolloutplan").exists()


def test_other_bad_values_name_their_field(client_as, world):
    client = client_as("operator")
    cases = [
        (_post(world, [("1", "", ""), ("50", "", "")]), "steps[1].share_percent: the last step"),
        (
            _post(world, [("1", "-5", ""), ("100", "", "")]),
            "steps[0].min_duration_s: must be &gt;= 0",
        ),
        (_post(world, [("one", "", ""), ("100", "", "")]), "steps[0].share_percent: must be an"),
        (_post(world, []), "Must be a non-empty list of steps."),
        (_post(world, STEPS, gate_success_rate_min="1.5"), 'data-field="gate_success_rate_min"'),
        (_post(world, STEPS, gate_ttft_p50_ratio="x"), 'data-field="gate_ttft_p50_ratio"'),
    ]
    for body, expected in cases:
        response = client.post("/rollouts/new/", body)
        assert response.status_code == 400, expected
        assert expected in response.content.decode(), expected
    assert not RolloutPlan.objects.exists()


def test_a_second_plan_for_the_same_deployment_is_refused_on_the_field(client_as, world):
    services.rollout_plan_create(actor=None, name="first", deployment=world.deployment)

    response = client_as("operator").post("/rollouts/new/", _post(world, STEPS))

    assert response.status_code == 400
    assert 'data-field="deployment"' in response.content.decode()
    assert RolloutPlan.objects.count() == 1


def test_add_step_row_is_one_empty_row(client_as, db):
    html = client_as("operator").get("/rollouts/step-row/").content.decode()

    assert html.strip().startswith('<tr class="step-row">')
    assert html.count('name="step_share_percent" value=""') == 1


def test_viewer_reads_plans_sees_no_form_and_a_crafted_post_is_refused(client_as, world):
    plan = services.rollout_plan_create(actor=None, name="careful", deployment=world.deployment)
    viewer = client_as("viewer")

    listing = viewer.get("/rollouts/").content.decode()
    detail = viewer.get(f"/rollouts/{plan.pk}/").content.decode()

    assert f'href="/rollouts/{plan.pk}/"' in listing
    assert "1 → 10 → 50 → 100 %" in listing
    assert 'id="plan-steps"' in detail
    assert "/edit/" not in detail
    assert "New rollout plan" not in listing
    assert 'href="/rollouts/"' in listing  # in the nav
    for url in ("/rollouts/new/", f"/rollouts/{plan.pk}/edit/", "/rollouts/step-row/"):
        assert viewer.get(url).status_code == 403, url
    assert viewer.post("/rollouts/new/", _post(None, STEPS, name="x")).status_code == 403
    response = viewer.post(f"/rollouts/{plan.pk}/edit/", _post(world, [("100", "", "")]))
    assert response.status_code == 403
    plan.refresh_from_db()
    assert len(plan.steps) == 4
    assert RolloutPlan.objects.count() == 1

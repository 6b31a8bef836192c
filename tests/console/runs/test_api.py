import pytest

from console.runs import services
from console.runs.models import WorkflowRun
from tests.conftest import role_client

pytestmark = pytest.mark.django_db


@pytest.mark.parametrize(
    ("role", "expected"), [("anonymous", 401), ("viewer", 200), ("operator", 200), ("admin", 200)]
)
def test_runs_are_readable_by_every_role(api_as, role, expected):
    assert role_client(api_as, role).get("/api/runs/").status_code == expected


@pytest.mark.parametrize(
    ("role", "expected"), [("anonymous", 401), ("viewer", 403), ("operator", 201), ("admin", 201)]
)
def test_starting_a_selfcheck_needs_operator(api_as, role, expected):
    response = role_client(api_as, role).post("/api/runs/", {"kind": "selfcheck"}, format="json")

    assert response.status_code == expected


def test_started_run_has_its_steps_pending_and_is_audited(api_as):
    response = api_as("operator").post(
        "/api/runs/", {"kind": "selfcheck", "params": {"recheck_s": 2}}, format="json"
    )

    body = response.json()
    assert [s["name"] for s in body["steps"]] == ["database", "worker", "scheduled_recheck"]
    assert {s["state"] for s in body["steps"]} == {"pending"}
    assert body["params"] == {"recheck_s": 2}
    assert (
        api_as("viewer")
        .get(f"/api/audit-log/?object_type=runs.workflowrun&object_id={body['id']}")
        .json()["count"]
        == 1
    )


def test_unknown_workflow_is_400_naming_kind(api_as):
    response = api_as("operator").post("/api/runs/", {"kind": "deploy-everything"}, format="json")

    assert response.status_code == 400
    assert "kind" in response.json()


def test_cancel_then_cancel_again_is_409(api_as):
    run = services.run_create(actor=None, kind="selfcheck", steps=["database"], start=False)
    api = api_as("operator")

    assert api.post(f"/api/runs/{run.pk}/cancel/").status_code == 202
    services.step_claim_next(run_id=run.pk, worker="w", stale_after_s=30)
    response = api.post(f"/api/runs/{run.pk}/cancel/")

    assert response.status_code == 409
    assert "canceled" in response.json()["detail"]


def test_retry_validates_step_index(api_as):
    run = services.run_create(actor=None, kind="selfcheck", steps=["database"], start=False)
    claim = services.step_claim_next(run_id=run.pk, worker="w", stale_after_s=30)
    services.step_fail(step_id=claim.step_id, worker="w", error="x", evidence={})

    bad = api_as("operator").post(f"/api/runs/{run.pk}/retry/", {"from_step": 5}, format="json")
    good = api_as("operator").post(f"/api/runs/{run.pk}/retry/", {"from_step": 0}, format="json")

    assert bad.status_code == 400
    assert "from_step" in bad.json()
    assert good.status_code == 202
    assert WorkflowRun.objects.get(pk=run.pk).state == "running"


def test_filters_by_state_and_kind(api_as):
    services.run_create(actor=None, kind="selfcheck", steps=["database"], start=False)

    assert api_as("viewer").get("/api/runs/?state=pending&kind=selfcheck").json()["count"] == 1
    assert api_as("viewer").get("/api/runs/?state=running").json()["count"] == 0
    assert api_as("viewer").get("/api/runs/?state=bogus").status_code == 400

import pytest

from console.core.models import AuditLog
from console.planner.models import PlannerScenario
from console.planner.presets import preset_scenario
from tests.conftest import role_client

pytestmark = pytest.mark.django_db

LIST = "/api/planner/scenarios/"


def small_case_study():
    body = preset_scenario("prfaas-case-study")
    body["grid"] = {"thresholds": 100}
    return body


@pytest.fixture
def saved(api_as):
    response = api_as("operator").post(
        LIST, {"name": "case-study", "description": "the paper", "body": small_case_study()}
    )
    assert response.status_code == 201, response.content
    return response.json()


@pytest.mark.parametrize(
    ("role", "expected"),
    [("anonymous", 401), ("viewer", 403), ("operator", 201), ("admin", 201)],
)
def test_operators_save_scenarios(api_as, role, expected):
    response = role_client(api_as, role).post(
        LIST, {"name": f"s-{role}", "body": small_case_study()}
    )

    assert response.status_code == expected


@pytest.mark.parametrize(
    ("role", "expected"), [("anonymous", 401), ("viewer", 200), ("operator", 200), ("admin", 200)]
)
def test_every_role_reads_and_evaluates_saved_scenarios(api_as, saved, role, expected):
    api = role_client(api_as, role)

    listing = api.get(LIST)
    evaluated = api.post(f"{LIST}{saved['id']}/evaluate/?sweeps=false")

    assert (listing.status_code, evaluated.status_code) == (expected, expected)


def test_saved_scenario_evaluates_like_the_body(api_as, saved):
    api = api_as("viewer")

    by_id = api.post(f"{LIST}{saved['id']}/evaluate/?sweeps=false").json()
    direct = api.post("/api/planner/evaluate/?sweeps=false", small_case_study()).json()

    assert by_id["scenario"] == {"id": saved["id"], "name": "case-study"}
    assert by_id["optimum"] == direct["optimum"]
    assert by_id["optimum"]["lambda_max_rps"] == pytest.approx(3.24, rel=0.02)


def test_create_is_audited_with_the_author(api_as, saved):
    entry = AuditLog.objects.get(object_type="planner.plannerscenario", object_id=str(saved["id"]))

    assert entry.action == "create"
    assert entry.after["name"] == "case-study"
    assert saved["created_by"].startswith("operator")


def test_invalid_body_is_a_400_naming_the_field(api_as):
    body = small_case_study()
    body["decode"]["batch_size"] = -3

    response = api_as("operator").post(LIST, {"name": "bad", "body": body})

    assert response.status_code == 400
    assert response.json() == {"body.decode.batch_size": ["must be > 0"]}
    assert not PlannerScenario.objects.exists()


@pytest.mark.parametrize(
    ("payload", "field"),
    [
        ({"name": "Bad Name!", "body": {}}, "name"),
        ({"name": "no-body"}, "body"),
        ({"name": "x", "body": [1]}, "body"),
        ({"name": "x", "body": {"kv": {"model": 12345}}}, "body.kv.model"),
    ],
)
def test_create_validation_names_the_field(api_as, payload, field):
    response = api_as("operator").post(LIST, payload)

    assert response.status_code == 400
    assert field in response.json()


def test_update_revalidates_and_audits(api_as, saved):
    api = api_as("operator")
    body = small_case_study()
    body["link"]["bandwidth_gbps"] = 5

    bad = api.patch(f"{LIST}{saved['id']}/", {"body": {**body, "lengths": {"kind": "x"}}})
    good = api.patch(f"{LIST}{saved['id']}/", {"body": body})

    assert bad.status_code == 400
    assert "body.lengths.kind" in bad.json()
    assert good.status_code == 200
    entry = AuditLog.objects.filter(object_id=str(saved["id"]), action="update").get()
    assert entry.before["body"]["link"]["bandwidth_gbps"] == 100
    assert entry.after["body"]["link"]["bandwidth_gbps"] == 5
    verdict = api.post(f"{LIST}{saved['id']}/evaluate/?sweeps=false").json()["verdict"]
    assert verdict["decision"] == "stay_local"


def test_duplicate_name_is_a_conflict(api_as, saved):
    response = api_as("operator").post(LIST, {"name": "case-study", "body": small_case_study()})

    assert response.status_code in (400, 409)
    assert PlannerScenario.objects.count() == 1


def test_delete_and_unknown_ids(api_as, saved):
    api = api_as("operator")

    assert api.delete(f"{LIST}{saved['id']}/").status_code == 204
    assert api.post(f"{LIST}{saved['id']}/evaluate/").status_code == 404
    assert api.get(f"{LIST}abc/").status_code == 404


def test_admin_pages_render_and_save_through_the_service(client, saved):
    from django.contrib.auth import get_user_model

    admin = get_user_model().objects.create_superuser("root", "r@example.com", "pw-for-tests-1")
    client.force_login(admin)

    assert client.get("/admin/planner/plannerscenario/").status_code == 200
    assert client.get(f"/admin/planner/plannerscenario/{saved['id']}/change/").status_code == 200
    response = client.post(
        f"/admin/planner/plannerscenario/{saved['id']}/change/",
        {"name": "case-study", "description": "edited in admin", "body": '{"lengths": 1}'},
    )
    assert response.status_code == 200  # the form comes back with the service's error
    assert PlannerScenario.objects.get().description == "the paper"


def test_admin_saves_a_valid_edit_through_the_service(client, saved):
    import json

    from django.contrib.auth import get_user_model

    admin = get_user_model().objects.create_superuser("root", "r@example.com", "pw-for-tests-1")
    client.force_login(admin)
    body = small_case_study()

    response = client.post(
        f"/admin/planner/plannerscenario/{saved['id']}/change/",
        {"name": "case-study", "description": "edited in admin", "body": json.dumps(body)},
    )

    assert response.status_code == 302
    assert PlannerScenario.objects.get().description == "edited in admin"
    assert AuditLog.objects.filter(object_id=str(saved["id"]), action="update").exists()

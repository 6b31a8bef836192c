"""Bad list parameters are a 400 naming the parameter (never ignored, never a 500), and the
schema documents each operation's error answers with the bodies the API really sends."""

from __future__ import annotations

from typing import Any

import pytest
from drf_spectacular.generators import SchemaGenerator

from console.deployments.services import deployment_update

pytestmark = pytest.mark.django_db


@pytest.fixture
def viewer(api_as: Any) -> Any:
    return api_as("viewer")


@pytest.mark.parametrize(
    ("query", "field", "message"),
    [
        ("page_size=abc", "page_size", "A whole number is required."),
        ("page_size=0", "page_size", "Ensure this value is greater than or equal to 1."),
        ("page_size=501", "page_size", "Ensure this value is less than or equal to 500."),
        ("page_size=", "page_size", "A whole number is required."),
        ("page=abc", "page", "A whole number is required."),
        ("page=%C2%B2", "page", "A whole number is required."),
        ("page=0", "page", "Ensure this value is greater than or equal to 1."),
        (
            "created_after=",
            "created_after",
            "This field may not be blank: leave the parameter out to not filter by it.",
        ),
        ("created_after=yesterday", "created_after", "Enter a valid date/time."),
        (
            "object_type=",
            "object_type",
            "This field may not be blank: leave the parameter out to not filter by it.",
        ),
        (
            "ordering=bogus",
            "ordering",
            "Cannot order by 'bogus'; one of: created_at, id.",
        ),
        ("ordering=id,-nope", "ordering", "Cannot order by '-nope'; one of: created_at, id."),
        ("search=a%00b", "search", "Null characters are not allowed."),
    ],
)
def test_a_bad_list_parameter_is_a_400_naming_it(viewer, world, query, field, message):
    response = viewer.get(f"/api/audit-log/?{query}")

    assert response.status_code == 400
    assert response.json() == {field: [message]}


def test_a_page_past_the_end_is_a_404(viewer, world):
    response = viewer.get("/api/audit-log/?page=999")

    assert response.status_code == 404
    assert response.json() == {"detail": "Invalid page."}


def test_a_date_time_filter_takes_any_offset_python_parses(viewer, world):
    # PostgreSQL refuses offsets past +-15:59; the filter compares in UTC.
    later = viewer.get("/api/audit-log/?created_after=2000-01-01T00:00:00%2B21:46")
    edge = viewer.get("/api/audit-log/?created_before=0001-01-01T00:00:00%2B01:00")

    assert later.status_code == 200
    assert later.json()["count"] > 0
    assert edge.status_code == 400
    assert edge.json() == {"created_before": ["Out of range once converted to UTC."]}


def test_an_empty_search_is_no_search(viewer, world):
    response = viewer.get("/api/audit-log/?search=")

    assert response.status_code == 200


def test_snapshots_take_the_snapshot_filters_not_the_deployment_ones(api_as, world):
    api = api_as("operator")
    deployment_update(actor=None, deployment=world.deployment, remote_share_percent=5)
    world.deployment.refresh_from_db()
    path = f"/api/deployments/{world.deployment.pk}/snapshots/"

    newest = api.get(path, {"version_min": world.deployment.version}).json()
    oldest_first = api.get(path, {"ordering": "version"}).json()
    # ``state`` is a deployment filter: here it is no parameter at all, so it filters nothing.
    unfiltered = api.get(path, {"state": "retired"})
    bad = api.get(path, {"version_min": "x"})

    assert [s["version"] for s in newest["results"]] == [world.deployment.version]
    assert oldest_first["results"][0]["version"] == 1
    assert unfiltered.status_code == 200
    assert unfiltered.json()["count"] == world.deployment.version
    assert bad.status_code == 400
    assert bad.json() == {"version_min": ["Enter a number."]}


@pytest.fixture(scope="module")
def schema() -> dict[str, Any]:
    return SchemaGenerator().get_schema(request=None, public=True)


def _operations(schema: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    return {
        (method.upper(), path): op
        for path, item in schema["paths"].items()
        for method, op in item.items()
    }


def test_every_operation_documents_its_error_answers(schema):
    ops = _operations(schema)
    missing = []
    for (method, path), op in ops.items():
        codes = set(op["responses"])
        expected = set()
        if path != "/api/auth/token/":
            expected |= {"401", "403"}
        if "{id}" in path:
            expected.add("404")
        if any(p["in"] != "path" for p in op.get("parameters", [])) or "requestBody" in op:
            expected.add("400")
        if not expected <= codes:
            missing.append((method, path, sorted(expected - codes)))

    assert len(ops) > 120
    assert missing == []


def test_error_answers_name_the_error_shapes(schema):
    ops = _operations(schema)
    ref = "#/components/schemas/{}"

    def body(op: dict[str, Any], code: str) -> str:
        return op["responses"][code]["content"]["application/json"]["schema"]["$ref"]

    site = ops[("PATCH", "/api/sites/{id}/")]
    deployment = ops[("DELETE", "/api/deployments/{id}/")]
    assert body(site, "400") == ref.format("ValidationError")
    assert body(site, "401") == body(site, "403") == body(site, "404") == ref.format("Error")
    assert body(deployment, "409") == ref.format("Conflict")
    assert "409" not in ops[("POST", "/api/planner/evaluate/")]["responses"]
    assert set(ops[("POST", "/api/auth/token/")]["responses"]) == {"200", "400"}
    components = schema["components"]["schemas"]
    assert components["Error"]["required"] == ["detail"]
    assert components["Conflict"]["properties"]["current_version"]["type"] == "integer"


def test_users_and_creators_are_typed_as_they_are_sent(schema):
    components = schema["components"]["schemas"]

    email = components["User"]["properties"]["email"]
    creators = [
        components[name]["properties"][field]
        for name, field in [
            ("Drill", "created_by"),
            ("WorkflowRun", "created_by"),
            ("PlannerScenario", "created_by"),
            ("GatewayKey", "created_by"),
            ("GatewayKey", "revoked_by"),
            ("Alert", "acknowledged_by"),
        ]
    ]

    assert {"type": "string", "maxLength": 0} in email["oneOf"]  # most users have none
    for field in creators:
        assert field["type"] == "string"
        assert field["nullable"] is True
        assert "150 characters" not in field.get("description", "")


def test_snapshot_parameters_are_the_snapshot_filters(schema):
    op = _operations(schema)[("GET", "/api/deployments/{id}/snapshots/")]

    names = {p["name"] for p in op["parameters"] if p["in"] == "query"}

    assert names == {
        "author_label",
        "created_after",
        "version_min",
        "ordering",
        "page",
        "page_size",
        "search",
    }


def test_parameters_read_by_views_are_a_400_naming_them_too(api_as, world):
    # "²".isdigit() is true but int("²") raises: each of these was a 500.
    api = api_as("operator")
    d, m = world.deployment.pk, world.model.pk

    answers = {
        "version": api.get(f"/api/deployments/{d}/config/?version=%C2%B2"),
        "baseline": api.get(f"/api/models/{m}/kv-size/?baseline=%C2%B2"),
        "tokens": api.get(f"/api/models/{m}/kv-size/?tokens=%C2%B2"),
        "If-Match": api.patch(
            f"/api/deployments/{d}/", {"remote_share_percent": 1}, HTTP_IF_MATCH='"²"'
        ),
        "sweeps": api.post("/api/planner/evaluate/?sweeps=maybe", {}),
    }

    assert {name: r.status_code for name, r in answers.items()} == dict.fromkeys(answers, 400)
    assert {name: list(r.json()) for name, r in answers.items()} == {n: [n] for n in answers}

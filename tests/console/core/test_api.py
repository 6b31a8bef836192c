import re

import pytest

from console.core.models import AuditLog
from tests.conftest import role_client

pytestmark = pytest.mark.django_db


@pytest.mark.parametrize(
    ("role", "expected"),
    [("anonymous", 401), ("viewer", 403), ("operator", 403), ("admin", 200)],
)
def test_user_list_is_admin_only(api_as, role, expected):
    response = role_client(api_as, role).get("/api/users/")

    assert response.status_code == expected


@pytest.mark.parametrize(
    ("role", "expected"), [("anonymous", 401), ("viewer", 200), ("operator", 200), ("admin", 200)]
)
def test_audit_log_is_readable_by_every_role(api_as, role, expected):
    response = role_client(api_as, role).get("/api/audit-log/")

    assert response.status_code == expected


def test_admin_creates_user_with_role_and_it_is_audited(api_as):
    api = api_as("admin")

    response = api.post(
        "/api/users/", {"username": "ops1", "password": "a-long-password-9", "role": "operator"}
    )

    assert response.status_code == 201
    assert response.json()["role"] == "operator"
    entry = AuditLog.objects.get(object_type="auth.user", object_id=str(response.json()["id"]))
    assert entry.action == "create"
    assert entry.after["roles"] == ["operator"]
    assert "password" not in entry.after


def test_user_create_names_missing_and_invalid_fields(api_as):
    api = api_as("admin")

    response = api.post("/api/users/", {"username": "x", "role": "overlord"})

    assert response.status_code == 400
    assert set(response.json()) == {"role"}
    response = api.post("/api/users/", {"username": "x", "role": "viewer"})
    assert response.status_code == 400
    assert set(response.json()) == {"password"}


def test_duplicate_username_is_a_conflict_not_a_500(api_as):
    api = api_as("admin")
    api.post("/api/users/", {"username": "dup", "password": "a-long-password-9", "role": "viewer"})

    response = api.post(
        "/api/users/", {"username": "dup", "password": "a-long-password-9", "role": "viewer"}
    )

    assert response.status_code == 409
    assert "detail" in response.json()


def test_role_change_is_audited_with_before_and_after(api_as, make_user):
    api = api_as("admin")
    user = make_user("viewer", username="promote-me")

    response = api.patch(f"/api/users/{user.pk}/", {"role": "operator"})

    assert response.status_code == 200
    entry = AuditLog.objects.filter(object_type="auth.user", object_id=str(user.pk)).get()
    assert entry.before["roles"] == ["viewer"]
    assert entry.after["roles"] == ["operator"]


def test_non_numeric_id_is_404(api_as):
    response = api_as("admin").get("/api/users/abc/")

    assert response.status_code == 404


def test_token_obtained_with_password_authenticates(make_user, client):
    make_user("viewer", username="tok")

    response = client.post("/api/auth/token/", {"username": "tok", "password": "pw-for-tests-1"})

    assert response.status_code == 200
    token = response.json()["token"]
    me = client.get("/api/me/", HTTP_AUTHORIZATION=f"Token {token}")
    assert me.json()["username"] == "tok"
    assert me.json()["role"] == "viewer"


def test_browser_session_reaches_the_api_and_writes_need_the_csrf_token(make_user):
    """Session auth (the browser): log in through the login page, then call the API with the
    session cookie; a write without the CSRF token is refused, with it it goes through."""
    from django.test import Client

    make_user("operator", username="browser")
    browser = Client(enforce_csrf_checks=True)
    browser.get("/login/")
    login = browser.post(
        "/login/",
        {
            "username": "browser",
            "password": "pw-for-tests-1",
            "csrfmiddlewaretoken": browser.cookies["csrftoken"].value,
        },
    )
    assert login.status_code == 302
    body = {"name": "from-browser", "steps": [{"share_percent": 100}]}

    me = browser.get("/api/me/")
    refused = browser.post("/api/rollout-plans/", body, content_type="application/json")
    accepted = browser.post(
        "/api/rollout-plans/",
        body,
        content_type="application/json",
        HTTP_X_CSRFTOKEN=browser.cookies["csrftoken"].value,
    )

    assert me.status_code == 200
    assert me.json()["username"] == "browser"
    assert refused.status_code == 403
    assert "CSRF" in refused.json()["detail"]
    assert accepted.status_code == 201, accepted.content
    assert AuditLog.objects.get(object_type="rollouts.rolloutplan").actor_label == "browser"


def test_wrong_password_gets_400_naming_no_secret(make_user, client):
    make_user("viewer", username="tok2")

    response = client.post("/api/auth/token/", {"username": "tok2", "password": "nope"})

    assert response.status_code == 400
    assert "non_field_errors" in response.json()


def test_pagination_shape_and_page_size(api_as, make_user):
    for _ in range(7):
        make_user("viewer")
    api = api_as("admin")

    response = api.get("/api/users/?page_size=3&page=2")

    body = response.json()
    assert body["count"] == 8
    assert len(body["results"]) == 3
    assert body["next"] is not None
    assert body["previous"] is not None
    assert api.get("/api/users/?page=99").status_code == 404


def test_invalid_filter_value_is_400_naming_field(api_as):
    response = api_as("viewer").get("/api/audit-log/?created_after=yesterday")

    assert response.status_code == 400
    assert "created_after" in response.json()


def test_request_id_is_echoed_and_recorded(api_as):
    api = api_as("admin")

    response = api.post(
        "/api/users/",
        {"username": "rid", "password": "a-long-password-9", "role": "viewer"},
        HTTP_X_REQUEST_ID="req-123",
    )

    assert response["X-Request-Id"] == "req-123"
    assert (
        AuditLog.objects.get(
            object_id=str(response.json()["id"]), object_type="auth.user"
        ).request_id
        == "req-123"
    )


def test_schema_and_docs_are_served(api_as, client):
    assert client.get("/api/schema/").status_code == 200
    assert client.get("/api/docs/").status_code == 200


@pytest.mark.parametrize("page", ["/api/docs/", "/api/redoc/"])
def test_api_docs_pages_load_nothing_from_another_host(client, page):
    """The sidecar serves Swagger UI and Redoc: a console without internet shows its docs."""
    html = client.get(page).content.decode()
    assets = re.findall(r'(?:src|href)="([^"]+)"', html)

    assert re.findall(r"https?://", html) == []
    assert any(a.endswith(".js") for a in assets)
    for asset in assets:
        response = client.get(asset)
        assert response.status_code == 200, asset
        b"".join(response.streaming_content if response.streaming else [response.content])


def test_healthz_reports_database(client):
    response = client.get("/healthz")

    assert response.status_code == 200
    assert response.json() == {"status": "ok", "database": "ok"}


def test_malformed_json_is_400(api_as):
    response = api_as("admin").post(
        "/api/users/", data="{not json", content_type="application/json"
    )

    assert response.status_code == 400
    assert "detail" in response.json()


def test_overview_requires_login_then_renders(client, make_user):
    assert client.get("/").status_code == 302
    client.force_login(make_user("viewer"))

    response = client.get("/")

    assert response.status_code == 200
    assert b"<h1>Overview</h1>" in response.content

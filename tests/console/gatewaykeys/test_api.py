"""Gateway keys API and page: a key's plaintext is answered once and only its hash stored;
revoke; the audit log; roles (viewers read, admins write); 400 naming the field; the access
document the gateway polls (node token, ETag/304), with the key hashes the gateway checks."""

from __future__ import annotations

import hashlib
import json

import pytest
from rest_framework.test import APIClient

from console.core.models import AuditLog
from console.gatewaykeys.models import GatewayKey
from console.inventory.services import node_token_issue

pytestmark = pytest.mark.django_db


def _create(api: APIClient, deployment: int, name: str = "team-a") -> dict:
    response = api.post(
        "/api/gateway-keys/", {"deployment": deployment, "name": name}, format="json"
    )
    assert response.status_code == 201, response.content
    return response.json()


def test_create_answers_the_key_once_and_stores_only_its_hash(world, api_as):
    admin = api_as("admin")

    body = _create(admin, world.deployment.pk)

    key = body["key"]
    row = GatewayKey.objects.get(pk=body["id"])
    assert key.startswith("pdbk_")
    assert len(key) > 40
    assert row.key_hash == hashlib.sha256(key.encode()).hexdigest()
    assert row.key_prefix == key[:12]
    assert body["key_prefix"] == key[:12]
    assert (body["name"], body["deployment"], body["active"]) == (
        "team-a",
        world.deployment.pk,
        True,
    )
    stored = json.dumps([list(r) for r in GatewayKey.objects.values_list()], default=str)
    assert key not in stored
    listed = admin.get(f"/api/gateway-keys/{row.pk}/").json()
    assert "key" not in listed
    assert "key_hash" not in listed
    assert key not in json.dumps(admin.get("/api/gateway-keys/").json())


def test_create_and_revoke_are_audited_without_the_key(world, api_as):
    admin = api_as("admin")
    body = _create(admin, world.deployment.pk)

    revoked = admin.post(f"/api/gateway-keys/{body['id']}/revoke/")
    again = admin.post(f"/api/gateway-keys/{body['id']}/revoke/")

    assert revoked.status_code == 200
    assert revoked.json()["active"] is False
    assert revoked.json()["revoked_at"] is not None
    assert again.status_code == 400
    assert "revoked_at" in again.json()
    entries = AuditLog.objects.filter(object_type="gatewaykeys.gatewaykey").order_by("id")
    assert [(e.action, e.verb) for e in entries] == [("create", ""), ("action", "revoke")]
    assert entries[0].after == {
        "deployment": world.deployment.pk,
        "name": "team-a",
        "key_prefix": body["key_prefix"],
    }
    row = GatewayKey.objects.get(pk=body["id"])
    for entry in entries:
        assert body["key"] not in json.dumps([entry.before, entry.after])
        assert row.key_hash not in json.dumps([entry.before, entry.after])


@pytest.mark.parametrize(
    ("role", "read", "write"),
    [(None, 401, 401), ("viewer", 200, 403), ("operator", 200, 403), ("admin", 200, 201)],
)
def test_roles(world, api_as, role, read, write):
    api = api_as(role)
    body = {"deployment": world.deployment.pk, "name": "team-a"}

    assert api.get("/api/gateway-keys/").status_code == read
    assert api.post("/api/gateway-keys/", body, format="json").status_code == write
    access = f"/api/deployments/{world.deployment.pk}/gateway-access/"
    assert api.get(access).status_code == read
    change = api.put(access, {"require_client_keys": True}, format="json").status_code
    assert change == (200 if write == 201 else write)


def test_a_viewer_cannot_revoke(world, api_as):
    body = _create(api_as("admin"), world.deployment.pk)

    assert api_as("viewer").post(f"/api/gateway-keys/{body['id']}/revoke/").status_code == 403
    assert GatewayKey.objects.get(pk=body["id"]).revoked_at is None


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"name": "team-a"}, "deployment"),
        ({"deployment": 999999, "name": "team-a"}, "deployment"),
        ({"deployment": "abc", "name": "team-a"}, "deployment"),
        ({"deployment": "DEP"}, "name"),
        ({"deployment": "DEP", "name": ""}, "name"),
        ({"deployment": "DEP", "name": "team a"}, "name"),
        ({"deployment": "DEP", "name": "x" * 65}, "name"),
        ({"deployment": "DEP", "name": "-leading"}, "name"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(world, api_as, body, field):
    if body.get("deployment") == "DEP":
        body = {**body, "deployment": world.deployment.pk}

    response = api_as("admin").post("/api/gateway-keys/", body, format="json")

    assert response.status_code == 400
    assert list(response.json()) == [field]


def test_an_active_name_is_unique_per_deployment_until_revoked(world, api_as):
    admin = api_as("admin")
    first = _create(admin, world.deployment.pk)

    duplicate = admin.post(
        "/api/gateway-keys/", {"deployment": world.deployment.pk, "name": "team-a"}, format="json"
    )
    admin.post(f"/api/gateway-keys/{first['id']}/revoke/")
    rotated = _create(admin, world.deployment.pk)

    assert duplicate.status_code == 400
    assert list(duplicate.json()) == ["name"]
    assert rotated["key"] != first["key"]


def test_the_gateway_polls_the_access_document_with_its_node_token(world, api_as):
    admin = api_as("admin")
    path = f"/api/deployments/{world.deployment.pk}/gateway-access/"
    node = APIClient()
    node.credentials(
        HTTP_AUTHORIZATION=f"Bearer {node_token_issue(actor=None, node=world.decode_node)}"
    )
    initial = node.get(path)
    a = _create(admin, world.deployment.pk, "team-a")
    b = _create(admin, world.deployment.pk, "team-b")
    admin.put(path, {"require_client_keys": True}, format="json")
    full = node.get(path)
    unchanged = node.get(path, HTTP_IF_NONE_MATCH=full["ETag"])
    admin.post(f"/api/gateway-keys/{a['id']}/revoke/")
    after_revoke = node.get(path, HTTP_IF_NONE_MATCH=full["ETag"])

    assert initial.json() == {
        "deployment": world.deployment.pk,
        "require_client_keys": False,
        "keys": [],
    }
    assert full.status_code == 200
    assert full.json() == {
        "deployment": world.deployment.pk,
        "require_client_keys": True,
        "keys": [
            {
                "name": "team-a",
                "sha256": hashlib.sha256(a["key"].encode()).hexdigest(),
                "prefix": a["key_prefix"],
            },
            {
                "name": "team-b",
                "sha256": hashlib.sha256(b["key"].encode()).hexdigest(),
                "prefix": b["key_prefix"],
            },
        ],
    }
    assert unchanged.status_code == 304
    assert after_revoke.status_code == 200
    assert [k["name"] for k in after_revoke.json()["keys"]] == ["team-b"]
    assert AuditLog.objects.filter(object_type="gatewaykeys.gatewayaccess").count() == 1


def test_the_access_document_parses_at_the_gateway(world, api_as):
    """The console's document is what the gateway's parser takes (the contract)."""
    from agents.gateway.access import ClientKeys, parse_access

    admin = api_as("admin")
    key = _create(admin, world.deployment.pk)["key"]
    path = f"/api/deployments/{world.deployment.pk}/gateway-access/"
    admin.put(path, {"require_client_keys": True}, format="json")
    required, hashes = parse_access(admin.get(path).json())
    keys = ClientKeys()
    keys.set_console(required=required, keys=hashes)

    assert keys.admit(f"Bearer {key}") == "team-a"


def test_a_node_outside_the_deployment_is_refused(world):
    from tests.console.factories import NodeFactory

    stranger = NodeFactory(site=world.local, hostname="dec-9")
    node = APIClient()
    node.credentials(HTTP_AUTHORIZATION=f"Bearer {node_token_issue(actor=None, node=stranger)}")

    response = node.get(f"/api/deployments/{world.deployment.pk}/gateway-access/")

    assert response.status_code == 403


def test_put_needs_a_boolean(world, api_as):
    response = api_as("admin").put(
        f"/api/deployments/{world.deployment.pk}/gateway-access/",
        {"require_client_keys": "maybe"},
        format="json",
    )

    assert response.status_code == 400
    assert list(response.json()) == ["require_client_keys"]


def test_the_page_shows_a_new_key_once_and_revokes(world, client, make_user):
    admin = make_user("admin")
    client.force_login(admin)

    created = client.post(
        "/gateway-keys/create/", {"deployment": world.deployment.pk, "name": "web-team"}
    )
    row = GatewayKey.objects.get(name="web-team")
    listing = client.get("/gateway-keys/")
    revoked = client.post(f"/gateway-keys/{row.pk}/revoke/")
    bad = client.post(
        "/gateway-keys/create/", {"deployment": world.deployment.pk, "name": "bad name"}
    )
    required = client.post(
        f"/gateway-keys/deployments/{world.deployment.pk}/access/", {"require_client_keys": "true"}
    )

    html = created.content.decode()
    assert created.status_code == 200
    assert 'id="created-key-value"' in html
    assert (
        hashlib.sha256(html.split('id="created-key-value">')[1].split("<")[0].encode()).hexdigest()
        == row.key_hash
    )
    assert 'id="created-key"' not in listing.content.decode()
    assert row.key_prefix in listing.content.decode()
    assert revoked.status_code == 302
    assert GatewayKey.objects.get(pk=row.pk).revoked_at is not None
    assert "name: " in bad.content.decode()
    assert required.status_code == 302
    assert world.deployment.gateway_access.require_client_keys is True


def test_a_viewer_sees_the_page_but_cannot_create(world, client, make_user):
    client.force_login(make_user("viewer"))

    page = client.get("/gateway-keys/")
    create = client.post("/gateway-keys/create/", {"deployment": world.deployment.pk, "name": "x"})

    assert page.status_code == 200
    assert 'id="create-key"' not in page.content.decode()
    assert create.status_code == 403
    assert GatewayKey.objects.count() == 0

"""Node tokens, heartbeats, clock skew and liveness (online -> degraded -> lost with an
injected clock), through the real API and Postgres."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from django.core.management import call_command
from django.test import override_settings

from console.core.models import AuditLog
from console.inventory.models import Node, NodeCredential
from console.inventory.services import node_mark_missing, node_token_issue

pytestmark = pytest.mark.django_db

BEAT = {
    "agent_version": "0.1.0",
    "clock": "2026-11-29T17:40:00.123Z",
    "capacity": {
        "accelerators": [{"type": "H200", "count": 8, "memory_gib": 141}],
        "memory_gib": 2048,
    },
    "children": [
        {
            "name": "prefill-engine",
            "kind": "prefill-engine",
            "state": "running",
            "pid": 123,
            "port": 8100,
            "healthy": True,
            "restarts": 0,
            "config_version": 3,
        }
    ],
    "faults": [
        {"id": "f1", "kind": "link_cut", "target": "remote", "expires_at": "2026-11-29T17:45:00Z"}
    ],
    "config_versions": {"1": 3},
    "tls": {
        "mtls": True,
        "subject": "dec-1",
        "sans": ["dec-1", "127.0.0.1"],
        "not_after": "2027-12-31T00:00:00Z",
        "ca_fingerprint": "cd" * 32,
        "allowlist_size": 1,
        "error": "",
    },
    "weights": [
        {
            "model": "tiny",
            "child": "prefill-engine",
            "path": "/models/tiny-seed1234/model.safetensors",
            "state": "ok",
            "sha256": "ab" * 32,
            "detail": "",
        }
    ],
}


def beat(client, token, body=None, **headers):
    return client.post(
        "/api/heartbeats/",
        body if body is not None else BEAT,
        content_type="application/json",
        HTTP_AUTHORIZATION=f"Bearer {token}",
        **headers,
    )


def test_admin_issues_token_shown_once_and_only_hash_stored(api_as, world):
    response = api_as("admin").post(f"/api/nodes/{world.decode_node.pk}/token/")

    assert response.status_code == 201
    token = response.json()["token"]
    credential = NodeCredential.objects.get(node=world.decode_node)
    assert token not in credential.token_hash
    assert len(credential.token_hash) == 64
    assert api_as("admin").get(f"/api/nodes/{world.decode_node.pk}/").json()["has_token"] is True
    assert "token" not in api_as("admin").get(f"/api/nodes/{world.decode_node.pk}/").json()
    # The node's token issue, and the API tokens of the users the test calls as: none shows it.
    entries = AuditLog.objects.filter(verb="token_issue")
    assert entries.filter(object_type="inventory.node").count() == 1
    assert all(token not in str(entry.after) for entry in entries)


def test_rotating_a_token_revokes_the_old_one(client, world):
    old = node_token_issue(actor=None, node=world.decode_node)
    new = node_token_issue(actor=None, node=world.decode_node)

    assert beat(client, old).status_code == 401
    assert beat(client, new).status_code == 200
    assert AuditLog.objects.filter(verb="token_rotate").count() == 1


def test_heartbeat_marks_node_online_and_stores_report(client, world):
    token = node_token_issue(actor=None, node=world.decode_node)
    assert world.decode_node.status == "unknown"

    response = beat(client, token)

    assert response.status_code == 200
    body = response.json()
    assert body["node"] == world.decode_node.pk
    assert body["status"] == "online"
    assert body["interval_s"] == 10
    assert body["deployments"] == {str(world.deployment.pk): world.deployment.version}
    node = Node.objects.get(pk=world.decode_node.pk)
    assert node.status == "online"
    assert node.agent_version == "0.1.0"
    assert node.reported_children[0]["pid"] == 123
    assert node.reported_faults[0]["kind"] == "link_cut"
    assert node.reported_config_versions == {"1": 3}
    assert node.reported_capacity["memory_gib"] == 2048
    assert node.reported_tls["not_after"] == "2027-12-31T00:00:00Z"
    assert node.reported_tls["sans"] == ["dec-1", "127.0.0.1"]
    assert node.reported_weights[0]["sha256"] == "ab" * 32
    assert AuditLog.objects.filter(verb="node_status", object_id=str(node.pk)).count() == 1


def test_clock_skew_is_node_clock_minus_console_clock(client, world):
    token = node_token_issue(actor=None, node=world.decode_node)
    ahead = (datetime.now(tz=UTC) + timedelta(seconds=30)).isoformat()

    response = beat(client, token, {**BEAT, "clock": ahead})

    skew = response.json()["clock_skew_ms"]
    assert 29_000 < skew <= 30_000
    assert Node.objects.get(pk=world.decode_node.pk).clock_skew_ms == skew


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({**BEAT, "clock": "yesterday"}, "clock"),
        ({**BEAT, "clock": "2026-11-29T17:40:00"}, "clock"),
        ({k: v for k, v in BEAT.items() if k != "agent_version"}, "agent_version"),
        ({**BEAT, "children": [{"name": "x", "kind": "k", "state": "s", "pid": -1}]}, "children"),
        ({**BEAT, "children": "lots"}, "children"),
        ({**BEAT, "faults": [{"kind": "link_cut"}]}, "faults"),
        ({**BEAT, "config_versions": {"demo": 3}}, "config_versions"),
        ({**BEAT, "config_versions": {"1": "three"}}, "config_versions"),
        ({**BEAT, "capacity": [1, 2]}, "capacity"),
    ],
)
def test_bad_heartbeat_body_is_400_naming_field(client, world, body, field):
    token = node_token_issue(actor=None, node=world.decode_node)

    response = beat(client, token, body)

    assert response.status_code == 400
    assert field in response.json()


TLS = BEAT["tls"]
WEIGHT = BEAT["weights"][0]


@pytest.mark.parametrize(
    ("body", "path"),
    [
        ({**BEAT, "tls": "on"}, ["tls", "non_field_errors"]),
        ({**BEAT, "tls": {**TLS, "mtls": "maybe"}}, ["tls", "mtls"]),
        ({**BEAT, "tls": {k: v for k, v in TLS.items() if k != "mtls"}}, ["tls", "mtls"]),
        ({**BEAT, "tls": {**TLS, "not_after": "2027-12-31T00:00:00"}}, ["tls", "not_after"]),
        ({**BEAT, "tls": {**TLS, "not_after": "soon"}}, ["tls", "not_after"]),
        ({**BEAT, "tls": {**TLS, "sans": "dec-1"}}, ["tls", "sans"]),
        ({**BEAT, "tls": {**TLS, "ca_fingerprint": "not-hex"}}, ["tls", "ca_fingerprint"]),
        ({**BEAT, "tls": {**TLS, "allowlist_size": -1}}, ["tls", "allowlist_size"]),
        ({**BEAT, "weights": {"tiny": "ab"}}, ["weights", "non_field_errors"]),
        ({**BEAT, "weights": [{**WEIGHT, "sha256": "AB" * 32}]}, ["weights", "0", "sha256"]),
        ({**BEAT, "weights": [{**WEIGHT, "sha256": None}]}, ["weights", "0", "sha256"]),
        ({**BEAT, "weights": [{**WEIGHT, "state": "fine"}]}, ["weights", "0", "state"]),
        ({**BEAT, "weights": [{**WEIGHT, "model": ""}]}, ["weights", "0", "model"]),
    ],
)
def test_bad_tls_or_weights_report_is_400_naming_the_nested_field(client, world, body, path):
    token = node_token_issue(actor=None, node=world.decode_node)

    response = beat(client, token, body)

    assert response.status_code == 400
    errors = response.json()
    for key in path:
        errors = errors[key]
    assert errors  # a message at exactly that field
    assert Node.objects.get(pk=world.decode_node.pk).status == "unknown"  # nothing stored


def test_an_agent_that_reports_no_tls_or_weights_stores_null(client, world):
    token = node_token_issue(actor=None, node=world.decode_node)
    old = {k: v for k, v in BEAT.items() if k not in {"tls", "weights"}}

    assert beat(client, token, old).status_code == 200

    node = Node.objects.get(pk=world.decode_node.pk)
    assert node.reported_tls is None
    assert node.reported_weights is None


def test_heartbeat_without_or_with_bad_token_is_401(client, world):
    assert client.post("/api/heartbeats/", BEAT, content_type="application/json").status_code == 401
    assert beat(client, "pdbn_not-a-token").status_code == 401
    response = client.post(
        "/api/heartbeats/", BEAT, content_type="application/json", HTTP_AUTHORIZATION="Bearer"
    )
    assert response.status_code == 401


def test_malformed_heartbeat_json_is_400(client, world):
    token = node_token_issue(actor=None, node=world.decode_node)

    response = beat(client, token, "{nope")

    assert response.status_code == 400


@override_settings(HEARTBEAT_INTERVAL_S=10, HEARTBEAT_MISSED_LIMIT=3)
def test_missed_heartbeats_turn_node_degraded_then_lost_then_online_again(client, world):
    token = node_token_issue(actor=None, node=world.decode_node)
    beat(client, token)
    last = Node.objects.get(pk=world.decode_node.pk).last_heartbeat_at

    assert node_mark_missing(now=last + timedelta(seconds=12)) == {"degraded": [], "lost": []}
    assert node_mark_missing(now=last + timedelta(seconds=16)) == {
        "degraded": [world.decode_node.pk],
        "lost": [],
    }
    assert Node.objects.get(pk=world.decode_node.pk).status == "degraded"
    assert node_mark_missing(now=last + timedelta(seconds=30)) == {"degraded": [], "lost": []}
    assert node_mark_missing(now=last + timedelta(seconds=35)) == {
        "degraded": [],
        "lost": [world.decode_node.pk],
    }
    assert Node.objects.get(pk=world.decode_node.pk).status == "lost"
    assert node_mark_missing(now=last + timedelta(hours=1)) == {"degraded": [], "lost": []}

    assert beat(client, token).json()["status"] == "online"
    transitions = [
        (e.before["status"], e.after["status"])
        for e in AuditLog.objects.filter(verb="node_status").order_by("id")
    ]
    assert transitions == [
        ("unknown", "online"),
        ("online", "degraded"),
        ("degraded", "lost"),
        ("lost", "online"),
    ]


def test_nodes_that_never_beat_stay_unknown(world):
    node_mark_missing(now=datetime.now(tz=UTC) + timedelta(days=1))

    assert Node.objects.get(pk=world.prefill_node.pk).status == "unknown"


def test_management_command_marks_missing(world, client, capsys):
    token = node_token_issue(actor=None, node=world.decode_node)
    beat(client, token)
    later = (datetime.now(tz=UTC) + timedelta(minutes=10)).isoformat()

    call_command("node_mark_missing", "--now", later)

    assert "lost: 1" in capsys.readouterr().out
    assert Node.objects.get(pk=world.decode_node.pk).status == "lost"


def test_status_is_not_writable_through_the_api(api_as, world):
    response = api_as("admin").patch(
        f"/api/nodes/{world.decode_node.pk}/", {"status": "online"}, format="json"
    )

    assert response.status_code == 200
    assert Node.objects.get(pk=world.decode_node.pk).status == "unknown"


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"hostname": "bad host"}, "hostname"),
        ({"agent_address": "nohostport"}, "agent_address"),
        ({"accelerator_count": -1}, "accelerator_count"),
        ({"site": 999999}, "site"),
    ],
)
def test_node_validation_names_field(api_as, world, body, field):
    data = {"site": world.local.pk, "hostname": "n1", "agent_address": "10.0.0.9:7070", **body}

    response = api_as("admin").post("/api/nodes/", data, format="json")

    assert response.status_code == 400
    assert field in response.json()


def test_hostname_unique_per_site(api_as, world):
    data = {"site": world.local.pk, "hostname": "dec-1", "agent_address": "10.0.0.9:7070"}

    response = api_as("admin").post("/api/nodes/", data, format="json")

    assert response.status_code == 400
    other_site = api_as("admin").post(
        "/api/nodes/", {**data, "site": world.remote.pk}, format="json"
    )
    assert other_site.status_code == 201


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"utilization_ceiling": 0}, "utilization_ceiling"),
        ({"utilization_ceiling": 1.5}, "utilization_ceiling"),
        ({"provisioned_mbit_s": 0}, "provisioned_mbit_s"),
        ({"to_site": "same"}, "to_site"),
    ],
)
def test_link_validation_names_field(api_as, world, body, field):
    data = {
        "from_site": world.local.pk,
        "to_site": world.remote.pk,
        "provisioned_mbit_s": 1000,
        **body,
    }
    if data["to_site"] == "same":
        data["to_site"] = world.local.pk

    response = api_as("admin").post("/api/links/", data, format="json")

    assert response.status_code == 400
    assert field in response.json()


def test_link_pair_is_ordered_and_unique(api_as, world):
    api = api_as("admin")

    duplicate = api.post(
        "/api/links/",
        {"from_site": world.remote.pk, "to_site": world.local.pk, "provisioned_mbit_s": 1},
        format="json",
    )
    reverse = api.post(
        "/api/links/",
        {"from_site": world.local.pk, "to_site": world.remote.pk, "provisioned_mbit_s": 1},
        format="json",
    )

    assert duplicate.status_code == 400
    assert reverse.status_code == 201
    assert api.get(f"/api/links/{reverse.json()['id']}/").json()["utilization_ceiling"] == 0.7


def test_site_in_use_cannot_be_deleted(api_as, world):
    response = api_as("admin").delete(f"/api/sites/{world.local.pk}/")

    assert response.status_code == 409
    assert "detail" in response.json()


def test_site_writes_are_audited(api_as):
    api = api_as("admin")
    created = api.post(
        "/api/sites/", {"name": "dc-a", "role": "decode", "gpu_hour_price": "2.5"}, format="json"
    )
    api.patch(f"/api/sites/{created.json()['id']}/", {"region": "eu"}, format="json")

    entries = AuditLog.objects.filter(object_type="inventory.site").order_by("id")

    assert [e.action for e in entries] == ["create", "update"]
    assert entries[1].before["region"] == ""
    assert entries[1].after["region"] == "eu"


def test_lists_filter_and_paginate(api_as, world):
    api = api_as("viewer")

    by_site = api.get(f"/api/nodes/?site={world.remote.pk}").json()
    paged = api.get("/api/sites/?page_size=1&page=2").json()

    assert [n["hostname"] for n in by_site["results"]] == ["pre-1"]
    assert paged["count"] == 2
    assert len(paged["results"]) == 1
    assert paged["previous"]
    assert api.get("/api/nodes/?status=bogus").status_code == 400


def test_a_heartbeat_carries_the_agents_address_and_the_node_follows_it(client, world):
    """An agent restarted on another port says so: the node's address takes the port (and a
    specific listen host; a wildcard keeps the registered one), audited; a bad host is a 400
    naming the field, and nothing changes."""
    node = world.decode_node
    token = node_token_issue(actor=None, node=node)
    host = node.agent_address.rsplit(":", 1)[0]

    moved = beat(client, token, {**BEAT, "agent_listen_host": "0.0.0.0", "agent_port": 7171})
    node.refresh_from_db()
    after_wildcard = node.agent_address
    named = beat(client, token, {**BEAT, "agent_listen_host": "10.1.2.3", "agent_port": 7272})
    node.refresh_from_db()
    after_named = node.agent_address
    bad = beat(client, token, {**BEAT, "agent_listen_host": "bad host!", "agent_port": 7373})
    node.refresh_from_db()

    assert (moved.status_code, named.status_code) == (200, 200)
    assert after_wildcard == f"{host}:7171"
    assert after_named == "10.1.2.3:7272"
    assert bad.status_code == 400
    assert list(bad.json()) == ["agent_listen_host"]
    assert node.agent_address == "10.1.2.3:7272"
    changes = AuditLog.objects.filter(verb="agent_address").order_by("id")
    assert [c.after["agent_address"] for c in changes] == [f"{host}:7171", "10.1.2.3:7272"]

"""Who may send KV to a deployment's receivers: by default the prefill pools' nodes, plus the
operator's ``extra_allowed_peers``; validated naming the field, carried by the config document,
audited (``kv_allowlist``) whatever changed it, and shown on the security page."""

from __future__ import annotations

import pytest
from django.test import Client

from console.core.models import AuditLog
from console.deployments.models import ConfigSnapshot, Deployment
from console.deployments.services import pool_update
from console.inventory.services import node_update
from tests.console.factories import NodeFactory

pytestmark = pytest.mark.django_db


def url(world, suffix=""):
    return f"/api/deployments/{world.deployment.pk}/{suffix}"


def allowlist_entries(world):
    return list(
        AuditLog.objects.filter(
            object_type="deployments.deployment",
            object_id=str(world.deployment.pk),
            verb="kv_allowlist",
        ).order_by("id")
    )


def test_by_default_the_prefill_pools_nodes_may_send_kv(api_as, world):
    body = api_as("viewer").get(url(world)).json()
    config = api_as("viewer").get(url(world, "config/")).json()

    assert body["extra_allowed_peers"] == []
    assert body["allowed_peers"] == ["pre-1"]
    assert config["kv_transfer"]["extra_allowed_peers"] == []
    assert config["kv_transfer"]["allowed_peers"] == ["pre-1"]


def test_the_decode_pools_nodes_are_not_on_the_default_allowlist(world):
    config = ConfigSnapshot.objects.get(
        deployment=world.deployment, version=world.deployment.version
    ).config

    assert "dec-1" not in config["kv_transfer"]["allowed_peers"]


def test_extra_peers_are_added_in_a_new_version_and_audited(api_as, world):
    response = api_as("operator").patch(
        url(world), {"extra_allowed_peers": ["kv-relay.example", "10.9.0.7"]}, format="json"
    )

    assert response.status_code == 200
    assert response.json()["allowed_peers"] == ["10.9.0.7", "kv-relay.example", "pre-1"]
    snapshot = ConfigSnapshot.objects.get(
        deployment=world.deployment, version=response.json()["version"]
    )
    assert snapshot.config["kv_transfer"]["allowed_peers"] == [
        "10.9.0.7",
        "kv-relay.example",
        "pre-1",
    ]
    assert snapshot.diff["kv_transfer.extra_allowed_peers"] == {
        "from": [],
        "to": ["kv-relay.example", "10.9.0.7"],
    }
    entry = allowlist_entries(world)[-1]
    assert entry.actor_label.startswith("operator")
    assert entry.before == {"allowed_peers": ["pre-1"]}
    assert entry.after == {
        "allowed_peers": ["10.9.0.7", "kv-relay.example", "pre-1"],
        "extra_allowed_peers": ["kv-relay.example", "10.9.0.7"],
        "reason": "updated",
    }


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("pre-2", "Must be a list of certificate names"),
        ([""], "Item 0: must be a non-empty string"),
        (["ok", "  "], "Item 1: must be a non-empty string"),
        (["ok", 7], "Item 1: must be a non-empty string"),
        ([" pre-2"], "Item 0: ' pre-2' has leading or trailing whitespace."),
        (["x" * 254], "Item 0: longer than 253 characters."),
        (["pre-2", "pre-2"], "Listed more than once: pre-2."),
    ],
)
def test_invalid_extra_peers_are_400_naming_the_field(api_as, world, value, message):
    response = api_as("operator").patch(url(world), {"extra_allowed_peers": value}, format="json")

    assert response.status_code == 400
    errors = response.json()["extra_allowed_peers"]
    assert any(e.startswith(message) for e in errors), errors
    assert Deployment.objects.get(pk=world.deployment.pk).version == world.deployment.version
    assert allowlist_entries(world)[-1].after["allowed_peers"] == ["pre-1"]


def test_a_viewer_cannot_change_the_allowlist(api_as, world):
    response = api_as("viewer").patch(url(world), {"extra_allowed_peers": ["x"]}, format="json")

    assert response.status_code == 403


def test_a_prefill_node_joining_the_pool_joins_the_allowlist_and_is_audited(world):
    second = NodeFactory(site=world.remote, hostname="pre-2", agent_address="10.1.0.6:7070")

    pool_update(actor=None, pool=world.prefill_pool, nodes=[world.prefill_node, second])

    world.deployment.refresh_from_db()
    config = ConfigSnapshot.objects.get(
        deployment=world.deployment, version=world.deployment.version
    ).config
    assert config["kv_transfer"]["allowed_peers"] == ["pre-1", "pre-2"]
    entry = allowlist_entries(world)[-1]
    assert entry.actor_label == "system"
    assert entry.before == {"allowed_peers": ["pre-1"]}
    assert entry.after["allowed_peers"] == ["pre-1", "pre-2"]
    assert entry.after["reason"] == "prefill pool changed"


def test_a_renamed_prefill_node_is_renamed_on_the_allowlist(world):
    node_update(actor=None, node=world.prefill_node, hostname="pre-1b")

    world.deployment.refresh_from_db()
    config = ConfigSnapshot.objects.get(
        deployment=world.deployment, version=world.deployment.version
    ).config
    assert config["kv_transfer"]["allowed_peers"] == ["pre-1b"]
    assert allowlist_entries(world)[-1].before == {"allowed_peers": ["pre-1"]}


def test_a_change_that_leaves_the_allowlist_alone_writes_no_allowlist_entry(api_as, world):
    before = len(allowlist_entries(world))

    api_as("operator").patch(url(world), {"remote_share_percent": 10}, format="json")

    assert len(allowlist_entries(world)) == before


def test_restore_sets_the_extra_peers_back(api_as, world):
    operator = api_as("operator")
    plain = world.deployment.version
    operator.patch(url(world), {"extra_allowed_peers": ["relay"]}, format="json")

    response = operator.post(url(world, "restore/"), {"version": plain}, format="json")

    assert response.status_code == 200
    assert response.json()["extra_allowed_peers"] == []
    assert response.json()["allowed_peers"] == ["pre-1"]
    assert allowlist_entries(world)[-1].after["reason"] == f"restore of v{plain}"


def test_the_security_page_lists_allowlist_changes(api_as, make_user, world):
    api_as("operator").patch(url(world), {"extra_allowed_peers": ["kv-relay"]}, format="json")
    viewer = Client()
    viewer.force_login(make_user("viewer"))

    html = viewer.get("/security/").content.decode()

    assert f"deployments.deployment #{world.deployment.pk}" in html
    assert "kv-relay" in html

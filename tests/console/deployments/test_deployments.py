"""Deployment writes: defaults, validation naming the field, optimistic concurrency (409),
snapshots + restore, the kill switch, pools, lifecycle guards and the audit log."""

from __future__ import annotations

import threading

import pytest
from django.db import connection
from rest_framework.test import APIClient

from console.core.models import AuditLog
from console.deployments.models import ConfigSnapshot, Deployment
from tests.console.factories import NodeFactory, SiteFactory
from tests.support import unavailable

pytestmark = pytest.mark.django_db


def url(world, suffix=""):
    return f"/api/deployments/{world.deployment.pk}/{suffix}"


def test_create_applies_guide_defaults_and_writes_version_1(api_as, world):
    response = api_as("operator").post(
        "/api/deployments/", {"name": "fresh", "model": world.model.pk}, format="json"
    )

    assert response.status_code == 201
    body = response.json()
    assert body["version"] == 1
    assert body["state"] == "draft"
    expected = {
        "remote_prefill_threshold_tokens": 4096,
        "fallback_to_local_prefill": True,
        "error_rate_limit": 0.05,
        "latency_p99_limit_ms": 2500,
        "chunk_size_mb": 32,
        "compression": "auto",
        "checksum": True,
        "retry": 3,
        "timeout_ms": 4000,
        "kv_mode": "push",
        "chunked_prefill_tokens": 2048,
        "link_utilization_ceiling": 0.7,
        "remote_share_percent": 0,
        "kill_switch": False,
    }
    assert {k: body[k] for k in expected} == expected
    snapshot = ConfigSnapshot.objects.get(deployment_id=body["id"])
    assert snapshot.version == 1
    assert snapshot.reason == "created"
    assert snapshot.author_label.startswith("operator")


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("remote_share_percent", 101),
        ("remote_share_percent", -1),
        ("compression", "gzip"),
        ("kv_mode", "nixl"),
        ("error_rate_limit", 0),
        ("error_rate_limit", 1.5),
        ("link_utilization_ceiling", 0),
        ("chunk_size_mb", 0),
        ("timeout_ms", 0),
        ("retry", "many"),
        ("chunked_prefill_tokens", 0),
        ("model", 999999),
        ("name", "Has Spaces"),
        ("fallback_to_local_prefill", "perhaps"),
    ],
)
def test_invalid_setting_is_400_naming_the_field(api_as, world, field, value):
    response = api_as("operator").patch(url(world), {field: value}, format="json")

    assert response.status_code == 400
    assert field in response.json()
    assert Deployment.objects.get(pk=world.deployment.pk).version == world.deployment.version


def test_update_bumps_version_writes_snapshot_and_audit(api_as, world):
    before = world.deployment.version

    response = api_as("operator").patch(
        url(world), {"remote_prefill_threshold_tokens": 8192}, format="json"
    )

    assert response.status_code == 200
    assert response.json()["version"] == before + 1
    assert response["ETag"] == f'"{before + 1}"'
    snapshot = ConfigSnapshot.objects.get(deployment=world.deployment, version=before + 1)
    assert snapshot.diff == {"routing.remote_prefill_threshold_tokens": {"from": 4096, "to": 8192}}
    entry = AuditLog.objects.filter(object_type="deployments.deployment", action="update").latest(
        "id"
    )
    assert entry.before["remote_prefill_threshold_tokens"] == 4096
    assert entry.after["remote_prefill_threshold_tokens"] == 8192


def test_a_write_that_changes_nothing_makes_no_version(api_as, world):
    response = api_as("operator").patch(url(world), {"remote_share_percent": 0}, format="json")

    assert response.json()["version"] == world.deployment.version
    assert (
        ConfigSnapshot.objects.filter(deployment=world.deployment).count()
        == world.deployment.version
    )


def test_stale_if_match_is_409_with_current_version(api_as, world):
    current = world.deployment.version

    response = api_as("operator").patch(
        url(world), {"remote_share_percent": 10}, format="json", HTTP_IF_MATCH=f'"{current - 1}"'
    )

    assert response.status_code == 409
    assert response.json()["current_version"] == current
    assert "detail" in response.json()
    assert Deployment.objects.get(pk=world.deployment.pk).remote_share_percent == 0


def test_bad_if_match_is_400(api_as, world):
    response = api_as("operator").patch(
        url(world), {"retry": 4}, format="json", HTTP_IF_MATCH="yesterday"
    )

    assert response.status_code == 400
    assert "If-Match" in response.json()


def test_two_operators_editing_one_deployment_never_lose_an_update(api_as, world):
    alice, bob = api_as("operator"), api_as("operator")
    seen_by_alice = alice.get(url(world)).json()["version"]
    seen_by_bob = bob.get(url(world)).json()["version"]

    first = alice.patch(
        url(world), {"remote_share_percent": 10, "version": seen_by_alice}, format="json"
    )
    second = bob.patch(url(world), {"retry": 5, "version": seen_by_bob}, format="json")

    assert first.status_code == 200
    assert second.status_code == 409
    assert second.json()["current_version"] == first.json()["version"]
    retry = bob.patch(
        url(world), {"retry": 5}, format="json", HTTP_IF_MATCH=second.json()["current_version"]
    )
    assert retry.status_code == 200
    final = Deployment.objects.get(pk=world.deployment.pk)
    assert (final.remote_share_percent, final.retry) == (10, 5)


@pytest.mark.django_db(transaction=True)
def test_concurrent_writes_with_the_same_version_exactly_one_wins(make_user, world):
    if connection.vendor != "postgresql":
        unavailable("row-lock concurrency test needs PostgreSQL")
    from console.core.services_tokens import api_token_issue

    version = world.deployment.version
    tokens = [api_token_issue(actor=None, user=make_user("operator"))[1] for _ in range(4)]
    results: list[int] = []
    barrier = threading.Barrier(len(tokens))

    def edit(token: str, share: int) -> None:
        api = APIClient()
        api.credentials(HTTP_AUTHORIZATION=f"Token {token}")
        barrier.wait(timeout=30)
        response = api.patch(
            url(world), {"remote_share_percent": share}, format="json", HTTP_IF_MATCH=f'"{version}"'
        )
        results.append(response.status_code)
        connection.close()

    threads = [threading.Thread(target=edit, args=(t, 10 * (i + 1))) for i, t in enumerate(tokens)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)

    assert sorted(results) == [200, 409, 409, 409]
    final = Deployment.objects.get(pk=world.deployment.pk)
    assert final.version == version + 1
    assert ConfigSnapshot.objects.filter(deployment=final).count() == version + 1


def test_restore_makes_an_earlier_config_current_as_a_new_version(api_as, world):
    api = api_as("operator")
    v3 = api.get(url(world, "config/")).json()
    api.patch(url(world), {"remote_share_percent": 50, "compression": "zstd"}, format="json")
    api.delete(f"/api/pools/{world.prefill_pool.pk}/")

    response = api.post(url(world, "restore/"), {"version": v3["version"]}, format="json")

    assert response.status_code == 200
    assert response.json()["version"] == v3["version"] + 3
    restored = api.get(url(world, "config/")).json()
    assert restored["version"] == v3["version"] + 3
    assert {k: v for k, v in restored.items() if k not in {"version", "created_at"}} == {
        k: v for k, v in v3.items() if k not in {"version", "created_at"}
    }
    snapshot = ConfigSnapshot.objects.get(deployment=world.deployment, version=restored["version"])
    assert snapshot.reason == f"restore of v{v3['version']}"
    assert AuditLog.objects.filter(verb="restore").count() == 1


def test_restore_of_unknown_version_is_400_and_missing_node_is_409(api_as, world):
    api = api_as("operator")
    assert api.post(url(world, "restore/"), {"version": 99}, format="json").status_code == 400
    assert "version" in api.post(url(world, "restore/"), {}, format="json").json()

    api_as("admin").delete(f"/api/nodes/{world.prefill_node.pk}/")
    response = api.post(url(world, "restore/"), {"version": 3}, format="json")

    assert response.status_code == 409
    assert "pre-1@remote" in response.json()["detail"]


def test_kill_switch_is_immediate_idempotent_and_audited(api_as, world):
    api = api_as("operator")
    version = world.deployment.version

    on = api.post(url(world, "kill-switch/"), {"enabled": True}, format="json")
    again = api.post(url(world, "kill-switch/"), {"enabled": True}, format="json")
    config = api.get(url(world, "config/")).json()

    assert on.json() == {"kill_switch": True, "version": version + 1}
    assert again.json() == {"kill_switch": True, "version": version + 1}
    assert config["routing"]["kill_switch"] is True
    assert AuditLog.objects.filter(verb="kill_switch").count() == 1
    bad = api.post(url(world, "kill-switch/"), {"enabled": "maybe"}, format="json")
    assert bad.status_code == 400
    assert "enabled" in bad.json()


def test_kill_switch_is_not_a_plain_field(api_as, world):
    api_as("operator").patch(url(world), {"kill_switch": True}, format="json")

    assert Deployment.objects.get(pk=world.deployment.pk).kill_switch is False


def test_pool_rules_name_the_field(api_as, world):
    api = api_as("operator")
    elsewhere = NodeFactory(site=world.remote, hostname="pre-9")

    second_decode = api.post(
        "/api/pools/",
        {
            "deployment": world.deployment.pk,
            "role": "decode",
            "site": SiteFactory(role="decode").pk,
        },
        format="json",
    )
    wrong_site_role = api.post(
        "/api/pools/",
        {"deployment": world.deployment.pk, "role": "prefill", "site": world.local.pk},
        format="json",
    )
    node_elsewhere = api.patch(
        f"/api/pools/{world.decode_pool.pk}/", {"nodes": [elsewhere.pk]}, format="json"
    )
    change_role = api.patch(
        f"/api/pools/{world.decode_pool.pk}/", {"role": "prefill"}, format="json"
    )
    unknown_node = api.patch(
        f"/api/pools/{world.decode_pool.pk}/", {"nodes": [999999]}, format="json"
    )

    assert second_decode.status_code == 400
    assert "one decode pool" in str(second_decode.json())
    assert wrong_site_role.status_code == 400
    assert "site" in wrong_site_role.json()
    assert node_elsewhere.status_code == 400
    assert "nodes" in node_elsewhere.json()
    assert change_role.status_code == 400
    assert "role" in change_role.json()
    assert unknown_node.status_code == 400
    assert "nodes" in unknown_node.json()


def test_pool_change_is_a_new_version_with_stale_check(api_as, world):
    api = api_as("operator")
    extra = NodeFactory(site=world.remote, hostname="pre-2", agent_address="10.1.0.6:7070")
    version = world.deployment.version

    stale = api.patch(
        f"/api/pools/{world.prefill_pool.pk}/",
        {"nodes": [extra.pk]},
        format="json",
        HTTP_IF_MATCH=f'"{version - 1}"',
    )
    ok = api.patch(
        f"/api/pools/{world.prefill_pool.pk}/",
        {"nodes": [world.prefill_node.pk, extra.pk]},
        format="json",
        HTTP_IF_MATCH=f'"{version}"',
    )

    assert stale.status_code == 409
    assert ok.status_code == 200
    nodes = api.get(url(world, "config/")).json()["pools"]["prefill"][0]["nodes"]
    assert [n["hostname"] for n in nodes] == ["pre-1", "pre-2"]


def test_active_deployment_cannot_be_deleted_until_retired(api_as, world):
    from console.deployments.services import deployment_transition

    deployment_transition(actor=None, deployment=world.deployment, to_state="deploying")
    deployment_transition(actor=None, deployment=world.deployment, to_state="active")
    api = api_as("operator")

    refused = api.delete(url(world))
    retired = api.post(url(world, "retire/"))
    again = api.post(url(world, "retire/"))
    deleted = api.delete(url(world))

    assert refused.status_code == 409
    assert retired.json()["state"] == "retired"
    assert again.status_code == 409
    assert deleted.status_code == 204
    assert not ConfigSnapshot.objects.filter(deployment_id=world.deployment.pk).exists()
    assert (
        AuditLog.objects.filter(object_type="deployments.deployment", action="delete").count() == 1
    )


def test_model_in_use_cannot_be_deleted(api_as, world):
    response = api_as("admin").delete(f"/api/models/{world.model.pk}/")

    assert response.status_code == 409


def test_deployment_list_filters(api_as, world):
    api = api_as("viewer")

    assert api.get("/api/deployments/?state=draft").json()["count"] == 1
    assert api.get("/api/deployments/?state=active").json()["count"] == 0
    assert (
        api.get(f"/api/pools/?deployment={world.deployment.pk}&role=prefill").json()["count"] == 1
    )
    assert api.get(f"/api/pools/?node={world.decode_node.pk}").json()["count"] == 1


def test_restore_with_stale_if_match_is_409(api_as, world):
    response = api_as("operator").post(
        url(world, "restore/"), {"version": 1}, format="json", HTTP_IF_MATCH='"1"'
    )

    assert response.status_code == 409
    assert response.json()["current_version"] == world.deployment.version


def test_restore_never_turns_the_kill_switch_off(api_as, world):
    api = api_as("operator")
    api.post(url(world, "kill-switch/"), {"enabled": True}, format="json")

    api.post(url(world, "restore/"), {"version": 1}, format="json")

    assert api.get(url(world, "config/")).json()["routing"]["kill_switch"] is True


def test_site_role_and_node_site_changes_that_break_pools_are_400(api_as, world):
    api = api_as("admin")

    role = api.patch(f"/api/sites/{world.local.pk}/", {"role": "prefill"}, format="json")
    both = api.patch(f"/api/sites/{world.local.pk}/", {"role": "both"}, format="json")
    move = api.patch(
        f"/api/nodes/{world.decode_node.pk}/", {"site": world.remote.pk}, format="json"
    )

    assert role.status_code == 400
    assert "role" in role.json()
    assert both.status_code == 200
    assert move.status_code == 400
    assert "site" in move.json()


@pytest.mark.parametrize("state", ["deploying", "active"])
def test_a_node_serving_a_live_deployment_is_not_deleted_until_drained(api_as, world, state):
    """Deleting the only node of an active prefill pool once answered 204, emptied the pool
    and left its engine running: now 409 naming the deployment and the way out (drain), and
    204 once the node is drained from that pool."""
    Deployment.objects.filter(pk=world.deployment.pk).update(state=state)
    admin = api_as("admin")

    refused = admin.delete(f"/api/nodes/{world.prefill_node.pk}/")

    assert refused.status_code == 409
    detail = refused.json()["detail"]
    assert "demo" in detail
    assert f"/api/pools/{world.prefill_pool.pk}/drain/" in detail
    assert world.prefill_pool.nodes.filter(pk=world.prefill_node.pk).exists()
    drained = api_as("operator").post(
        f"/api/pools/{world.prefill_pool.pk}/drain/",
        {"drain": [world.prefill_node.pk]},
        format="json",
    )
    assert drained.status_code == 200
    assert admin.delete(f"/api/nodes/{world.prefill_node.pk}/").status_code == 204

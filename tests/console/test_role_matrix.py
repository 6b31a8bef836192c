"""Every console endpoint against every role: anonymous 401, too low a role 403, the right
role succeeds. Each case runs on a fresh small world (tests/console/conftest.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from console.inventory.services import node_token_issue
from tests.conftest import role_client
from tests.console.factories import DENSE_ARCH, ModelSpecFactory, NodeFactory, SiteFactory

pytestmark = pytest.mark.django_db

RANK = {"anonymous": 0, "viewer": 1, "operator": 2, "admin": 3}

# (name, method, path(world), body(world) or None, role needed, success status)
Case = tuple[str, str, Callable[[Any], str], Callable[[Any], Any] | None, str, int]

READS: list[Case] = [
    (f"GET {path}", "get", (lambda w, p=path: p.format(w=w)), None, "viewer", 200)
    for path in [
        "/api/sites/",
        "/api/sites/{w.local.pk}/",
        "/api/nodes/",
        "/api/nodes/{w.decode_node.pk}/",
        "/api/links/",
        "/api/links/{w.link.pk}/",
        "/api/models/",
        "/api/models/{w.model.pk}/",
        "/api/models/{w.model.pk}/kv-size/?tokens=1024",
        "/api/models/kv-size/?tokens=1024",
        "/api/deployments/",
        "/api/deployments/{w.deployment.pk}/",
        "/api/deployments/{w.deployment.pk}/config/",
        "/api/deployments/{w.deployment.pk}/snapshots/",
        "/api/deployments/{w.deployment.pk}/rollout-plan/",
        "/api/pools/",
        "/api/pools/{w.decode_pool.pk}/",
        "/api/rollout-plans/",
        "/api/audit-log/",
    ]
]


def _spare_site(w: Any) -> Any:
    return SiteFactory(name="spare", role="prefill")


WRITES: list[Case] = [
    (
        "create site",
        "post",
        lambda w: "/api/sites/",
        lambda w: {"name": "new-site", "role": "prefill"},
        "admin",
        201,
    ),
    (
        "update site",
        "patch",
        lambda w: f"/api/sites/{w.local.pk}/",
        lambda w: {"region": "ap-east"},
        "admin",
        200,
    ),
    ("delete site", "delete", lambda w: f"/api/sites/{_spare_site(w).pk}/", None, "admin", 204),
    (
        "create node",
        "post",
        lambda w: "/api/nodes/",
        lambda w: {"site": w.local.pk, "hostname": "dec-2", "agent_address": "10.0.0.6:7070"},
        "admin",
        201,
    ),
    (
        "update node",
        "patch",
        lambda w: f"/api/nodes/{w.decode_node.pk}/",
        lambda w: {"accelerator_count": 4},
        "admin",
        200,
    ),
    (
        "delete node",
        "delete",
        lambda w: f"/api/nodes/{NodeFactory(site=w.local).pk}/",
        None,
        "admin",
        204,
    ),
    (
        "issue node token",
        "post",
        lambda w: f"/api/nodes/{w.decode_node.pk}/token/",
        None,
        "admin",
        201,
    ),
    (
        "create link",
        "post",
        lambda w: "/api/links/",
        lambda w: {"from_site": w.local.pk, "to_site": w.remote.pk, "provisioned_mbit_s": 10_000},
        "admin",
        201,
    ),
    (
        "update link",
        "patch",
        lambda w: f"/api/links/{w.link.pk}/",
        lambda w: {"rtt_ms": 12.5},
        "admin",
        200,
    ),
    ("delete link", "delete", lambda w: f"/api/links/{w.link.pk}/", None, "admin", 204),
    (
        "create model",
        "post",
        lambda w: "/api/models/",
        lambda w: {
            "name": "m-new",
            "architecture": DENSE_ARCH,
            "parameter_count": 10,
            "weights_sha256": "0" * 64,
        },
        "admin",
        201,
    ),
    (
        "update model",
        "patch",
        lambda w: f"/api/models/{w.model.pk}/",
        lambda w: {"family": "renamed"},
        "admin",
        200,
    ),
    (
        "delete model",
        "delete",
        lambda w: f"/api/models/{ModelSpecFactory().pk}/",
        None,
        "admin",
        204,
    ),
    (
        "create deployment",
        "post",
        lambda w: "/api/deployments/",
        lambda w: {"name": "dep-new", "model": w.model.pk},
        "operator",
        201,
    ),
    (
        "update deployment",
        "patch",
        lambda w: f"/api/deployments/{w.deployment.pk}/",
        lambda w: {"remote_share_percent": 10},
        "operator",
        200,
    ),
    (
        "delete deployment",
        "delete",
        lambda w: f"/api/deployments/{w.deployment.pk}/",
        None,
        "operator",
        204,
    ),
    (
        "restore",
        "post",
        lambda w: f"/api/deployments/{w.deployment.pk}/restore/",
        lambda w: {"version": 1},
        "operator",
        200,
    ),
    (
        "kill switch",
        "post",
        lambda w: f"/api/deployments/{w.deployment.pk}/kill-switch/",
        lambda w: {"enabled": True},
        "operator",
        200,
    ),
    (
        "retire",
        "post",
        lambda w: f"/api/deployments/{w.deployment.pk}/retire/",
        None,
        "operator",
        200,
    ),
    (
        "create pool",
        "post",
        lambda w: "/api/pools/",
        lambda w: {"deployment": w.deployment.pk, "role": "prefill", "site": _spare_site(w).pk},
        "operator",
        201,
    ),
    (
        "update pool",
        "patch",
        lambda w: f"/api/pools/{w.prefill_pool.pk}/",
        lambda w: {"engine_settings": {"tp": 8}},
        "operator",
        200,
    ),
    ("delete pool", "delete", lambda w: f"/api/pools/{w.prefill_pool.pk}/", None, "operator", 204),
    (
        "create plan",
        "post",
        lambda w: "/api/rollout-plans/",
        lambda w: {"name": "fast", "steps": [{"share_percent": 50}, {"share_percent": 100}]},
        "operator",
        201,
    ),
]


def _expected(role: str, needed: str, success: int) -> int:
    if role == "anonymous":
        return 401
    return success if RANK[role] >= RANK[needed] else 403


@pytest.mark.parametrize("role", list(RANK))
@pytest.mark.parametrize("case", READS + WRITES, ids=lambda c: c[0])
def test_role_matrix(api_as, world, role, case):
    _, method, path, body, needed, success = case
    api = role_client(api_as, role)
    url = path(world)
    data = body(world) if body else None

    response = getattr(api, method)(url, data, format="json")

    assert response.status_code == _expected(role, needed, success), response.content


@pytest.mark.parametrize("role", list(RANK))
def test_plan_update_and_delete_need_operator(api_as, role):
    from console.rollouts.services import rollout_plan_create

    plan = rollout_plan_create(actor=None, name="p")
    api = role_client(api_as, role)

    patched = api.patch(
        f"/api/rollout-plans/{plan.pk}/", {"gate_success_rate_min": 0.98}, format="json"
    )
    detail = api.get(f"/api/rollout-plans/{plan.pk}/")
    deleted = api.delete(f"/api/rollout-plans/{plan.pk}/")

    assert patched.status_code == _expected(role, "operator", 200)
    assert detail.status_code == _expected(role, "viewer", 200)
    assert deleted.status_code == _expected(role, "operator", 204)


@pytest.mark.parametrize("role", ["viewer", "operator", "admin"])
def test_heartbeat_refuses_user_tokens(api_as, world, role):
    response = api_as(role).post(
        "/api/heartbeats/", {"agent_version": "1", "clock": "2026-01-01T00:00:00Z"}, format="json"
    )

    assert response.status_code == 401


def test_node_token_is_refused_by_role_endpoints(client, world):
    token = node_token_issue(actor=None, node=world.decode_node)

    response = client.get("/api/deployments/", HTTP_AUTHORIZATION=f"Bearer {token}")

    assert response.status_code == 401


@pytest.mark.parametrize(
    "path",
    [
        "/api/sites/999999/",
        "/api/nodes/999999/",
        "/api/links/999999/",
        "/api/models/999999/",
        "/api/models/999999/kv-size/",
        "/api/deployments/999999/",
        "/api/deployments/999999/config/",
        "/api/deployments/999999/snapshots/",
        "/api/pools/999999/",
        "/api/rollout-plans/999999/",
        "/api/deployments/abc/",
    ],
)
def test_unknown_id_is_404(api_as, path):
    assert api_as("viewer").get(path).status_code == 404

"""The config contract: document shape, ETag / If-None-Match, ?version=, node-token access,
and new versions when something the document names changes."""

from __future__ import annotations

import pytest

from console.catalog.services import model_update
from console.deployments.models import ConfigSnapshot
from console.inventory.services import link_update, node_token_issue, node_update
from tests.console.factories import NodeFactory

pytestmark = pytest.mark.django_db


def test_config_document_follows_the_contract(api_as, world):
    response = api_as("viewer").get(f"/api/deployments/{world.deployment.pk}/config/")

    assert response.status_code == 200
    body = response.json()
    assert response["ETag"] == f'"{body["version"]}"'
    assert list(body) == [
        "deployment",
        "version",
        "created_at",
        "model",
        "routing",
        "circuit_breaker",
        "kv_transfer",
        "prefill",
        "pools",
        "links",
    ]
    assert body["deployment"] == {"id": world.deployment.pk, "name": "demo", "state": "draft"}
    assert body["version"] == 3  # created, + decode pool, + prefill pool
    assert body["created_at"].endswith("Z")
    assert body["model"] == {
        "name": "qwen3next-tiny",
        "weights_sha256": world.model.weights_sha256,
        "architecture_hash": world.model.architecture_hash,
        "engine_settings": {},
    }
    assert body["routing"] == {
        "remote_prefill_threshold_tokens": 4096,
        "remote_share_percent": 0,
        "kill_switch": False,
        "fallback_to_local_prefill": True,
        "link_utilization_ceiling": 0.7,
    }
    assert body["circuit_breaker"] == {"error_rate_limit": 0.05, "latency_p99_limit_ms": 2500}
    assert body["kv_transfer"] == {
        "chunk_size_mb": 32,
        "compression": "auto",
        "checksum": True,
        "retry": 3,
        "timeout_ms": 4000,
        "mode": "push",
        "extra_allowed_peers": [],
        "allowed_peers": ["pre-1"],
    }
    assert body["prefill"] == {"chunked_prefill_tokens": 2048}
    assert body["pools"] == {
        "decode": {
            "site": "local",
            "nodes": [{"hostname": "dec-1", "agent_address": "10.0.0.5:7070"}],
            "engine_settings": {},
        },
        "prefill": [
            {
                "site": "remote",
                "nodes": [{"hostname": "pre-1", "agent_address": "10.1.0.5:7070"}],
                "engine_settings": {},
            }
        ],
    }
    assert body["links"] == [
        {
            "from_site": "remote",
            "to_site": "local",
            "provisioned_mbit_s": 100000,
            "measured_mbit_s": None,
            "rtt_ms": None,
            "utilization_ceiling": 0.7,
        }
    ]


def test_if_none_match_current_version_is_304_without_body(api_as, world):
    api = api_as("viewer")
    url = f"/api/deployments/{world.deployment.pk}/config/"
    tag = api.get(url)["ETag"]

    same = api.get(url, HTTP_IF_NONE_MATCH=tag)
    weak = api.get(url, HTTP_IF_NONE_MATCH=f"W/{tag}")
    stale = api.get(url, HTTP_IF_NONE_MATCH='"1"')

    assert same.status_code == 304
    assert same.content == b""
    assert same["ETag"] == tag
    assert weak.status_code == 304
    assert stale.status_code == 200


def test_poller_sees_a_new_version_after_a_change(api_as, world):
    viewer, operator = api_as("viewer"), api_as("operator")
    url = f"/api/deployments/{world.deployment.pk}/config/"
    tag = viewer.get(url)["ETag"]

    operator.patch(
        f"/api/deployments/{world.deployment.pk}/", {"remote_share_percent": 10}, format="json"
    )
    polled = viewer.get(url, HTTP_IF_NONE_MATCH=tag)

    assert polled.status_code == 200
    assert polled.json()["version"] == 4
    assert polled.json()["routing"]["remote_share_percent"] == 10


def test_old_version_by_query_and_unknown_version(api_as, world):
    api = api_as("viewer")
    url = f"/api/deployments/{world.deployment.pk}/config/"

    first = api.get(url, {"version": 1})

    assert first.status_code == 200
    assert first["ETag"] == '"1"'
    assert first.json()["version"] == 1
    assert first.json()["pools"] == {"decode": None, "prefill": []}
    assert api.get(url, {"version": 99}).status_code == 404
    bad = api.get(url, {"version": "latest"})
    assert bad.status_code == 400
    assert "version" in bad.json()


def test_node_of_the_deployment_reads_config_with_its_token(client, world):
    token = node_token_issue(actor=None, node=world.prefill_node)
    url = f"/api/deployments/{world.deployment.pk}/config/"

    response = client.get(url, HTTP_AUTHORIZATION=f"Bearer {token}")
    not_modified = client.get(
        url, HTTP_AUTHORIZATION=f"Bearer {token}", HTTP_IF_NONE_MATCH=response["ETag"]
    )

    assert response.status_code == 200
    assert response.json()["deployment"]["name"] == "demo"
    assert not_modified.status_code == 304


def test_node_outside_the_deployment_is_403_and_bad_token_401(client, world):
    stranger = NodeFactory(site=world.local, hostname="other")
    token = node_token_issue(actor=None, node=stranger)
    url = f"/api/deployments/{world.deployment.pk}/config/"

    assert client.get(url, HTTP_AUTHORIZATION=f"Bearer {token}").status_code == 403
    assert client.get(url, HTTP_AUTHORIZATION="Bearer pdbn_wrong").status_code == 401
    assert client.get(url).status_code == 401


def test_node_token_cannot_write(client, world):
    token = node_token_issue(actor=None, node=world.prefill_node)

    response = client.post(
        f"/api/deployments/{world.deployment.pk}/kill-switch/",
        {"enabled": True},
        content_type="application/json",
        HTTP_AUTHORIZATION=f"Bearer {token}",
    )

    assert response.status_code == 401


def test_inventory_and_model_changes_make_new_versions(world):
    start = world.deployment.version

    node_update(actor=None, node=world.prefill_node, agent_address="10.1.0.9:7070")
    link_update(actor=None, link=world.link, measured_mbit_s=81_000.0, rtt_ms=31.5)
    model_update(actor=None, model=world.model, weights_sha256="cd" * 32)
    node_update(actor=None, node=world.prefill_node, accelerator_count=4)  # not in the config

    snapshots = ConfigSnapshot.objects.filter(
        deployment=world.deployment, version__gt=start
    ).order_by("version")
    assert [s.version for s in snapshots] == [start + 1, start + 2, start + 3]
    assert set(snapshots[0].diff) == {"pools.prefill"}
    assert set(snapshots[1].diff) == {"links"}
    assert snapshots[2].diff == {"model.weights_sha256": {"from": "ab" * 32, "to": "cd" * 32}}
    assert snapshots[2].config["model"]["weights_sha256"] == "cd" * 32


def test_snapshot_history_is_paginated_newest_first_with_diffs(api_as, world):
    api = api_as("operator")
    for share in (1, 10, 50):
        api.patch(
            f"/api/deployments/{world.deployment.pk}/",
            {"remote_share_percent": share},
            format="json",
        )

    page = api.get(f"/api/deployments/{world.deployment.pk}/snapshots/", {"page_size": 2}).json()

    assert page["count"] == 6
    assert [s["version"] for s in page["results"]] == [6, 5]
    assert page["results"][0]["diff"] == {"routing.remote_share_percent": {"from": 10, "to": 50}}
    assert page["results"][0]["reason"] == "updated"
    assert page["results"][0]["author_label"].startswith("operator")
    assert page["next"] is not None


def test_a_poll_that_finds_nothing_new_costs_a_few_queries(
    client, world, django_assert_max_num_queries
):
    token = node_token_issue(actor=None, node=world.prefill_node)
    url = f"/api/deployments/{world.deployment.pk}/config/"
    tag = client.get(url, HTTP_AUTHORIZATION=f"Bearer {token}")["ETag"]

    # node credential, node-in-pool check, deployment row
    with django_assert_max_num_queries(3):
        response = client.get(url, HTTP_AUTHORIZATION=f"Bearer {token}", HTTP_IF_NONE_MATCH=tag)

    assert response.status_code == 304


def test_lists_do_not_grow_queries_with_rows(api_as, world, django_assert_max_num_queries):
    from tests.console.factories import make_deployment

    api = api_as("viewer")
    for n in range(5):
        make_deployment(name=f"extra-{n}", model=world.model)
    api.get("/api/deployments/")  # warm the role cache of this client's user

    with django_assert_max_num_queries(10):
        deployments = api.get("/api/deployments/")
    with django_assert_max_num_queries(8):
        nodes = api.get("/api/nodes/")

    assert deployments.json()["count"] == 6
    assert nodes.json()["count"] == 2

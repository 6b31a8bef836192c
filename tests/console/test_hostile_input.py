"""Never a 500: odd values in paths, query strings, headers and bodies get 4xx answers."""

from __future__ import annotations

import pytest

from console.inventory.services import node_token_issue

pytestmark = pytest.mark.django_db

HUGE = "9" * 30


@pytest.mark.parametrize(
    ("method", "path", "body", "headers"),
    [
        ("get", "/api/deployments/{d}/config/?version=" + HUGE, None, {}),
        ("get", "/api/deployments/" + HUGE + "/", None, {}),
        ("get", "/api/nodes/?site=" + HUGE, None, {}),
        ("get", "/api/nodes/?site=abc", None, {}),
        ("get", "/api/pools/?node=abc", None, {}),
        ("get", "/api/deployments/{d}/snapshots/?version_min=abc", None, {}),
        ("get", "/api/models/{m}/kv-size/?tokens=" + HUGE, None, {}),
        ("patch", "/api/deployments/{d}/", [], {}),
        ("patch", "/api/deployments/{d}/", {"remote_share_percent": HUGE}, {}),
        ("patch", "/api/deployments/{d}/", {"retry": 1}, {"HTTP_IF_MATCH": '"' + HUGE + '"'}),
        ("patch", "/api/deployments/{d}/", {"version": {"a": 1}}, {}),
        ("post", "/api/deployments/{d}/restore/", {"version": HUGE}, {}),
        ("post", "/api/deployments/{d}/restore/", {"version": "abc"}, {}),
        ("post", "/api/deployments/{d}/kill-switch/", "just a string", {}),
        (
            "post",
            "/api/models/",
            {
                "name": "x",
                "architecture": {"layers": [{"kind": "full", "count": HUGE}]},
                "parameter_count": 1,
                "weights_sha256": "",
            },
            {},
        ),
        (
            "post",
            "/api/models/",
            {
                "name": "x",
                "architecture": {"layers": [{"kind": "full", "kv_heads": 1.5, "head_dim": 1}]},
                "parameter_count": 1,
            },
            {},
        ),
        (
            "post",
            "/api/pools/",
            {"deployment": "{d}", "role": "prefill", "site": "x", "nodes": "abc"},
            {},
        ),
        ("post", "/api/rollout-plans/", {"name": "p", "steps": [{"share_percent": HUGE}]}, {}),
        (
            "post",
            "/api/links/",
            {"from_site": None, "to_site": None, "provisioned_mbit_s": HUGE},
            {},
        ),
        ("post", "/api/sites/", {"name": "s" * 500, "gpu_hour_price": "1e30"}, {}),
    ],
)
def test_hostile_input_is_a_4xx(api_as, world, method, path, body, headers):
    api = api_as("admin")
    ids = {"d": world.deployment.pk, "m": world.model.pk}
    url = path.format(**ids)
    if isinstance(body, dict):
        body = {
            k: (v.format(**ids) if isinstance(v, str) and "{" in v else v) for k, v in body.items()
        }

    response = getattr(api, method)(url, body, format="json", **headers)

    assert 400 <= response.status_code < 500, response.content


def test_an_unknown_etag_is_simply_ignored(api_as, world):
    api = api_as("viewer")

    polled = api.get(
        f"/api/deployments/{world.deployment.pk}/config/", HTTP_IF_NONE_MATCH='"' + HUGE + '"'
    )

    assert polled.status_code == 200


def test_an_unknown_ordering_is_a_400_naming_it(api_as, world):
    api = api_as("viewer")

    ordered = api.get("/api/deployments/?ordering=nonexistent")

    assert ordered.status_code == 400
    assert ordered.json() == {
        "ordering": ["Cannot order by 'nonexistent'; one of: id, name, updated_at."]
    }


@pytest.mark.parametrize(
    "body",
    [
        {
            "agent_version": "1",
            "clock": "2026-11-29T17:40:00Z",
            "children": [{"name": "x", "kind": "k", "state": "s", "pid": int(HUGE)}],
        },
        {"agent_version": "1", "clock": "9999-12-31T23:59:59Z"},
        {"agent_version": "1", "clock": "2026-11-29T17:40:00+25:00"},
        {"agent_version": "x" * 1000, "clock": "2026-11-29T17:40:00Z"},
        {
            "agent_version": "1",
            "clock": "2026-11-29T17:40:00Z",
            "faults": [{"id": "f", "kind": "k", "expires_at": "soon"}],
        },
    ],
)
def test_hostile_heartbeat_is_not_a_500(client, world, body):
    token = node_token_issue(actor=None, node=world.decode_node)

    response = client.post(
        "/api/heartbeats/",
        body,
        content_type="application/json",
        HTTP_AUTHORIZATION=f"Bearer {token}",
    )

    assert response.status_code in {200, 400}, response.content

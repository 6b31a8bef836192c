"""Readiness items fed by agents' heartbeats: weights hashes on every node of both pools, and
TLS state (mTLS on, certificate expiry, allowlist), through the real heartbeat service and
Postgres."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
from django.utils import timezone

from console.deployments.readiness import readiness
from console.deployments.services import deployment_update
from console.inventory.services import node_heartbeat

pytestmark = pytest.mark.django_db

GOOD = "ab" * 32
OTHER = "ef" * 32
ENGINE = {"decode": "decode-engine", "prefill": "prefill-engine"}


def _beat(world: Any, node: Any, role: str, **reports: Any) -> None:
    node_heartbeat(
        node=node,
        agent_version="t",
        clock=timezone.now(),
        capacity={},
        children=[
            {
                "name": f"dep{world.deployment.pk}-{role}",
                "kind": ENGINE[role],
                "state": "running",
                "healthy": True,
                "deployment_id": world.deployment.pk,
            }
        ],
        faults=[],
        config_versions={},
        **reports,
    )


def _served(world: Any, role: str, sha: str | None, state: str = "ok") -> list[dict[str, Any]]:
    return [
        {
            "model": "tiny",
            "child": f"dep{world.deployment.pk}-{role}",
            "path": f"/models/{role}/model.safetensors",
            "state": state,
            "sha256": sha,
            "detail": "",
        }
    ]


def _tls(days: float, **extra: Any) -> dict[str, Any]:
    return {
        "mtls": True,
        "not_after": timezone.now() + timedelta(days=days),
        "allowlist_size": 1,
        "error": "",
        **extra,
    }


def _item(world: Any, key: str) -> Any:
    pools = list(world.deployment.pools.select_related("site").prefetch_related("nodes"))
    return {i.key: i for i in readiness(world.deployment, pools)}[key]


def test_weights_pass_when_every_node_of_both_pools_serves_the_catalog_hash(world):
    _beat(world, world.decode_node, "decode", weights=_served(world, "decode", GOOD))
    _beat(world, world.prefill_node, "prefill", weights=_served(world, "prefill", GOOD))

    item = _item(world, "weights")

    assert item.state == "pass"
    assert item.detail == f"2 nodes at local, remote hold weights {GOOD[:12]}…"


def test_weights_mismatch_fails_naming_the_node_and_both_hashes(world):
    _beat(world, world.decode_node, "decode", weights=_served(world, "decode", GOOD))
    _beat(world, world.prefill_node, "prefill", weights=_served(world, "prefill", OTHER))

    item = _item(world, "weights")

    assert item.state == "fail"
    assert item.detail == (
        f"pre-1@remote has {OTHER} at /models/prefill/model.safetensors, the catalog says {GOOD}"
    )


def test_weights_unknown_only_while_a_node_has_not_reported(world):
    _beat(world, world.decode_node, "decode", weights=_served(world, "decode", GOOD))
    _beat(world, world.prefill_node, "prefill")  # an agent that does not report weights

    item = _item(world, "weights")
    assert item.state == "unknown"
    assert item.detail == "pre-1@remote has not reported its weights yet"

    _beat(world, world.prefill_node, "prefill", weights=_served(world, "prefill", None, "hashing"))
    item = _item(world, "weights")
    assert item.state == "unknown"
    assert item.detail == "pre-1@remote is still hashing /models/prefill/model.safetensors"


def test_weights_fail_for_a_node_without_the_model_or_with_unreadable_weights(world):
    _beat(world, world.decode_node, "decode", weights=[])
    broken = _served(world, "prefill", None, "error")
    broken[0]["detail"] = "model: /models/prefill holds no weights file"
    _beat(world, world.prefill_node, "prefill", weights=broken)

    item = _item(world, "weights")

    assert item.state == "fail"
    assert item.detail == (
        f"dec-1@local reports no weights of {world.model.name}; "
        "pre-1@remote: model: /models/prefill holds no weights file"
    )


def test_weights_held_under_the_catalog_name_count_when_no_engine_runs_yet(world):
    held = [{"model": world.model.name, "child": None, "path": "/m", "state": "ok", "sha256": GOOD}]
    for node in (world.decode_node, world.prefill_node):
        node_heartbeat(
            node=node,
            agent_version="t",
            clock=timezone.now(),
            capacity={},
            children=[],
            faults=[],
            config_versions={},
            weights=held,
        )

    assert _item(world, "weights").state == "pass"


def test_a_held_checkpoint_stands_in_for_an_engine_whose_model_is_not_local(world):
    for node, role in ((world.decode_node, "decode"), (world.prefill_node, "prefill")):
        hub = _served(world, role, None, "error")
        hub[0]["detail"] = "model: 'Org/Model' is neither a path on this node nor generated"
        held = {"model": world.model.name, "child": None, "path": "/m", "state": "ok"}
        _beat(world, node, role, weights=[*hub, {**held, "sha256": GOOD}])

    assert _item(world, "weights").state == "pass"

    _beat(world, world.prefill_node, "prefill", weights=_served(world, "prefill", None, "error"))
    assert _item(world, "weights").state == "fail"  # and without one, the engine's error


def test_weights_fail_when_the_catalog_has_no_hash(world):
    world.model.weights_sha256 = ""
    world.model.save()

    item = _item(world, "weights")

    assert (item.state, item.detail) == ("fail", "the model has no registered weights sha256")


def test_certificates_pass_with_mtls_everywhere_and_no_early_expiry(world):
    _beat(world, world.decode_node, "decode", tls=_tls(90))
    _beat(world, world.prefill_node, "prefill", tls=_tls(30))

    item = _item(world, "certificates")

    expiry = (timezone.now() + timedelta(days=30)).strftime("%Y-%m-%d")
    assert item.state == "pass"
    assert (
        item.detail == f"mTLS on for all 2 agents; first certificate expiry {expiry} (pre-1@remote)"
    )


def test_certificates_fail_on_expiry_within_14_days_mtls_off_or_empty_allowlist(world):
    _beat(world, world.decode_node, "decode", tls=_tls(5.5))
    _beat(world, world.prefill_node, "prefill", tls={"mtls": False, "allowlist_size": 0})

    item = _item(world, "certificates")

    expiry = (timezone.now() + timedelta(days=5.5)).strftime("%Y-%m-%d")
    assert item.state == "fail"
    assert item.detail == (
        f"the certificate of dec-1@local expires on {expiry}, in 5 days (under 14); "
        "mTLS off on pre-1@remote"
    )

    _beat(world, world.decode_node, "decode", tls=_tls(90, allowlist_size=0))
    _beat(world, world.prefill_node, "prefill", tls=_tls(-1))
    detail = _item(world, "certificates").detail
    assert "dec-1@local has an empty allowlist (its control API refuses everyone)" in detail
    assert "the certificate of pre-1@remote expired on" in detail


def test_certificates_fail_when_a_prefill_node_certificate_does_not_carry_its_hostname(world):
    _beat(world, world.decode_node, "decode", tls=_tls(90, subject="dec-1", sans=["dec-1"]))
    _beat(world, world.prefill_node, "prefill", tls=_tls(90, subject="gpu-7", sans=["10.1.0.5"]))

    item = _item(world, "certificates")

    assert item.state == "fail"
    assert item.detail == (
        "the certificate of pre-1@remote has the common name gpu-7 (names gpu-7, 10.1.0.5), not "
        "its hostname pre-1: the KV receivers match the common name only and would refuse it "
        "(reissue it for the hostname, or add its common name to extra_allowed_peers)"
    )
    deployment_update(actor=None, deployment=world.deployment, extra_allowed_peers=["gpu-7"])
    world.deployment.refresh_from_db()
    assert _item(world, "certificates").state == "pass"


def test_certificates_fail_when_the_hostname_is_only_a_san_of_a_prefill_node_certificate(world):
    """The KV receivers match a certificate's common name only: a certificate issued for
    another node (gpu-7) that also carries pre-1 as a SAN is not pre-1's."""
    _beat(world, world.decode_node, "decode", tls=_tls(90, subject="dec-1", sans=["dec-1"]))
    _beat(world, world.prefill_node, "prefill", tls=_tls(90, subject="gpu-7", sans=["pre-1"]))

    item = _item(world, "certificates")

    assert item.state == "fail"
    assert "has the common name gpu-7 (names gpu-7, pre-1), not its hostname pre-1" in item.detail
    deployment_update(actor=None, deployment=world.deployment, extra_allowed_peers=["pre-1"])
    world.deployment.refresh_from_db()
    assert _item(world, "certificates").state == "fail"  # a SAN on the list still is not it


def test_certificates_unknown_until_every_agent_reported(world):
    _beat(world, world.decode_node, "decode", tls=_tls(90))

    item = _item(world, "certificates")

    assert item.state == "unknown"
    assert item.detail == "1 of 2 agents have not reported TLS state yet: pre-1@remote"

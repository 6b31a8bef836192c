"""A real agent against the real console (live server, Postgres): heartbeats mark the node
online, Launch fetches a real config snapshot with the node token, a stopped agent's node
turns lost after the configured number of missed beats, and the weights hashes and TLS state
agents report drive the readiness checklist and the Security page."""

from __future__ import annotations

import hashlib
import json
import os
import urllib.request
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding
from django.test import Client

from agents.proto.api import pb
from console.deployments.readiness import readiness
from console.inventory.models import Node
from console.inventory.services import node_mark_missing, node_token_issue
from grpc_kv.certs import create_ca, create_node_cert
from tests.agents.conftest import AgentProc, agent_config, stub
from tests.agents.pki import Pki
from tests.agents.test_grpc_api import T
from tests.agents.test_grpc_api import settings as struct
from tests.console.conftest import World, world  # noqa: F401  (the console's test world)
from tests.support import wait_for

#: How long a test waits for an event (a beat, a hash, a status): generous, so that a loaded
#: machine (agents start slowly, hashing a checkpoint takes longer) is not a failure; a
#: passing run returns as soon as the event is seen.
EVENT_S = 120

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.slow]


def _status(node: Any) -> str:
    status: str = Node.objects.get(pk=node.pk).status
    return status


def test_agent_heartbeats_online_then_lost_after_missed_beats(
    live_server: Any,
    world: World,  # noqa: F811
    agent_factory: Callable[..., AgentProc],
    tmp_path: Path,
    settings: Any,
) -> None:
    settings.HEARTBEAT_INTERVAL_S = 1
    settings.HEARTBEAT_MISSED_LIMIT = 2
    node = world.decode_node
    token = node_token_issue(actor=None, node=node)
    config = agent_config(
        tmp_path,
        None,
        console={"url": live_server.url, "token": token, "heartbeat_interval_s": 0.5},
    )
    agent = agent_factory(config)
    wait_for(lambda: _status(node) == "online", EVENT_S)

    version = world.deployment.version
    request = pb.LaunchRequest(
        request_id=os.urandom(8).hex(),
        name="dec",
        kind="decode-engine",
        engine="plain",
        config_version=version,
        deployment_id=world.deployment.pk,
    )
    child = stub(agent, None).Launch(request, timeout=T).child
    assert child.config_version == version
    snapshot = (
        Path(config["state_dir"])
        / "snapshots"
        / f"deployment-{world.deployment.pk}-v{version}.json"
    )
    assert f'"version": {version}' in snapshot.read_text()

    def reported() -> Any:
        fresh = Node.objects.get(pk=node.pk)
        return fresh if fresh.reported_children else None

    fresh = wait_for(reported, EVENT_S)
    assert fresh.reported_children[0]["name"] == "dec"
    assert fresh.reported_children[0]["healthy"] is True
    assert fresh.reported_config_versions == {str(world.deployment.pk): version}
    assert fresh.agent_version == "0.1.0"

    missing = request.__class__(
        **{**_fields(request), "request_id": os.urandom(8).hex(), "config_version": version + 50}
    )
    with pytest.raises(grpc.RpcError) as err:
        stub(agent, None).Launch(missing, timeout=T)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert (
        err.value.details()
        == f"config_version: deployment {world.deployment.pk} has no config version {version + 50}"
    )

    gateway = pb.LaunchRequest(
        request_id=os.urandom(8).hex(),
        name="gw",
        kind="gateway",
        deployment_id=world.deployment.pk,
        settings=struct(host="127.0.0.1"),
    )
    gw = stub(agent, None).Launch(gateway, timeout=T).child  # healthy = it loaded the config
    assert gw.state == "running"
    with urllib.request.urlopen(gw.health_url, timeout=10) as resp:  # noqa: S310
        assert json.loads(resp.read())["config_version"] == version

    assert agent.terminate() == 0
    node_mark_missing()
    assert _status(node) == "online"  # not late yet
    # Two missed 1 s beats plus the console's half-interval grace.
    wait_for(lambda: node_mark_missing() and _status(node) == "lost", EVENT_S, interval=0.5)
    last_beat = Node.objects.get(pk=node.pk).last_heartbeat_at
    assert (datetime.now(UTC) - last_beat).total_seconds() >= 2  # two missed 1 s beats


def _fields(message: Any) -> dict[str, Any]:
    return {f.name: getattr(message, f.name) for f in message.DESCRIPTOR.fields}


def _weights_of(node: Any) -> list[dict[str, Any]]:
    return Node.objects.get(pk=node.pk).reported_weights or []


def _readiness_item(world: World, key: str) -> Any:  # noqa: F811
    pools = list(world.deployment.pools.select_related("site").prefetch_related("nodes"))
    return {i.key: i for i in readiness(world.deployment, pools)}[key]


def test_agents_report_weights_and_tls_that_readiness_and_the_security_page_use(
    live_server: Any,
    world: World,  # noqa: F811
    agent_factory: Callable[..., AgentProc],
    tmp_path: Path,
    make_user: Callable[..., Any],
) -> None:
    # Given two agents with mTLS, one certificate expiring in 5 days, each holding the model's
    # checkpoint, the prefill node's copy differing in one byte.
    ca = create_ca(tmp_path / "ca")
    certs = {
        "dec-1": create_node_cert(ca, tmp_path / "nodes", "dec-1", days=5),
        "pre-1": create_node_cert(ca, tmp_path / "nodes", "pre-1"),
    }
    good = os.urandom(3 * 1024 * 1024 + 17)
    bad = good[:-1] + bytes([good[-1] ^ 1])
    checkpoints = {"dec-1": tmp_path / "ckpt-dec", "pre-1": tmp_path / "ckpt-pre"}
    for name, data in (("dec-1", good), ("pre-1", bad)):
        checkpoints[name].mkdir()
        (checkpoints[name] / "model.safetensors").write_bytes(data)
    world.model.weights_sha256 = hashlib.sha256(good).hexdigest()
    world.model.save()
    for node in (world.decode_node, world.prefill_node):
        files = certs[node.hostname]
        pki = Pki(ca=ca.ca_file, agent_cert=files.cert_file, agent_key=files.key_file, clients={})
        config = agent_config(
            tmp_path / node.hostname,
            pki,
            node={"name": node.hostname, "site": node.site.name},
            console={
                "url": live_server.url,
                "token": node_token_issue(actor=None, node=node),
                "heartbeat_interval_s": 0.3,
            },
            models={world.model.name: str(checkpoints[node.hostname])},
        )
        agent_factory(config, subdir=node.hostname)

    # When they have beaten with their hashes computed,
    wait_for(
        lambda: all(
            [w["state"] for w in _weights_of(n)] == ["ok"]
            for n in (world.decode_node, world.prefill_node)
        ),
        EVENT_S,
    )

    # then both reports are what the files say,
    fresh = Node.objects.get(pk=world.decode_node.pk)
    assert fresh.reported_weights == [
        {
            "model": world.model.name,
            "child": None,
            "path": str(checkpoints["dec-1"]),
            "state": "ok",
            "sha256": hashlib.sha256(good).hexdigest(),
            "detail": "",
        }
    ]
    tls = fresh.reported_tls
    assert (tls["mtls"], tls["subject"], tls["allowlist_size"], tls["error"]) == (
        True,
        "dec-1",
        1,
        "",
    )
    assert tls["sans"] == ["dec-1"]  # its own name only: no loopback names
    assert (
        tls["ca_fingerprint"]
        == hashlib.sha256(
            x509.load_pem_x509_certificate(ca.ca_file.read_bytes()).public_bytes(Encoding.DER)
        ).hexdigest()
    )
    not_after = datetime.fromisoformat(tls["not_after"].replace("Z", "+00:00"))
    assert 4.9 < (not_after - datetime.now(UTC)).total_seconds() / 86400 <= 5

    # readiness names the node whose weights differ, with both hashes, and the expiring cert,
    weights = _readiness_item(world, "weights")
    assert weights.state == "fail"
    assert weights.detail == (
        f"pre-1@remote has {hashlib.sha256(bad).hexdigest()} at {checkpoints['pre-1']}, "
        f"the catalog says {hashlib.sha256(good).hexdigest()}"
    )
    certificates = _readiness_item(world, "certificates")
    assert certificates.state == "fail"
    assert certificates.detail.startswith("the certificate of dec-1@local expires on ")
    assert certificates.detail.endswith(", in 4 days (under 14)")

    # and the Security page shows the expiry dates with the warning on the expiring one.
    client = Client()
    client.force_login(make_user("viewer"))
    html = client.get("/security/").content.decode()
    assert f'{not_after:%Y-%m-%d} <span class="badge warn">expires in 4 days</span>' in html
    assert '<span class="badge good">396 days</span>' in html

    # When the prefill copy is fixed in place, the agent hashes it again (mtime changed)
    (checkpoints["pre-1"] / "model.safetensors").write_bytes(good)
    wait_for(lambda: _readiness_item(world, "weights").state == "pass", EVENT_S)
    assert _weights_of(world.prefill_node)[0]["sha256"] == hashlib.sha256(good).hexdigest()

"""A real agent against the real console (live server, Postgres): heartbeats mark the node
online, Launch fetches a real config snapshot with the node token, and a stopped agent's node
turns lost after the configured number of missed beats."""

from __future__ import annotations

import json
import os
import urllib.request
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import grpc
import pytest

from agents.proto.api import pb
from console.inventory.models import Node
from console.inventory.services import node_mark_missing, node_token_issue
from tests.agents.conftest import AgentProc, agent_config, stub, wait_for
from tests.agents.test_grpc_api import T
from tests.agents.test_grpc_api import settings as struct
from tests.console.conftest import World, world  # noqa: F401  (the console's test world)

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
    wait_for(lambda: _status(node) == "online", 15)

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

    fresh = wait_for(reported, 10)
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
    wait_for(lambda: node_mark_missing() and _status(node) == "lost", 10, interval=0.5)
    last_beat = Node.objects.get(pk=node.pk).last_heartbeat_at
    assert (datetime.now(UTC) - last_beat).total_seconds() >= 2  # two missed 1 s beats


def _fields(message: Any) -> dict[str, Any]:
    return {f.name: getattr(message, f.name) for f in message.DESCRIPTOR.fields}

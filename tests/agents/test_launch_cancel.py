"""A Launch whose caller goes away mid-start (the orchestrator's worker killed, its deadline
passed) leaves no untracked process: the child it started is stopped, and the caller's retry
with the same request runs exactly one child on the pinned port (what the deployment
workflow's resumed step relies on)."""

from __future__ import annotations

import json
import os
import time

from google.protobuf.struct_pb2 import Struct

from agents.proto.api import pb
from tests.agents.conftest import HEALTHSERVER, agent_config, free_port, pid_alive, stub, wait_for


def test_cancelled_launch_leaves_no_orphan_and_the_retry_runs_one_child(
    agent_factory, pki, tmp_path
):
    config = agent_config(tmp_path, pki)
    config["engines"]["slow"] = {"argv": [*HEALTHSERVER, "--start-delay", "{settings.delay}"]}
    agent = agent_factory(config)
    api = stub(agent, pki)
    settings = Struct()
    settings.update({"delay": 2.0, "port": free_port()})
    request = pb.LaunchRequest(
        request_id=os.urandom(8).hex(),
        name="slow-1",
        kind="prefill-engine",
        engine="slow",
        settings=settings,
    )

    call = api.Launch.future(request, timeout=30)
    time.sleep(0.7)  # the child is starting
    call.cancel()  # what the agent sees when the caller's process dies
    time.sleep(2.5)  # the abandoned child is stopped (grace 2 s) and frees its port
    retried = api.Launch(request, timeout=30)

    assert call.cancelled()
    assert retried.child.state == "running"
    status = api.Status(pb.StatusRequest(), timeout=10)
    assert [(c.name, c.pid, c.restarts) for c in status.children] == [
        ("slow-1", retried.child.pid, 0)
    ]
    events = [
        json.loads(line) for line in agent.log_path.read_text().splitlines() if line.startswith("{")
    ]
    spawned = [e["pid"] for e in events if e["event"] == "agent.child_spawned"]
    assert len(spawned) == 2
    wait_for(lambda: not pid_alive(spawned[0]), 10)
    assert pid_alive(spawned[1])

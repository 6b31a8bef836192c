"""A Launch whose caller goes away mid-start (its deadline passes, or the orchestrator's
worker is killed) must not orphan the child it started: a retry with the same request finds
it ``unchanged`` — one process on the pinned port, not two."""

from __future__ import annotations

import os
import time

from google.protobuf.struct_pb2 import Struct

from agents.proto.api import pb
from tests.agents.conftest import HEALTHSERVER, agent_config, free_port, stub


def test_cancelled_launch_keeps_its_child_and_the_retry_reuses_it(agent_factory, pki, tmp_path):
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
    call.cancel()  # what the server sees when the caller's process dies
    retried = api.Launch(request, timeout=30)

    assert call.cancelled()
    assert retried.child.state == "running"
    status = api.Status(pb.StatusRequest(), timeout=10)
    assert [c.name for c in status.children] == ["slow-1"]
    child = status.children[0]
    assert (child.restarts, child.pid) == (0, retried.child.pid)
    time.sleep(2.5)  # an orphan (the bug) would have started and tried its port by now
    spawns = agent.log_path.read_text().count('"agent.child_spawned", "child": "slow-1"')
    assert spawns == 1

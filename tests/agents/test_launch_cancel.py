"""A Launch whose caller goes away mid-start (the orchestrator's worker killed, its deadline
passed) goes on to its end; the caller's retry with the same request id -- while the launch is
still in progress, or after it finished -- gets that launch's outcome, and the engine is
started exactly once (what the deployment workflow's resumed step relies on). The agent's own
shutdown cancels a launch in progress and leaves no process behind."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.protobuf.struct_pb2 import Struct

from agents.proto.api import pb
from tests.agents.conftest import (
    HEALTHSERVER,
    agent_config,
    command_pids,
    free_port,
    pid_alive,
    stub,
)
from tests.support import wait_for


def _slow_request(delay: float) -> Any:
    settings = Struct()
    settings.update({"delay": delay, "port": free_port()})
    return pb.LaunchRequest(
        request_id=os.urandom(8).hex(),
        name="slow-1",
        kind="prefill-engine",
        engine="slow",
        settings=settings,
    )


def _events(log_path: Path, event: str) -> list[dict[str, Any]]:
    lines = log_path.read_text().splitlines()
    return [e for e in (json.loads(x) for x in lines if x.startswith("{")) if e["event"] == event]


@pytest.fixture
def slow_agent(agent_factory, pki, tmp_path):
    config = agent_config(tmp_path, pki)
    config["engines"]["slow"] = {"argv": [*HEALTHSERVER, "--start-delay", "{settings.delay}"]}
    return agent_factory(config)


def test_launch_whose_caller_goes_away_goes_on_and_the_retry_in_flight_gets_its_child(
    slow_agent, pki
):
    api = stub(slow_agent, pki)
    request = _slow_request(delay=3.0)

    call = api.Launch.future(request, timeout=30)
    wait_for(lambda: _events(slow_agent.log_path, "agent.child_spawned"), 10)
    call.cancel()  # what the agent sees when the caller's process dies
    retried = api.Launch(request, timeout=30)  # the resumed caller: the launch is in flight

    assert call.cancelled()
    assert (retried.action, retried.child.state) == ("started", "running")
    status = api.Status(pb.StatusRequest(), timeout=10)
    assert [(c.name, c.pid, c.restarts) for c in status.children] == [
        ("slow-1", retried.child.pid, 0)
    ]
    spawned = [e["pid"] for e in _events(slow_agent.log_path, "agent.child_spawned")]
    assert spawned == [retried.child.pid]
    [repeated] = _events(slow_agent.log_path, "agent.request_repeated")
    assert (repeated["method"], repeated["request_id"]) == ("Launch", request.request_id)
    assert repeated["in_flight"] is True


def test_launch_past_its_deadline_goes_on_and_a_later_retry_gets_its_outcome(slow_agent, pki):
    api = stub(slow_agent, pki)
    request = _slow_request(delay=2.0)

    with pytest.raises(grpc.RpcError) as err:
        api.Launch(request, timeout=0.8)
    running = wait_for(
        lambda: [c for c in api.Status(pb.StatusRequest(), timeout=10).children if c.pid], 20
    )
    retried = api.Launch(request, timeout=30)

    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert (retried.action, retried.child.pid) == ("started", running[0].pid)
    spawned = [e["pid"] for e in _events(slow_agent.log_path, "agent.child_spawned")]
    assert spawned == [running[0].pid]
    [repeated] = _events(slow_agent.log_path, "agent.request_repeated")
    assert repeated["in_flight"] is False


def test_second_launch_of_the_same_spec_while_the_first_starts_waits_and_is_unchanged(
    slow_agent, pki
):
    api = stub(slow_agent, pki)
    first_request = _slow_request(delay=2.0)
    second_request = pb.LaunchRequest()
    second_request.CopyFrom(first_request)
    second_request.request_id = os.urandom(8).hex()  # another caller, same child and spec

    first = api.Launch.future(first_request, timeout=30)
    wait_for(lambda: _events(slow_agent.log_path, "agent.child_spawned"), 10)
    second = api.Launch(second_request, timeout=30)

    assert (first.result().action, second.action) == ("started", "unchanged")
    assert second.child.pid == first.result().child.pid
    spawned = [e["pid"] for e in _events(slow_agent.log_path, "agent.child_spawned")]
    assert spawned == [second.child.pid]


def test_agent_shutdown_cancels_a_launch_in_progress_and_leaves_no_process(slow_agent, pki):
    api = stub(slow_agent, pki)
    call = api.Launch.future(_slow_request(delay=60.0), timeout=90)
    [spawned] = wait_for(lambda: _events(slow_agent.log_path, "agent.child_spawned"), 10)
    engine_pids = wait_for(lambda: command_pids(spawned["pid"]), 10)

    code = slow_agent.terminate()

    assert code == 0
    assert not pid_alive(spawned["pid"])
    assert not any(pid_alive(pid) for pid in engine_pids)
    with pytest.raises(grpc.RpcError):
        call.result(timeout=10)

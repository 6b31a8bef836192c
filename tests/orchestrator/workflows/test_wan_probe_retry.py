"""Step 2's probe retries a transient failure a bounded number of times (#19: ``make run``
gave up at step 2 when the WAN probe's first connection timed out once). A real agent probes
a kv-link address where nothing answers yet, as a peer that is still starting."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from orchestrator import agentops
from orchestrator.workflows import deploy
from orchestrator.workflows.deploy import PROBE_ATTEMPTS, probe_retry
from tests.agents.conftest import agent_config, start_agent
from tests.agents.engines.client import free_port


@pytest.fixture
def agent_target(tmp_path: Path, settings):
    settings.PDBRIDGE_CONTROLLER_INSECURE = True
    agent = start_agent(tmp_path / "agent", agent_config(tmp_path / "agent", None))
    yield agent_target_of(agent.address)
    agent.terminate()


def agent_target_of(address: str) -> agentops.Target:
    return agentops.Target("prefill", "remote", "pre-1", address, {"model": "m"})


def test_a_probe_that_cannot_reach_its_peer_waits_and_retries_then_gives_up(agent_target):
    nowhere = f"127.0.0.1:{free_port()}"
    with pytest.raises(grpc.RpcError) as failed:
        agentops.probe(agent_target, "local", nowhere, 0.2)
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE

    rounds, evidence = [], {}
    while (wait := probe_retry(evidence, failed.value)) is not None:
        rounds.append(wait.seconds)
        evidence = wait.evidence

    assert rounds == [1.0, 2.0, 4.0]  # PROBE_ATTEMPTS rounds in all, with backoff
    assert len(rounds) + 1 == PROBE_ATTEMPTS
    assert evidence["probe_round"] == 3
    assert [e.split(":")[0] for e in evidence["probe_errors"]] == ["UNAVAILABLE"] * 3
    assert "did not answer the probe" in evidence["probe_errors"][0]


def test_an_error_no_retry_can_fix_fails_the_step_at_once(agent_target):
    with pytest.raises(grpc.RpcError) as refused:
        agentops.probe(agent_target, "", "127.0.0.1:1", 0.2)  # no peer_site: a bad request

    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert probe_retry({}, refused.value) is None
    assert deploy.PROBE_TRANSIENT == ("UNAVAILABLE", "DEADLINE_EXCEEDED")

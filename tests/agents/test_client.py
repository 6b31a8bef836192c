"""The async client the orchestrator uses, against a real agent over mTLS."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from agents.client import AgentClient
from grpc_kv.tls import TLSConfig
from tests.agents.conftest import AgentProc, agent_config
from tests.agents.pki import Pki


def test_client_drives_an_agent(
    agent_factory: Callable[..., AgentProc], tmp_path: Path, pki: Pki
) -> None:
    agent = agent_factory(agent_config(tmp_path, pki))
    cert, key = pki.client("orchestrator")
    tls = TLSConfig(ca_file=pki.ca, cert_file=cert, key_file=key, server_name="dec-1")

    async def scenario() -> None:
        async with AgentClient(agent.address, tls) as client:
            launched = await client.launch("decode-engine", "plain", name="d1", request_id="rid-1")
            assert launched.action == "started"
            again = await client.launch("decode-engine", "plain", name="d1", request_id="rid-1")
            assert again == launched  # a retry with the same id: the first answer
            status = await client.status()
            assert [c.name for c in status.children] == ["d1"]
            logs = await client.logs("d1")
            assert b"healthserver pid=" in logs.data
            fault = (await client.inject_fault("engine_restart", "d1", duration_s=30)).fault
            cleared = await client.clear_fault(fault.id)
            assert [f.id for f in cleared.cleared] == [fault.id]
            metrics = await client.metrics()
            assert "pdbridge_agent_faults_restored_total 1.0" in metrics.agent
            stopped = await client.stop("d1")
            assert stopped.child.state == "stopped"
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await client.stop("d1")
            assert err.value.code() == grpc.StatusCode.NOT_FOUND

    asyncio.run(scenario())

"""The gateway the agent launches over TLS, with a node certificate as ``pdbridge kv certs``
issues it: the node's names only, no ``localhost``/``127.0.0.1``. The agent reaches the
gateway on loopback, so it checks the gateway's certificate against the certificate's own
name (``LaunchPlan.tls_server_name``): the gateway turns healthy and its metrics are relayed.
A real agent, a real gateway process, and an HTTPS console double serving its config."""

from __future__ import annotations

import asyncio
import os
import ssl
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from cryptography import x509

from agents.proto.api import pb
from grpc_kv.certs import create_ca, create_node_cert
from tests.agents.conftest import AgentProc, agent_config, start_agent, stub
from tests.agents.gateway.console_double import ConsoleDouble
from tests.agents.gateway.snapshots import snapshot
from tests.agents.pki import Pki
from tests.agents.test_grpc_api import T
from tests.agents.test_grpc_api import settings as struct


@pytest.fixture
def https_console(tmp_path: Path) -> Iterator[tuple[ConsoleDouble, Path, Pki]]:
    """A console double over HTTPS (its own certificate, for its address 127.0.0.1) on a loop
    in a thread, and the PKI: CA, the agent ``dec-1`` and the controller ``orchestrator``."""
    ca = create_ca(tmp_path / "ca")
    console_cert = create_node_cert(ca, tmp_path / "console", "console", sans=["127.0.0.1"])
    node = create_node_cert(ca, tmp_path / "nodes", "dec-1")
    controller = create_node_cert(ca, tmp_path / "nodes", "orchestrator")
    server_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_tls.load_cert_chain(console_cert.cert_file, console_cert.key_file)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    console = ConsoleDouble(snapshot(), token="node-token")
    asyncio.run_coroutine_threadsafe(console.start(server_tls), loop).result(30)
    pki = Pki(
        ca=ca.ca_file,
        agent_cert=node.cert_file,
        agent_key=node.key_file,
        clients={"orchestrator": controller},
    )
    yield console, ca.ca_file, pki
    asyncio.run_coroutine_threadsafe(console.stop(), loop).result(30)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


@pytest.fixture
def agent(tmp_path: Path, https_console: tuple[ConsoleDouble, Path, Pki]) -> Iterator[AgentProc]:
    console, ca, pki = https_console
    config = agent_config(
        tmp_path / "agent",
        pki,
        console={"url": console.url, "ca": str(ca), "token": "node-token"},
        supervision={"readiness_timeout_s": 90},
    )
    proc = start_agent(tmp_path / "agent", config)
    yield proc
    proc.terminate()


def test_a_tls_gateway_is_checked_against_the_node_certificates_own_name(
    agent: AgentProc, https_console: tuple[ConsoleDouble, Path, Pki]
) -> None:
    _, _, pki = https_console
    cert = x509.load_pem_x509_certificate(pki.agent_cert.read_bytes())
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert [str(n.value) for n in sans] == ["dec-1"]  # not 127.0.0.1, where the agent dials

    request = pb.LaunchRequest(
        request_id=os.urandom(8).hex(),
        name="gw",
        kind="gateway",
        deployment_id=1,
        settings=struct(host="0.0.0.0"),
    )
    child = stub(agent, pki).Launch(request, timeout=T).child

    assert child.state == "running"
    assert child.healthy
    assert child.health_url.startswith("https://127.0.0.1:")
    relay = f"http://127.0.0.1:{agent.metrics_port}/children/gw/metrics"
    with urllib.request.urlopen(relay, timeout=10) as resp:
        assert resp.status == 200
        assert b"pdbridge_gateway" in resp.read()
    stub(agent, pki).Stop(pb.StopRequest(request_id=os.urandom(8).hex(), name="gw"), timeout=T)

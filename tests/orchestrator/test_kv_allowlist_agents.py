"""The deployment's KV allowlist reaches every KV receiver the orchestrator launches, through a
real agent: a decode node's ``pdbridge agent`` (mTLS) launches the decode engine's KV listener
and the kv-link with the launch settings ``orchestrator.agentops`` computes from the
deployment's config document; then a certificate of the same CA that is not on the allowlist
pushes KV at both and is refused (PERMISSION_DENIED naming it, counted, logged with its
subject), while the prefill node's certificate -- and, on the kv-link, the orchestrator's
step-5 loopback -- get through. All on loopback; the engine is the reference engine."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from django.test import override_settings

from agents.client import AgentClient
from console.deployments.config import build_config
from console.deployments.models import Deployment
from console.deployments.services import pool_create
from console.inventory.models import Node
from grpc_kv.api import (
    LinkOptions,
    PeerRefused,
    TLSConfig,
    TransferRefused,
    loopback,
    open_transfer,
)
from orchestrator import agentops
from tests.agents.conftest import AgentProc, agent_config, free_port, start_agent
from tests.agents.pki import Pki, make_pki
from tests.console.factories import ModelSpecFactory, SiteFactory, make_deployment
from tests.grpc_kv.kvtest import make_header
from tests.support import deadline_in, subprocess_env

pytestmark = [pytest.mark.django_db, pytest.mark.timeout(300)]

MODEL = "qwen3-next"
FAST = LinkOptions(timeout_ms=3000, rpc_timeout_ms=1000)


@dataclass
class Bed:
    pki: Pki
    agent: AgentProc
    models_dir: Path
    controller: dict[str, Any]


@pytest.fixture(scope="module")
def bed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Bed]:
    tmp = tmp_path_factory.mktemp("kv-allowlist")
    pki = make_pki(tmp / "pki")
    models_dir = tmp / "models"
    subprocess.run(
        [sys.executable, "-m", "pdbridge.cli", "engine", "build", MODEL, "--models-dir", str(models_dir)],
        check=True, env=subprocess_env(), capture_output=True, timeout=300,
    )  # fmt: skip
    # The decode node ``dec-1``: its agent, engine listener and kv-link share its certificate.
    config = agent_config(tmp / "agent", pki, supervision={"readiness_timeout_s": 120})
    agent = start_agent(tmp / "agent", config)
    cert, key = pki.client("orchestrator")
    controller = {
        "PDBRIDGE_CONTROLLER_INSECURE": False,
        "PDBRIDGE_CONTROLLER_TLS_CA": str(pki.ca),
        "PDBRIDGE_CONTROLLER_TLS_CERT": str(cert),
        "PDBRIDGE_CONTROLLER_TLS_KEY": str(key),
    }
    try:
        yield Bed(pki, agent, models_dir, controller)
    finally:
        agent.terminate()


def deployment_config(bed: Bed, kv_port: int, kv_link_port: int) -> dict[str, Any]:
    """The config document of a deployment whose decode pool is ``dec-1`` (the agent) and
    whose prefill pool is ``pre-1``; nothing set by the operator (the default allowlist)."""
    local, remote = SiteFactory(role="decode"), SiteFactory(role="prefill")
    dec = Node.objects.create(site=local, hostname="dec-1", agent_address=bed.agent.address)
    pre = Node.objects.create(site=remote, hostname="pre-1", agent_address="127.0.0.1:1")
    dep = make_deployment(model=ModelSpecFactory(name="tiny"), chunked_prefill_tokens=64)
    tls = {"ca": str(bed.pki.ca), "cert": str(bed.pki.agent_cert), "key": str(bed.pki.agent_key)}
    pool_create(
        actor=None, deployment=dep, role="decode", site=local, nodes=[dec],
        engine_settings={
            "model": f"tiny={MODEL}", "models_dir": str(bed.models_dir), "threads": 1,
            "kv_tls": tls, "host": "127.0.0.1", "port": free_port(),
            "kv_listen": f"127.0.0.1:{kv_port}", "kv_link_port": kv_link_port,
        },
    )  # fmt: skip
    pool_create(actor=None, deployment=dep, role="prefill", site=remote, nodes=[pre])
    return build_config(Deployment.objects.get(pk=dep.pk))


def sender_tls(bed: Bed, name: str) -> TLSConfig:
    cert, key = bed.pki.client(name)
    return TLSConfig(ca_file=bed.pki.ca, cert_file=cert, key_file=key, server_name="dec-1")


async def push(address: str, tls: TLSConfig) -> Any:
    """Push one small transfer of KV; its summary, or the refusal."""
    try:
        async with open_transfer(address, make_header({"l0": 900}), FAST, tls) as tx:
            await tx.send_layer("l0", b"secret kv" * 100)
            return await tx.finish()
    except TransferRefused as exc:
        return exc


def child(agent: AgentProc, tls: TLSConfig, name: str) -> Any:
    async def go() -> Any:
        async with AgentClient(agent.address, tls) as client:
            status = await client.status()
        return next(c for c in status.children if c.name == name)

    return asyncio.run(go())


def child_log(agent: AgentProc, name: str, needle: str, timeout: float = 10) -> str:
    """The first line of child ``name``'s log (kept by the agent) that contains ``needle``."""
    deadline = deadline_in(timeout)
    while time.monotonic() < deadline:
        for path in agent.state_dir.rglob(f"{name}.log*"):
            for line in path.read_text(errors="replace").splitlines():
                if needle in line:
                    return line
        time.sleep(0.2)
    raise AssertionError(f"no {needle!r} in the log of {name}")


def test_kv_receivers_launched_by_the_orchestrator_admit_only_the_deployments_allowlist(bed):
    kv_port, kv_link_port = free_port(), free_port()
    with override_settings(**bed.controller):
        config = deployment_config(bed, kv_port, kv_link_port)
        [decode] = agentops.targets(config, "decode")
        engine, engine_settings = agentops.engine_launch_settings(decode, config)
        link_settings = agentops.kv_link_launch_settings(decode, config)
        engine_child = agentops.launch(
            decode, kind="decode-engine", name="dep-decode", engine=engine,
            launch_settings=engine_settings, rid="allowlist-engine-1",
        )  # fmt: skip
        link_child = agentops.launch(
            decode, kind="kv-link", name="dep-kvlink", launch_settings=link_settings,
            rid="allowlist-kvlink-1",
        )  # fmt: skip
        controller = agentops.controller_tls("dec-1")

        # The allowlist the snapshot carries and what each receiver was given.
        assert config["kv_transfer"]["allowed_peers"] == ["pre-1"]
        assert agentops.allowlist_evidence("decode-engine", engine_settings) == {
            "applies": True,
            "peers": ["pre-1"],
        }
        assert link_settings["allow_peers"] == ["orchestrator", "pre-1"]
        assert (engine_child["state"], link_child["state"]) == ("running", "running")

        async def scenario() -> dict[str, Any]:
            engine_kv = f"127.0.0.1:{kv_port}"
            link_kv = f"127.0.0.1:{kv_link_port}"
            return {
                "engine_intruder": await push(engine_kv, sender_tls(bed, "intruder")),
                "engine_prefill": await push(engine_kv, sender_tls(bed, "pre-1")),
                "link_intruder": await push(link_kv, sender_tls(bed, "intruder")),
                "link_prefill": await push(link_kv, sender_tls(bed, "pre-1")),
                "link_loopback": await loopback(link_kv, controller, blocks=2, block_bytes=1 << 16),
            }

        results = asyncio.run(scenario())
        link_metrics_url = child(bed.agent, controller, "dep-kvlink").metrics_url

    refused = "peer 'intruder' is not on the allowlist (certificate CN=intruder; names intruder"
    for where in ("engine_intruder", "link_intruder"):
        assert isinstance(results[where], PeerRefused), (where, results[where])
        assert results[where].code == grpc.StatusCode.PERMISSION_DENIED
        assert results[where].reason == "not_allowed"
        assert refused in str(results[where])
    assert results["engine_prefill"].bytes_raw == 900
    assert results["link_prefill"].bytes_raw == 900
    assert results["link_loopback"]["ok"] is True, results["link_loopback"]
    # Counted where it was refused, and logged with the certificate's subject.
    metrics = urllib.request.urlopen(link_metrics_url, timeout=5).read().decode()  # noqa: S310
    assert 'pdbridge_kv_rejected_peers_total{reason="not_allowed",role="receiver"} 1.0' in metrics
    for name in ("dep-decode", "dep-kvlink"):
        line = child_log(bed.agent, name, "peer_rejected")
        assert "certificate CN=intruder; names intruder; only the common name is matched" in line


def test_the_decode_nodes_own_certificate_is_not_let_into_the_kv_link(bed):
    kv_port, kv_link_port = free_port(), free_port()
    with override_settings(**bed.controller):
        config = deployment_config(bed, kv_port, kv_link_port)
        [decode] = agentops.targets(config, "decode")
        settings = agentops.kv_link_launch_settings(decode, config)
        agentops.launch(
            decode, kind="kv-link", name="dep-kvlink-2", launch_settings=settings,
            rid="allowlist-kvlink-2",
        )  # fmt: skip
        cert = (bed.pki.agent_cert, bed.pki.agent_key)
        own = TLSConfig(
            ca_file=bed.pki.ca, cert_file=cert[0], key_file=cert[1], server_name="dec-1"
        )

        result = asyncio.run(push(f"127.0.0.1:{kv_link_port}", own))

    assert isinstance(result, PeerRefused)
    assert result.reason == "not_allowed"
    assert "peer 'dec-1' is not on the allowlist" in str(result)


def test_on_a_plaintext_kv_link_no_allowlist_applies_and_the_evidence_says_so(bed):
    kv_port, kv_link_port = free_port(), free_port()
    config = deployment_config(bed, kv_port, kv_link_port)
    [decode] = agentops.targets(config, "decode")
    plain = agentops.Target(
        "decode", decode.site, decode.hostname, decode.agent_address,
        {**{k: v for k, v in decode.settings.items() if k != "kv_tls"}, "kv_insecure": True},
    )  # fmt: skip

    _, engine_settings = agentops.engine_launch_settings(plain, config)
    with override_settings(PDBRIDGE_CONTROLLER_INSECURE=True):
        link_settings = agentops.kv_link_launch_settings(plain, config)

    assert "--kv-allowed-peer" not in engine_settings["extra_args"]
    assert agentops.allowlist_evidence("decode-engine", engine_settings) == {
        "applies": False,
        "why": "kv_insecure: plaintext KV link, no certificate to check",
    }
    assert "allow_peers" not in link_settings
    assert agentops.allowlist_evidence("kv-link", link_settings)["applies"] is False


def test_a_deployment_nobody_may_send_kv_to_is_not_launched_with_an_open_listener(bed):
    local = SiteFactory(role="decode")
    dec = Node.objects.create(site=local, hostname="dec-9", agent_address="127.0.0.1:1")
    dep = make_deployment()
    tls = {"ca": "/etc/ca.pem", "cert": "/etc/n.pem", "key": "/etc/n-key.pem"}
    pool_create(
        actor=None, deployment=dep, role="decode", site=local, nodes=[dec],
        engine_settings={"model": "m", "kv_tls": tls},
    )  # fmt: skip
    config = build_config(Deployment.objects.get(pk=dep.pk))
    [decode] = agentops.targets(config, "decode")

    with pytest.raises(agentops.AgentOpsError, match=r"^kv_transfer\.allowed_peers: empty"):
        agentops.engine_launch_settings(decode, config)

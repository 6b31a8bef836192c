"""Exact identities on the agent's control API (#44, item 6): a real agent over mTLS admits a
caller by its certificate's common name only. A certificate the product's tool issued for
another node is refused -- even when it also carries the allowed controller's name as a SAN --
before anything of the call runs; the controller's own certificate is admitted. The agent's
own certificate carries no loopback name: callers dial it by IP and expect its node name."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from agents.proto.api import pb
from grpc_kv.certs import CertFiles
from tests.agents.conftest import AgentProc, agent_config, start_agent, stub
from tests.agents.pki import Pki
from tests.agents.test_grpc_api import T
from tests.support import subprocess_env, wait_for


def kv_certs(out: Path, *args: str) -> None:
    """``pdbridge kv certs --out OUT ARGS...``: the product's own certificate tool."""
    result = subprocess.run(
        [sys.executable, "-m", "pdbridge.cli", "kv", "certs", "--out", str(out), *args],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    """One CA (the tool's): the agent ``dec-1``, the controller ``orchestrator`` and the node
    ``pre-1`` issued with the controller's name as an extra SAN (a name the two share)."""
    out = tmp_path_factory.mktemp("identity-pki")
    kv_certs(out, "--node", "dec-1")
    kv_certs(out, "--node", "orchestrator")
    kv_certs(out, "--node", "pre-1", "--san", "orchestrator")

    def files(name: str) -> CertFiles:
        return CertFiles(out / "ca.pem", out / f"{name}.pem", out / f"{name}-key.pem")

    return Pki(
        ca=out / "ca.pem",
        agent_cert=out / "dec-1.pem",
        agent_key=out / "dec-1-key.pem",
        clients={name: files(name) for name in ("orchestrator", "pre-1")},
    )


@pytest.fixture(scope="module")
def agent(tmp_path_factory: pytest.TempPathFactory, pki: Pki) -> Iterator[AgentProc]:
    """The agent of ``dec-1``, allowing the controller ``orchestrator`` only."""
    tmp = tmp_path_factory.mktemp("identity-agent")
    proc = start_agent(tmp, agent_config(tmp, pki))
    yield proc
    assert proc.terminate() == 0


def refused_events(agent: AgentProc) -> list[dict[str, Any]]:
    lines = agent.log_path.read_text().splitlines()
    events = [json.loads(line) for line in lines if line.startswith("{")]
    return [e for e in events if e.get("event") == "agent.caller_refused"]


def test_a_certificate_issued_for_another_node_is_refused_by_the_control_api(
    agent: AgentProc, pki: Pki
) -> None:
    intruder = stub(agent, pki, client="pre-1")
    launch = pb.LaunchRequest(
        request_id=os.urandom(8).hex(), name="intruded", kind="prefill-engine", engine="plain"
    )

    with pytest.raises(grpc.RpcError) as status_err:
        intruder.Status(pb.StatusRequest(), timeout=T)
    with pytest.raises(grpc.RpcError) as launch_err:
        intruder.Launch(launch, timeout=T)

    reason = (
        "peer 'pre-1' is not on the allowlist (certificate CN=pre-1; names pre-1, orchestrator; "
        "only the common name is matched)"
    )
    for err in (status_err, launch_err):
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert err.value.details() == f"caller refused: {reason} of this agent"
    # Nothing of the refused Launch ran; the agent logs whom it refused and why.
    children = stub(agent, pki).Status(pb.StatusRequest(), timeout=T).children
    assert [c.name for c in children if c.name == "intruded"] == []
    events = wait_for(lambda: len(refused_events(agent)) >= 2 and refused_events(agent), 10)
    assert {(e["method"], e["reason"]) for e in events} == {
        ("Status", reason),
        ("Launch", reason),
    }


def test_the_allowed_controllers_own_certificate_is_admitted(agent: AgentProc, pki: Pki) -> None:
    status = stub(agent, pki, client="orchestrator").Status(pb.StatusRequest(), timeout=T)

    assert status.node == "dec-1"


def test_the_agents_certificate_names_its_node_only(pki: Pki) -> None:
    from cryptography import x509

    cert = x509.load_pem_x509_certificate(pki.agent_cert.read_bytes())
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value

    assert [str(n.value) for n in sans] == ["dec-1"]  # dialled at 127.0.0.1 as "dec-1"

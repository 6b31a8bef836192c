"""Test certificates: a CA, the agent's server certificate, controller certificates, and a
certificate from a different CA (the "wrong CA" caller)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from grpc_kv.certs import CertFiles, create_ca, create_node_cert


@dataclass(frozen=True)
class Pki:
    ca: Path
    agent_cert: Path
    agent_key: Path
    clients: dict[str, CertFiles]

    def client(self, name: str) -> tuple[Path, Path]:
        files = self.clients[name]
        return files.cert_file, files.key_file


def make_pki(directory: Path) -> Pki:
    """CA + ``dec-1`` (agent) + ``orchestrator`` (allowlisted) + ``intruder`` (same CA, not
    allowlisted) + ``pre-1`` (a peer's kv-link receiver) + ``stranger`` (another CA)."""
    ca = create_ca(directory / "ca")
    # The agent and pre-1 serve on loopback and are dialled there (the agent's kv-link and a
    # peer receiver, probed at 127.0.0.1): they need the loopback names. Clients do not.
    agent = create_node_cert(ca, directory / "nodes", "dec-1", loopback=True)
    clients = {
        name: create_node_cert(ca, directory / "nodes", name, loopback=name == "pre-1")
        for name in ("orchestrator", "intruder", "pre-1")
    }
    other = create_ca(directory / "other-ca", name="other-ca")
    clients["stranger"] = create_node_cert(other, directory / "other", "orchestrator")
    return Pki(ca=ca.ca_file, agent_cert=agent.cert_file, agent_key=agent.key_file, clients=clients)

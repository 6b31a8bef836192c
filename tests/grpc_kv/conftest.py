"""Fixtures of the KV-link tests: certificates, made once per session."""

from __future__ import annotations

import pytest

from grpc_kv.api import CertFiles, create_ca, create_node_cert


@pytest.fixture(scope="session")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, CertFiles]:
    """A CA with nodes site-a, site-b, intruder; and a foreign CA with node foreign."""
    base = tmp_path_factory.mktemp("pki")
    ca = create_ca(base)
    files = {name: create_node_cert(ca, base, name) for name in ("site-a", "site-b", "intruder")}
    other = create_ca(base / "other", name="other-ca")
    files["foreign"] = create_node_cert(other, base / "other", "foreign")
    files["ca"] = ca
    return files

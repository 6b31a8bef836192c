"""The engine's own HTTP endpoint: mTLS when given certificates; plaintext off loopback only
behind an explicit --insecure."""

from __future__ import annotations

import ssl
import urllib.error
import urllib.request

import pytest

from tests.agents.engines.conftest import engine_args, serve_expecting_exit, start_engine


@pytest.fixture(scope="module")
def tls_engine(models_dir, tmp_path_factory):
    from grpc_kv.api import create_ca, create_node_cert

    root = tmp_path_factory.mktemp("http-certs")
    ca = create_ca(root / "ca")
    server = create_node_cert(ca, root / "engine", "engine")
    client = create_node_cert(ca, root / "gateway", "gateway")
    engine = start_engine(
        [
            *engine_args(models_dir, ["dense=dense"]),
            "--ssl-certfile",
            str(server.cert_file),
            "--ssl-keyfile",
            str(server.key_file),
            "--ssl-ca-certs",
            str(server.ca_file),
        ],
        root / "engine.log",
    )
    yield engine, ca, client
    engine.stop()


def _get(url: str, context: ssl.SSLContext) -> int:
    with urllib.request.urlopen(url, timeout=30, context=context) as resp:  # noqa: S310 - loopback URL built here
        return resp.status


def test_mtls_engine_serves_only_clients_with_a_certificate(tls_engine):
    engine, ca, client = tls_engine
    url = engine.url.replace("http://", "https://") + "/v1/models"
    with_cert = ssl.create_default_context(cafile=str(ca.ca_file))
    with_cert.load_cert_chain(str(client.cert_file), str(client.key_file))
    without_cert = ssl.create_default_context(cafile=str(ca.ca_file))

    assert _get(url, with_cert) == 200
    with pytest.raises((ssl.SSLError, urllib.error.URLError, ConnectionError)):
        _get(url, without_cert)


def test_plaintext_off_loopback_needs_insecure():
    result = serve_expecting_exit("--model", "dense", "--host", "0.0.0.0")

    assert result.returncode == 2
    assert "--insecure" in result.stderr
    assert result.stdout == ""  # never reached the ready line

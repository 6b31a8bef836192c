"""The engine's own HTTP endpoint: mTLS when given certificates; plaintext off loopback only
behind an explicit --insecure."""

from __future__ import annotations

import ssl
import urllib.error
import urllib.request

import pytest

from tests.agents.engines.conftest import engine_args, serve_expecting_exit, start_engine
from tests.support import deadline_in


@pytest.fixture(scope="module")
def tls_engine(models_dir, tmp_path_factory):
    from grpc_kv.api import create_ca, create_node_cert

    root = tmp_path_factory.mktemp("http-certs")
    ca = create_ca(root / "ca")
    server = create_node_cert(ca, root / "engine", "engine", loopback=True)
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


# -- the KV listener's certificate rotated during a transfer, without a restart --------------
@pytest.fixture(scope="module")
def rotating_engine(engine_pair, models_dir, tmp_path_factory):
    """An engine (role both) whose KV listener's files live in a directory of their own, and
    a client certificate of the same CA. No compression: ``auto`` would first measure the
    link's rate through the toxic below, eating into the transfer's 4 s deadline."""
    from grpc_kv.api import create_ca, create_node_cert

    root = tmp_path_factory.mktemp("kv-rotation")
    ca = create_ca(root / "ca")
    live = create_node_cert(ca, root / "live", "decode-r", loopback=True)
    client = create_node_cert(ca, root / "client", "prefill-r")
    engine = start_engine(
        [
            *engine_args(models_dir, ["qwen3-next=qwen3-next"]),
            "--role", "both", "--kv-listen", "127.0.0.1:0", "--kv-compression", "none",
            "--kv-tls-ca", str(live.ca_file), "--kv-tls-cert", str(live.cert_file),
            "--kv-tls-key", str(live.key_file),
        ],
        root / "engine.log",
    )  # fmt: skip
    yield engine, ca, live, client, root
    engine.stop()


def test_kv_listener_rotation_mid_transfer_keeps_it_and_serves_the_new_certificate(
    rotating_engine,
):
    """The files are replaced while a transfer crawls through a 'WAN' (Bandwidth toxic): the
    transfer completes intact on its open connections, and the next client is shown the
    new certificate by the same process."""
    import os
    import threading
    import time
    import uuid

    from agents.engines.verify import compare, make_prompt
    from grpc_kv.api import create_node_cert
    from grpc_kv.faultproxy import Bandwidth
    from tests.agents.engines.client import decode_leg, post, prefill_leg
    from tests.agents.engines.test_faults import ProxyThread
    from tests.grpc_kv.test_tls import peer_serial, serial_of

    engine, ca, live, client, root = rotating_engine
    port = int(engine.ready["kv_listen"].rsplit(":", 1)[1])
    body = {"model": "qwen3-next", "prompt": make_prompt(400, seed=8), "max_tokens": 6,
            "temperature": 0, "ignore_eos": True}  # fmt: skip
    old = serial_of(live.cert_file)
    assert peer_serial(port, client) == old
    proxy = ProxyThread(engine.ready["kv_listen"])
    try:
        # Size the toxic so that the transfer takes about 1.5 s: well inside the link's
        # 4 s deadline, far longer than the swap and the handshake that follows it.
        tid = f"r-{uuid.uuid4().hex}"
        _, _, sized = prefill_leg(engine.url, body, tid, engine.ready["kv_listen"])
        decode_leg(engine.url, body, tid, 30)
        kv_bytes = sized["kv_transfer_params"]["bytes"]
        proxy.call(proxy.proxy.add, Bandwidth(direction="upstream", bytes_per_s=kv_bytes / 1.5))
        tid = f"r-{uuid.uuid4().hex}"
        legs: dict[str, tuple] = {}
        prefill = threading.Thread(
            target=lambda: legs.__setitem__(
                "prefill", prefill_leg(engine.url, body, tid, proxy.address)
            )
        )
        decode = threading.Thread(
            target=lambda: legs.__setitem__("decode", decode_leg(engine.url, body, tid, 60))
        )
        prefill.start()
        decode.start()
        deadline = deadline_in(30)
        while proxy.proxy.stats.bytes_upstream < kv_bytes / 10:  # KV on the wire
            assert time.monotonic() < deadline, "the transfer never started"
            time.sleep(0.01)

        new = create_node_cert(ca, root / "new", "decode-r", loopback=True)
        os.replace(new.cert_file, live.cert_file)
        os.replace(new.key_file, live.key_file)
        rotated = serial_of(live.cert_file)
        seen_after = peer_serial(port, client)
        in_flight = prefill.is_alive()
        prefill.join(60)
        decode.join(60)
    finally:
        proxy.close()
    _, _, local = post(f"{engine.url}/v1/completions", body)

    assert rotated != old
    assert seen_after == rotated  # the next handshake, same process
    assert in_flight  # the swap happened while the KV was still on the wire
    status_p, _, _ = legs["prefill"]
    status_d, headers, remote = legs["decode"]
    assert (status_p, status_d) == (200, 200)
    assert headers["x-pdbridge-path"] == "remote"
    assert compare(local, remote) == (True, 6, 6, None)
    assert f"tls_reloaded use=grpc_server cert_file={live.cert_file} serial={rotated:x}" in (
        engine.log.read_text()
    )

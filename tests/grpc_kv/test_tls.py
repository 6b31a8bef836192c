"""Certificate reload of ``grpc_kv.tls.TLSConfig`` as listeners see it: the certificate a new
client is shown after the files were replaced, on the gRPC port and on the bulk data port,
including the shapes that once kept the old certificate (the same config's client side
reading the new files first, as a decode engine's link pool does) and a rotation caught
between its two files."""

from __future__ import annotations

import asyncio
import os
import socket
import ssl
from pathlib import Path

from cryptography import x509

from grpc_kv.api import CertFiles, ReceiverOptions, TLSConfig, create_node_cert
from grpc_kv.tls import certificate_summary, pair_matches
from tests.grpc_kv.kvtest import receiver, run


def peer_serial(port: int, client: CertFiles, alpn: str | None = "h2") -> int:
    """The serial number of the certificate a listener shows a new TLS client (a full
    handshake with a client certificate from the same CA)."""
    ctx = ssl.create_default_context(cafile=str(client.ca_file))
    ctx.load_cert_chain(str(client.cert_file), str(client.key_file))
    ctx.check_hostname = False  # the serial is what is compared, not the name
    if alpn:
        ctx.set_alpn_protocols([alpn])
    with (
        socket.create_connection(("127.0.0.1", port), timeout=10) as raw,
        ctx.wrap_socket(raw) as tls,
    ):
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return x509.load_der_x509_certificate(der).serial_number


def serial_of(cert_file: Path) -> int:
    return x509.load_pem_x509_certificate(cert_file.read_bytes()).serial_number


def live_files(pki: dict[str, CertFiles], tmp_path: Path, name: str) -> CertFiles:
    """A node certificate of the test CA in a directory of its own (the one rotated)."""
    return create_node_cert(pki["ca"], tmp_path / "live", name)


def rotate(pki: dict[str, CertFiles], live: CertFiles, name: str, tmp_path: Path) -> int:
    """Issue a new pair for ``name`` and move it over ``live`` (certificate, then key: each
    an atomic rename, as deploy/certs.md says); returns the new serial."""
    new = create_node_cert(pki["ca"], tmp_path / f"new-{os.urandom(4).hex()}", name)
    os.replace(new.cert_file, live.cert_file)
    os.replace(new.key_file, live.key_file)
    return serial_of(live.cert_file)


def test_listener_reloads_even_when_its_config_opened_a_client_first(pki, tmp_path):
    """A decode engine's KV listener and its link pool share one TLSConfig: the pool opening
    a link after the rotation reads the new files first, and the listener must still serve
    them from its next handshake on."""
    live = live_files(pki, tmp_path, "site-b")
    tls = TLSConfig(ca_file=live.ca_file, cert_file=live.cert_file, key_file=live.key_file)
    old = serial_of(live.cert_file)

    async def scenario() -> tuple[int, int, int]:
        async with receiver(tls=tls) as (server, _target):
            before = await asyncio.to_thread(peer_serial, server.port, pki["site-a"])
            new = rotate(pki, live, "site-b", tmp_path)
            tls.channel_credentials()  # the link pool's new link, before any handshake
            after = await asyncio.to_thread(peer_serial, server.port, pki["site-a"])
            return before, new, after

    before, new, after = run(scenario())

    assert before == old
    assert new != old
    assert after == new


def test_a_certificate_without_its_new_key_keeps_the_old_pair_until_both_land(pki, tmp_path):
    live = live_files(pki, tmp_path, "site-b")
    tls = TLSConfig(ca_file=live.ca_file, cert_file=live.cert_file, key_file=live.key_file)
    old = serial_of(live.cert_file)
    new = create_node_cert(pki["ca"], tmp_path / "new", "site-b")

    async def scenario() -> tuple[int, int]:
        async with receiver(tls=tls) as (server, _target):
            os.replace(new.cert_file, live.cert_file)  # the key is still the old one
            halfway = await asyncio.to_thread(peer_serial, server.port, pki["site-a"])
            os.replace(new.key_file, live.key_file)
            whole = await asyncio.to_thread(peer_serial, server.port, pki["site-a"])
            return halfway, whole

    halfway, whole = run(scenario())

    assert halfway == old
    assert whole == serial_of(live.cert_file) != old


def test_bulk_data_port_serves_the_new_certificate_after_rotation(pki, tmp_path):
    live = live_files(pki, tmp_path, "site-b")
    tls = TLSConfig(ca_file=live.ca_file, cert_file=live.cert_file, key_file=live.key_file)
    old = serial_of(live.cert_file)

    async def scenario() -> tuple[int, int, int]:
        async with receiver(ReceiverOptions(bulk=True), tls=tls) as (server, _target):
            assert server.bulk is not None
            port = server.bulk.port
            before = await asyncio.to_thread(peer_serial, port, pki["site-a"], None)
            new = rotate(pki, live, "site-b", tmp_path)
            after = await asyncio.to_thread(peer_serial, port, pki["site-a"], None)
            return before, new, after

    before, new, after = run(scenario())

    assert before == old
    assert after == new != old


def test_pair_check_and_summary_read_pem(pki):
    site_a, site_b = pki["site-a"], pki["site-b"]
    cert = site_a.cert_file.read_bytes()

    assert pair_matches(cert, site_a.key_file.read_bytes()) is True
    assert pair_matches(cert, site_b.key_file.read_bytes()) is False
    assert pair_matches(cert[:100], site_a.key_file.read_bytes()) is False
    serial, subject, not_after = certificate_summary(cert)
    assert int(serial, 16) == serial_of(site_a.cert_file)
    assert subject == "CN=site-a"
    assert not_after.endswith("+00:00")
    assert certificate_summary(b"not a certificate") == ("?", "?", "?")

"""Exact identities on the KV link: a certificate's identity is its one subject common name,
and a node certificate of ``pdbridge kv certs`` carries its own node's names only.

The issue (#44, item 6): a certificate the product's own tool issued for another host was let
into a KV receiver, because every certificate carried ``localhost``/``127.0.0.1`` and an
allowlist matched any name on it. Here real receivers on loopback, over mTLS on the gRPC and
the bulk data path, refuse a certificate issued for node A by a receiver that allows node B
even when A's certificate also carries a name on B's allowlist, import nothing from it, and
take B's own certificate.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import ipaddress
import os
import ssl
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from grpc_kv.api import (
    CertFiles,
    LinkOptions,
    PeerRefused,
    PeerRejected,
    ReceiverOptions,
    TLSConfig,
    create_ca,
    create_node_cert,
    open_transfer,
)
from grpc_kv.protocol import pb
from grpc_kv.tls import certificate_identity, certificate_server_name, subject_common_names
from tests.grpc_kv.kvtest import make_header, receiver, run
from tests.grpc_kv.test_bulk import MAGIC, RawBulk, hello
from tests.support import subprocess_env

MIB = 1 << 20


def kv_certs(out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``pdbridge kv certs --out OUT ARGS...``: the product's own certificate tool."""
    return subprocess.run(
        [sys.executable, "-m", "pdbridge.cli", "kv", "certs", "--out", str(out), *args],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def sans_of(cert_file: Path) -> list[str]:
    cert = x509.load_pem_x509_certificate(cert_file.read_bytes())
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return [str(n.value) for n in names]


def files(directory: Path, name: str) -> CertFiles:
    return CertFiles(directory / "ca.pem", directory / f"{name}.pem", directory / f"{name}-key.pem")


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, CertFiles]:
    """Issued by ``pdbridge kv certs`` from one CA: ``node-b`` (the allowed sender) and two
    certificates for node A -- ``node-a`` carrying node B's name as a SAN (a name the two
    share), ``node-a-lo`` issued ``--loopback`` (``localhost``/``127.0.0.1``, as every
    certificate once was) -- and ``node-r``, the receiver's own."""
    out = tmp_path_factory.mktemp("identity-pki")
    for args in (
        ("--node", "node-b"),
        ("--node", "node-r"),
        ("--node", "node-a", "--san", "node-b"),
        ("--node", "node-a-lo", "--loopback"),
    ):
        result = kv_certs(out, *args)
        assert result.returncode == 0, result.stderr
    return {name: files(out, name) for name in ("node-a", "node-a-lo", "node-b", "node-r")}


def tls(node: CertFiles, **kw: object) -> TLSConfig:
    return TLSConfig(ca_file=node.ca_file, cert_file=node.cert_file, key_file=node.key_file, **kw)  # type: ignore[arg-type]


async def push(target: str, client: TLSConfig, payload: bytes, data_path: str) -> object:
    """Push ``payload`` as one layer; the summary, or the exception the sender raised."""
    options = LinkOptions(timeout_ms=10_000, rpc_timeout_ms=2000, data_path=data_path)
    header = make_header({"l0": len(payload)})
    try:
        async with open_transfer(target, header, options, client) as tx:
            await tx.send_layer("l0", payload)
            return await tx.finish()
    except Exception as exc:
        return exc


# -- what the tool issues ----------------------------------------------------------------


def test_a_node_certificate_names_its_node_only_unless_loopback_is_asked_for(tmp_path):
    ca = create_ca(tmp_path / "ca")

    plain = create_node_cert(ca, tmp_path, "pre-1", sans=["pre-1.dc2.example", "10.20.0.11"])
    looped = create_node_cert(ca, tmp_path / "lo", "testbed", loopback=True)

    assert sans_of(plain.cert_file) == [
        "pre-1",
        "pre-1.dc2.example",
        str(ipaddress.ip_address("10.20.0.11")),
    ]
    assert certificate_identity(plain.cert_file.read_bytes()) == "pre-1"
    assert sans_of(looped.cert_file) == ["testbed", "localhost", "127.0.0.1"]


def test_the_tool_gives_extra_names_to_one_node_at_a_time(tmp_path):
    refused = kv_certs(tmp_path, "--node", "pre-1", "--node", "pre-2", "--san", "10.20.0.11")
    issued = kv_certs(tmp_path, "--node", "pre-1", "--san", "10.20.0.11")

    assert refused.returncode == 2
    assert "--san: names the extra DNS names/IPs of one node" in refused.stderr
    assert not (tmp_path / "pre-2.pem").exists()
    assert issued.returncode == 0, issued.stderr
    assert sans_of(tmp_path / "pre-1.pem") == ["pre-1", "10.20.0.11"]


# -- a KV receiver ---------------------------------------------------------------------------


@pytest.mark.parametrize("data_path", ["grpc", "bulk"])
@pytest.mark.parametrize(
    ("sender", "allowed", "shared"),
    [
        ("node-a", ["node-b"], "node-b"),  # A's certificate carries B's name as a SAN
        ("node-a-lo", ["localhost"], "localhost"),  # a receiver allowing a node `localhost`
    ],
)
def test_a_kv_receiver_refuses_a_certificate_issued_for_another_node(
    nodes, data_path, sender, allowed, shared
):
    """Given a receiver that allows ``allowed`` and a certificate of the same CA, issued by
    the tool for node A, that carries ``shared`` (on the allowlist) as a SAN: the transfer is
    refused at once, named, counted, and not a byte of it is imported."""

    async def scenario():
        server_tls = tls(nodes["node-r"], allowed_peers=allowed)
        options = ReceiverOptions(bulk=True)
        async with receiver(options, tls=server_tls) as (server, target):
            client = tls(nodes[sender], server_name="node-r")
            result = await push(target, client, os.urandom(MIB), data_path)
            imported = server.metrics.value("pdbridge_kv_bytes_raw_total", role="receiver")
            rejected = server.metrics.value(
                "pdbridge_kv_rejected_peers_total", role="receiver", reason="not_allowed"
            )
            return result, imported, rejected, server.memory_in_use

    result, imported, rejected, memory = run(scenario())

    assert isinstance(result, PeerRefused), result
    assert result.reason == "not_allowed"
    assert result.code == grpc.StatusCode.PERMISSION_DENIED
    assert f"peer {sender!r} is not on the allowlist (certificate CN={sender}; names " in str(
        result
    )
    assert shared in str(result)
    assert "only the common name is matched" in str(result)
    assert imported == 0
    assert rejected == 1
    assert memory == 0


@pytest.mark.parametrize("data_path", ["grpc", "bulk"])
def test_the_allowed_nodes_own_certificate_pushes_its_kv(nodes, data_path):
    payload = os.urandom(MIB)

    async def scenario():
        server_tls = tls(nodes["node-r"], allowed_peers=["node-b"])
        async with receiver(ReceiverOptions(bulk=True), tls=server_tls) as (server, target):
            options = LinkOptions(timeout_ms=10_000, data_path=data_path)
            header = make_header({"l0": len(payload)})
            consumer = asyncio.create_task(server.open(header.transfer_id, 20.0))
            async with open_transfer(
                target, header, options, tls(nodes["node-b"], server_name="node-r")
            ) as tx:
                await tx.send_layer("l0", payload)
                summary = await tx.finish()
            received = bytearray()
            async with await consumer as reader:
                async for seg in reader:
                    received += bytes(seg.data)
            return summary, bytes(received)

    summary, received = run(scenario())

    assert summary.bytes_raw == MIB
    assert summary.data_path == data_path
    assert received == payload


def test_the_bulk_data_port_refuses_another_nodes_certificate_at_its_own_handshake(nodes):
    """The bulk port checks the identity itself (a data connection opened without Begin):
    node A's certificate carrying node B's name is refused with PERMISSION_DENIED."""

    async def scenario():
        server_tls = tls(nodes["node-r"], allowed_peers=["node-b"])
        async with receiver(ReceiverOptions(bulk=True), tls=server_tls) as (server, _target):
            port = server.bulk.port

            def attempt(name: str) -> list[tuple[int, int]]:
                ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
                ctx.load_verify_locations(cafile=nodes[name].ca_file)
                ctx.load_cert_chain(nodes[name].cert_file, nodes[name].key_file)
                conn = RawBulk(port, ctx, server_hostname="node-r")
                conn.send(MAGIC)
                conn.frame(hello("t-unknown"))
                return [(a.status, a.code) for a in conn.acks()]

            refused = await asyncio.to_thread(attempt, "node-a")
            rejected = server.metrics.value(
                "pdbridge_kv_rejected_peers_total", role="receiver", reason="not_allowed"
            )
            return refused, rejected

    refused, rejected = run(scenario())

    assert refused == [(pb.ACK_REFUSED, grpc.StatusCode.PERMISSION_DENIED.value[0])]
    assert rejected == 1


# -- certificates with no single identity -----------------------------------------------------


def foreign_style_cert(ca: CertFiles, directory: Path, name: str, subject: x509.Name) -> CertFiles:
    """A client certificate of ``ca`` with any subject (another PKI's shape), SAN ``name``."""
    ca_cert = x509.load_pem_x509_certificate(ca.cert_file.read_bytes())
    ca_key = serialization.load_pem_private_key(ca.key_file.read_bytes(), password=None)
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(name)]), critical=False)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    cert_file, key_file = directory / f"{name}.pem", directory / f"{name}-key.pem"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return CertFiles(ca.ca_file, cert_file, key_file)


@pytest.mark.parametrize(
    ("subject", "words"),
    [
        (
            x509.Name(
                [
                    x509.NameAttribute(NameOID.COMMON_NAME, "node-a"),
                    x509.NameAttribute(NameOID.COMMON_NAME, "node-b"),
                ]
            ),
            "peer certificate has 2 common names, an identity is exactly one",
        ),
        (
            x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "site a")]),
            "peer certificate has no common name, the identity an allowlist matches",
        ),
    ],
    ids=["two common names", "no common name"],
)
def test_a_certificate_without_exactly_one_common_name_is_refused(tmp_path, subject, words):
    ca = create_ca(tmp_path / "ca")
    receiver_files = create_node_cert(ca, tmp_path, "node-r")
    # Its only SAN is on the allowlist: a SAN never stands in for the identity.
    client = foreign_style_cert(ca, tmp_path, "node-b", subject)

    async def scenario():
        server_tls = tls(receiver_files, allowed_peers=["node-b"])
        async with receiver(tls=server_tls) as (server, target):
            result = await push(target, tls(client, server_name="node-r"), b"kv" * 512, "grpc")
            imported = server.metrics.value("pdbridge_kv_bytes_raw_total", role="receiver")
            return result, imported

    result, imported = run(scenario())

    assert isinstance(result, PeerRefused), result
    assert result.reason == "not_allowed"
    assert words in str(result)
    assert imported == 0
    # The bulk path's check says the same of the same certificate.
    decoded = ssl._ssl._test_decode_cert(str(client.cert_file))  # type: ignore[attr-defined]
    with pytest.raises(PeerRejected, match=words):
        tls(receiver_files, allowed_peers=["node-b"]).check_peercert(decoded)


def test_subject_common_names_reads_grpcs_subject_with_its_escapes():
    assert subject_common_names("CN=node-b,O=o\\+o,CN=evil\\,x") == ["node-b", "evil,x"]
    assert subject_common_names("CN=a+CN=b,O=x") == ["a", "b"]
    assert subject_common_names("O=site a") == []
    assert subject_common_names("CN=caf\\C3\\A9") == ["café"]


def test_a_self_test_expects_the_certificates_own_name(nodes):
    assert certificate_server_name(nodes["node-r"].cert_file.read_bytes()) == "node-r"

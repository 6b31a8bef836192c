"""Certificate helper: a CA and per-node certificates for mTLS on the KV link and the
agents' control API (``pdbridge kv certs``).

A node's **identity** is its certificate's subject common name (CN): what KV receivers'
``allowed_peers`` and agents' ``tls.allowed_identities`` match, exactly
(:meth:`grpc_kv.tls.TLSConfig.check_peer`). Subject alternative names are only what TLS
clients check the server's certificate against (the names and addresses peers dial). So a
certificate issued here for a node carries that node's names and no one else's: no
``localhost`` or ``127.0.0.1`` unless asked for (``loopback=True``, single-machine testbeds),
since any name two certificates share would let a client that dials it accept either.

Meant for tests and first deployments; production sites may bring their own PKI (the CN is
then the identity too). Blocking (EC P-256 key generation takes milliseconds). Files are PEM;
keys are written with mode 0600.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class CertFiles:
    """Paths of one node's certificate material (what :class:`grpc_kv.tls.TLSConfig` takes)."""

    ca_file: Path
    cert_file: Path
    key_file: Path


def _write_private(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


def create_ca(directory: Path, name: str = "pdbridge-ca", days: int = 825) -> CertFiles:
    """Create ``ca.pem`` and ``ca-key.pem`` in ``directory`` (created if missing).

    Returns CertFiles whose cert/key are the CA's own (used to sign node certificates).
    """
    directory.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(key, hashes.SHA256())
    )
    ca_file, key_file = directory / "ca.pem", directory / "ca-key.pem"
    ca_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    _write_private(key_file, _key_pem(key))
    return CertFiles(ca_file=ca_file, cert_file=ca_file, key_file=key_file)


#: The names ``loopback=True`` adds: what a process dials to reach another on the same host.
LOOPBACK_NAMES = ("localhost", "127.0.0.1")


def create_node_cert(
    ca: CertFiles,
    directory: Path,
    name: str,
    sans: list[str] | None = None,
    days: int = 397,
    *,
    loopback: bool = False,
) -> CertFiles:
    """Issue ``<name>.pem`` / ``<name>-key.pem`` signed by ``ca`` for node ``name``.

    The common name -- the node's identity, the one name allowlists match -- is ``name``;
    the subject alternative names are ``name`` and every entry of ``sans`` (this node's other
    DNS names and addresses; IP addresses are recognised), nothing else. ``loopback=True``
    adds ``localhost`` and ``127.0.0.1``: only for a testbed whose processes all run on one
    machine and dial each other on loopback, never for a certificate that leaves it (every
    such certificate would answer to the same names). The certificate is valid for both
    server and client authentication, so one file pair serves a node's receiver and its
    sender. Raises ValueError on an unreadable CA or an empty ``name``.
    """
    if not name or name != name.strip():
        raise ValueError(f"name: a node name without surrounding spaces, got {name!r}")
    directory.mkdir(parents=True, exist_ok=True)
    ca_cert = x509.load_pem_x509_certificate(ca.cert_file.read_bytes())
    ca_key = serialization.load_pem_private_key(ca.key_file.read_bytes(), password=None)
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise ValueError(f"{ca.key_file}: expected an EC private key")
    key = ec.generate_private_key(ec.SECP256R1())
    names: list[x509.GeneralName] = []
    extra = LOOPBACK_NAMES if loopback else ()
    for entry in dict.fromkeys([name, *(sans or []), *extra]):
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(entry)))
        except ValueError:
            names.append(x509.DNSName(entry))
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(
            x509.ExtendedKeyUsage(
                [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
            ),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    cert_file, key_file = directory / f"{name}.pem", directory / f"{name}-key.pem"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    _write_private(key_file, _key_pem(key))
    return CertFiles(ca_file=ca.ca_file, cert_file=cert_file, key_file=key_file)

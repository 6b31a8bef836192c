"""Test certificates: a CA, the agent's server certificate, controller certificates, and a
certificate from a different CA (the "wrong CA" caller)."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from pathlib import Path

try:
    from grpc_kv.certs import CertFiles, create_ca, create_node_cert
except ImportError:  # until the kv branch (grpc_kv.certs) is merged: the same, minimal
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    @dataclass(frozen=True)
    class CertFiles:  # type: ignore[no-redef]
        ca_file: Path
        cert_file: Path
        key_file: Path

    def _issue(
        name: str,
        issuer: tuple[x509.Certificate, ec.EllipticCurvePrivateKey] | None,
        directory: Path,
        stem: str,
    ) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey, Path, Path]:
        directory.mkdir(parents=True, exist_ok=True)
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        now = dt.datetime.now(dt.UTC)
        builder = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(issuer[0].subject if issuer else subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=2))
            .add_extension(
                x509.BasicConstraints(ca=issuer is None, path_length=None), critical=True
            )
        )
        if issuer:
            builder = builder.add_extension(
                x509.SubjectAlternativeName([x509.DNSName(name), x509.DNSName("localhost")]),
                critical=False,
            )
        cert = builder.sign(issuer[1] if issuer else key, hashes.SHA256())
        cert_path, key_path = directory / f"{stem}.pem", directory / f"{stem}-key.pem"
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        key_path.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
        return cert, key, cert_path, key_path

    _CAS: dict[Path, tuple[x509.Certificate, ec.EllipticCurvePrivateKey]] = {}

    def create_ca(directory: Path, name: str = "pdbridge-ca") -> CertFiles:  # type: ignore[misc]
        cert, key, cert_path, key_path = _issue(name, None, directory, "ca")
        _CAS[cert_path] = (cert, key)
        return CertFiles(cert_path, cert_path, key_path)

    def create_node_cert(ca: CertFiles, directory: Path, name: str) -> CertFiles:  # type: ignore[misc]
        _, _, cert_path, key_path = _issue(name, _CAS[ca.ca_file], directory, name)
        return CertFiles(ca.ca_file, cert_path, key_path)


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
    allowlisted) + ``stranger`` (signed by another CA)."""
    ca = create_ca(directory / "ca")
    agent = create_node_cert(ca, directory / "nodes", "dec-1")
    clients = {
        name: create_node_cert(ca, directory / "nodes", name)
        for name in ("orchestrator", "intruder")
    }
    other = create_ca(directory / "other-ca", name="other-ca")
    clients["stranger"] = create_node_cert(other, directory / "other", "orchestrator")
    return Pki(ca=ca.ca_file, agent_cert=agent.cert_file, agent_key=agent.key_file, clients=clients)

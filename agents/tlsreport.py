"""The agent's TLS state for heartbeats: is mTLS on, which certificate, until when, which CA,
how many callers are allowlisted.

The console's Security page shows the expiry dates and its readiness check fails a deployment
whose nodes run without mTLS or whose certificate expires within 14 days. Certificates are
reloadable on disk (rotation replaces the files), so the files are re-read whenever their
mtime or size changes; otherwise the parsed result is reused.

Who calls it: :meth:`agents.service.AgentService.heartbeat_body`, on the event loop, once per
beat: a ``stat`` of two files, and a parse of a few KiB when they changed. Never raises: an
unreadable or malformed file is reported in ``error``.
"""

from __future__ import annotations

import hashlib
from datetime import UTC
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.x509.oid import NameOID

from agents.config import AgentConfig

_Key = tuple[tuple[str, int, int], ...]


def _stat_key(paths: list[str]) -> _Key:
    key = []
    for path in paths:
        st = Path(path).stat()
        key.append((path, st.st_mtime_ns, st.st_size))
    return tuple(key)


def _first_cert(path: str) -> x509.Certificate:
    certs = x509.load_pem_x509_certificates(Path(path).read_bytes())
    return certs[0]


def describe(cert_path: str, ca_path: str) -> dict[str, Any]:
    """Subject CN, DNS/IP SANs, not-after (UTC ISO) of the certificate; sha256 fingerprint of
    the CA certificate's DER. Blocking (reads two small files); raises OSError / ValueError."""
    cert = _first_cert(cert_path)
    ca = _first_cert(ca_path)
    names = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    try:
        ext = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        sans = [*ext.get_values_for_type(x509.DNSName)]
        sans += [str(ip) for ip in ext.get_values_for_type(x509.IPAddress)]
    except x509.ExtensionNotFound:
        sans = []
    not_after = cert.not_valid_after_utc.astimezone(UTC)
    return {
        "subject": str(names[0].value) if names else cert.subject.rfc4514_string(),
        "sans": sans,
        "not_after": not_after.isoformat().replace("+00:00", "Z"),
        "ca_fingerprint": hashlib.sha256(ca.public_bytes(serialization.Encoding.DER)).hexdigest(),
    }


class TlsReporter:
    """Builds the heartbeat's ``tls`` object from the agent's config, caching the parse."""

    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        self._key: _Key | None = None
        self._cached: dict[str, Any] = {}

    def report(self) -> dict[str, Any]:
        """``{mtls, subject, sans, not_after, ca_fingerprint, allowlist_size, error}``."""
        tls = self.config.tls
        out: dict[str, Any] = {
            "mtls": not self.config.insecure,
            "subject": "",
            "sans": [],
            "not_after": None,
            "ca_fingerprint": "",
            "allowlist_size": len(tls.allowed_identities),
            "error": "",
        }
        if self.config.insecure:
            return out
        try:
            key = _stat_key([tls.cert, tls.ca])
            if key != self._key:
                self._cached = describe(tls.cert, tls.ca)
                self._key = key
        except (OSError, ValueError, IndexError) as exc:
            # A rotation caught half-written, or a file removed: say so, try again next beat.
            self._key = None
            out["error"] = f"tls: cannot read the certificate or CA: {exc}"
            return out
        return {**out, **self._cached}

"""mTLS for the KV link and the agents' control API: one config object, credentials that
reload certificates without a restart, and a peer allowlist.

A peer's **identity** is the subject common name (CN) of its certificate, exactly one per
certificate; an allowlist (``allowed_peers``) admits a peer when that CN is one of its
entries, and nothing else on the certificate counts: subject alternative names say where a
server may be dialled (TLS clients check them), not who a client is, and two certificates
may share them (``localhost``, a service name). A certificate with no CN, or more than one,
is refused by an allowlist (:meth:`TLSConfig.check_peer`).

Who calls it: :class:`grpc_kv.receiver.ReceiverServer`, the sender, and the agent's control
API (``tls.add_port(server, bind)``, ``tls.channel(target)``, ``tls.authorize(context)``).
Non-blocking except for reading PEM files. Misconfiguration raises ValueError naming the
field; a peer outside the allowlist gets PERMISSION_DENIED.
"""

from __future__ import annotations

import contextlib
import logging
import os
import ssl
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

log = logging.getLogger("grpc_kv.tls")


class PeerRejected(Exception):
    """The peer's identity (its certificate's common name) is not one of the allowed peers,
    or its certificate has no single common name to check."""


@dataclass(frozen=True)
class TLSConfig:
    """Transport security of a link endpoint.

    ``ca_file`` verifies the peer, ``cert_file``/``key_file`` identify this node (PEM, as made
    by ``pdbridge kv certs``). ``allowed_peers``: the identities accepted from clients --
    certificate common names, matched exactly; a subject alternative name never matches (None
    = any certificate signed by the CA).
    ``server_name``: the name a client expects in the server's certificate when it differs
    from the host it dials (e.g. dialing 127.0.0.1 of a cert issued to ``site-a``).
    ``insecure=True`` switches TLS off entirely; only for localhost development (the CLIs
    require an explicit ``--insecure``). Files are re-read when they change on disk.
    """

    ca_file: Path | None = None
    cert_file: Path | None = None
    key_file: Path | None = None
    allowed_peers: Sequence[str] | None = None
    server_name: str | None = None
    insecure: bool = False
    _state: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("ca_file", "cert_file", "key_file"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, Path):
                object.__setattr__(self, name, Path(value))
        if self.insecure:
            if self.allowed_peers:
                raise ValueError("allowed_peers: an allowlist needs TLS (insecure=True given)")
            return
        for name in ("ca_file", "cert_file", "key_file"):
            path = getattr(self, name)
            if path is None:
                raise ValueError(f"{name}: required unless insecure=True")
            if not path.is_file():
                raise ValueError(f"{name}: {path} is not a readable file")

    @classmethod
    def development(cls) -> TLSConfig:
        """Plaintext, for localhost development and tests that are not about security."""
        return cls(insecure=True)

    @classmethod
    def from_dir(cls, directory: Path | str, name: str, **kwargs: Any) -> TLSConfig:
        """The files ``pdbridge kv certs`` writes for node ``name`` into ``directory``."""
        base = Path(directory)
        return cls(
            ca_file=base / "ca.pem",
            cert_file=base / f"{name}.pem",
            key_file=base / f"{name}-key.pem",
            **kwargs,
        )

    # -- file reading, cached by file identity (reload without restart) ------------------
    def _files(self) -> tuple[Path, Path, Path]:
        if self.ca_file is None or self.cert_file is None or self.key_file is None:
            raise ValueError("tls: ca_file, cert_file and key_file are required unless insecure")
        return self.ca_file, self.cert_file, self.key_file

    def _stamp(self) -> tuple[int, ...]:
        # Inode and size as well as the modification time: a rotation by rename (mv, a
        # Kubernetes Secret's symlink swap) or a copy that keeps the old mtime (cp -p) still
        # reads as a change.
        out: list[int] = []
        for path in self._files():
            st = os.stat(path)
            out += (st.st_ino, st.st_size, st.st_mtime_ns)
        return tuple(out)

    def _material(self) -> tuple[tuple[int, ...], tuple[bytes, bytes, bytes]]:
        """(stamp, (ca, cert, key)) as on disk now, read again only when the files changed.
        The cache is shared by every user of this config (the engine's KV listener and its
        link pool hold the same one); each user keeps its own record of the stamp it last
        used, so one user reading new files first never hides the change from another."""
        ca_file, cert_file, key_file = self._files()
        stamp = self._stamp()
        cached = self._state.get("material")
        if cached is not None and cached[0] == stamp:
            return cached
        material = (ca_file.read_bytes(), cert_file.read_bytes(), key_file.read_bytes())
        self._state["material"] = (stamp, material)
        return stamp, material

    def _log_reload(self, use: str, cert: bytes) -> None:
        serial, subject, not_after = certificate_summary(cert)
        log.info(
            "tls_reloaded use=%s cert_file=%s serial=%s subject=%s not_after=%s",
            use,
            self.cert_file,
            serial,
            subject,
            not_after,
        )

    # -- server side ---------------------------------------------------------------------
    def server_credentials(self) -> grpc.ServerCredentials:
        """Server credentials requiring a client certificate signed by the CA. gRPC asks
        for a new configuration at every handshake; files changed on disk are served from
        the next handshake on (connections already open keep theirs: a transfer in flight
        is not disturbed). A certificate that does not match its key (a rotation caught
        between the two files) is not taken: the old pair serves until the new one is
        whole."""
        stamp, (ca, cert, key) = self._material()
        served = {"stamp": stamp, "deferred": None}

        def config(ca: bytes, cert: bytes, key: bytes) -> Any:
            return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)

        def fetch() -> Any:
            try:
                stamp, (ca, cert, key) = self._material()
            except OSError as exc:  # mid-rotation: keep serving with the old files
                log.warning("tls_reload_failed use=grpc_server error=%s", exc)
                return None
            if stamp == served["stamp"]:
                return None
            if not pair_matches(cert, key):
                if served["deferred"] != stamp:  # once per state of the files, not per peer
                    served["deferred"] = stamp
                    log.warning(
                        "tls_reload_deferred use=grpc_server cert_file=%s "
                        "reason=certificate_does_not_match_key",
                        self.cert_file,
                    )
                return None
            served["stamp"] = stamp
            self._log_reload("grpc_server", cert)
            return config(ca, cert, key)

        return grpc.dynamic_ssl_server_credentials(
            config(ca, cert, key), fetch, require_client_authentication=True
        )

    def add_port(self, server: grpc.aio.Server, bind: str) -> int:
        """Bind ``server`` to ``bind`` (``host:port``, port 0 = ephemeral); returns the port."""
        if self.insecure:
            return server.add_insecure_port(bind)
        return server.add_secure_port(bind, self.server_credentials())

    def authorize(self, context: grpc.aio.ServicerContext[Any, Any]) -> str:
        """The peer's identity (its certificate's common name, or ``insecure``) or
        PeerRejected when an allowlist is set and does not hold it (:meth:`check_peer`)."""
        if self.insecure:
            return "insecure"
        auth = context.auth_context()

        def values(key: str) -> list[str]:
            # gRPC lists an empty common name for a certificate without one.
            return [value.decode(errors="replace") for value in auth.get(key, []) if value]

        subject = ",".join(values("x509_subject"))
        # gRPC lists one common name (the first); only the subject shows whether there are
        # more, and a certificate with several has no single identity.
        common_names = values("x509_common_name")
        in_subject = subject_common_names(subject)
        if len(in_subject) > 1:
            common_names = in_subject
        names = [*common_names, *values("x509_subject_alternative_name")]
        return self.check_peer(common_names, names, subject=subject or None)

    def check_peercert(self, cert: dict[str, Any] | None) -> str:
        """:meth:`check_peer` for a peer certificate as ``SSLObject.getpeercert()`` returns
        it (the bulk data path), with its subject in the refusal."""
        return self.check_peer(
            peercert_common_names(cert), peercert_names(cert), subject=peercert_subject(cert)
        )

    def check_peer(
        self, common_names: Sequence[str], names: Sequence[str], subject: str | None = None
    ) -> str:
        """The peer's identity -- the common name of its certificate -- or PeerRejected when
        it presented no certificate, or an allowlist is set and the certificate has no common
        name, several, or one not on the allowlist. ``names`` (the common name and every
        subject alternative name) only describe the certificate in the refusal: a name the
        allowlist holds as a SAN does not admit a certificate whose common name it is not.
        Shared by gRPC and the bulk data path, so both admit exactly the same peers. The
        refusal's message names the certificate's ``subject`` (``CN=...``) and every name it
        carries, so the receiver's ``peer_rejected`` log line says exactly who was turned
        away. Without an allowlist the identity is only recorded: the common name, else the
        first name."""
        common_names = [n for n in common_names if n]
        names = [n for n in names if n]
        if not common_names and not names:
            raise PeerRejected("no client certificate")
        listed = ", ".join(dict.fromkeys(names)) or "none"
        described = f"certificate {subject or 'subject unknown'}; names {listed}"
        if self.allowed_peers is None:
            return common_names[0] if len(common_names) == 1 else [*common_names, *names][0]
        if not common_names:
            raise PeerRejected(
                f"peer certificate has no common name, the identity an allowlist matches "
                f"({described})"
            )
        if len(common_names) > 1:
            raise PeerRejected(
                f"peer certificate has {len(common_names)} common names, an identity is exactly "
                f"one ({described})"
            )
        identity = common_names[0]
        if identity not in self.allowed_peers:
            raise PeerRejected(
                f"peer {identity!r} is not on the allowlist ({described}; only the common "
                f"name is matched)"
            )
        return identity

    # -- the bulk data path (Python's ssl, not grpc's) -----------------------------------
    def ssl_context(self, server_side: bool) -> ssl.SSLContext:
        """An ``ssl`` context with the same files and rules as the gRPC credentials: peer
        certificate REQUIRED and verified against the CA on both sides; the client checks
        the server's name (``server_name`` or the host it dials). Rebuilt when the files
        change on disk (the next connection uses the new ones)."""
        ca_file, cert_file, key_file = self._files()
        key = "ssl_server" if server_side else "ssl_client"
        stamp = self._stamp()
        cached = self._state.get(key)
        if cached is not None and cached[0] == stamp:
            return cached[1]
        proto = ssl.PROTOCOL_TLS_SERVER if server_side else ssl.PROTOCOL_TLS_CLIENT
        ctx = ssl.SSLContext(proto)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        try:
            ctx.load_cert_chain(cert_file, key_file)
            ctx.load_verify_locations(cafile=ca_file)
        except (OSError, ssl.SSLError) as exc:
            if cached is None:
                raise
            # A rotation caught half-way (the certificate replaced, its key not yet): keep
            # the context that worked; the next connection tries again.
            log.warning("tls_reload_deferred use=%s cert_file=%s error=%s", key, cert_file, exc)
            return cached[1]
        ctx.verify_mode = ssl.CERT_REQUIRED
        self._state[key] = (stamp, ctx)
        if cached is not None:
            with contextlib.suppress(OSError):
                self._log_reload(
                    "bulk_server" if server_side else "bulk_client", cert_file.read_bytes()
                )
        return ctx

    # -- client side ---------------------------------------------------------------------
    def channel_credentials(self) -> grpc.ChannelCredentials:
        """Client credentials from the current files (a new channel picks up new files)."""
        _, (ca, cert, key) = self._material()
        return grpc.ssl_channel_credentials(
            root_certificates=ca, private_key=key, certificate_chain=cert
        )

    def channel(self, target: str, options: Sequence[tuple[str, Any]] = ()) -> grpc.aio.Channel:
        """An asyncio channel to ``target``, secure unless insecure=True."""
        opts = list(options)
        if self.insecure:
            return grpc.aio.insecure_channel(target, options=opts)
        if self.server_name:
            opts.append(("grpc.ssl_target_name_override", self.server_name))
        return grpc.aio.secure_channel(target, self.channel_credentials(), options=opts)


#: ``getpeercert()`` attribute names -> the short names of RFC 4514 (what gRPC's
#: ``x509_subject`` uses).
_RDN_SHORT = {
    "commonName": "CN",
    "organizationName": "O",
    "organizationalUnitName": "OU",
    "countryName": "C",
    "stateOrProvinceName": "ST",
    "localityName": "L",
}


def peercert_subject(cert: dict[str, Any] | None) -> str | None:
    """The subject of a peer certificate from ``SSLObject.getpeercert()`` written as gRPC's
    auth context writes it (``CN=node-a`` or ``CN=node-a,O=site``), None without one."""
    if not cert or not cert.get("subject"):
        return None
    parts = [
        f"{_RDN_SHORT.get(key, key)}={value}"
        for rdn in reversed(cert["subject"])
        for key, value in rdn
    ]
    return ",".join(parts)


def peercert_names(cert: dict[str, Any] | None) -> list[str]:
    """Common name and subject alternative names of a peer certificate as returned by
    ``SSLObject.getpeercert()`` (the same names gRPC's auth context lists)."""
    if not cert:
        return []
    names = peercert_common_names(cert)
    names += [value for _kind, value in cert.get("subjectAltName", ())]
    return names


def peercert_common_names(cert: dict[str, Any] | None) -> list[str]:
    """Every common name in the subject of a peer certificate from ``getpeercert()`` (one
    for a certificate with an identity)."""
    if not cert:
        return []
    return [value for rdn in cert.get("subject", ()) for key, value in rdn if key == "commonName"]


def subject_common_names(subject: str) -> list[str]:
    """Every ``CN`` value of a subject written as RFC 4514 / 2253 (gRPC's ``x509_subject``:
    ``CN=node-a,O=site``), escapes undone. Attributes are split at unescaped ``,`` and ``+``."""
    out: list[str] = []
    parts: list[str] = []
    current: list[str] = []
    i = 0
    while i < len(subject):
        char = subject[i]
        if char == "\\" and i + 1 < len(subject):
            current.append(subject[i : i + 2])
            i += 2
            continue
        if char in ",+":
            parts.append("".join(current))
            current = []
        else:
            current.append(char)
        i += 1
    parts.append("".join(current))
    for part in parts:
        key, sep, value = part.partition("=")
        if sep and key.strip().upper() in {"CN", "COMMONNAME", "2.5.4.3"}:
            out.append(_unescape_rdn_value(value))
    return out


def _unescape_rdn_value(value: str) -> str:
    """An RFC 4514 attribute value with ``\\,`` style and ``\\XX`` hex escapes undone."""
    raw = bytearray()
    i = 0
    while i < len(value):
        char = value[i]
        if char == "\\" and i + 1 < len(value):
            pair = value[i + 1 : i + 3]
            if len(pair) == 2 and all(c in "0123456789abcdefABCDEF" for c in pair):
                raw.append(int(pair, 16))
                i += 3
                continue
            raw += value[i + 1].encode()
            i += 2
            continue
        raw += char.encode()
        i += 1
    return raw.decode(errors="replace")


def certificate_identity(cert: bytes) -> str | None:
    """The identity of a PEM certificate (its one subject common name), None when it has
    none or several (an allowlist would refuse it). ValueError when it does not parse."""
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    parsed = x509.load_pem_x509_certificate(cert)
    names = parsed.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    return str(names[0].value) if len(names) == 1 else None


def certificate_server_name(cert: bytes) -> str | None:
    """A name a TLS client can expect when it dials the holder of a PEM certificate by an
    address the certificate does not list (its own loopback): the identity when the
    certificate's subject alternative names carry it (certificates of ``pdbridge kv certs``
    always do), else its first DNS name, else its first IP address; None without any.
    ValueError when it does not parse."""
    from cryptography import x509

    parsed = x509.load_pem_x509_certificate(cert)
    try:
        sans = parsed.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return None
    dns = [str(n) for n in sans.get_values_for_type(x509.DNSName)]
    ips = [str(n) for n in sans.get_values_for_type(x509.IPAddress)]
    identity = certificate_identity(cert)
    if identity is not None and identity in (*dns, *ips):
        return identity
    first = [*dns, *ips]
    return first[0] if first else None


def pair_matches(cert: bytes, key: bytes) -> bool:
    """Whether a PEM certificate holds the public half of a PEM private key (False for
    anything unparsable: a file caught half-written)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    try:
        public = x509.load_pem_x509_certificate(cert).public_key()
        private = serialization.load_pem_private_key(key, password=None)
    except (ValueError, TypeError):
        return False
    encoding, fmt = serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    return public.public_bytes(encoding, fmt) == private.public_key().public_bytes(encoding, fmt)


def certificate_summary(cert: bytes) -> tuple[str, str, str]:
    """(serial in hex, subject, notAfter in ISO 8601) of a PEM certificate, for logs; "?"
    fields when it does not parse."""
    from cryptography import x509

    try:
        parsed = x509.load_pem_x509_certificate(cert)
    except ValueError:
        return "?", "?", "?"
    return (
        format(parsed.serial_number, "x"),
        parsed.subject.rfc4514_string(),
        parsed.not_valid_after_utc.isoformat(),
    )

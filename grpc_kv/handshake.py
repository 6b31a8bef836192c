"""Telling a refused TLS handshake from an unreachable receiver, so that the sender fails at
once with the reason instead of retrying until its deadline.

grpcio reports every failed connection as UNAVAILABLE; only its text tells a certificate
problem (which no retry fixes) from a receiver that is down or a path that is cut (which a
retry may). :func:`refusal_in_details` reads that text. Two refusals leave no trace in it
("Socket closed"): the receiver refusing *our* certificate (its CA unknown there, expired,
revoked) and a plaintext sender dialling a TLS port. :func:`diagnose` then performs one TLS
handshake of its own with the same files and reports what the receiver answered. Both are
called by :mod:`grpc_kv.sender` only after a failure; nothing here runs on a healthy path.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl

from grpc_kv.tls import TLSConfig

#: Texts of grpcio's connection errors that mean a certificate or protocol refusal.
_TLS_FAILURES = (
    ("Hostname Verification Check failed", "the receiver's certificate names another host"),
    ("CERTIFICATE_VERIFY_FAILED", "the receiver's certificate is not trusted by this sender"),
    ("WRONG_VERSION_NUMBER", "the receiver does not speak TLS; this sender requires it"),
    ("certificate has expired", "a certificate has expired"),
    ("Tls handshake failed", "the TLS handshake failed"),
)
#: How long the diagnostic handshake waits for the receiver's verdict on our certificate
#: (TLS 1.3 sends it after the client's half of the handshake, with the first read). Only a
#: failed connection waits for it (a receiver that accepts speaks first at once); 0.5 s was
#: missed on a loaded 2-core host, and the refusal was then retried to the deadline.
VERDICT_WAIT_S = 2.0


def refusal_in_details(details: str) -> str | None:
    """The reason a gRPC connection error is a TLS refusal, or None if it is not one."""
    for marker, reason in _TLS_FAILURES:
        if marker in details:
            # grpcio's text ends with the address and the TLS library's words.
            cause = details.removesuffix(": OK").rpartition(": ")[2] or marker
            return f"{reason} ({cause})"
    return None


def _looks_closed(details: str) -> bool:
    """The connection was closed during set-up, with no reason given."""
    return "Socket closed" in details or "Connection reset" in details


async def diagnose(target: str, tls: TLSConfig, details: str, timeout: float) -> str | None:
    """Why connecting to ``target`` fails in a way no retry fixes, or None (down, cut, or
    nothing wrong that a handshake shows). ``details``: grpcio's text for the failure."""
    reason = refusal_in_details(details)
    if reason is not None or not _looks_closed(details):
        return reason
    host, _, port = target.rpartition(":")
    host = host.strip("[]")
    if tls.insecure:
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        server_name: str | None = None
    else:
        context = tls.ssl_context(server_side=False)
        server_name = tls.server_name or host
    try:
        async with asyncio.timeout(timeout):
            reader, writer = await asyncio.open_connection(
                host, int(port), ssl=context, server_hostname=server_name
            )
    except ssl.SSLCertVerificationError as exc:
        return f"the receiver's certificate is not trusted by this sender ({exc.verify_message})"
    except ssl.SSLError as exc:
        if tls.insecure:
            return "the receiver requires TLS; this sender is configured for plaintext"
        return f"the receiver refused this sender's certificate ({exc.reason or exc})"
    except (OSError, TimeoutError, ValueError):
        return None
    try:
        if tls.insecure:
            return "the receiver requires TLS; this sender is configured for plaintext"
        try:
            async with asyncio.timeout(VERDICT_WAIT_S):
                first = await reader.read(1)
        except ssl.SSLError as exc:
            return f"the receiver refused this sender's certificate ({exc.reason or exc})"
        except (OSError, TimeoutError):
            return None
        if not first:
            # A gRPC server that accepts a connection speaks first (HTTP/2 SETTINGS); one that
            # closes it right after the handshake has refused the client's certificate (grpc
            # core sends no alert that Python could read).
            return (
                "the receiver closed the connection after the handshake: it refused this "
                "sender's certificate (not from a CA it trusts, expired, or revoked)"
            )
        return None
    finally:
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()

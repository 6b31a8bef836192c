"""What a transfer returns (:class:`TransferSummary`) or raises (:class:`TransferError` and
its kinds). Raised by :mod:`grpc_kv.sender`; re-exported by :mod:`grpc_kv.api`."""

from __future__ import annotations

from dataclasses import dataclass, field

import grpc


class _StreamStalled(Exception):
    """A connection had chunks in flight and no ack for the stall timeout."""


class TransferError(Exception):
    """A transfer failed; ``code`` is the receiver's gRPC status when it refused."""

    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        self.code = code


class TransferTimeout(TransferError):
    """The transfer did not complete within ``timeout_ms``."""


class ReceiverUnreachable(TransferError):
    """The sender could not open the transfer: every Begin for ``unreachable_ms`` failed to
    reach the receiver (connection refused or reset, no route, no answer within the RPC's
    deadline). The decode site's KV receiver is down, or the path to it is cut."""


class TransferRefused(TransferError):
    """The receiver refused (fingerprint, version, id reuse, peer not allowed, bad frame)."""


class PeerRefused(TransferRefused):
    """Sender and receiver do not accept each other: a TLS handshake refused (a certificate
    untrusted, expired or for another name, plaintext against TLS or the reverse) or the
    sender's certificate not on the receiver's allowlist. Raised at the first attempt, never
    retried: no retry can fix it. ``reason``: ``tls`` or ``not_allowed``."""

    def __init__(self, message: str, code: grpc.StatusCode | None, reason: str) -> None:
        super().__init__(message, code)
        self.reason = reason


@dataclass
class TransferSummary:
    """What a finished transfer cost: returned by :meth:`Transfer.finish`."""

    transfer_id: str
    bytes_raw: int = 0
    bytes_wire: int = 0
    chunks: int = 0
    retransmits: int = 0
    resent_bytes: int = 0
    resumes: int = 0
    checksum_failures: int = 0
    busy: int = 0
    seconds: float = 0.0
    codecs: dict[str, int] = field(default_factory=dict)
    #: The per-chunk checksum used: xxh3 | crc32c | none (``none``: nothing was verified).
    checksum: str = "xxh3"
    #: Where the chunks went: ``grpc`` (Push streams) or ``bulk`` (data connections); a
    #: sender that asked for ``bulk`` of a receiver that does not offer it says ``grpc``.
    data_path: str = "grpc"

    @property
    def goodput_mbit_s(self) -> float:
        return self.bytes_raw * 8 / 1e6 / self.seconds if self.seconds else 0.0

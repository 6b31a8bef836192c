"""Knobs of the KV link, each documented once here (``docs/kv-link.md`` explains trade-offs).

Defaults follow the deployment guide: 32 MiB chunks, 3 retries, 4000 ms transfer timeout,
checksums on (``checksum="none"`` only for diagnostics), 70 % link utilisation ceiling.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from grpc_kv.codec import Checksum, Codec

MIB = 1 << 20
DATA_PATHS = ("grpc", "bulk")


@dataclass(frozen=True)
class LinkOptions:
    """Sender-side behaviour of a transfer (and the receiver's expectations of it)."""

    #: Bytes per chunk. Large chunks amortise per-message cost; small ones let the receiver
    #: hand the first layer to decode sooner and bound what a resume re-sends. The guide's
    #: 32 MiB measured ~5x slower than 4 MiB through grpcio (docs/kv-link.md), hence 4 MiB.
    chunk_size_bytes: int = 4 * MIB
    #: none | zstd | zstd-byteplane | auto (compress only when it shortens the transfer).
    compression: Codec = Codec.AUTO
    #: zstd level: 1 is ~600 MB/s per core on bf16; higher levels barely improve KV ratios.
    zstd_level: int = 1
    #: Per-chunk checksum of the raw bytes: xxh3 (default) or crc32c. ``none`` is a
    #: diagnostic mode, never for production: no checksum is computed or verified, so bytes
    #: damaged in flight reach the consumer (logged once per link, counted in
    #: ``pdbridge_kv_unverified_chunks_total``).
    checksum: Checksum = Checksum.XXH3
    #: Parallel TCP connections per peer; chunks are striped across them.
    connections: int = 2
    #: Chunks in flight (sent, not yet acknowledged) across all connections. Also the most
    #: a reconnect ever re-sends.
    window: int = 8
    #: Attempts per chunk after its first send (corrupt in flight, lost in a cut).
    retry: int = 3
    #: First backoff between attempts; doubles per attempt with +-50 % jitter.
    backoff_ms: int = 50
    #: Overall deadline of a transfer, from open to the receiver's confirmation of finish.
    timeout_ms: int = 4000
    #: Deadline of each control RPC (Begin, Finish, Cancel, Ping).
    rpc_timeout_ms: int = 2000
    #: How long the sender keeps re-trying a receiver it cannot reach -- connection refused
    #: or reset, no route, no answer within ``rpc_timeout_ms`` -- with nothing heard from it
    #: (no Begin answered, no ack), before failing the transfer with ``ReceiverUnreachable``
    #: (0: until the deadline). Shorter outages are resumed as before; a cut link fails
    #: within this, named, and the gateway serves the request another way at once instead
    #: of every request in flight waiting out ``timeout_ms``. A slow link still acks: never
    #: unreachable; a stalled stream is reset and resumed, then judged by this.
    unreachable_ms: int = 3000
    #: Link capacity in bits/s as measured by ``probe`` (0 = unknown). Feeds the rate
    #: ceiling and ``auto`` compression.
    link_rate_bps: float = 0.0
    #: Fraction of ``link_rate_bps`` the sender may use (token bucket on wire bytes);
    #: 1.0 means no pacing at all.
    utilisation_ceiling: float = 0.7
    #: Absolute ceiling in bits/s; overrides link_rate_bps x utilisation_ceiling when > 0.
    rate_limit_bps: float = 0.0
    #: HTTP/2 keepalive ping interval (and timeout) of sender connections: a black-holed
    #: path is noticed after about twice this, so keep it well under timeout_ms.
    keepalive_ms: int = 1000
    #: Encoded bytes a producer may have queued or in flight before send_layer blocks.
    send_buffer_bytes: int = 512 * MIB
    #: ``grpc``: chunks travel as gRPC messages on the Push streams. ``bulk``: gRPC stays
    #: the control plane (Begin, acks' meaning, Finish, Cancel) but chunks go over raw
    #: data connections (TLS with the same certificates unless insecure) that the receiver
    #: advertises in Begin, bypassing grpcio's message copies (docs/kv-link.md, "Bulk data
    #: path"). A receiver that does not offer it gets gRPC chunks. Default ``grpc`` until
    #: the bulk path has run in production.
    data_path: str = "grpc"

    def __post_init__(self) -> None:
        if self.data_path not in DATA_PATHS:
            raise ValueError(f"data_path: {self.data_path!r} is not one of {', '.join(DATA_PATHS)}")
        object.__setattr__(self, "compression", _enum(Codec, self.compression, "compression"))
        object.__setattr__(self, "checksum", _enum(Checksum, self.checksum, "checksum"))
        positive = (
            "chunk_size_bytes",
            "connections",
            "window",
            "timeout_ms",
            "rpc_timeout_ms",
            "keepalive_ms",
        )
        for name in positive:
            if int(getattr(self, name)) <= 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)!r}")
        for name in ("retry", "backoff_ms", "link_rate_bps", "rate_limit_bps", "unreachable_ms"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: must be >= 0, got {getattr(self, name)!r}")
        if not 0 < self.utilisation_ceiling <= 1:
            raise ValueError("utilisation_ceiling: must be in (0, 1]")
        if not 1 <= self.zstd_level <= 22:
            raise ValueError("zstd_level: must be 1..22")
        if self.send_buffer_bytes < self.chunk_size_bytes:
            raise ValueError("send_buffer_bytes: must hold at least one chunk")

    @property
    def rate_ceiling_bps(self) -> float:
        """Bits/s the sender may put on the wire (0 = unlimited). A ceiling of 1.0 is no
        ceiling: pacing at a *measured* link rate can only under-fill the link (a probe
        reading 3 % low cost 3 % of goodput on a 1 Gbit/s link), and the link paces itself."""
        if self.rate_limit_bps > 0:
            return self.rate_limit_bps
        if self.utilisation_ceiling >= 1.0:
            return 0.0
        return self.link_rate_bps * self.utilisation_ceiling

    def replace(self, **changes: Any) -> LinkOptions:
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class ReceiverOptions:
    """Receiver-side limits."""

    #: Decoded bytes the receiver holds for all transfers (not yet consumed). A chunk over
    #: the budget is answered BUSY and the sender backs off.
    memory_budget_bytes: int = 1024 * MIB
    #: Largest raw chunk accepted; bigger declared chunks are INVALID_ARGUMENT.
    max_chunk_bytes: int = 64 * MIB
    #: An incomplete transfer with no progress for this long is expired and its memory freed.
    ttl_s: float = 30.0
    #: Extra time past a sender's announced deadline before the receiver gives up on it.
    deadline_grace_s: float = 0.25
    #: A begun, unfinished transfer whose sender (its certificate identity and host) has had
    #: no data stream open for this long fails as ``sender lost`` (a killed prefill engine's
    #: connections close at once): its consumer learns in seconds, not at its deadline. A
    #: sender on a cut link gives up after its own ``unreachable_ms`` (3 s by default), so
    #: the two ends agree. 0: only the deadline and the TTL end such a transfer.
    sender_lost_s: float = 3.0
    #: Completed transfer ids remembered to refuse reuse.
    remember_completed: int = 65536
    #: gRPC keepalive: ping an idle connection every this many ms (detects dead WAN paths).
    keepalive_ms: int = 10_000
    #: Accept transfers whose sender turned per-chunk checksums off (``checksum="none"``,
    #: diagnostics only). Off: such a transfer is refused at Begin (FAILED_PRECONDITION), so
    #: a misconfigured sender can never hand unverified KV to a decode engine.
    accept_unverified: bool = False
    #: Offer the bulk data path (a second listening TCP port, TLS like the gRPC port) to
    #: senders that ask for it in Begin. Off (the default: no listening port an operator did
    #: not ask for): every sender uses gRPC chunks.
    bulk: bool = False
    #: Port of the bulk data endpoint on the gRPC bind address (0 = ephemeral; set it when
    #: a firewall must know the port).
    bulk_port: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.bulk_port <= 65535:
            raise ValueError(f"bulk_port: must be 0..65535, got {self.bulk_port!r}")
        for f in dataclasses.fields(self):
            if f.type in (bool, "bool") or f.name == "bulk_port":
                continue
            if getattr(self, f.name) <= 0:
                raise ValueError(f"{f.name}: must be > 0, got {getattr(self, f.name)!r}")


def _enum(kind: Any, value: Any, name: str) -> Any:
    try:
        return kind(value)
    except ValueError:
        choices = ", ".join(m.value for m in kind)
        raise ValueError(f"{name}: {value!r} is not one of {choices}") from None


#: The shortest time a connection attempt gets before gRPC gives up on it and tries again:
#: a few WAN round trips of handshakes with room for a busy host.
CONNECT_TIMEOUT_MS = 5000


def grpc_options(max_message: int, keepalive_ms: int = 10_000) -> list[tuple[str, Any]]:
    """Channel/server options shared by both ends: message size for big chunks, keepalive
    so a silently dead WAN path is noticed, and a connection of its own per channel (the
    striping across connections depends on it)."""
    return [
        ("grpc.max_send_message_length", max_message),
        ("grpc.max_receive_message_length", max_message),
        ("grpc.keepalive_time_ms", keepalive_ms),
        ("grpc.keepalive_timeout_ms", max(keepalive_ms, 1000)),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
        # Senders ping every second to notice a black-holed path within the deadline; the
        # receiver must not treat that as abuse.
        ("grpc.http2.min_ping_interval_without_data_ms", 500),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 500),
        ("grpc.http2.max_ping_strikes", 0),
        ("grpc.use_local_subchannel_pool", 1),
        # Reconnect quickly after a cut is restored: the default 1 s+ backoff would eat
        # most of a 4 s transfer deadline.
        ("grpc.initial_reconnect_backoff_ms", 100),
        ("grpc.max_reconnect_backoff_ms", 1000),
        # Not a backoff: gRPC core gives each connection attempt (TCP, TLS handshake, HTTP/2
        # settings) at least this long (grpc/grpc#12830, #33423). At 100 ms, mTLS handshakes
        # across a WAN or a loaded host were cut short ("Handshake read failed (Endpoint
        # closing)", "timed out before receiving SETTINGS frame") until the transfer's
        # deadline passed.
        ("grpc.min_reconnect_backoff_ms", CONNECT_TIMEOUT_MS),
    ]

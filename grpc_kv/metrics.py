"""Prometheus metrics of the KV link.

One :class:`LinkMetrics` per registry: each receiver gets its own (so several receivers in one
test process are counted apart); senders share :data:`SENDER_METRICS` on the default
registry unless given one. ``pdbridge kv serve --metrics-port`` exposes a receiver's.
"""

from __future__ import annotations

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram


class LinkMetrics:
    """Counters and gauges named ``pdbridge_kv_*``; label ``role`` is sender or receiver."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.bytes_raw = Counter(
            "pdbridge_kv_bytes_raw", "Raw (decoded) KV bytes moved", ["role"], registry=r
        )
        self.bytes_wire = Counter(
            "pdbridge_kv_bytes_wire", "Encoded payload bytes on the wire", ["role"], registry=r
        )
        self.chunks = Counter("pdbridge_kv_chunks", "Chunks moved", ["role"], registry=r)
        self.retransmits = Counter(
            "pdbridge_kv_retransmits",
            "Chunks sent again (corrupt, lost, busy)",
            ["role"],
            registry=r,
        )
        self.resumes = Counter(
            "pdbridge_kv_resumes", "Transfers resumed after a reconnect", ["role"], registry=r
        )
        self.checksum_failures = Counter(
            "pdbridge_kv_checksum_failures",
            "Chunks that failed checksum or decode",
            ["role"],
            registry=r,
        )
        self.unverified = Counter(
            "pdbridge_kv_unverified_chunks",
            "Chunks moved with checksum none (diagnostic mode, never in production)",
            ["role"],
            registry=r,
        )
        self.rejected_peers = Counter(
            "pdbridge_kv_rejected_peers", "Peers refused", ["role", "reason"], registry=r
        )
        self.invalid = Counter(
            "pdbridge_kv_invalid_frames",
            "Malformed frames answered INVALID_ARGUMENT",
            ["role"],
            registry=r,
        )
        self.transfer_seconds = Histogram(
            "pdbridge_kv_transfer_seconds",
            "Transfer duration by outcome",
            ["role", "outcome"],
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64),
            registry=r,
        )
        self.active = Gauge(
            "pdbridge_kv_active_transfers", "Transfers in progress", ["role"], registry=r
        )
        self.memory = Gauge(
            "pdbridge_kv_receiver_memory_bytes", "Decoded bytes held by the receiver", registry=r
        )
        self.local_streams = Gauge(
            "pdbridge_kv_local_streams",
            "Engines reading a transfer through the local socket now",
            registry=r,
        )
        self.local_bytes = Counter(
            "pdbridge_kv_local_bytes",
            "Verified bytes handed to engines through the local socket",
            registry=r,
        )
        self.rtt = Gauge(
            "pdbridge_kv_link_rtt_seconds", "Last measured link round trip", ["target"], registry=r
        )

    def value(self, name: str, **labels: str) -> float:
        """Current value of a sample (tests and the CLI read counters this way)."""
        got = self.registry.get_sample_value(name, labels)
        return float(got or 0.0)


SENDER_METRICS = LinkMetrics(REGISTRY)

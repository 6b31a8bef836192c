"""Request traces: each request's path and timeline as the gateway saw it (which path served
it, its queue / prefill / transfer / decode / first-token times, the KV bytes on the wire, the
fallback cause), kept in a bounded ring for ``GET /debug/traces`` and queued, sampled, for
the console (:mod:`agents.gateway.traceship`). The document's shape is :mod:`pdproto.trace`.

Who calls it: :mod:`agents.gateway.app` and :mod:`agents.gateway.remote` mark a request's
:class:`Trace` on the event loop as it goes (a few float stores per request); the ring takes
it when the request ends. Nothing here blocks or raises into the request path.

Bounds: the ring holds ``trace_ring_size`` traces (a few hundred bytes each: request ids are
clipped to :data:`pdproto.http.REQUEST_ID_MAX_CHARS`, failed attempts to
:data:`pdproto.trace.MAX_ATTEMPTS`); the ship queue ``trace_ship_queue``.
"""

from __future__ import annotations

import collections
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from pdproto.http import clip_request_id
from pdproto.trace import MAX_ATTEMPTS, TRACE_VERSION

#: The kv_transfer_params fields of a prefill answer a trace keeps (numbers only).
_KV_FIELDS = ("bytes", "bytes_wire", "send_seconds", "chunks", "retransmits", "resumes")


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 3)


@dataclass(slots=True)
class Trace:
    """One request's record. ``arrived``: the gateway's monotonic clock at arrival, every mark
    is seconds after it; ``started_at``: the wall clock then (shown, and corrected for the
    gateway node's clock skew by the console)."""

    request_id: str
    kind: str
    arrived: float
    started_at: float
    stream: bool = False
    path: str = ""
    outcome: str = ""
    status: int | None = None
    site: str | None = None
    prefill_instance: str | None = None
    decode_instance: str | None = None
    transfer_id: str | None = None
    fallback_cause: str | None = None
    #: A local request of a deployment with a local prefill pool: ``served`` (its KV came
    #: from the pool), else why the decode engine prefilled it itself.
    local_prefill: str | None = None
    failover: tuple[str, str] | None = None
    prompt_tokens: int | None = None
    marks: dict[str, float] = field(default_factory=dict)
    kv: dict[str, float] = field(default_factory=dict)
    attempts: list[dict[str, Any]] = field(default_factory=list)

    def mark(self, name: str, at: float | None = None) -> None:
        """Record ``name`` at ``at`` (monotonic; now when None)."""
        self.marks[name] = (time.monotonic() if at is None else at) - self.arrived

    def prefill_answer(self, kv_params: Any) -> None:
        """Keep the transfer's figures from a prefill answer's ``kv_transfer_params``."""
        if not isinstance(kv_params, dict):
            return
        for key in _KV_FIELDS:
            value = kv_params.get(key)
            if isinstance(value, int | float) and not isinstance(value, bool):
                self.kv[key] = value

    def attempt_failed(self, cause: str) -> None:
        """The remote attempt marked so far failed with ``cause``: it moves to ``attempts``
        (at most :data:`MAX_ATTEMPTS`) and the next one starts afresh."""
        if len(self.attempts) < MAX_ATTEMPTS:
            m = self.marks
            self.attempts.append(
                {
                    "site": self.site,
                    "instance": self.prefill_instance,
                    "transfer_id": self.transfer_id,
                    "cause": cause,
                    "start_ms": _ms(m.get("prefill_sent")),
                    "end_ms": _ms(m.get("prefill_done", m.get("attempt_end"))),
                }
            )
        for key in ("prefill_sent", "prefill_done", "decode_sent", "decode_first_byte"):
            self.marks.pop(key, None)
        self.kv.clear()
        self.transfer_id = self.prefill_instance = None

    def legs(self) -> list[dict[str, Any]]:
        """The timeline (:data:`pdproto.trace.LEGS`), legs that did not happen left out."""
        m = self.marks
        legs: list[dict[str, Any]] = []
        if "admitted" in m:
            legs.append({"leg": "queue", "start_ms": 0.0, "end_ms": _ms(m["admitted"])})
        if "prefill_sent" in m:
            end = m.get("prefill_done")
            legs.append(
                {
                    "leg": "prefill",
                    "site": self.site,
                    "instance": self.prefill_instance,
                    "start_ms": _ms(m["prefill_sent"]),
                    "end_ms": _ms(end),
                }
            )
            send_s = self.kv.get("send_seconds")
            if end is not None and send_s is not None:
                legs.append(
                    {
                        "leg": "transfer",
                        "site": self.site,
                        "instance": self.prefill_instance,
                        "start_ms": _ms(max(end - send_s, m["prefill_sent"])),
                        "end_ms": _ms(end),
                        "source": "prefill engine",
                    }
                )
        if "decode_sent" in m:
            legs.append(
                {
                    "leg": "decode",
                    "instance": self.decode_instance,
                    "start_ms": _ms(m["decode_sent"]),
                    "first_byte_ms": _ms(m.get("decode_first_byte")),
                    "end_ms": _ms(m.get("done")),
                }
            )
        if "first_byte" in m:
            at = _ms(m["first_byte"])
            legs.append({"leg": "first_token", "start_ms": at, "end_ms": at})
        return legs

    def to_json(self) -> dict[str, Any]:
        """The trace document (:mod:`pdproto.trace`)."""
        failover = None
        if self.failover is not None:
            failover = {"from_site": self.failover[0], "cause": self.failover[1]}
        return {
            "version": TRACE_VERSION,
            "request_id": self.request_id,
            "started_at": datetime.fromtimestamp(self.started_at, UTC).isoformat(
                timespec="milliseconds"
            ),
            "kind": self.kind,
            "stream": self.stream,
            "path": self.path,
            "outcome": self.outcome,
            "status": self.status,
            "site": self.site if self.path == "remote" else None,
            "transfer_id": self.transfer_id,
            "fallback_cause": self.fallback_cause,
            "local_prefill": self.local_prefill,
            "failover": failover,
            "prompt_tokens": self.prompt_tokens,
            "kv": dict(self.kv),
            "legs": self.legs(),
            "attempts": list(self.attempts),
            "first_token_ms": _ms(self.marks.get("first_byte")),
            "total_ms": _ms(self.marks.get("done")),
        }


def new_trace(request_id: str, kind: str, arrived: float) -> Trace:
    """A request's trace, started at ``arrived`` (monotonic)."""
    wall = time.time() - (time.monotonic() - arrived)
    return Trace(clip_request_id(request_id), kind, arrived, wall)


class TraceRing:
    """The last ``size`` requests' traces, by request id (a reused id: the newest), and the
    queue of those to ship. Event-loop only."""

    def __init__(self, size: int, ship_queue: int = 0, sample_rate: float = 0.0) -> None:
        self.size = size
        self._ring: collections.deque[Trace] = collections.deque()
        self._by_id: dict[str, Trace] = {}
        self.ship_queue = ship_queue
        self.sample_rate = sample_rate
        self._ship: collections.deque[Trace] = collections.deque()
        self.dropped = 0  # traces that found the ship queue full
        self.shipped = 0  # traces the console took (counted by the shipper)
        self.ship_failures = 0  # batches the console did not take (put back)

    def add(self, trace: Trace) -> None:
        """Keep a finished request's trace; queue it to ship when it is sampled (always when
        it fell back, failed over or failed)."""
        if self.size <= 0:
            return
        if len(self._ring) >= self.size:
            old = self._ring.popleft()
            if self._by_id.get(old.request_id) is old:
                del self._by_id[old.request_id]
        self._ring.append(trace)
        self._by_id[trace.request_id] = trace
        if self.ship_queue <= 0:
            return
        notable = (
            trace.path == "fallback"
            or trace.failover is not None
            or bool(trace.attempts)  # a local prefill leg that failed
            or trace.outcome in ("upstream_error", "rejected")
        )
        if not notable and (self.sample_rate <= 0 or random.random() >= self.sample_rate):  # noqa: S311 - sampling, not security
            return
        if len(self._ship) >= self.ship_queue:
            self.dropped += 1
            return
        self._ship.append(trace)

    def get(self, request_id: str) -> Trace | None:
        return self._by_id.get(clip_request_id(request_id))

    def recent(self, limit: int, path: str | None = None) -> list[Trace]:
        """The newest ``limit`` traces, newest first (only ``path`` when given)."""
        out: list[Trace] = []
        for trace in reversed(self._ring):
            if path is None or trace.path == path:
                out.append(trace)
                if len(out) >= limit:
                    break
        return out

    def take_batch(self, limit: int) -> list[Trace]:
        """Up to ``limit`` queued traces, oldest first, removed from the queue."""
        batch: list[Trace] = []
        while self._ship and len(batch) < limit:
            batch.append(self._ship.popleft())
        return batch

    def requeue(self, batch: list[Trace]) -> None:
        """Put a batch the console did not take back in front (within the queue's bound;
        what does not fit is dropped and counted)."""
        room = max(self.ship_queue - len(self._ship), 0)
        keep = batch[:room]
        self.dropped += len(batch) - len(keep)
        self._ship.extendleft(reversed(keep))

    @property
    def queued(self) -> int:
        return len(self._ship)

    @property
    def held(self) -> int:
        return len(self._ring)


class TraceCollector:
    """The ring's shipping counts as Prometheus families, read at scrape time (the ring and
    the shipper keep plain integers; nothing on the request path touches a metric):
    ``pdbridge_gateway_traces_shipped_total``, ``..._dropped_total`` (the queue was full),
    ``pdbridge_gateway_trace_ship_failures_total`` (batches put back) and the
    ``pdbridge_gateway_traces_queued`` gauge."""

    def __init__(self, ring: TraceRing) -> None:
        self.ring = ring

    def collect(self) -> Iterator[Metric]:
        ring = self.ring
        for name, help_text, value in (
            ("pdbridge_gateway_traces_shipped", "Traces the console took.", ring.shipped),
            ("pdbridge_gateway_traces_dropped", "Traces dropped: the ship queue was full.",
             ring.dropped),
            ("pdbridge_gateway_trace_ship_failures", "Trace batches the console did not take.",
             ring.ship_failures),
        ):  # fmt: skip
            yield CounterMetricFamily(name, help_text, value=value)
        yield GaugeMetricFamily(
            "pdbridge_gateway_traces_queued", "Traces waiting to be shipped.", value=ring.queued
        )

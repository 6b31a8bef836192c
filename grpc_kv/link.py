"""Client side connections to one receiver: N channels (one TCP connection each), a shared
token-bucket rate ceiling, a goodput estimate for ``auto`` compression, and RTT pings.

A :class:`Link` may carry many transfers one after another or at once (the prefill engine
keeps one per decode site). Not thread-safe; use from one asyncio loop.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any

import grpc

from grpc_kv.alloc import tune_allocator
from grpc_kv.metrics import SENDER_METRICS, LinkMetrics
from grpc_kv.options import LinkOptions, grpc_options
from grpc_kv.protocol import PACKAGE, pb
from grpc_kv.tls import TLSConfig
from grpc_kv.wire import varint

log = logging.getLogger("grpc_kv.link")
METHOD = f"/{PACKAGE}.KvLink/"
#: End-of-stream marker of grpc.aio calls (missing from the type stubs).
EOF: Any = grpc.aio.EOF  # type: ignore[attr-defined]


class TokenBucket:
    """Rate ceiling on wire bytes shared by every connection of a link. ``take`` may leave
    the bucket in debt and then sleeps the debt off, so a chunk larger than the burst
    still goes out at the configured average rate."""

    def __init__(self, bytes_per_s: float, burst: float) -> None:
        self.rate = bytes_per_s
        self.burst = burst
        self._tokens = burst
        self._stamp = time.monotonic()

    async def take(self, n: int) -> None:
        if self.rate <= 0:
            return
        now = time.monotonic()
        self._tokens = min(self.burst, self._tokens + (now - self._stamp) * self.rate)
        self._stamp = now
        self._tokens -= n
        if self._tokens < 0:
            await asyncio.sleep(-self._tokens / self.rate)


class Link:
    """Connections from this process to one receiver ``target`` (``host:port``).

    Created by :func:`grpc_kv.sender.open_transfer` when none is passed; long-lived users
    create one, pass it as ``link=`` and ``await link.close()`` at shutdown.
    """

    def __init__(
        self,
        target: str,
        options: LinkOptions | None = None,
        tls: TLSConfig | None = None,
        metrics: LinkMetrics | None = None,
    ) -> None:
        if tls is None:
            raise ValueError("tls: required (TLSConfig(...) or TLSConfig.development())")
        self.target = target
        self.options = options or LinkOptions()
        self.tls = tls
        self.metrics = metrics or SENDER_METRICS
        tune_allocator()
        max_message = self.options.chunk_size_bytes + (1 << 20)
        self._opts = grpc_options(max(max_message, 64 << 20), self.options.keepalive_ms)
        self.channels = [
            self.tls.channel(target, self._opts) for _ in range(self.options.connections)
        ]
        self._closing: set[asyncio.Future[None]] = set()  # replaced channels still closing
        ceiling = self.options.rate_ceiling_bps / 8
        self.bucket = TokenBucket(ceiling, burst=max(self.options.chunk_size_bytes, ceiling * 0.05))
        self._window_bytes = 0
        self._window_start = time.monotonic()
        self.goodput_bytes_per_s = 0.0
        self._measuring: asyncio.Future[None] | None = None
        self.acked_wire_bytes = 0  # every transfer's, since the link opened
        self._probe_failed_at = -PROBE_RETRY_S
        self._warned_unverified = False
        #: Transfers open on this link now: the rate probe runs only while there are none.
        self.transfers = 0
        self._probing = False

    def unary(self, index: int, name: str, response: Any) -> Any:
        return self.channels[index % len(self.channels)].unary_unary(
            METHOD + name, request_serializer=_serialize, response_deserializer=response.FromString
        )

    def push(self, index: int) -> Any:
        return self.channels[index].stream_stream(
            METHOD + "Push", request_serializer=None, response_deserializer=pb.Ack.FromString
        )

    def probe_call(self, index: int) -> Any:
        return self.channels[index].stream_unary(
            METHOD + "Probe",
            request_serializer=None,
            response_deserializer=pb.ProbeReply.FromString,
        )

    def warn_unverified(self) -> None:
        """Log, once per link, that a transfer on it runs with ``checksum=none``: corrupted
        bytes would reach the consumer. A diagnostic mode that must never go unnoticed."""
        if self._warned_unverified:
            return
        self._warned_unverified = True
        log.warning(
            "checksum_disabled target=%s detail=%s",
            self.target,
            "chunks are neither checksummed nor verified (diagnostic mode, never in production)",
        )

    def known_bytes_per_s(self) -> float:
        """The configured rate, else the goodput seen so far (0 = nothing known yet)."""
        if self.options.link_rate_bps > 0:
            return self.options.link_rate_bps / 8
        return self.goodput_bytes_per_s

    def link_bytes_per_s(self) -> float:
        """Link capacity in bytes/s for ``auto`` compression: ``link_rate_bps`` when
        configured, else a short measurement (cached per target for a minute). Goodput
        seen by transfers is no substitute: while compressing it measures the codec.

        Never waits for the measurement, and the probe never shares the link with a
        transfer: it waits until no transfer is open on this link, and a transfer that opens
        while it runs stops it (a probe inside a transfer stretched a vLLM request's tail
        from 0.2 to 0.58 s, and read 43-222 Mbit/s on a 200 Mbit/s link). Until a
        measurement lands, the last one (expired) or the goodput seen stands in; none (0):
        ``auto`` takes the link for a slow one, the right guess on a WAN."""
        if self.options.link_rate_bps > 0:
            return self.options.link_rate_bps / 8
        cached = _MEASURED.get(self.target)
        if cached is not None and time.monotonic() - cached[0] < 60:
            return cached[1]
        if self._measuring is None and time.monotonic() - self._probe_failed_at >= PROBE_RETRY_S:
            self._measuring = asyncio.ensure_future(self._measure_in_background())
        return cached[1] if cached is not None else self.goodput_bytes_per_s

    def transfer_opened(self) -> None:
        """A transfer opens on this link: a rate probe running now is stopped (measured
        again once the link is idle)."""
        self.transfers += 1
        if self._probing and self._measuring is not None:
            self._measuring.cancel()

    def transfer_closed(self) -> None:
        self.transfers -= 1

    async def _measure_in_background(self) -> None:
        try:
            idle_by = time.monotonic() + PROBE_IDLE_WAIT_S
            while self.transfers:
                if time.monotonic() > idle_by:
                    return  # busy all along: the goodput seen stands in; asked again later
                await asyncio.sleep(PROBE_IDLE_POLL_S)
            self._probing = True
            rate = (await self.measure_rate(PROBE_SECONDS, PROBE_MAX_BYTES))["bytes_per_s"]
        except asyncio.CancelledError:
            log.info("rate_probe_deferred target=%s detail=a transfer opened", self.target)
            return
        except (*CONNECTION_ERRORS, OSError) as exc:
            # The probe shares the link's connections: a broken one (reset, a TLS record
            # failing its MAC -> INTERNAL) is a connection failure the push streams handle
            # by reconnecting and resuming. Measure again later, never fail a transfer for it.
            self._probe_failed_at = time.monotonic()
            log.warning(
                "rate_probe_failed target=%s error=%s fallback_bytes_per_s=%.0f",
                self.target,
                describe_error(exc),
                self.goodput_bytes_per_s,
            )
        else:
            _MEASURED[self.target] = (time.monotonic(), float(rate))
            log.info("rate_measured target=%s mbit_s=%.1f", self.target, rate * 8 / 1e6)
        finally:
            self._probing = False
            self._measuring = None

    async def measure_rate(self, seconds: float, max_bytes: int | None = None) -> dict[str, Any]:
        """Push random 1 MiB probe blocks over every connection for ``seconds`` (or until
        ``max_bytes``); returns bytes, seconds (receiver-timed) and bytes_per_s. A broken
        connection raises one of CONNECTION_ERRORS (the other probes are stopped)."""
        block = os.urandom(PROBE_BLOCK)
        frame = b"\x0a" + varint(len(block)) + block  # ProbeBlock{payload}: field 1, bytes
        budget = (max_bytes or 1 << 62) // len(self.channels)
        stop_at = time.monotonic() + seconds

        async def one(index: int) -> Any:
            call = self.probe_call(index)(timeout=seconds + 30)
            sent = 0
            while time.monotonic() < stop_at and sent < budget:
                await call.write(frame)
                sent += len(block)
            await call.done_writing()
            return await call

        start = time.perf_counter()
        tasks = [asyncio.ensure_future(one(i)) for i in range(len(self.channels))]
        try:
            replies = await asyncio.gather(*tasks)
        finally:  # one connection failed: stop probing the others too
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        wall = time.perf_counter() - start
        total = sum(int(r.bytes) for r in replies)
        # Receiver-side timing (first block's arrival to the last's) excludes the sender's
        # socket buffering. Each stream's first block arrived at the start of that interval,
        # not during it: counting it overstated a short probe (1 s at 100 Mbit/s: +17 % with
        # two connections). A probe too short for that falls back to wall time.
        timed = sum(max(int(r.bytes) - len(frame), 0) for r in replies)
        busy = max((float(r.seconds) for r in replies), default=0.0)
        if not (timed and busy):
            timed, busy = total, wall
        return {"bytes": total, "seconds": busy, "bytes_per_s": timed / busy if busy else 0.0}

    def observe_acked(self, wire_bytes: int) -> None:
        """Fold acknowledged wire bytes into the goodput estimate (EWMA over >= 250 ms)."""
        self.acked_wire_bytes += wire_bytes
        self._window_bytes += wire_bytes
        now = time.monotonic()
        elapsed = now - self._window_start
        if elapsed >= 0.25:
            rate = self._window_bytes / elapsed
            self.goodput_bytes_per_s = (
                rate
                if not self.goodput_bytes_per_s
                else 0.7 * self.goodput_bytes_per_s + 0.3 * rate
            )
            self._window_bytes = 0
            self._window_start = now

    async def ping(self, count: int = 5) -> float:
        """Median round trip of ``count`` Ping RPCs in seconds (also the RTT gauge)."""
        call = self.unary(0, "Ping", pb.PingReply)
        samples = []
        for nonce in range(count):
            start = time.perf_counter()
            await call(pb.PingRequest(nonce=nonce), timeout=self.options.rpc_timeout_ms / 1000)
            samples.append(time.perf_counter() - start)
        samples.sort()
        rtt = samples[len(samples) // 2]
        self.metrics.rtt.labels(self.target).set(rtt)
        return rtt

    async def describe(self) -> dict[str, str]:
        """What the receiver says of itself (``ReceiverServer.describe``; empty from one that
        predates it). One round trip; raises one of CONNECTION_ERRORS when unreachable."""
        call = self.unary(0, "Ping", pb.PingReply)
        reply = await call(pb.PingRequest(nonce=0), timeout=self.options.rpc_timeout_ms / 1000)
        return dict(reply.attrs)

    async def reset(self, index: int) -> None:
        """Replace connection ``index`` with a new TCP connection: a stalled one may sit on
        a dead path that neither TCP nor HTTP/2 keepalive has noticed. Calls still on the
        old channel (other transfers) fail and resume on the new one."""
        old = self.channels[index]
        self.channels[index] = self.tls.channel(self.target, self._opts)
        # The caller (a push worker) is often cancelled right here, when the transfer fails
        # at its deadline: an interrupted close would leave the old connection open with
        # nothing referring to it, so the close runs on its own and close() waits for it.
        closing = asyncio.ensure_future(old.close(None))
        self._closing.add(closing)
        closing.add_done_callback(self._closing.discard)
        await asyncio.shield(closing)

    async def close(self) -> None:
        if self._measuring is not None:
            self._measuring.cancel()
            await asyncio.gather(self._measuring, return_exceptions=True)
        await asyncio.gather(
            *(channel.close(None) for channel in self.channels), *list(self._closing)
        )


_MEASURED: dict[str, tuple[float, float]] = {}
PROBE_BLOCK = 1 << 20
#: ``auto``'s link-rate probe: this long or this many bytes, whichever ends first. A few
#: MiB tell a link far faster than the codecs from a slow one, which is all ``auto`` needs.
PROBE_SECONDS = 0.3
PROBE_MAX_BYTES = 8 << 20
#: After a failed rate probe, the goodput estimate stands in for this long.
PROBE_RETRY_S = 5.0
#: The probe waits for a moment with no transfer open on the link, polling this often, at
#: most this long (then it is asked for again by the next transfer that needs a rate).
PROBE_IDLE_POLL_S = 0.02
PROBE_IDLE_WAIT_S = 30.0
#: What a call on a broken connection raises in grpc.aio (an RPC error, or a write on a
#: call that already ended).
CONNECTION_ERRORS = (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError)


def describe_error(exc: BaseException) -> str:
    """A connection error in one line: the gRPC status and its details, else the exception."""
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return f"{type(exc).__name__}: {exc}"


def _serialize(message: Any) -> bytes:
    return bytes(message.SerializeToString())

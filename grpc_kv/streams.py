"""The sending side's streams: how a transfer's queued chunks travel to the receiver.

One worker per connection takes chunks from the transfer's queue (at most ``window`` in
flight), paces them through the link's rate ceiling, writes them on a Push call or a bulk data
connection, and reads the receiver's acknowledgements: ``ACK_OK`` frees the chunk's buffer,
``ACK_CORRUPT`` (or an ack that names another seq: the chunk's head was damaged) resends it,
``BUSY`` backs off without counting an attempt. A stream that breaks or stalls (no ack within
``_stall_timeout``) puts its chunks in flight back at the front of the queue, and its worker
reconnects with backoff and resumes (Begin again: the receiver says what it holds).

:class:`ChunkStreams` is the part of :class:`grpc_kv.sender.Transfer` that does this; it shares
the transfer's state (queue, window, lock and conditions, summary) and calls back into its
start, failure and deadline helpers. Who calls it: ``Transfer.start`` starts the workers,
``Transfer.finish`` / ``cancel`` stop them. Failures surface as the transfer's error.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from typing import TYPE_CHECKING, Any

import grpc

from grpc_kv.bulk import BulkRefused, BulkStream, is_certificate_error
from grpc_kv.link import EOF, Link
from grpc_kv.manifest import TransferHeader
from grpc_kv.options import LinkOptions
from grpc_kv.protocol import pb
from grpc_kv.results import (
    PeerRefused,
    ReceiverUnreachable,
    TransferError,
    TransferRefused,
    TransferSummary,
    _StreamStalled,
)
from grpc_kv.wire import OutChunk

#: One logger and one metrics role for the whole sending side (sender and streams).
log = logging.getLogger("grpc_kv.sender")
ROLE = "sender"


#: The slowest link the sender assumes before it has measured one (bits/s): only for noticing
#: a stalled connection, never for pacing.
STALL_FLOOR_BPS = 1_000_000


#: Failures that mean the receiver was not reached (``LinkOptions.unreachable_ms``).
_UNREACHABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}


class ChunkStreams:
    """The stream workers of a transfer (a base of :class:`grpc_kv.sender.Transfer`, whose
    ``__init__`` sets the state declared here)."""

    link: Link
    header: TransferHeader
    options: LinkOptions
    session: str
    summary: TransferSummary
    broken_calls: int
    _queue: deque[OutChunk]
    _inflight: dict[int, OutChunk]
    _unacked: dict[int, OutChunk]
    _buffered: int
    _closed: bool
    _done: bool
    _error: TransferError | None
    _failing_since: float | None
    _cond: asyncio.Condition
    _space: asyncio.Condition
    _timers: set[asyncio.Future[None]]
    _bulk_port: int
    _unverified: bool
    _count_wire: Any
    _count_raw: Any
    _count_chunks: Any

    if TYPE_CHECKING:  # provided by Transfer

        def remaining(self) -> float: ...
        def _rpc_timeout(self) -> float: ...
        async def _notify(self) -> None: ...
        def _wake_all(self) -> None: ...
        def _fail(self, error: TransferError) -> None: ...
        def _backoff(self, attempt: int) -> float: ...
        async def _begin(self, resume: bool, index: int = 0) -> None: ...
        def _refused(self, error: PeerRefused) -> None: ...
        def _handle_rpc_error(self, exc: grpc.aio.AioRpcError, what: str) -> None: ...

    def _unreachable(self, what: str, exc: BaseException, since: float | None = None) -> bool:
        """Fail the transfer with ``ReceiverUnreachable`` (True) when ``exc`` means the
        receiver was not reached (refused, reset, no route, no answer in time) and every try
        since the first such failure -- at the latest ``since``, when the failed try began --
        has failed for ``unreachable_ms``. An answer from the receiver (a Begin, an ack) ends
        the outage; a slow link that keeps acking never starts one."""
        bound = self.options.unreachable_ms / 1000
        reached = isinstance(exc, grpc.aio.AioRpcError) and exc.code() not in _UNREACHABLE
        if bound <= 0 or reached or not isinstance(exc, (grpc.aio.AioRpcError, OSError)):
            return False
        now = time.monotonic()
        began = min(since if since is not None else now, now)
        if self._failing_since is None or began < self._failing_since:
            self._failing_since = began
        if now - self._failing_since < bound:
            return False
        detail = (
            f"{exc.code().name}: {exc.details() or ''}"
            if isinstance(exc, grpc.aio.AioRpcError)
            else f"{type(exc).__name__}: {exc}"
        )
        self._fail(
            ReceiverUnreachable(
                f"{what}: receiver {self.link.target} unreachable for "
                f"{self.options.unreachable_ms} ms ({detail[:200]})",
                exc.code() if isinstance(exc, grpc.aio.AioRpcError) else None,
            )
        )
        return True

    def _pause(self, attempt: int) -> float:
        """The backoff before re-trying the receiver: never past the deadline, nor past the
        moment ``unreachable_ms`` without an answer would end the transfer."""
        pause = min(self._backoff(attempt), max(self.remaining(), 0))
        bound = self.options.unreachable_ms / 1000
        if bound > 0 and self._failing_since is not None:
            pause = min(pause, max(self._failing_since + bound - time.monotonic(), 0))
        return pause

    def _acked(self, chunk: OutChunk) -> None:
        if self._unacked.pop(chunk.seq, None) is None:
            return
        self._inflight.pop(chunk.seq, None)
        if chunk.queued:
            self._queue.remove(chunk)
            chunk.queued = False
        self._buffered -= chunk.wire

    async def _next(self, index: int, reader: asyncio.Task[None]) -> OutChunk | None:
        async with self._cond:
            while True:
                if reader.done():
                    return None
                if self._error is not None or (self._closed and not self._unacked):
                    return None
                if self._queue and len(self._inflight) < self.options.window:
                    chunk = self._queue.popleft()
                    chunk.queued = False
                    chunk.conn = index
                    self._inflight[chunk.seq] = chunk
                    return chunk
                if self.remaining() <= 0:
                    return None
                await self._cond.wait()

    async def _requeue(self, chunk: OutChunk, counts: bool) -> None:
        """Put a chunk back at the front; ``counts``: the attempt counts against retry."""
        async with self._cond:
            if chunk.seq not in self._unacked:
                return
            self._inflight.pop(chunk.seq, None)
            if counts:
                # Handed to a connection that broke or answered corrupt: its next write is a
                # resend, also when this write raised before returning (a stream that died
                # under it), so ``retransmits`` counts it.
                chunk.sends = max(chunk.sends, 1)
                chunk.attempts += 1
                if chunk.attempts > self.options.retry:
                    self._fail(
                        TransferError(f"chunk {chunk.seq} failed {chunk.attempts} times (retry)")
                    )
            if not chunk.queued:
                self._queue.appendleft(chunk)
                chunk.queued = True
            self._wake_all()  # a failed retry ends the producer's wait too

    def _requeue_later(self, chunk: OutChunk, delay: float) -> None:
        def fire() -> None:
            task = asyncio.ensure_future(self._requeue(chunk, counts=False))
            self._timers.add(task)
            task.add_done_callback(self._timers.discard)

        asyncio.get_running_loop().call_later(delay, fire)

    async def _worker(self, index: int) -> None:
        failures = 0
        resume = False
        while self._error is None and not self._done and self.remaining() > 0:
            if self._closed and not self._unacked:
                return
            try:
                if resume:
                    await self._begin(resume=True, index=index)
                    self._failing_since = None
                await self._stream(index)
                failures = 0
                resume = False
            except BulkRefused as exc:
                self._fail(TransferRefused(f"bulk: {exc}", exc.code))
                await self._requeue_connection(index)
                await self._notify()
                return
            except (
                grpc.aio.AioRpcError,
                grpc.aio.UsageError,
                asyncio.InvalidStateError,
                _StreamStalled,
                OSError,  # the bulk data path: refused, reset, unreachable, TLS failure
            ) as exc:
                if isinstance(exc, OSError) and is_certificate_error(exc):
                    error = PeerRefused(
                        f"bulk: TLS handshake refused: {exc}", grpc.StatusCode.UNAVAILABLE, "tls"
                    )
                    with contextlib.suppress(PeerRefused):
                        self._refused(error)
                self.broken_calls += 1
                if isinstance(exc, grpc.aio.AioRpcError):
                    with contextlib.suppress(TransferError):
                        self._handle_rpc_error(exc, "push")
                if not isinstance(exc, _StreamStalled):  # a stall is slow, not gone
                    self._unreachable("push", exc)
                await self._requeue_connection(index)
                await self._notify()
                if self._error is not None:
                    return
                if isinstance(exc, _StreamStalled) or (
                    isinstance(exc, grpc.aio.AioRpcError)
                    and exc.code() is grpc.StatusCode.DEADLINE_EXCEEDED
                ):
                    await self.link.reset(index)
                resume = True
                await asyncio.sleep(self._pause(failures))
                failures += 1

    async def _requeue_connection(self, index: int) -> None:
        for chunk in sorted(self._inflight.values(), key=lambda c: -c.seq):
            if chunk.conn == index:
                await self._requeue(chunk, counts=True)

    async def _open_stream(self, index: int) -> Any:
        """A Push call on connection ``index``, or a bulk data connection standing in for
        one (same interface: write/send, read -> ack or EOF, done_writing, cancel)."""
        if not self._bulk_port:
            return self.link.push(index)(timeout=max(self.remaining(), 0.01))
        return await BulkStream.open(
            self.link.target,
            self._bulk_port,
            self.link.tls,
            self.header.transfer_id,
            self.session,
            self._rpc_timeout(),
            EOF,
        )

    async def _stream(self, index: int) -> None:
        call = await self._open_stream(index)
        bulk = isinstance(call, BulkStream)
        # The receiver answers a stream's chunks one by one, in the order they were written
        # (on both data paths), so each ack is matched to the oldest chunk still unanswered
        # on it -- not only by the seq it names, which may be a damaged one.
        sent: deque[OutChunk] = deque()
        reader = asyncio.create_task(self._read_acks(call, index, sent))
        chunk: OutChunk | None = None
        try:
            while True:
                chunk = await self._next(index, reader)
                if chunk is None:
                    break
                await self.link.bucket.take(chunk.wire)
                if reader.done():  # the stream died while we waited: never sent on it
                    await self._requeue(chunk, counts=False)
                    break
                sent.append(chunk)  # before writing: its ack may be read before we resume
                try:
                    if bulk:
                        await call.send(chunk.bulk_parts)
                    else:
                        await call.write(chunk.frame())
                except (
                    grpc.aio.AioRpcError,
                    grpc.aio.UsageError,
                    asyncio.InvalidStateError,
                    OSError,  # BulkBroken, a reset data connection
                ):
                    await self._requeue(chunk, counts=True)
                    break
                if chunk.sends:
                    self.summary.retransmits += 1
                    self.summary.resent_bytes += chunk.raw
                    self.link.metrics.retransmits.labels(ROLE).inc()
                chunk.sends += 1
                self.summary.bytes_wire += chunk.wire
                self._count_wire.inc(chunk.wire)
            if not reader.done():
                await call.done_writing()
            await reader
        finally:
            if bulk:
                call.cancel()  # closes the data connection, however the stream ended
            if not reader.done():
                reader.cancel()
                call.cancel()
            elif not reader.cancelled():
                reader.exception()  # a broken stream whose worker is being stopped: seen
            # A grpc.aio call keeps its TCP connection alive until the call object is freed,
            # even after the channel is closed; tracebacks of the cancelled workers hold
            # these frames in reference cycles that only the cyclic GC would break. Drop the
            # references here so the connection closes with its channel.
            del call, reader, chunk

    async def _read_acks(self, call: Any, index: int, sent: deque[OutChunk]) -> None:
        try:
            await self._read_loop(call, index, sent)
        finally:
            del call  # see _stream
            # Wake the writer of this connection: it must notice the stream ended.
            await self._notify()

    def _stall_timeout(self) -> float:
        """How long a connection with chunks in flight may go without an ack before it is
        declared dead (a black-holed path that TCP and HTTP/2 keepalive do not notice):
        four chunks per connection at the link's rate, at least ``rpc_timeout_ms``. Before
        the rate is known (the first transfer on a link), at the configured ``link_rate_bps``
        or else at ``STALL_FLOOR_BPS``: a connection broken silently (a TLS record damaged in
        flight leaves it open and mute) must not hold a transfer for its whole deadline,
        which can outlast the receiver's patience (its ``ttl_s``)."""
        rate = self.link.known_bytes_per_s()
        if rate <= 0:
            configured = self.options.link_rate_bps / 8
            rate = configured if configured > 0 else STALL_FLOOR_BPS / 8
        per_conn = 4 * self.options.chunk_size_bytes * len(self.link.channels) / rate
        return min(max(self.options.rpc_timeout_ms / 1000, per_conn), max(self.remaining(), 0.05))

    async def _read_loop(self, call: Any, index: int, sent: deque[OutChunk]) -> None:
        # The server ends a stream only on error (raised by read) or after we finished
        # writing; anything still in flight on it goes around again.
        # One read kept pending across timeouts: cancelling a grpc.aio read cancels the RPC.
        read = asyncio.ensure_future(call.read())
        # A bulk data connection hands over the acks it already holds without a wait.
        ready = getattr(call, "ready_ack", None)
        try:
            while True:
                done, _ = await asyncio.wait({read}, timeout=self._stall_timeout())
                if not done:
                    if any(c.conn == index for c in self._inflight.values()):
                        log.warning(
                            "stream_stalled transfer_id=%s connection=%d",
                            self.header.transfer_id,
                            index,
                        )
                        call.cancel()
                        raise _StreamStalled(f"no ack on connection {index}")
                    continue
                ack = read.result()
                if ack is EOF:
                    await self._requeue_connection(index)
                    return
                self._failing_since = None  # heard from: any outage is over
                await self._answered(ack, sent)
                while ready is not None and (ack := ready()) is not None:
                    await self._answered(ack, sent)
                read = asyncio.ensure_future(call.read())
        finally:
            # A read given up on may still end with the call's error (cancelling it races
            # with the RPC failing); retrieve that, or asyncio logs "exception never retrieved"
            # with a traceback that keeps the call, and so its connection, alive.
            read.add_done_callback(_retrieve)
            read.cancel()
            del call, read, ready  # see _stream

    async def _answered(self, ack: Any, sent: deque[OutChunk]) -> None:
        """Apply an ack as the answer to the oldest chunk unanswered on its stream, which the
        receiver answers one by one in the order written. Where the ack names another seq:

        * a verified "ok" for a chunk further down the stream: the answers to the chunks
          before it -- or those chunks themselves -- were lost in flight (a path that dropped
          whole frames and went on); those chunks go again and the ack is applied to the chunk
          it names. Taking it as the oldest chunk's answer instead would put every later
          answer on this stream one chunk off, each taken for corrupt, until the chunks ran
          out of retries. Only an "ok" is verified (the checksum covers the seq); a "busy" is
          answered before the checksum, and with ``checksum: none`` nothing is.
        * otherwise: the oldest chunk's head -- its seq -- was damaged on the way (the
          receiver answers such a chunk corrupt, under the damaged seq); it is resent at once
          instead of waiting, unanswered, for the stall timeout."""
        if not sent or ack.seq == sent[0].seq:
            if sent:
                sent.popleft()
            await self._on_ack(ack)
            return
        position = next((i for i, c in enumerate(sent) if c.seq == ack.seq), None)
        if ack.status == pb.ACK_OK and not self._unverified and position is not None:
            lost = [sent.popleft() for _ in range(position)]
            sent.popleft()
            log.warning(
                "ack_skipped transfer_id=%s seqs=%s answered=%d detail=%s",
                self.header.transfer_id,
                ",".join(str(c.seq) for c in lost),
                ack.seq,
                "their answers or the chunks were lost in flight; resending them",
            )
            for chunk in lost:
                await self._requeue(chunk, counts=True)
            await self._on_ack(ack)
            return
        expected = sent.popleft()
        log.warning(
            "ack_mismatch transfer_id=%s seq=%d answered_as=%d detail=%s",
            self.header.transfer_id,
            expected.seq,
            ack.seq,
            "the chunk's head was damaged in flight; resending it",
        )
        await self._on_ack(
            pb.Ack(
                seq=expected.seq,
                status=pb.ACK_CORRUPT,
                detail=f"answered as seq {ack.seq}: the chunk's head was damaged in flight",
            )
        )

    async def _on_ack(self, ack: Any) -> None:
        chunk = self._unacked.get(ack.seq)
        if chunk is None:
            return
        if ack.status == pb.ACK_OK:
            async with self._cond:
                self._acked(chunk)
                self._wake_all()  # a window slot and buffer space
            self.link.observe_acked(chunk.wire)
            self._count_raw.inc(chunk.raw)
            self._count_chunks.inc()
            if self._unverified:
                self.link.metrics.unverified.labels(ROLE).inc()
        elif ack.status == pb.ACK_CORRUPT:
            self.summary.checksum_failures += 1
            self.link.metrics.checksum_failures.labels(ROLE).inc()
            log.warning(
                "chunk_resend transfer_id=%s seq=%d detail=%s",
                self.header.transfer_id,
                ack.seq,
                ack.detail,
            )
            await self._requeue(chunk, counts=True)
        else:  # BUSY: the receiver is over its memory budget; back off, not an attempt
            self.summary.busy += 1
            async with self._cond:
                self._inflight.pop(chunk.seq, None)
                self._cond.notify_all()
            self._requeue_later(chunk, self._backoff(min(self.summary.busy, 4)))


def _retrieve(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()

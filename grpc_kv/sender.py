"""The producing end of the KV link: stream a request's KV layer by layer to a receiver.

    async with open_transfer(target, header, options, tls) as tx:
        await tx.send_layer("layers.0.kv", data, final=True)   # as each layer is computed
        summary = await tx.finish()

``send_layer`` returns once its chunks are encoded and queued (it blocks only when the send
buffer is full), so prefill keeps computing while earlier layers travel. Chunks are striped
over ``connections`` streams, each on its own TCP connection, at most ``window`` in flight.
A corrupt chunk is resent; a broken connection reconnects with backoff and resumes from
what the receiver holds. Failures surface from ``send_layer``/``finish`` as TransferError
(TransferTimeout past ``timeout_ms``, TransferRefused for a refusal no retry can fix).

This module holds the transfer's lifecycle (Begin and resume, refusals, encoding and queueing
chunks, the trailer, cancel); :mod:`grpc_kv.streams` moves the queued chunks over the
connections and reads their acknowledgements.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import math
import random
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator

import grpc

from grpc_kv.codec import (
    CHECKSUM_TO_PB,
    CODEC_TO_PB,
    AutoCodec,
    Checksum,
    Codec,
    chunk_seed,
    split,
    transfer_digest,
)
from grpc_kv.handshake import diagnose, refusal_in_details
from grpc_kv.link import Link
from grpc_kv.manifest import TransferHeader
from grpc_kv.options import LinkOptions
from grpc_kv.protocol import PROTOCOL_VERSION, pb
from grpc_kv.results import (
    PeerRefused,
    TransferError,
    TransferRefused,
    TransferSummary,
    TransferTimeout,
)
from grpc_kv.streams import ROLE, ChunkStreams, log
from grpc_kv.tls import TLSConfig
from grpc_kv.wire import OutChunk, encode_chunk

_THREAD_ENCODE_BYTES = 256 * 1024
# Statuses no retry can fix: the transfer fails at once.
_FATAL = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.UNIMPLEMENTED,
    grpc.StatusCode.DATA_LOSS,
    grpc.StatusCode.NOT_FOUND,
}


class Transfer(ChunkStreams):
    """One transfer in progress; made by :func:`open_transfer` (see module docstring)."""

    def __init__(self, link: Link, header: TransferHeader, options: LinkOptions) -> None:
        self.link = link
        self.header = header
        self.options = options
        self.session = uuid.uuid4().hex
        #: Stated in Begin and seeding every chunk's checksum (see grpc_kv.codec.chunk_seed).
        self._header_digest = header.digest()
        self.summary = TransferSummary(header.transfer_id, checksum=options.checksum.value)
        self._unverified = options.checksum is Checksum.NONE
        self._auto = AutoCodec(level=options.zstd_level)
        self._started = time.monotonic()
        #: When the receiver stopped answering (None: it answers; LinkOptions.unreachable_ms).
        self._failing_since: float | None = None
        self._deadline = self._started + options.timeout_ms / 1000
        self._next_seq = 0
        self._checksums: list[int] = []
        self._layer_ends: dict[str, int] = {}
        self._final_layers: set[str] = set()
        self._queue: deque[OutChunk] = deque()
        self._inflight: dict[int, OutChunk] = {}
        self._unacked: dict[int, OutChunk] = {}
        self._buffered = 0
        self._closed = False  # producer called finish
        self._error: TransferError | None = None
        # One lock, two conditions, so that each event wakes only who can act on it: the
        # stream workers wait on ``_cond`` (a chunk queued, a window slot freed), the
        # producer and ``finish`` on ``_space`` (acknowledgements). Waits carry no timer
        # each: ``_deadline_task`` wakes everyone once, at the deadline.
        lock = asyncio.Lock()
        self._cond = asyncio.Condition(lock)
        self._space = asyncio.Condition(lock)
        self._deadline_task: asyncio.Task[None] | None = None
        self._workers: list[asyncio.Task[None]] = []
        self._begun = asyncio.Event()
        self._done = False
        self._active = False
        self._timers: set[asyncio.Future[None]] = set()
        #: Bulk data port the receiver advertised in Begin (0: chunks go over gRPC).
        self._bulk_port = 0
        # Counters bumped for every chunk, resolved once (``labels`` takes a lock and a
        # lookup per call).
        self._count_wire = link.metrics.bytes_wire.labels(ROLE)
        self._count_raw = link.metrics.bytes_raw.labels(ROLE)
        self._count_chunks = link.metrics.chunks.labels(ROLE)
        #: Push streams that broke (RPC error, stall): their call objects outlive them.
        self.broken_calls = 0
        self.finished = False  # finish() returned: every chunk acknowledged

    # -- helpers -------------------------------------------------------------------------
    def remaining(self) -> float:
        return self._deadline - time.monotonic()

    def _rpc_timeout(self) -> float:
        return max(0.05, min(self.options.rpc_timeout_ms / 1000, self.remaining()))

    async def _notify(self) -> None:
        async with self._cond:
            self._wake_all()

    def _wake_all(self) -> None:
        """With the lock held: wake every waiter (an ack, a failure, the end, the deadline)."""
        self._cond.notify_all()
        self._space.notify_all()

    async def _wake_at_deadline(self) -> None:
        """Wake every waiter once the deadline has passed: each re-checks ``remaining()``
        (``_raise_if_failed``) before waiting again, so none outlives it."""
        await asyncio.sleep(max(self.remaining(), 0) + 0.001)
        await self._notify()

    def _fail(self, error: TransferError) -> None:
        if self._error is None:
            self._error = error
            log.warning(
                "transfer_failed transfer_id=%s request_id=%s error=%s",
                self.header.transfer_id,
                self.header.request_id,
                error,
            )

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error
        if self.remaining() <= 0:
            self._fail(
                TransferTimeout(
                    f"transfer {self.header.transfer_id!r} missed its deadline of "
                    f"{self.options.timeout_ms} ms"
                )
            )
            raise self._error  # type: ignore[misc]

    def _backoff(self, attempt: int) -> float:
        base = self.options.backoff_ms / 1000 * (2 ** min(attempt, 6))
        return base * random.uniform(0.5, 1.5)  # noqa: S311 - jitter, not security

    # -- start ---------------------------------------------------------------------------
    async def _begin(self, resume: bool, index: int = 0) -> None:
        request = pb.BeginRequest(
            protocol_version=PROTOCOL_VERSION,
            header=self.header.to_pb(),
            session=self.session,
            deadline_ms=max(1, int(self.remaining() * 1000)),
            checksum=CHECKSUM_TO_PB[self.options.checksum],
            want_bulk=self.options.data_path == "bulk",
            header_digest=self._header_digest,
        )
        reply = await self.link.unary(index, "Begin", pb.BeginReply)(
            request, timeout=self._rpc_timeout()
        )
        if not resume and request.want_bulk:
            # The data path is settled by the first Begin: a receiver that does not offer
            # bulk (an older one, or ReceiverOptions(bulk=False)) gets gRPC chunks.
            self._bulk_port = int(reply.bulk_port)
            self.summary.data_path = "bulk" if self._bulk_port else "grpc"
            if not self._bulk_port:
                log.info(
                    "bulk_unavailable transfer_id=%s target=%s detail=%s",
                    self.header.transfer_id,
                    self.link.target,
                    "receiver does not offer the bulk data path; using gRPC chunks",
                )
        elif resume and self._bulk_port and reply.bulk_port:
            self._bulk_port = int(reply.bulk_port)
        if resume:
            held = set(reply.held)
            for chunk in list(self._unacked.values()):
                if chunk.seq < reply.contiguous or chunk.seq in held:
                    self._acked(chunk)
            await self._notify()
            self.summary.resumes += 1
            self.link.metrics.resumes.labels(ROLE).inc()
            log.info(
                "transfer_resumed transfer_id=%s request_id=%s contiguous=%d",
                self.header.transfer_id,
                self.header.request_id,
                reply.contiguous,
            )

    async def start(self) -> None:
        """Begin the transfer (retrying an unreachable receiver until the deadline) and
        start one stream worker per connection."""
        self._deadline_task = asyncio.create_task(self._wake_at_deadline())
        attempt = 0
        diagnosed = False
        while True:
            self._raise_if_failed()
            tried_at = time.monotonic()
            try:
                await self._begin(resume=False)
                break
            except grpc.aio.AioRpcError as exc:
                if exc.code() is grpc.StatusCode.UNAVAILABLE and not diagnosed:
                    # Once per transfer: a refused handshake is final, whatever grpcio says.
                    diagnosed = True
                    await self._diagnose(exc)
                self._handle_rpc_error(exc, "begin")
                if self._unreachable("begin", exc, since=tried_at):
                    raise self._error from None  # type: ignore[misc]
                await asyncio.sleep(self._pause(attempt))
                attempt += 1
        self._failing_since = None
        if self._unverified:
            self.link.warn_unverified()
        self.link.metrics.active.labels(ROLE).inc()
        self._active = True
        self._workers = [
            asyncio.create_task(self._worker(i), name=f"kv-push-{i}")
            for i in range(len(self.link.channels))
        ]

    async def _diagnose(self, exc: grpc.aio.AioRpcError) -> None:
        """Fail at once (PeerRefused) when a connection error is a refused TLS handshake;
        otherwise return and let the caller retry."""
        timeout = max(0.05, min(self.options.rpc_timeout_ms / 1000, self.remaining()))
        reason = await diagnose(self.link.target, self.link.tls, exc.details() or "", timeout)
        if reason is not None:
            self._refused(PeerRefused(f"begin: TLS refused: {reason}", exc.code(), "tls"))

    def _refused(self, error: PeerRefused) -> None:
        self.link.metrics.rejected_peers.labels(ROLE, error.reason).inc()
        self._fail(error)
        raise error

    def _handle_rpc_error(self, exc: grpc.aio.AioRpcError, what: str) -> None:
        code = exc.code()
        details = exc.details() or ""
        if code in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED):
            self._refused(PeerRefused(f"{what}: {code.name}: {details}", code, "not_allowed"))
        if code is grpc.StatusCode.UNAVAILABLE and (reason := refusal_in_details(details)):
            self._refused(PeerRefused(f"{what}: TLS refused: {reason}", code, "tls"))
        if code in _FATAL:
            self._fail(TransferRefused(f"{what}: {code.name}: {exc.details()}", code))
            raise self._error  # type: ignore[misc]
        if code is grpc.StatusCode.RESOURCE_EXHAUSTED and "message larger" in (exc.details() or ""):
            self._fail(TransferRefused(f"{what}: chunk larger than the receiver accepts", code))
            raise self._error  # type: ignore[misc]
        log.info(
            "rpc_retry transfer_id=%s what=%s code=%s detail=%s",
            self.header.transfer_id,
            what,
            code.name,
            exc.details(),
        )
        self._raise_if_failed()

    # -- producer API --------------------------------------------------------------------
    async def send_layer(
        self,
        name: str,
        data: bytes | bytearray | memoryview,
        offset: int | None = None,
        final: bool = True,
    ) -> None:
        """Queue ``data`` as the bytes of layer ``name`` starting at ``offset`` (default:
        where the layer's previous segment ended; segments are append-only). ``final``
        marks the layer complete. Returns when queued; blocks while the send buffer is
        full. ``bytes`` are referenced until acknowledged; any other buffer is copied
        before this returns, so the caller may reuse it at once. Raises ValueError for a layer not in the manifest, a gap/overlap, or data
        after final; TransferError when the transfer has failed."""
        self._raise_if_failed()
        if self._closed:
            raise ValueError("send_layer: the transfer is already finishing")
        if self.header.layers and self.header.layer(name) is None:
            raise ValueError(f"layer: {name!r} is not in the header's layout manifest")
        if name in self._final_layers:
            raise ValueError(f"layer: {name!r} was already sent with final=True")
        end = self._layer_ends.get(name, 0)
        if offset is None:
            offset = end
        if offset != end:
            raise ValueError(f"offset: layer {name!r} continues at {end}, got {offset}")
        view = memoryview(data).cast("B")
        spec = self.header.layer(name)
        declared = spec.length if spec is not None else 0
        if declared and (end + len(view) > declared or (final and end + len(view) != declared)):
            raise ValueError(
                f"data: layer {name!r} would end at byte {end + len(view)}"
                f"{'' if final else ' or later'}; the manifest declares {declared}"
            )
        # bytes cannot change under us: their chunks are referenced, not copied, until
        # acknowledged. Any other buffer is copied into its frames here.
        lazy = isinstance(data, bytes) or isinstance(view.obj, bytes)
        pieces = list(split(view, self.options.chunk_size_bytes))
        for i, (start, piece) in enumerate(pieces):
            last = final and i == len(pieces) - 1
            await self._enqueue(name, offset + start, piece, last, lazy)
        self._layer_ends[name] = offset + len(view)
        if final:
            self._final_layers.add(name)

    async def _enqueue(
        self, layer: str, offset: int, piece: memoryview, final: bool, lazy: bool
    ) -> None:
        codec = self.options.compression
        if codec is Codec.AUTO:
            codec = self._auto.choose(piece, self.link.link_bytes_per_s())
        seq = self._next_seq
        self._next_seq += 1
        head = pb.Chunk(
            transfer_id=self.header.transfer_id,
            seq=seq,
            layer=layer,
            offset=offset,
            layer_final=final,
            codec=CODEC_TO_PB[codec],
            raw_length=len(piece),
        )
        seed = chunk_seed(self._header_digest, seq, layer, offset, len(piece), final)
        if (
            self._bulk_port
            and codec is Codec.NONE
            and lazy
            and self.options.checksum is not Checksum.NONE
        ):
            # The bulk writer checksums the slice right before writing it (bulk_parts).
            chunk = OutChunk(seq, (b"", piece), len(piece), len(piece), 0)
            chunk.deferred = (head, self.options.checksum, seed, self._record_checksum)
            self._checksums.append(0)  # filled in when the chunk is first written
            await self._queue_chunk(chunk, codec)
            return
        args = (piece, codec, self.options.zstd_level, self.options.checksum, head, lazy, seed)
        # Uncompressed chunks cost one copy and a checksum (about a millisecond for 4 MiB):
        # cheaper on the loop than a thread hop, which on a busy machine waits for a core.
        if len(piece) > _THREAD_ENCODE_BYTES and codec is not Codec.NONE:
            encoded, wire, spent = await asyncio.to_thread(encode_chunk, *args)
        else:
            encoded, wire, spent = encode_chunk(*args)
        if self.options.compression is Codec.AUTO and codec is not Codec.NONE:
            self._auto.observe(codec, len(piece), spent)
        raw_sum = int(head.checksum)
        chunk = OutChunk(seq, encoded, len(piece), wire, raw_sum)
        self._checksums.append(raw_sum)
        await self._queue_chunk(chunk, codec)

    def _record_checksum(self, seq: int, value: int) -> None:
        """A deferred checksum, computed by the bulk writer (possibly in a worker thread:
        one list item assignment). Every chunk is written before it can be acknowledged,
        so the trailer's digest never sees a placeholder."""
        self._checksums[seq] = value

    async def _queue_chunk(self, chunk: OutChunk, codec: Codec) -> None:
        seq = chunk.seq
        self.summary.codecs[codec.value] = self.summary.codecs.get(codec.value, 0) + 1
        async with self._cond:
            while self._buffered + chunk.wire > self.options.send_buffer_bytes and self._unacked:
                self._raise_if_failed()
                await self._space.wait()
            self._raise_if_failed()
            self._buffered += chunk.wire
            self._unacked[seq] = chunk
            self._queue.append(chunk)
            chunk.queued = True
            self._cond.notify_all()

    async def finish(self) -> TransferSummary:
        """Wait until every chunk is acknowledged, send the trailer, return the summary.
        Raises ValueError when a layer was left without its final segment (the receiver
        would refuse the transfer as incomplete), TransferError (TransferTimeout past the
        deadline)."""
        self._raise_if_failed()
        unfinished = [
            name
            for name in (*(s.name for s in self.header.layers), *self._layer_ends)
            if name not in self._final_layers
        ]
        if unfinished:
            raise ValueError(f"finish: layer {unfinished[0]!r} was never sent with final=True")
        self._closed = True
        await self._notify()
        async with self._cond:
            while self._unacked:
                self._raise_if_failed()
                await self._space.wait()
        self._raise_if_failed()
        trailer = pb.Trailer(
            transfer_id=self.header.transfer_id,
            chunk_count=self._next_seq,
            raw_bytes=sum(self._layer_ends.values()),
            digest=transfer_digest(self._checksums),
        )
        attempt = 0
        while True:
            self._raise_if_failed()
            try:
                reply = await self.link.unary(attempt, "Finish", pb.FinishReply)(
                    trailer, timeout=self._rpc_timeout()
                )
                break
            except grpc.aio.AioRpcError as exc:
                self._handle_rpc_error(exc, "finish")
                await asyncio.sleep(min(self._backoff(attempt), max(self.remaining(), 0)))
                attempt += 1
        if not reply.ok:
            self._fail(TransferError(f"finish: receiver misses chunks {list(reply.missing)[:8]}"))
            raise self._error  # type: ignore[misc]
        self._done = True
        self.finished = True
        await self._stop_workers()
        self.summary.bytes_raw = trailer.raw_bytes
        self.summary.chunks = self._next_seq
        self.summary.seconds = time.monotonic() - self._started
        self._observe("completed")
        log.info(
            "transfer_sent transfer_id=%s request_id=%s chunks=%d raw_bytes=%d wire_bytes=%d "
            "retransmits=%d resumes=%d seconds=%.3f",
            self.header.transfer_id,
            self.header.request_id,
            self.summary.chunks,
            self.summary.bytes_raw,
            self.summary.bytes_wire,
            self.summary.retransmits,
            self.summary.resumes,
            self.summary.seconds,
        )
        return self.summary

    async def cancel(self, reason: str = "canceled by producer") -> None:
        """Abandon the transfer: stop streams, tell the receiver (best effort, short
        deadline) so it frees the memory at once rather than at its TTL."""
        if self._done:
            return
        self._done = True
        if isinstance(self._error, TransferTimeout):
            # The deadline, whatever the producer calls its exit: the receiver's consumer
            # then hears a deadline (its engine answers kv_timeout), not a bare cancel.
            reason = str(self._error)
        self._fail(TransferError(reason))
        await self._stop_workers()
        if not self._active:  # never begun: nothing to free on the receiver
            return
        with contextlib.suppress(grpc.aio.AioRpcError):
            await self.link.unary(0, "Cancel", pb.CancelReply)(
                pb.CancelRequest(transfer_id=self.header.transfer_id, reason=reason),
                timeout=min(0.5, self.options.rpc_timeout_ms / 1000),
            )
        outcome = "timeout" if isinstance(self._error, TransferTimeout) else "failed"
        self._observe(outcome)

    def _observe(self, outcome: str) -> None:
        if not self._active:
            return
        self._active = False
        self.link.metrics.active.labels(ROLE).dec()
        self.link.metrics.transfer_seconds.labels(ROLE, outcome).observe(
            time.monotonic() - self._started
        )

    async def _stop_workers(self) -> None:
        if self._deadline_task is not None:
            self._deadline_task.cancel()
        for task in self._workers:
            task.cancel()
        await asyncio.gather(*self._workers, return_exceptions=True)
        self._workers = []  # their tracebacks reference this transfer: no cycle kept alive


@contextlib.asynccontextmanager
async def open_transfer(
    target: str,
    header: TransferHeader,
    options: LinkOptions | None = None,
    tls: TLSConfig | None = None,
    *,
    link: Link | None = None,
) -> AsyncIterator[Transfer]:
    """Open a transfer to the receiver at ``target`` (see module docstring).

    ``link``: an existing :class:`Link` to reuse (its options and TLS then apply unless
    ``options`` is given); otherwise one is made for this transfer and closed after it.
    Leaving the block without ``finish()`` (or by an exception, or task cancellation)
    cancels the transfer on both sides.
    """
    own = link is None
    if link is None:
        link = Link(target, options, tls)
    transfer = Transfer(link, header, options or link.options)
    link.transfer_opened()
    try:
        await transfer.start()
        yield transfer
        if not transfer._done:
            await transfer.cancel("producer left the transfer without finish()")
    except BaseException as exc:
        await asyncio.shield(transfer.cancel(f"producer error: {type(exc).__name__}"))
        raise
    finally:
        link.transfer_closed()
        if own:
            await link.close()
        if transfer.broken_calls or not transfer.finished:
            _collect_cycles_soon()


class _CollectState:
    last = -math.inf
    pending: asyncio.AbstractEventLoop | None = None  # the loop a collection is due on


_collect = _CollectState()
#: At most one collection this often (seconds): a long outage fails many transfers.
COLLECT_INTERVAL_S = 2.0


def _collect_cycles_soon() -> None:
    """After a transfer that did not finish cleanly, run the cyclic GC soon (rate-limited).

    A grpc.aio call that ended in an error or was cancelled on a dead path sits in a
    reference cycle through grpc's own frames (its exception's traceback); until a full
    collection frees the call object, it keeps its TCP connection open, closed channel or
    not. Long-lived processes with large heaps (an engine and its model) run full
    collections rarely, so without this every failed transfer would hold a descriptor and a
    connection for minutes. Cheap where the process froze its start-up heap (``gc.freeze()``,
    as the engines and the gateway do); finished transfers need none of this (the workers
    drop their references)."""
    loop = asyncio.get_running_loop()
    if _collect.pending is loop:
        return
    _collect.pending = loop  # (one due on a loop that has closed since does not count)
    delay = max(0.5, _collect.last + COLLECT_INTERVAL_S - time.monotonic())

    def run() -> None:
        _collect.pending, _collect.last = None, time.monotonic()
        gc.collect()

    loop.call_later(delay, run)

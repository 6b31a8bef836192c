"""The receiver's transfer store: verified chunks held within a memory budget, handed to
consumers in sequence order, expired after a TTL.

Used by :mod:`grpc_kv.receiver` (gRPC handlers) from one asyncio loop; nothing here blocks
except :func:`decode_chunk`, which the handlers run in a worker thread for big chunks.
Errors: ChunkRejected (peer sent something impossible -> INVALID_ARGUMENT), BeginRefused
(-> the status it names), TransferFailed (raised to consumers).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc

from grpc_kv.chunks import ChunkRejected
from grpc_kv.codec import PB_TO_CHECKSUM, Checksum, transfer_digest
from grpc_kv.coverage import Coverage, CoverageError
from grpc_kv.manifest import Fingerprint, TransferHeader
from grpc_kv.metrics import LinkMetrics
from grpc_kv.options import ReceiverOptions
from grpc_kv.protocol import pb

log = logging.getLogger("grpc_kv.receiver")
ROLE = "receiver"


class TransferFailed(Exception):
    """A transfer a consumer waits for failed: expired, canceled, digest mismatch, deadline."""


class FingerprintMismatch(TransferFailed):
    """The sender's model fingerprint is not the one the consumer expects."""


class BeginRefused(Exception):
    def __init__(self, code: grpc.StatusCode, detail: str) -> None:
        super().__init__(detail)
        self.code = code
        self.detail = detail


@dataclass
class Segment:
    """Verified bytes of one layer at ``offset``; ``final`` marks the layer's last bytes.
    ``data`` is bytes-like: ``bytes``, or a ``memoryview`` that nothing else writes (of the
    buffer an uncompressed chunk was received into on the bulk data path, or of the gRPC
    frame it arrived in: not copied after the kernel wrote it). ``bytes(segment.data)``
    where ``bytes`` itself is needed."""

    layer: str
    offset: int
    data: bytes | memoryview
    final: bool


class SenderLost(TransferFailed):
    """The sender's data connections all closed and none came back within
    ``ReceiverOptions.sender_lost_s`` (a killed or crashed prefill engine)."""


SENDER_LOST = "sender lost"


def failure(reason: str) -> TransferFailed:
    """The exception a consumer gets for ``reason``: FingerprintMismatch when the sender's
    model is not the one expected, SenderLost when the sender went away, TransferFailed
    otherwise (also used by the local socket's engine side, which gets the reason as text)."""
    if "fingerprint mismatch" in reason:
        return FingerprintMismatch(reason)
    if f"{SENDER_LOST}:" in reason:
        return SenderLost(reason)
    return TransferFailed(reason)


def peer_key(identity: str, address: str) -> str:
    """One sending node: its certificate identity and host (the port and gRPC's ``ipv4:``
    prefix dropped), the same on the gRPC and the bulk data path."""
    host = address.removeprefix("ipv4:").removeprefix("ipv6:")
    if host.count(":") == 1 or host.startswith("["):  # host:port
        host = host.rpartition(":")[0]
    return f"{identity}@{host.strip('[]')}"


def _immutable(data: bytes | memoryview) -> bool:
    """``bytes``, or a view of ``bytes`` (which keeps the whole object alive: for a payload
    cut out of a frame, a few dozen bytes more than the payload)."""
    return isinstance(data, bytes) or isinstance(getattr(data, "obj", None), bytes)


@dataclass
class _Transfer:
    transfer_id: str
    header: TransferHeader | None = None
    header_digest: int = 0
    session: str = ""
    checksum_kind: Checksum = Checksum.XXH3
    expect: Fingerprint | None = None
    started: float = field(default_factory=time.monotonic)
    progress: float = field(default_factory=time.monotonic)
    deadline: float = float("inf")
    checksums: dict[int, int] = field(default_factory=dict)
    raw_bytes: int = 0
    pending: dict[int, Segment] = field(default_factory=dict)
    contiguous: int = 0
    delivered: int = 0
    held: int = 0
    #: Where each chunk not yet contiguous lands: seq -> (layer, offset, length, final).
    placements: dict[int, tuple[str, int, int, bool]] = field(default_factory=dict)
    coverage: Coverage | None = None
    finished: bool = False
    #: The accepted trailer (chunk count, raw bytes, digest): a repeated Finish is answered
    #: from it once the transfer has ended.
    trailer: tuple[int, int, int] | None = None
    failed: str | None = None
    discard: bool = False
    consumers: int = 0
    #: The sending node (:func:`peer_key`), whose data streams keep the transfer alive.
    peer: str = ""
    changed: asyncio.Event = field(default_factory=asyncio.Event)


class TransferStore:
    """All transfers of one receiver. Single asyncio loop; see module docstring."""

    def __init__(
        self,
        options: ReceiverOptions,
        metrics: LinkMetrics,
        accept_fingerprints: set[Fingerprint] | None = None,
    ) -> None:
        self.options = options
        self.metrics = metrics
        self.accept_fingerprints = accept_fingerprints
        self.transfers: dict[str, _Transfer] = {}
        self.memory_in_use = 0
        self._ended: OrderedDict[str, str] = OrderedDict()  # id -> "completed" | failure reason
        self._trailers: dict[str, tuple[int, int, int]] = {}  # completed id -> its trailer
        self._reaper: asyncio.Task[None] | None = None
        self._warned_unverified: set[str] = set()  # peers already warned about checksum none
        #: Data streams (Push calls, bulk connections) open per sending node, and since when
        #: a node has had none (sender_lost_s).
        self._streams: dict[str, int] = {}
        self._quiet: dict[str, float] = {}

    # -- lifecycle -----------------------------------------------------------------------
    def start(self) -> None:
        self._reaper = asyncio.get_running_loop().create_task(self._reap_loop())

    async def stop(self) -> None:
        if self._reaper:
            self._reaper.cancel()
        for transfer in list(self.transfers.values()):
            self._fail(transfer, "receiver stopped")

    async def _reap_loop(self) -> None:
        while True:
            await asyncio.sleep(0.1)
            self.reap()

    def reap(self) -> None:
        """Expire transfers past their deadline, idle past the TTL, or whose sender is gone,
        freeing their memory."""
        now = time.monotonic()
        lost_s = self.options.sender_lost_s
        for transfer in list(self.transfers.values()):
            if not transfer.finished and now > transfer.deadline + self.options.deadline_grace_s:
                self._fail(transfer, "deadline passed before the transfer completed")
            elif now - transfer.progress > self.options.ttl_s:
                self._fail(transfer, f"no progress for {self.options.ttl_s:g} s (ttl)")
            elif lost_s and self._lost(transfer, now, lost_s):
                self._fail(
                    transfer,
                    f"{SENDER_LOST}: no data connection from {transfer.peer} for {lost_s:g} s "
                    "(the prefill engine stopped or the path is cut)",
                )
        for peer, since in list(self._quiet.items()):
            if now - since > max(600.0, 2 * lost_s):
                del self._quiet[peer]

    def _lost(self, transfer: _Transfer, now: float, lost_s: float) -> bool:
        if transfer.finished or transfer.header is None or not transfer.peer:
            return False
        if self._streams.get(transfer.peer):
            return False
        quiet = max(self._quiet.get(transfer.peer, 0.0), transfer.started, transfer.progress)
        return now - quiet > lost_s

    def stream_opened(self, peer: str) -> None:
        """A data stream from ``peer`` opened (a Push call, a bulk connection)."""
        self._streams[peer] = self._streams.get(peer, 0) + 1
        self._quiet.pop(peer, None)

    def stream_closed(self, peer: str) -> None:
        left = self._streams.get(peer, 1) - 1
        if left > 0:
            self._streams[peer] = left
        else:
            self._streams.pop(peer, None)
            self._quiet[peer] = time.monotonic()

    # -- accounting ----------------------------------------------------------------------
    def _hold(self, transfer: _Transfer, n: int) -> None:
        transfer.held += n
        self.memory_in_use += n
        self.metrics.memory.set(self.memory_in_use)

    def _release(self, transfer: _Transfer, n: int) -> None:
        transfer.held -= n
        self.memory_in_use -= n
        self.metrics.memory.set(self.memory_in_use)

    def _end(self, transfer: _Transfer, outcome: str) -> None:
        if self.transfers.get(transfer.transfer_id) is transfer:
            del self.transfers[transfer.transfer_id]
            if transfer.header is not None:
                self.metrics.active.labels(ROLE).dec()
                self.metrics.transfer_seconds.labels(ROLE, outcome.split(":")[0]).observe(
                    time.monotonic() - transfer.started
                )
        self._release(transfer, transfer.held)
        transfer.pending.clear()
        self._ended[transfer.transfer_id] = outcome
        if outcome == "completed" and transfer.trailer is not None:
            self._trailers[transfer.transfer_id] = transfer.trailer
        while len(self._ended) > self.options.remember_completed:
            forgotten, _ = self._ended.popitem(last=False)
            self._trailers.pop(forgotten, None)

    def _fail(self, transfer: _Transfer, reason: str) -> None:
        if transfer.failed or (transfer.finished and transfer.delivered == transfer.contiguous):
            return
        transfer.failed = reason
        log.warning(
            "transfer_failed transfer_id=%s request_id=%s reason=%s",
            transfer.transfer_id,
            transfer.header.request_id if transfer.header is not None else "",
            reason,
        )
        self._end(transfer, f"failed: {reason}")
        transfer.changed.set()

    # -- sender side ---------------------------------------------------------------------
    def begin(self, request: Any, peer: str = "") -> Any:
        """Register a transfer (or resume it: same session). Returns a BeginReply.
        ``peer`` (the sender's identity and host, :func:`peer_key`) keys the once-per-link
        warning of ``checksum=none`` and whose data streams keep the transfer alive
        (``sender_lost_s``; none named: only the deadline and TTL apply)."""
        if request.protocol_version != 1:
            raise BeginRefused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"protocol version mismatch: sender speaks pdbridge.kv.v{request.protocol_version},"
                " this receiver speaks pdbridge.kv.v1",
            )
        try:
            header = TransferHeader.from_pb(request.header)
        except ValueError as exc:
            raise BeginRefused(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from exc
        if not request.header_digest:
            raise BeginRefused(
                grpc.StatusCode.FAILED_PRECONDITION,
                "header_digest: required; the sender predates header-bound checksums "
                "(upgrade it to this receiver's pdbridge)",
            )
        digest = header.digest()
        if digest != request.header_digest:
            # Damaged in flight (or a sender that encodes the header differently): the
            # sender retries ABORTED, so a one-off flip costs a round trip, not the transfer.
            raise BeginRefused(
                grpc.StatusCode.ABORTED,
                f"header_digest: the header hashes to {digest:#x}, the sender stated "
                f"{request.header_digest:#x} (damaged in flight)",
            )
        if not request.session:
            raise BeginRefused(grpc.StatusCode.INVALID_ARGUMENT, "session: required")
        kind = PB_TO_CHECKSUM.get(request.checksum)
        if kind is None:
            raise BeginRefused(grpc.StatusCode.INVALID_ARGUMENT, "checksum: unknown kind")
        if kind is Checksum.NONE and not self.options.accept_unverified:
            raise BeginRefused(
                grpc.StatusCode.FAILED_PRECONDITION,
                "checksum: this receiver refuses unverified transfers (checksum none); it "
                "accepts them only when started with accept_unverified (diagnostics)",
            )
        tid = header.transfer_id
        ended = self._ended.get(tid)
        transfer = self.transfers.get(tid)
        if transfer is None and ended is not None:
            raise BeginRefused(
                grpc.StatusCode.ALREADY_EXISTS, f"transfer id {tid!r} was already used ({ended})"
            )
        if transfer is not None and transfer.header is not None:
            if transfer.session != request.session or transfer.header_digest != digest:
                raise BeginRefused(
                    grpc.StatusCode.ALREADY_EXISTS,
                    f"transfer id {tid!r} is in use by another sender",
                )
            self.metrics.resumes.labels(ROLE).inc()
            transfer.progress = time.monotonic()
            transfer.peer = peer or transfer.peer
            log.info(
                "transfer_resumed transfer_id=%s request_id=%s contiguous=%d",
                tid,
                header.request_id,
                transfer.contiguous,
            )
            return pb.BeginReply(
                contiguous=transfer.contiguous,
                held=sorted(s for s in transfer.checksums if s >= transfer.contiguous),
                resumed=True,
                max_chunk_bytes=self.options.max_chunk_bytes,
            )
        expect = transfer.expect if transfer is not None else None
        if expect is not None and expect != header.fingerprint:
            detail = f"model fingerprint mismatch: receiver expects {expect}, sender has {header.fingerprint}"
            if transfer is not None:
                self._fail(transfer, detail)
            raise BeginRefused(grpc.StatusCode.FAILED_PRECONDITION, detail)
        if (
            self.accept_fingerprints is not None
            and header.fingerprint not in self.accept_fingerprints
        ):
            raise BeginRefused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"model fingerprint mismatch: {header.fingerprint} is not served by this receiver",
            )
        if transfer is None:
            transfer = _Transfer(transfer_id=tid)
            self.transfers[tid] = transfer
        transfer.header = header
        transfer.header_digest = digest
        transfer.coverage = Coverage(header)
        transfer.session = request.session
        transfer.peer = peer
        transfer.checksum_kind = kind
        transfer.started = transfer.progress = time.monotonic()
        transfer.discard = header.attrs.get("pdbridge.loopback") == "discard"
        if request.deadline_ms:
            transfer.deadline = transfer.started + request.deadline_ms / 1000
        self.metrics.active.labels(ROLE).inc()
        if kind is Checksum.NONE:
            self._warn_unverified(peer, tid)
        transfer.changed.set()
        log.info(
            "transfer_begun transfer_id=%s request_id=%s layers=%d",
            tid,
            header.request_id,
            len(header.layers),
        )
        return pb.BeginReply(contiguous=0, max_chunk_bytes=self.options.max_chunk_bytes)

    def _warn_unverified(self, peer: str, transfer_id: str) -> None:
        """Log once per sending peer that its chunks are not verified (checksum none)."""
        if peer in self._warned_unverified:
            return
        if len(self._warned_unverified) >= 4096:  # bounded: a flood of peers re-warns
            self._warned_unverified.clear()
        self._warned_unverified.add(peer)
        log.warning(
            "checksum_disabled peer=%s transfer_id=%s detail=%s",
            peer,
            transfer_id,
            "chunks are neither checksummed nor verified (diagnostic mode, never in production)",
        )

    def lookup(self, transfer_id: str) -> _Transfer:
        transfer = self.transfers.get(transfer_id)
        if transfer is None or transfer.header is None:
            ended = self._ended.get(transfer_id)
            if ended:
                raise BeginRefused(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"transfer {transfer_id!r} has ended ({ended})",
                )
            raise BeginRefused(
                grpc.StatusCode.NOT_FOUND, f"transfer {transfer_id!r} was never begun"
            )
        return transfer

    def check_chunk(self, transfer: _Transfer, chunk: Any) -> str | None:
        """Bound a chunk before decoding it. Returns "busy" or None (decode and verify);
        raises ChunkRejected. Where the chunk lands is checked only once its checksum -- which
        covers those fields -- has passed (:meth:`accept`): a damaged layer name or offset is
        then a resend, not a refusal. A chunk whose seq is already held is verified too before
        it is acknowledged (and then dropped by :meth:`accept`): its seq may be a damaged one,
        and an unverified "ok" would leave the real chunk unanswered."""
        duplicate = chunk.seq in transfer.checksums
        if transfer.header is None:
            raise ChunkRejected(f"transfer {transfer.transfer_id!r} was never begun")
        if chunk.raw_length > self.options.max_chunk_bytes:
            raise ChunkRejected(
                f"chunk.raw_length {chunk.raw_length} exceeds the maximum {self.options.max_chunk_bytes}"
            )
        if (
            not transfer.discard
            and not duplicate  # takes no memory: accept() drops it
            # The chunk a consumer is blocked on is always admitted (at most one chunk over
            # the budget per transfer); refusing it while later chunks fill the budget
            # would deadlock delivery, which is strictly in order.
            and not (chunk.seq == transfer.contiguous == transfer.delivered)
            and self.memory_in_use + chunk.raw_length > self.options.memory_budget_bytes
        ):
            return "busy"
        return None

    def accept(
        self,
        transfer: _Transfer,
        chunk: Any,
        data: bytes | memoryview,
        wire_bytes: int,
        owned: bool = False,
    ) -> None:
        """Record a verified chunk (its checksum already passed). For a consumer, ``data``
        is kept as it is when nothing can change it (``bytes``, a view of ``bytes`` such as
        a payload cut out of its gRPC frame, or a buffer the caller hands over: ``owned``),
        otherwise as a copy; a transfer that discards keeps nothing.

        Raises ChunkRejected for a chunk of a layer outside the manifest or past a layer's
        declared length (the sender really sent it so: its checksum passed). Chunks that
        become contiguous are placed in sequence order (:class:`Coverage`); one that
        overlaps, leaves a hole or follows its layer's final chunk fails the transfer."""
        held = transfer.checksums.get(chunk.seq)
        if held is not None and held != chunk.checksum and not transfer.failed:
            raise ChunkRejected(
                f"chunk {chunk.seq}: resent with other contents than the copy already held"
            )
        if held is not None or transfer.failed:
            return
        coverage = self._check_placement(transfer, chunk)
        transfer.checksums[chunk.seq] = chunk.checksum
        transfer.placements[chunk.seq] = (chunk.layer, chunk.offset, len(data), chunk.layer_final)
        transfer.raw_bytes += len(data)
        transfer.progress = time.monotonic()
        self.metrics.bytes_raw.labels(ROLE).inc(len(data))
        self.metrics.bytes_wire.labels(ROLE).inc(wire_bytes)
        self.metrics.chunks.labels(ROLE).inc()
        if transfer.checksum_kind is Checksum.NONE:
            self.metrics.unverified.labels(ROLE).inc()
        if not transfer.discard:
            kept = data if owned or _immutable(data) else bytes(data)
            transfer.pending[chunk.seq] = Segment(
                chunk.layer, chunk.offset, kept, chunk.layer_final
            )
            self._hold(transfer, len(data))
        while transfer.contiguous in transfer.checksums:
            layer, offset, length, final = transfer.placements.pop(transfer.contiguous)
            try:
                coverage.place(transfer.contiguous, layer, offset, length, final)
            except CoverageError as exc:
                self.metrics.invalid.labels(ROLE).inc()
                self._fail(transfer, f"layer coverage: {exc}")
                return
            transfer.contiguous += 1
        if transfer.discard:
            transfer.delivered = transfer.contiguous
        transfer.changed.set()

    def _check_placement(self, transfer: _Transfer, chunk: Any) -> Coverage:
        """Refuse a verified chunk that no manifest allows; the transfer's coverage."""
        header, coverage = transfer.header, transfer.coverage
        if header is None or coverage is None:
            raise ChunkRejected(f"transfer {transfer.transfer_id!r} was never begun")
        spec = header.layer(chunk.layer)
        if header.layers and spec is None:
            raise ChunkRejected(f"chunk.layer {chunk.layer!r} is not in the layout manifest")
        if spec is not None and spec.length and chunk.offset + chunk.raw_length > spec.length:
            raise ChunkRejected(
                f"chunk.offset+raw_length {chunk.offset + chunk.raw_length} exceeds layer "
                f"{chunk.layer!r} length {spec.length}"
            )
        return coverage

    def finish(self, trailer: Any) -> Any:
        stated = (trailer.chunk_count, trailer.raw_bytes, trailer.digest)
        if (
            trailer.transfer_id not in self.transfers
            and self._trailers.get(trailer.transfer_id) == stated
        ):
            # The same trailer again, after the transfer completed: the answer to the first
            # Finish was lost on its way back (a connection dropped under it) and the sender
            # asks again. Refusing it would fail a transfer that was delivered.
            return pb.FinishReply(ok=True)
        transfer = self.lookup(trailer.transfer_id)
        missing = [s for s in range(trailer.chunk_count) if s not in transfer.checksums]
        if missing:
            return pb.FinishReply(ok=False, missing=missing[:1024])
        if (
            len(transfer.checksums) != trailer.chunk_count
            or transfer.raw_bytes != trailer.raw_bytes
        ):
            self._fail(transfer, "trailer does not match the chunks received")
            raise BeginRefused(
                grpc.StatusCode.DATA_LOSS, "trailer: chunk count or raw bytes differ"
            )
        digest = transfer_digest(transfer.checksums[s] for s in range(trailer.chunk_count))
        if digest != trailer.digest:
            self._fail(transfer, "transfer digest mismatch")
            raise BeginRefused(grpc.StatusCode.DATA_LOSS, "trailer.digest: mismatch")
        incomplete = transfer.coverage.incomplete() if transfer.coverage else "never begun"
        if incomplete:
            self._fail(transfer, f"layer coverage: {incomplete}")
            raise BeginRefused(grpc.StatusCode.DATA_LOSS, f"layer coverage: {incomplete}")
        transfer.finished = True
        transfer.trailer = stated
        transfer.progress = time.monotonic()
        transfer.changed.set()
        if transfer.discard:
            self._end(transfer, "completed")
        log.info(
            "transfer_finished transfer_id=%s request_id=%s chunks=%d raw_bytes=%d",
            transfer.transfer_id,
            transfer.header.request_id if transfer.header is not None else "",
            trailer.chunk_count,
            trailer.raw_bytes,
        )
        return pb.FinishReply(ok=True)

    def cancel(self, transfer_id: str, reason: str) -> None:
        transfer = self.transfers.get(transfer_id)
        if transfer is not None:
            self._fail(transfer, f"canceled by sender: {reason or 'no reason given'}")

    # -- consumer side -------------------------------------------------------------------
    async def open(
        self,
        transfer_id: str,
        deadline_s: float,
        expect_fingerprint: Fingerprint | None = None,
    ) -> TransferReader:
        """Wait (up to deadline_s) for the transfer's header; see ReceiverServer.open."""
        loop_deadline = time.monotonic() + deadline_s
        transfer = self.transfers.get(transfer_id)
        if transfer is None:
            ended = self._ended.get(transfer_id)
            if ended is not None:
                raise TransferFailed(f"transfer {transfer_id!r} has ended ({ended})")
            transfer = _Transfer(transfer_id=transfer_id, expect=expect_fingerprint)
            transfer.deadline = loop_deadline
            self.transfers[transfer_id] = transfer
        if transfer.consumers:
            raise TransferFailed(f"transfer {transfer_id!r} already has a consumer")
        transfer.consumers += 1
        if transfer.expect is None:
            transfer.expect = expect_fingerprint
        reader = TransferReader(self, transfer, loop_deadline)
        try:
            await reader.wait_header()
        except BaseException:
            reader.close()
            raise
        return reader


class TransferReader:
    """A consumer's view of one transfer: ``header`` then ``async for segment in reader``.

    Segments come in sequence order, each verified; iteration ends after the last one
    once the trailer's digest matched; TransferFailed on expiry, cancel, mismatch or when
    the consumer's deadline passes. ``close()`` (or leaving ``async with``) frees it.
    """

    def __init__(self, store: TransferStore, transfer: _Transfer, deadline: float) -> None:
        self._store = store
        self._transfer = transfer
        self._deadline = deadline
        self.header: TransferHeader | None = None

    async def __aenter__(self) -> TransferReader:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()

    async def _wait(self) -> None:
        transfer = self._transfer
        remaining = self._deadline - time.monotonic()
        if remaining <= 0:
            self._store._fail(transfer, "consumer deadline passed")
            raise TransferFailed(f"transfer {transfer.transfer_id!r}: consumer deadline passed")
        transfer.changed.clear()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(transfer.changed.wait(), remaining)

    async def wait_header(self) -> TransferHeader:
        transfer = self._transfer
        while transfer.header is None:
            if transfer.failed:
                raise self._failure()
            await self._wait()
        if transfer.failed:
            raise self._failure()
        if transfer.expect is not None and transfer.expect != transfer.header.fingerprint:
            detail = (
                f"model fingerprint mismatch: consumer expects {transfer.expect}, "
                f"sender has {transfer.header.fingerprint}"
            )
            self._store._fail(transfer, detail)
            raise FingerprintMismatch(detail)
        self.header = transfer.header
        return transfer.header

    def _failure(self) -> TransferFailed:
        reason = self._transfer.failed or "failed"
        return failure(f"transfer {self._transfer.transfer_id!r}: {reason}")

    def __aiter__(self) -> AsyncIterator[Segment]:
        return self._segments()

    async def _segments(self) -> AsyncIterator[Segment]:
        transfer = self._transfer
        while True:
            if transfer.failed:
                raise self._failure()
            if transfer.delivered < transfer.contiguous:
                segment = transfer.pending.pop(transfer.delivered)
                transfer.delivered += 1
                self._store._release(transfer, len(segment.data))
                yield segment
                continue
            if transfer.finished:
                self._store._end(transfer, "completed")
                return
            await self._wait()

    def close(self) -> None:
        transfer = self._transfer
        transfer.consumers -= 1
        if transfer.finished and transfer.delivered == transfer.contiguous:
            self._store._end(transfer, "completed")
        elif not transfer.failed:
            self._store._fail(transfer, "consumer closed before the transfer completed")

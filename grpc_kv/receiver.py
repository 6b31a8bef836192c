"""The receiving end of the KV link: a gRPC server embeddable in any asyncio process.

``ReceiverServer(bind, options, tls)``; ``port = await server.start()``; consumers call
``await server.open(transfer_id, deadline_s, expect_fingerprint=...)``; ``await
server.stop(grace)``. With ``local_socket=path`` the same consumer API is also served on a
Unix socket for an engine in another process (:mod:`grpc_kv.local`). Handlers parse
requests themselves so that a malformed frame is INVALID_ARGUMENT (not INTERNAL) and only
its own stream ends.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from grpc_kv.alloc import tune_allocator
from grpc_kv.bulk import split_target
from grpc_kv.bulk_server import BulkServer
from grpc_kv.chunks import ChunkRejected, decode_chunk
from grpc_kv.codec import CorruptChunk
from grpc_kv.local import LocalServer
from grpc_kv.manifest import Fingerprint
from grpc_kv.metrics import LinkMetrics
from grpc_kv.options import ReceiverOptions, grpc_options
from grpc_kv.protocol import PACKAGE, pb
from grpc_kv.store import ROLE, BeginRefused, TransferReader, TransferStore, peer_key
from grpc_kv.tls import PeerRejected, TLSConfig
from grpc_kv.wire import CHUNK_PAYLOAD_FIELD, FrameError, split_field

log = logging.getLogger("grpc_kv.receiver")

SERVICE = f"{PACKAGE}.KvLink"
# Chunks above this many bytes are decoded in a worker thread to keep the loop responsive.
_THREAD_DECODE_BYTES = 256 * 1024

Context = grpc.aio.ServicerContext[Any, Any]


def _parse(message_type: Any, data: bytes, field: str) -> Any:
    msg = message_type()
    try:
        msg.ParseFromString(data)
    except DecodeError as exc:
        raise ChunkRejected(f"{field}: malformed {message_type.DESCRIPTOR.name} frame") from exc
    return msg


def _parse_chunk(data: bytes) -> tuple[Any, memoryview]:
    """A Chunk frame's small fields (parsed by protobuf) and its payload (a view, not
    copied); ChunkRejected when malformed."""
    try:
        head, payload = split_field(data, CHUNK_PAYLOAD_FIELD)
    except FrameError as exc:
        raise ChunkRejected(f"chunk: malformed Chunk frame ({exc})") from exc
    return _parse(pb.Chunk, head, "chunk"), payload


class _Servicer:
    def __init__(self, server: ReceiverServer) -> None:
        self.server = server
        self.store = server.store
        self.metrics = server.metrics

    async def _authorize(self, context: Context) -> str:
        try:
            return self.server.tls.authorize(context)
        except PeerRejected as exc:
            self.metrics.rejected_peers.labels(ROLE, "not_allowed").inc()
            log.warning("peer_rejected peer=%s reason=%s", context.peer(), exc)
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, str(exc))
            raise  # unreachable: abort raises

    async def _invalid(self, context: Context, exc: Exception) -> None:
        self.metrics.invalid.labels(ROLE).inc()
        log.warning("frame_invalid peer=%s error=%s", context.peer(), exc)
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))

    async def begin(self, data: bytes, context: Context) -> bytes:
        identity = await self._authorize(context)
        try:
            request = _parse(pb.BeginRequest, data, "begin")
            reply = self.store.begin(request, peer_key(identity, context.peer()))
            if request.want_bulk and self.server.bulk is not None:
                reply.bulk_port = self.server.bulk.advertised_port
            return bytes(reply.SerializeToString())
        except ChunkRejected as exc:
            await self._invalid(context, exc)
        except BeginRefused as exc:
            log.warning("begin_refused code=%s detail=%s", exc.code.name, exc.detail)
            await context.abort(exc.code, exc.detail)
        raise AssertionError("unreachable")

    async def push(self, requests: AsyncIterator[bytes], context: Context) -> AsyncIterator[bytes]:
        peer = peer_key(await self._authorize(context), context.peer())
        self.store.stream_opened(peer)
        try:
            async for ack in self._push(requests, context):
                yield ack
        finally:
            self.store.stream_closed(peer)

    async def _push(self, requests: AsyncIterator[bytes], context: Context) -> AsyncIterator[bytes]:
        max_chunk = self.server.options.max_chunk_bytes
        async for data in requests:
            try:
                chunk, payload = _parse_chunk(data)
                transfer = self.store.lookup(chunk.transfer_id)
                verdict = self.store.check_chunk(transfer, chunk)
                status = pb.ACK_OK
                detail = ""
                if verdict == "busy":
                    status, detail = pb.ACK_BUSY, "receiver memory budget exhausted"
                elif verdict is None:
                    args = (
                        chunk,
                        payload,
                        transfer.checksum_kind,
                        max_chunk,
                        transfer.header_digest,
                    )
                    try:
                        # Uncompressed chunks only need a checksum (tens of GB/s, well under
                        # a millisecond for 4 MiB): a thread hop would cost more than it saves.
                        if chunk.raw_length > _THREAD_DECODE_BYTES and chunk.codec != pb.CODEC_NONE:
                            raw = await asyncio.to_thread(decode_chunk, *args)
                        else:
                            raw = decode_chunk(*args)
                        self.store.accept(transfer, chunk, raw, len(payload))
                    except CorruptChunk as exc:
                        self.metrics.checksum_failures.labels(ROLE).inc()
                        log.warning(
                            "chunk_corrupt transfer_id=%s seq=%d error=%s",
                            chunk.transfer_id,
                            chunk.seq,
                            exc,
                        )
                        status, detail = pb.ACK_CORRUPT, str(exc)
            except ChunkRejected as exc:
                await self._invalid(context, exc)
                return
            except BeginRefused as exc:
                await context.abort(exc.code, exc.detail)
                return
            yield pb.Ack(
                seq=chunk.seq, status=status, contiguous=transfer.contiguous, detail=detail
            ).SerializeToString()

    async def finish(self, data: bytes, context: Context) -> bytes:
        await self._authorize(context)
        try:
            return bytes(self.store.finish(_parse(pb.Trailer, data, "trailer")).SerializeToString())
        except ChunkRejected as exc:
            await self._invalid(context, exc)
        except BeginRefused as exc:
            await context.abort(exc.code, exc.detail)
        raise AssertionError("unreachable")

    async def cancel(self, data: bytes, context: Context) -> bytes:
        await self._authorize(context)
        try:
            request = _parse(pb.CancelRequest, data, "cancel")
        except ChunkRejected as exc:
            await self._invalid(context, exc)
            raise
        self.store.cancel(request.transfer_id, request.reason)
        return bytes(pb.CancelReply().SerializeToString())

    async def ping(self, data: bytes, context: Context) -> bytes:
        await self._authorize(context)
        try:
            request = _parse(pb.PingRequest, data, "ping")
        except ChunkRejected as exc:
            await self._invalid(context, exc)
            raise
        reply = pb.PingReply(nonce=request.nonce, protocol_version=1, attrs=self.server.describe)
        return bytes(reply.SerializeToString())

    async def probe(self, requests: AsyncIterator[bytes], context: Context) -> bytes:
        await self._authorize(context)
        total, first, last = 0, 0.0, 0.0
        async for data in requests:
            now = time.perf_counter()
            first = first or now
            last = now
            total += len(data)
        return bytes(pb.ProbeReply(bytes=total, seconds=last - first).SerializeToString())


def _unary(fn: Callable[[bytes, Context], Awaitable[bytes]]) -> grpc.RpcMethodHandler:
    return grpc.unary_unary_rpc_method_handler(fn)


class ReceiverServer:
    """An embeddable KV-link receiver (see module docstring).

    ``bind``: ``host:port`` (port 0 = ephemeral). ``accept_fingerprints``: when set, Begin
    refuses any other model before data is accepted. Not thread-safe: use it from the loop
    that started it. Metrics live in ``self.metrics`` (own registry).
    """

    def __init__(
        self,
        bind: str = "127.0.0.1:0",
        options: ReceiverOptions | None = None,
        tls: TLSConfig | None = None,
        *,
        local_socket: Path | str | None = None,
        local_socket_mode: int = 0o600,
        accept_fingerprints: set[Fingerprint] | None = None,
        metrics: LinkMetrics | None = None,
    ) -> None:
        if tls is None:
            raise ValueError("tls: required (TLSConfig(...) or TLSConfig.development())")
        self.bind = bind
        self.options = options or ReceiverOptions()
        self.tls = tls
        self.local_socket = Path(local_socket) if local_socket else None
        self.local_socket_mode = local_socket_mode
        self.metrics = metrics or LinkMetrics()
        self.store = TransferStore(self.options, self.metrics, accept_fingerprints)
        self.health = health.aio.HealthServicer()  # type: ignore[attr-defined]
        #: Answered in every Ping (``PingReply.attrs``; :meth:`Link.describe`): what the
        #: receiver's owner says of itself -- a vLLM decode rank its tensor-parallel layout.
        self.describe: dict[str, str] = {}
        self.port: int | None = None
        self._server: grpc.aio.Server | None = None
        self._local: LocalServer | None = None
        #: The bulk data endpoint (None until started, or when ``options.bulk`` is off).
        self.bulk: BulkServer | None = None

    @property
    def memory_in_use(self) -> int:
        """Decoded bytes currently held (0 when every transfer was consumed or expired)."""
        return self.store.memory_in_use

    @property
    def active_transfers(self) -> int:
        return len(self.store.transfers)

    async def start(self) -> int:
        """Bind and serve; returns the bound TCP port. Raises RuntimeError if binding fails."""
        tune_allocator()
        servicer = _Servicer(self)
        max_message = self.options.max_chunk_bytes + (1 << 20)
        opts = grpc_options(max_message, self.options.keepalive_ms)
        handlers = {
            "Begin": _unary(servicer.begin),
            "Push": grpc.stream_stream_rpc_method_handler(servicer.push),
            "Finish": _unary(servicer.finish),
            "Cancel": _unary(servicer.cancel),
            "Ping": _unary(servicer.ping),
            "Probe": grpc.stream_unary_rpc_method_handler(servicer.probe),
        }
        self._server = grpc.aio.server(options=opts)
        self._server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(SERVICE, handlers),)
        )
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        try:
            port = self.tls.add_port(self._server, self.bind)
        except RuntimeError as exc:
            raise RuntimeError(f"bind: cannot listen on {self.bind}: {exc}") from exc
        if port == 0:
            raise RuntimeError(f"bind: cannot listen on {self.bind}")
        self.port = port
        self.store.start()
        if self.options.bulk:
            host, _ = split_target(self.bind)
            self.bulk = BulkServer(
                host, self.options.bulk_port, self.store, self.metrics, self.tls, self.options
            )
            try:
                await self.bulk.start()
            except RuntimeError:
                await self._server.stop(None)
                await self.store.stop()
                raise
        await self._server.start()
        if self.local_socket is not None:
            self._local = LocalServer(
                self.local_socket, self.open, self.metrics, self.local_socket_mode
            )
            try:
                await self._local.start()
            except RuntimeError:
                await self.stop(None)
                raise
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        await self.health.set(SERVICE, health_pb2.HealthCheckResponse.SERVING)
        log.info(
            "receiver_started bind=%s port=%d bulk_port=%s insecure=%s",
            self.bind,
            port,
            self.bulk.port if self.bulk else None,
            self.tls.insecure,
        )
        return port

    async def stop(self, grace: float | None = 1.0) -> None:
        """Stop accepting, let in-flight RPCs finish for ``grace`` seconds, fail the rest."""
        await self.health.enter_graceful_shutdown()
        if self.bulk is not None:
            await self.bulk.stop()
        if self._local is not None:
            await self._local.stop()
        if self._server is not None:
            await self._server.stop(grace)
        await self.store.stop()
        log.info("receiver_stopped port=%s", self.port)

    async def open(
        self,
        transfer_id: str,
        deadline_s: float,
        expect_fingerprint: Fingerprint | None = None,
    ) -> TransferReader:
        """Await a transfer's header (up to ``deadline_s``) and return its reader.

        May be called before the sender begins: an ``expect_fingerprint`` given then makes
        the receiver refuse a sender with another model at Begin, before any data. Raises
        TransferFailed (deadline, expiry, cancel) or FingerprintMismatch. Non-blocking.
        """
        return await self.store.open(transfer_id, deadline_s, expect_fingerprint)

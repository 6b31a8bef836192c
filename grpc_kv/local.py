"""The consumer API over a local Unix socket, for an engine in another process than its
receiver (``pdbridge kv serve --local-socket PATH``): :class:`LocalServer` on the
receiver's side, :func:`consume` on the engine's.

Same semantics as :meth:`grpc_kv.receiver.ReceiverServer.open`: the header first, then
verified segments in order; failures raise TransferFailed / FingerprintMismatch. The socket
is plaintext: protect it with filesystem permissions (it never leaves the host).

Wire format (integers little-endian), one connection per transfer:

    engine:   "PDKVLOCL"  u32 length, ConsumeRequest
    receiver: [u32 head_len, u64 data_len, head, data]...

Each head is a ``Segment`` without its data field. The first carries the transfer's
header; each later one a segment's layer, offset and layer_final, followed by its
``data_len`` bytes. A frame with both lengths 0 ends a transfer whose digest matched; a
head with ``error`` set (``error_code``: the gRPC status it stands for) ends one that
failed. The engine closing its end frees the transfer on the receiver (as leaving
``async with`` on an embedded reader does).

Costs: the receiver writes each segment from the buffer the chunk was verified in with
``sendmsg`` (no copy in Python) and the engine receives its data with ``recv_into`` a
buffer of its own that it keeps: one copy through the kernel, nothing else. A gRPC
service on this socket, which this replaced, cost each side 1.5-2 CPU s/GB
(docs/kv-link.md, "The local socket").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from grpc_kv.alloc import owned_buffer
from grpc_kv.bulk import MAX_HEAD, PREFIX, send_parts
from grpc_kv.coverage import Coverage, CoverageError
from grpc_kv.manifest import Fingerprint, TransferHeader, fingerprint_from_pb
from grpc_kv.metrics import LinkMetrics
from grpc_kv.protocol import pb
from grpc_kv.store import Segment, TransferFailed, TransferReader, failure

log = logging.getLogger("grpc_kv.local")

LOCAL_MAGIC = b"PDKVLOCL"
REQUEST_PREFIX = struct.Struct("<I")
#: Largest ConsumeRequest a receiver reads (real ones are < 200 bytes).
MAX_REQUEST = 64 * 1024
#: Largest segment an engine accepts (a chunk's raw length is capped well below it).
MAX_SEGMENT = 256 << 20
#: An engine must send its request this soon after connecting.
REQUEST_TIMEOUT_S = 10.0
#: How long past its own deadline an engine waits for the receiver (the receiver ends the
#: transfer at that deadline itself; this covers a receiver that hangs).
GRACE_S = 60.0
#: The receiver's send buffer per engine connection: a whole 4 MiB segment is taken by one
#: ``sendmsg`` and the engine's reads come in large pieces (fewer wakeups on both sides).
_SNDBUF = 4 << 20

OpenTransfer = Callable[[str, float, Fingerprint | None], Awaitable[TransferReader]]


class LocalRefused(Exception):
    """A request the receiver cannot serve (malformed, too large, too late)."""


# -- receiver side ---------------------------------------------------------------------
class LocalServer:
    """Serves ``open_transfer`` (a receiver's :meth:`open`) to engines on the Unix socket
    ``path``, one connection per transfer. :meth:`start` raises RuntimeError when the
    socket cannot be created; :meth:`stop` closes it and every stream being served."""

    def __init__(
        self, path: Path, open_transfer: OpenTransfer, metrics: LinkMetrics, mode: int = 0o600
    ) -> None:
        self.path = path
        self.mode = mode
        self.metrics = metrics
        self._open = open_transfer
        self._sock: socket.socket | None = None
        self._accepting: asyncio.Task[None] | None = None
        self._streams: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self.path.unlink(missing_ok=True)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(str(self.path))
            # Before listen(): until then a connect is refused, so no engine of another user
            # can slip in while the socket still has the umask's permissions.
            os.chmod(self.path, self.mode)
            sock.listen(64)
        except OSError as exc:
            sock.close()
            raise RuntimeError(f"local_socket: cannot listen on {self.path}: {exc}") from exc
        sock.setblocking(False)
        self._sock = sock
        self._accepting = asyncio.create_task(self._accept(sock))

    async def stop(self) -> None:
        tasks = [t for t in (self._accepting, *self._streams) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._sock is not None:
            self._sock.close()
            self._sock = None
            self.path.unlink(missing_ok=True)

    async def _accept(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                conn, _ = await loop.sock_accept(sock)
            except OSError as exc:  # out of descriptors, for one: keep serving the others
                log.warning("local_accept_failed error=%s", exc)
                await asyncio.sleep(0.1)
                continue
            task = asyncio.create_task(self._serve(conn))
            self._streams.add(task)
            task.add_done_callback(self._streams.discard)

    async def _serve(self, conn: socket.socket) -> None:
        conn.setblocking(False)
        with contextlib.suppress(OSError):
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SNDBUF)
        transfer_id = "?"
        try:
            try:
                async with asyncio.timeout(REQUEST_TIMEOUT_S):
                    request = await _read_request(conn)
            except (LocalRefused, TimeoutError) as exc:
                detail = str(exc) or f"no request within {REQUEST_TIMEOUT_S:.0f} s"
                log.warning("local_request_refused reason=%s", detail)
                await _send_error(conn, grpc.StatusCode.INVALID_ARGUMENT, detail)
                return
            transfer_id = request.transfer_id
            self.metrics.local_streams.inc()
            # The engine sends nothing after its request: a read that completes means it
            # closed its end, and the transfer is freed now, not at the next segment.
            streaming = asyncio.create_task(self._stream(conn, request))
            left = asyncio.ensure_future(asyncio.get_running_loop().sock_recv(conn, 1))
            try:
                await asyncio.wait({streaming, left}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                if not streaming.done():
                    streaming.cancel()  # its reader is closed: the transfer is freed
                    if left.done():
                        log.info("local_consumer_left transfer_id=%s", transfer_id)
                left.cancel()
                # Both finish here, even when the receiver stops: nothing outlives the stream.
                # A reset seen by ``left`` is the engine leaving too: retrieved, not raised.
                await asyncio.gather(streaming, left, return_exceptions=True)
                self.metrics.local_streams.dec()
            if not streaming.cancelled() and (error := streaming.exception()) is not None:
                raise error
        except (ConnectionError, OSError) as exc:  # the engine went away; its reader is closed
            log.info("local_consumer_gone transfer_id=%s error=%s", transfer_id, exc)
        except Exception as exc:  # a bug must cost this stream, never the receiver
            log.exception("local_internal_error transfer_id=%s", transfer_id)
            await _send_error(conn, grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}")
        finally:
            conn.close()

    async def _stream(self, conn: socket.socket, request: Any) -> None:
        expect = None
        if request.HasField("expect_fingerprint"):
            expect = fingerprint_from_pb(request.expect_fingerprint)
        try:
            reader = await self._open(request.transfer_id, request.deadline_s or 30.0, expect)
            async with reader:
                header = await reader.wait_header()
                await _send_frame(conn, pb.Segment(header=header.to_pb()).SerializeToString())
                async for segment in reader:
                    head = pb.Segment(
                        layer=segment.layer, offset=segment.offset, layer_final=segment.final
                    ).SerializeToString()
                    await _send_frame(conn, head, segment.data)
                    self.metrics.local_bytes.inc(len(segment.data))
        except TransferFailed as exc:
            code = grpc.StatusCode.FAILED_PRECONDITION
            if "deadline" in str(exc):
                code = grpc.StatusCode.DEADLINE_EXCEEDED
            await _send_error(conn, code, str(exc))
            return
        await _send_frame(conn, b"")  # the end: every segment verified, the digest matched


async def _read_request(conn: socket.socket) -> Any:
    """The engine's ConsumeRequest; LocalRefused naming what is wrong with it."""
    start = bytearray(len(LOCAL_MAGIC) + REQUEST_PREFIX.size)
    await _fill(conn, memoryview(start))
    if bytes(start[: len(LOCAL_MAGIC)]) != LOCAL_MAGIC:
        raise LocalRefused("local socket: not a pdbridge consumer stream (bad magic)")
    (length,) = REQUEST_PREFIX.unpack_from(start, len(LOCAL_MAGIC))
    if length > MAX_REQUEST:
        raise LocalRefused(f"local socket: request of {length} bytes (at most {MAX_REQUEST})")
    body = bytearray(length)
    await _fill(conn, memoryview(body))
    try:
        request = pb.ConsumeRequest.FromString(bytes(body))
    except DecodeError as exc:
        raise LocalRefused("local socket: malformed ConsumeRequest") from exc
    if not request.transfer_id:
        raise LocalRefused("transfer_id: required")
    if not 0 <= request.deadline_s <= 86_400:
        raise LocalRefused(f"deadline_s: {request.deadline_s} outside 0..86400")
    return request


async def _send_frame(conn: socket.socket, head: bytes, data: Any = b"") -> None:
    prefix = PREFIX.pack(len(head), len(data)) + head
    await send_parts(conn, [prefix, data] if len(data) else [prefix])


async def _send_error(conn: socket.socket, code: grpc.StatusCode, detail: str) -> None:
    head = pb.Segment(error=detail, error_code=code.value[0]).SerializeToString()
    with contextlib.suppress(OSError):  # an engine that is gone needs no explanation
        await _send_frame(conn, head)


async def _fill(conn: socket.socket, view: memoryview) -> None:
    """Receive exactly ``len(view)`` bytes into ``view``; ConnectionError at EOF."""
    loop = asyncio.get_running_loop()
    got = 0
    while got < len(view):
        n = await loop.sock_recv_into(conn, view[got:])
        if not n:
            raise ConnectionError("local socket: closed by the other end")
        got += n


# -- engine side -----------------------------------------------------------------------
class _Frames:
    """The engine's end of one stream: each frame read within ``until`` (loop time)."""

    def __init__(self, sock: socket.socket, until: float) -> None:
        self.sock = sock
        self.until = until

    async def next(self, where: str = "mid-transfer") -> tuple[Any, memoryview] | None:
        """(parsed head, data) of the next frame, None at the clean end; TransferFailed
        for a failed transfer, a broken (``where``) or malformed stream, or the receiver's
        silence."""
        try:
            async with asyncio.timeout_at(self.until):
                return await self._next()
        except TimeoutError as exc:
            raise TransferFailed(
                "local socket: the receiver sent nothing before the deadline"
            ) from exc
        except ConnectionError as exc:
            raise TransferFailed(f"local socket: the receiver closed the stream {where}") from exc

    async def _next(self) -> tuple[Any, memoryview] | None:
        prefix = bytearray(PREFIX.size)
        await _fill(self.sock, memoryview(prefix))
        head_len, data_len = PREFIX.unpack(prefix)
        if head_len == 0 and data_len == 0:
            return None
        if not 0 < head_len <= MAX_HEAD:
            raise TransferFailed(f"local socket: head length {head_len} outside 1..{MAX_HEAD}")
        if data_len > MAX_SEGMENT:
            raise TransferFailed(
                f"local socket: segment of {data_len} bytes (at most {MAX_SEGMENT})"
            )
        head = bytearray(head_len)
        await _fill(self.sock, memoryview(head))
        try:
            msg = pb.Segment.FromString(bytes(head))
        except DecodeError as exc:
            raise TransferFailed("local socket: malformed Segment head") from exc
        if msg.error:
            raise failure(msg.error)
        # The data lands in a buffer of its own that the engine keeps: no copy after this.
        data = owned_buffer(data_len) if data_len else memoryview(b"")
        await _fill(self.sock, data)
        return msg, data


class LocalReader:
    """What :func:`consume` yields: ``header`` and ``async for segment in reader`` (each
    segment's ``data`` a memoryview of a buffer that belongs to the engine)."""

    def __init__(self, frames: _Frames, header: TransferHeader) -> None:
        self._frames = frames
        self.header = header

    def __aiter__(self) -> AsyncIterator[Segment]:
        return self._segments()

    async def _segments(self) -> AsyncIterator[Segment]:
        # The receiver placed every chunk before sending it; the engine checks again what
        # reaches it over the socket, so a broken receiver cannot hand it a hole or overlap.
        coverage = Coverage(self.header)
        index = 0
        while (frame := await self._frames.next()) is not None:
            msg, data = frame
            try:
                coverage.place(index, msg.layer, msg.offset, len(data), msg.layer_final)
            except CoverageError as exc:
                raise TransferFailed(f"local socket: layer coverage: {exc}") from exc
            index += 1
            yield Segment(msg.layer, msg.offset, data, msg.layer_final)
        incomplete = coverage.incomplete()
        if incomplete:
            raise TransferFailed(f"local socket: layer coverage: {incomplete}")


@contextlib.asynccontextmanager
async def consume(
    socket_path: Path | str,
    transfer_id: str,
    deadline_s: float,
    expect_fingerprint: Fingerprint | None = None,
) -> AsyncIterator[LocalReader]:
    """Consume a transfer from the receiver listening on ``socket_path``.

    Waits up to ``deadline_s`` for the header (and bounds the whole read by it plus the
    sender's own deadline on the receiver). Raises TransferFailed / FingerprintMismatch.
    Leaving the block early closes the stream, which frees the transfer on the receiver.
    """
    request = pb.ConsumeRequest(transfer_id=transfer_id, deadline_s=deadline_s)
    if expect_fingerprint is not None:
        request.expect_fingerprint.weights_sha256 = expect_fingerprint.weights_sha256
        request.expect_fingerprint.arch_hash = expect_fingerprint.arch_hash
    body = request.SerializeToString()
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.setblocking(False)
    try:
        try:
            async with asyncio.timeout(max(deadline_s, 1.0)):
                await loop.sock_connect(sock, str(socket_path))
                await loop.sock_sendall(sock, LOCAL_MAGIC + REQUEST_PREFIX.pack(len(body)) + body)
        except (OSError, TimeoutError) as exc:
            raise TransferFailed(
                f"local socket {socket_path}: cannot reach the receiver: {exc}"
            ) from exc
        frames = _Frames(sock, loop.time() + deadline_s + GRACE_S)
        first = await frames.next("before the header")
        if first is None or not first[0].HasField("header"):
            raise TransferFailed(f"transfer {transfer_id!r}: receiver sent no header")
        yield LocalReader(frames, TransferHeader.from_pb(first[0].header))
    finally:
        sock.close()

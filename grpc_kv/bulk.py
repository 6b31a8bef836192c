"""The bulk data path of the KV link: chunks over raw TCP (or TLS) data connections.

gRPC stays the control plane: ``Begin`` (version, header, fingerprint; ``want_bulk`` ->
``BeginReply.bulk_port``), resume, ``Finish`` (trailer, digest), ``Cancel``, health. Only
chunks and their acks move to data connections, because on a fast link grpcio's message
objects cost more CPU per byte than everything else (docs/kv-link.md, "Performance").

Wire format (all integers little-endian; see ``BulkHello`` in kv.proto):

    sender:   "PDKVBULK"  [u32 head_len, u64 payload_len, head, payload]...
    receiver: [u32 length, Ack]...

The first frame's head is a ``BulkHello`` naming the transfer and its Begin session,
answered ``ACK_READY`` before the sender writes any chunk; every later head is a ``Chunk`` without its payload field, followed by ``payload_len`` payload
bytes. A frame with both lengths 0 ends the stream (the receiver closes once it acked
everything). A refusal is an ``Ack`` with status ``ACK_REFUSED`` and the gRPC status code
it stands for, after which the receiver closes the connection; other connections and
transfers are unaffected.

Costs: the sender writes the head and a memoryview of the producer's ``bytes`` with
``sendmsg`` (no Python-level copy); the receiver reads each payload with ``recv_into``
(one kernel->user copy, the only one): an uncompressed chunk for a consumer straight into a
buffer of its own that the store keeps, anything else into a reused per-connection buffer.

This module: the wire format and the sender's :class:`BulkStream` (used by
:mod:`grpc_kv.sender` in place of a Push call). Receiver side: :mod:`grpc_kv.bulk_server`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import queue
import socket
import ssl
import struct
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from grpc_kv.protocol import PROTOCOL_VERSION, pb
from grpc_kv.tls import TLSConfig

log = logging.getLogger("grpc_kv.bulk")

MAGIC = b"PDKVBULK"
PREFIX = struct.Struct("<IQ")  # head length, payload length
ACK_PREFIX = struct.Struct("<I")
#: Largest head (a BulkHello or a Chunk's small fields) accepted; real ones are < 1 KiB.
MAX_HEAD = 64 * 1024
#: Largest ack frame a sender accepts.
MAX_ACK = 64 * 1024
#: TLS handshake, and the hello after connecting, must complete within this.
HANDSHAKE_TIMEOUT_S = 10.0
#: A sender's blocking write gives up after this long without progress (the stall
#: detector normally closes a dead connection well before).
_SEND_TIMEOUT_S = 60.0
#: Frames a connection's writer thread may have queued (one being written, one ready).
_DEPTH = 2
#: PDBRIDGE_KV_BULK_THREAD_SEND=1: a writer thread per plaintext data connection instead of
#: the event loop (docs/kv-link.md, "Performance").
_THREAD_SEND = os.environ.get("PDBRIDGE_KV_BULK_THREAD_SEND", "0") == "1"


class BulkRefused(Exception):
    """The receiver refused the data connection (``code``: the gRPC status it stands for)."""

    def __init__(self, code: grpc.StatusCode, detail: str) -> None:
        super().__init__(f"{code.name}: {detail}")
        self.code = code
        self.detail = detail


class BulkBroken(ConnectionError):
    """The data connection broke or spoke nonsense: reconnect and resume."""


_CODES = {code.value[0]: code for code in grpc.StatusCode}


def split_target(target: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port``) -> (host, port); ValueError naming the target."""
    host, _, port = target.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"target: {target!r} is not host:port")
    return host.strip("[]"), int(port)


# -- sender ------------------------------------------------------------------------------
class BulkStream:
    """One sender data connection, standing in for a gRPC Push call: ``send`` a chunk's
    head and payload, ``read`` the next Ack (``eof`` at the end), ``done_writing``,
    ``cancel``. Plain TCP uses the loop's non-blocking socket calls with ``sendmsg`` of
    memoryviews (asyncio's transports would copy every partially written payload into
    their buffer), or with ``PDBRIDGE_KV_BULK_THREAD_SEND=1`` a writer thread per
    connection with blocking sends; TLS uses an asyncio stream (encryption copies anyway).

    Raises BulkBroken / OSError when the connection breaks (the sender resumes) and
    BulkRefused when the receiver refused it (the sender fails the transfer)."""

    def __init__(self, eof: Any) -> None:
        self._eof = eof
        self._loop = asyncio.get_running_loop()
        self._sock: socket.socket | None = None
        #: A duplicate of ``_sock`` with a timeout, for worker-thread writes (same file
        #: description: still non-blocking for the loop's reads on ``_sock``).
        self._wsock: socket.socket | None = None
        self._wlock = threading.Lock()
        self._wbusy = False
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._rbuf = bytearray()
        self._dead: asyncio.Future[None] = self._loop.create_future()
        #: Plaintext, threaded: frames queued for this connection's writer thread, and the
        #: loop's permits to queue more (``_DEPTH``): the thread writes them back to back.
        self._outq: queue.SimpleQueue[Any] | None = None
        self._slots = asyncio.Semaphore(_DEPTH)

    @classmethod
    async def open(
        cls,
        target: str,
        port: int,
        tls: TLSConfig,
        transfer_id: str,
        session: str,
        timeout: float,
        eof: Any,
    ) -> BulkStream:
        """Connect to ``port`` on ``target``'s host and send the hello. Raises OSError /
        TimeoutError when unreachable, ssl errors when the handshake fails."""
        host, _ = split_target(target)
        stream = cls(eof)
        hello = pb.BulkHello(
            protocol_version=PROTOCOL_VERSION, transfer_id=transfer_id, session=session
        ).SerializeToString()
        first = MAGIC + PREFIX.pack(len(hello), 0) + hello
        try:
            async with asyncio.timeout(timeout):
                await stream._connect(host, port, tls, timeout)
                await stream._write([first])
                # Chunks wait for the receiver's READY: a path that accepts connections
                # and then drops them fails here, before any chunk is charged an attempt.
                ready = await stream.read()
            if ready is eof or ready.status != pb.ACK_READY:
                raise BulkBroken("data connection closed before the receiver was ready")
        except BaseException:
            stream.cancel()
            raise
        return stream

    async def _connect(self, host: str, port: int, tls: TLSConfig, timeout: float) -> None:
        if tls.insecure:
            infos = await self._loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            family, kind, proto, _, address = infos[0]
            self._sock = socket.socket(family, kind, proto)
            self._sock.setblocking(False)
            self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            await self._until_dead(self._loop.sock_connect(self._sock, address))
            if _THREAD_SEND:
                self._wsock = self._sock.dup()
                self._wsock.settimeout(_SEND_TIMEOUT_S)
                self._outq = queue.SimpleQueue()
                threading.Thread(
                    target=self._writer_main, name="pdbridge-kv-bulk-writer", daemon=True
                ).start()
            return
        self._reader, self._writer = await asyncio.open_connection(
            host,
            port,
            ssl=tls.ssl_context(server_side=False),
            server_hostname=tls.server_name or host,
            ssl_handshake_timeout=timeout,
            limit=MAX_ACK * 4,
        )
        raw = self._writer.get_extra_info("socket")
        if raw is not None:
            raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    async def _until_dead(self, aw: Any) -> Any:
        """Await ``aw`` unless the stream is cancelled first (then BulkBroken)."""
        fut = asyncio.ensure_future(aw)
        try:
            await asyncio.wait({fut, self._dead}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not fut.done():
                fut.cancel()
        if not fut.done() or fut.cancelled():
            raise BulkBroken("data connection closed")
        return fut.result()

    async def _write(self, parts: Any) -> None:
        """Write ``parts`` (a list of buffers, or a callable returning one, called by the
        writer itself: in the writer thread when there is one)."""
        if self._dead.done():
            raise BulkBroken("data connection closed")
        if self._sock is None:
            if self._writer is None:
                raise BulkBroken("data connection not open")
            if callable(parts):
                parts = parts()
            for part in parts:
                self._writer.write(part)
            await self._until_dead(self._writer.drain())
            return
        if self._outq is not None:
            await self._until_dead(self._slots.acquire())
            if self._dead.done():
                raise BulkBroken("data connection closed")
            self._outq.put(parts)
            return
        if callable(parts):
            parts = parts()
        await send_parts(self._sock, parts, self._until_dead)

    def _writer_main(self) -> None:
        """The writer thread of a plaintext connection: writes queued frames back to back
        (no event-loop round trip between two chunks), returns a permit per frame, and on
        a write error closes the stream (the ack reader then raises BulkBroken and the
        sender resumes). Ends at the ``None`` that ``cancel`` queues."""
        outq = self._outq
        while outq is not None and (parts := outq.get()) is not None:
            try:
                self._send_rest(parts)
            except Exception as exc:  # OSError, BulkBroken: the connection is gone
                if not self._dead.done():
                    log.info("bulk_write_failed error=%s", exc)
                self._call_loop(self.cancel)
                return
            self._call_loop(self._slots.release)

    def _call_loop(self, fn: Callable[[], Any]) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
            self._loop.call_soon_threadsafe(fn)

    def _send_rest(self, parts: Any) -> None:
        """Blocking, in the writer thread: ``sendall`` on a duplicate of the socket that has
        a timeout, so CPython waits for buffer space in C with the GIL released, and the
        kernel's copy (the sender's largest cost) runs beside the event loop instead of on
        it. The descriptor is closed by whoever finishes last, never under a running send
        (a closed and reused fd would take these bytes into another connection)."""
        with self._wlock:
            wsock = self._wsock
            if wsock is None:
                raise BulkBroken("data connection closed")
            self._wbusy = True
        try:
            if callable(parts):
                parts = parts()
            sent = wsock.sendmsg(parts)  # one syscall for head and payload, mostly
            for view in unsent(parts, sent):
                wsock.sendall(view)
        finally:
            with self._wlock:
                self._wbusy = False
                if self._wsock is None:
                    wsock.close()

    async def send(self, parts: Callable[[], tuple[bytes, memoryview]]) -> None:
        """Write one chunk; ``parts`` returns its head and payload and is called by the
        writer (see OutChunk.bulk_parts). Returns once the kernel took the bytes, or with a
        writer thread once the frame is queued for it (at most ``_DEPTH``; a failed write
        then closes the stream and the sender resumes from the acks)."""

        def frame() -> list[bytes | memoryview]:
            head, payload = parts()
            return [PREFIX.pack(len(head), len(payload)) + head, payload]

        await self._write(frame)

    async def done_writing(self) -> None:
        """End the stream; the receiver closes after acknowledging what it got."""
        with contextlib.suppress(BulkBroken, OSError):
            await self._write([PREFIX.pack(0, 0)])

    async def _recv(self) -> bytes:
        if self._sock is not None:
            return bytes(await self._until_dead(self._loop.sock_recv(self._sock, 65536)))
        if self._reader is None:
            raise BulkBroken("data connection not open")
        return bytes(await self._until_dead(self._reader.read(65536)))

    def ready_ack(self) -> Any:
        """The next Ack already received, or None (no wait: the sender drains every ack
        that one socket read brought before it waits again)."""
        if len(self._rbuf) < ACK_PREFIX.size:
            return None
        (length,) = ACK_PREFIX.unpack_from(self._rbuf)
        if length > MAX_ACK:
            raise BulkBroken(f"ack frame of {length} bytes")
        end = ACK_PREFIX.size + length
        if len(self._rbuf) < end:
            return None
        try:
            ack = pb.Ack.FromString(bytes(self._rbuf[ACK_PREFIX.size : end]))
        except DecodeError as exc:
            raise BulkBroken("malformed ack frame") from exc
        del self._rbuf[:end]
        if ack.status == pb.ACK_REFUSED:
            code = _CODES.get(ack.code, grpc.StatusCode.UNKNOWN)
            raise BulkRefused(code, ack.detail)
        return ack

    async def read(self) -> Any:
        """The next Ack, or ``eof`` when the receiver closed the stream cleanly."""
        while True:
            ack = self.ready_ack()
            if ack is not None:
                return ack
            data = await self._recv()
            if not data:
                if self._rbuf:
                    raise BulkBroken("data connection closed inside an ack frame")
                return self._eof
            self._rbuf += data

    def cancel(self) -> None:
        """Close now; a pending send or read raises BulkBroken. Idempotent."""
        if self._dead.done():
            return
        self._dead.set_result(None)
        if self._outq is not None:
            self._outq.put(None)  # the writer thread ends after its current frame
        if self._sock is not None:
            # Unregister first: the loop must not keep watching a closed (reusable) fd.
            fd = self._sock.fileno()
            if fd >= 0:
                self._loop.remove_reader(fd)
                self._loop.remove_writer(fd)
                with contextlib.suppress(OSError):  # wakes a writer thread blocked in send
                    self._sock.shutdown(socket.SHUT_RDWR)
            self._loop.call_soon(self._sock.close)
            with self._wlock:
                wsock, self._wsock = self._wsock, None
                if wsock is not None and not self._wbusy:
                    wsock.close()
        elif self._writer is not None:
            self._writer.transport.abort()


async def send_parts(
    sock: socket.socket, parts: list[Any], guard: Callable[[Any], Awaitable[Any]] | None = None
) -> None:
    """Write ``parts`` (buffers, in order) to the non-blocking ``sock`` from the running
    loop: one ``sendmsg`` for all of them (memoryviews are not copied), then
    ``sock_sendall`` of whatever the socket did not take, each awaited through ``guard``
    when given (the bulk sender's: gives up when the stream is cancelled)."""
    loop = asyncio.get_running_loop()
    try:
        sent = sock.sendmsg(parts)
    except (BlockingIOError, InterruptedError):
        sent = 0
    for view in unsent(parts, sent):
        pending = loop.sock_sendall(sock, view)
        await (guard(pending) if guard is not None else pending)


def unsent(parts: list[Any], sent: int) -> list[Any]:
    """What of ``parts`` (buffers written in order) remains after ``sent`` bytes."""
    rest = []
    for part in parts:
        if sent >= len(part):
            sent -= len(part)
            continue
        rest.append(memoryview(part)[sent:] if sent else part)
        sent = 0
    return rest


def is_certificate_error(exc: BaseException) -> bool:
    """A TLS failure that no retry can fix (our certificate refused, or theirs)."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        return True
    return isinstance(exc, ssl.SSLError) and "CERTIFICATE" in (exc.reason or "").upper()

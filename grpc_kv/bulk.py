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
``sendmsg`` (no Python-level copy); the receiver reads each payload with ``recv_into`` a
per-connection buffer (one kernel->user copy; the store copies it once more only when it
keeps the bytes for a consumer, as on the gRPC path).

Receiver side: :class:`BulkServer` (started by :class:`grpc_kv.receiver.ReceiverServer`),
single asyncio loop, shares the receiver's :class:`~grpc_kv.store.TransferStore`. Sender
side: :class:`BulkStream`, used by :mod:`grpc_kv.sender` in place of a Push call.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
import struct
import threading
from collections.abc import Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from grpc_kv.codec import PB_TO_CODEC, CorruptChunk, max_payload
from grpc_kv.metrics import LinkMetrics
from grpc_kv.options import ReceiverOptions
from grpc_kv.protocol import PROTOCOL_VERSION, pb
from grpc_kv.store import ROLE, BeginRefused, ChunkRejected, TransferStore, decode_chunk
from grpc_kv.tls import PeerRejected, TLSConfig, peercert_names

log = logging.getLogger("grpc_kv.bulk")

MAGIC = b"PDKVBULK"
PREFIX = struct.Struct("<IQ")  # head length, payload length
ACK_PREFIX = struct.Struct("<I")
#: Largest head (a BulkHello or a Chunk's small fields) accepted; real ones are < 1 KiB.
MAX_HEAD = 64 * 1024
#: Largest ack frame a sender accepts.
MAX_ACK = 64 * 1024
#: Chunks above this many bytes that need decompressing are decoded in a worker thread.
_THREAD_DECODE_BYTES = 256 * 1024
_HANDSHAKE_TIMEOUT_S = 10.0
#: A sender's blocking write gives up after this long without progress (the stall
#: detector normally closes a dead connection well before).
_SEND_TIMEOUT_S = 60.0
_THREAD_SEND = __import__("os").environ.get("PDBRIDGE_KV_BULK_THREAD_SEND", "1") == "1"


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


# -- receiver ----------------------------------------------------------------------------
class BulkServer:
    """The receiver's bulk data endpoint: a TCP listener on ``host:port`` (0 = ephemeral),
    TLS unless ``tls.insecure``, each connection parsed by :class:`_BulkConnection`.
    Non-blocking; :meth:`start` returns the bound port; :meth:`stop` closes everything."""

    def __init__(
        self,
        host: str,
        port: int,
        store: TransferStore,
        metrics: LinkMetrics,
        tls: TLSConfig,
        options: ReceiverOptions,
    ) -> None:
        self.host = host
        self.port = port
        self.store = store
        self.metrics = metrics
        self.tls = tls
        self.options = options
        self.connections: set[_BulkConnection] = set()
        #: The port Begin advertises: the bound one, unless something forwards another
        #: port to it (a port mapping; the tests' fault proxy).
        self.advertised_port = port
        self._server: asyncio.Server | None = None

    async def start(self) -> int:
        loop = asyncio.get_running_loop()
        host = None if self.host in ("", "0.0.0.0", "::") else self.host  # noqa: S104
        try:
            self._server = await loop.create_server(
                lambda: _BulkConnection(self), host, self.port, reuse_address=True
            )
        except OSError as exc:
            raise RuntimeError(
                f"bulk_port: cannot listen on {self.host}:{self.port}: {exc}"
            ) from exc
        self.port = int(self._server.sockets[0].getsockname()[1])
        self.advertised_port = self.advertised_port or self.port
        return self.port

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for conn in list(self.connections):
            conn.abort()
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 1.0)


class _BulkConnection(asyncio.BufferedProtocol):
    """One data connection on the receiver: a state machine over the frames (magic ->
    prefix -> head -> payload). ``get_buffer`` hands out exactly the bytes the current
    field still needs, so a payload lands in its buffer straight from ``recv_into``
    (or from the TLS record decryption) and never passes through an intermediate one."""

    def __init__(self, server: BulkServer) -> None:
        self.server = server
        self.store = server.store
        self.metrics = server.metrics
        self.transport: asyncio.BaseTransport | None = None
        self.peer = "?"
        self.small = bytearray(max(MAX_HEAD, len(MAGIC), PREFIX.size))
        self.payload = bytearray()
        self.state = "magic"
        self.need = len(MAGIC)
        self.got = 0
        self.head_len = 0
        self.payload_len = 0
        self.transfer_id = ""  # set by the hello
        self.chunk: Any = None
        self.closing = False
        self.eof = False
        self.decoding: asyncio.Task[None] | None = None
        self.handshake: asyncio.Task[None] | None = None
        self.backlog: list[bytes] = []
        self.hello_timer: asyncio.TimerHandle | None = None

    # -- transport callbacks --------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if self.transport is not None:  # start_tls hands us the TLS transport: no new start
            return
        self.transport = transport
        peer = transport.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if peer else "?"
        self.server.connections.add(self)
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        # A connection must name its transfer soon: an idle or silent one is not kept.
        self.hello_timer = asyncio.get_running_loop().call_later(
            _HANDSHAKE_TIMEOUT_S, self._hello_overdue
        )
        if not self.server.tls.insecure:
            # Nothing may be read before the TLS handshake owns the socket.
            transport.pause_reading()  # type: ignore[attr-defined]
            self.handshake = asyncio.ensure_future(self._start_tls(transport))

    def _hello_overdue(self) -> None:
        if not self.transfer_id and not self.closing:
            log.warning("bulk_hello_overdue peer=%s", self.peer)
            self.abort()

    async def _start_tls(self, raw: asyncio.BaseTransport) -> None:
        """Handshake (client certificate required), check the allowlist, and only then
        attach this protocol: no byte of an unauthorised peer reaches the frame parser.
        The TLS layer may hand over the first decrypted bytes before ``start_tls``
        returns; a gate protocol holds them (bounded) until the peer is admitted."""
        loop = asyncio.get_running_loop()
        gate = _Gate()
        try:
            ctx = self.server.tls.ssl_context(server_side=True)
            tls = await loop.start_tls(
                raw,  # type: ignore[arg-type]
                gate,
                ctx,
                server_side=True,
                ssl_handshake_timeout=_HANDSHAKE_TIMEOUT_S,
            )
        except (OSError, ValueError, ConnectionError, TimeoutError) as exc:
            # No certificate, one from another CA, not TLS at all: refused by the handshake.
            # Unlike gRPC's C core, this one is visible to Python, so it is counted.
            self.metrics.rejected_peers.labels(ROLE, "tls_handshake").inc()
            log.warning("peer_rejected peer=%s path=bulk reason=%s", self.peer, exc)
            raw.abort()  # type: ignore[attr-defined]
            self._gone()
            return
        if tls is None or gate.lost or self.closing:
            raw.abort()  # type: ignore[attr-defined]
            self._gone()
            return
        self.transport = tls
        tls.set_protocol(self)
        try:
            self.server.tls.check_names(peercert_names(tls.get_extra_info("peercert")))
        except PeerRejected as exc:
            self.metrics.rejected_peers.labels(ROLE, "not_allowed").inc()
            log.warning("peer_rejected peer=%s path=bulk reason=%s", self.peer, exc)
            self._refuse(grpc.StatusCode.PERMISSION_DENIED, str(exc))
            return
        if gate.overflow:
            self._refuse(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                "bulk: too much data before the handshake completed",
            )
            return
        self.backlog = gate.data
        self._feed()

    def _feed(self) -> None:
        """Parse bytes that arrived before this protocol was attached (copied once; at
        most a few socket reads at the start of a TLS connection)."""
        while self.backlog and not self.closing and self.decoding is None:
            data = self.backlog[0]
            buf = self.get_buffer(len(data))
            n = min(len(buf), len(data))
            buf[:n] = data[:n]
            if n == len(data):
                self.backlog.pop(0)
            else:
                self.backlog[0] = data[n:]
            self.buffer_updated(n)

    def get_buffer(self, sizehint: int) -> memoryview:
        if self.closing:
            return memoryview(self.small)  # draining a refused connection: discarded
        if self.state == "payload":
            return memoryview(self.payload)[self.got : self.payload_len]
        return memoryview(self.small)[self.got : self.need]

    def buffer_updated(self, nbytes: int) -> None:
        if self.closing:
            return
        self.got += nbytes
        self._advance()

    def eof_received(self) -> bool | None:
        self.eof = True
        if self.state != "prefix" or self.got:
            log.info("bulk_eof_midframe peer=%s state=%s", self.peer, self.state)
        self._close_when_idle()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._gone()

    # -- frames ---------------------------------------------------------------------------
    def _advance(self) -> None:
        """Handle every complete field; stops at a partial one or while a chunk decodes."""
        while not self.closing and self.decoding is None:
            target = self.payload_len if self.state == "payload" else self.need
            if self.got < target:
                return
            try:
                self._field_complete()
            except ChunkRejected as exc:
                self.metrics.invalid.labels(ROLE).inc()
                self._refuse(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            except BeginRefused as exc:
                self._refuse(exc.code, exc.detail)
            except Exception as exc:  # a bug must cost this connection, never the server
                log.exception("bulk_internal_error peer=%s", self.peer)
                self._refuse(grpc.StatusCode.INTERNAL, f"bulk: {type(exc).__name__}: {exc}")

    def _expect(self, state: str, need: int) -> None:
        self.state, self.need, self.got = state, need, 0

    def _field_complete(self) -> None:
        if self.state == "magic":
            if bytes(self.small[: len(MAGIC)]) != MAGIC:
                raise ChunkRejected("bulk: not a pdbridge bulk data connection (bad magic)")
            self._expect("prefix", PREFIX.size)
        elif self.state == "prefix":
            self.head_len, self.payload_len = PREFIX.unpack_from(self.small)
            if self.head_len == 0 and self.payload_len == 0:  # end of stream
                self.eof = self.closing = True
                self._close_when_idle()  # every chunk before it is acked by now
                return
            if not 0 < self.head_len <= MAX_HEAD:
                raise ChunkRejected(f"bulk: head length {self.head_len} outside 1..{MAX_HEAD}")
            self._expect("head", self.head_len)
        elif self.state == "head":
            head = bytes(self.small[: self.head_len])
            if not self.transfer_id:
                self._hello(head)
                self._expect("prefix", PREFIX.size)
            else:
                self._chunk_head(head)
        else:
            self._payload_complete()

    def _hello(self, head: bytes) -> None:
        if self.payload_len:
            raise ChunkRejected("bulk: the hello frame carries no payload")
        try:
            hello = pb.BulkHello.FromString(head)
        except DecodeError as exc:
            raise ChunkRejected("bulk: malformed BulkHello frame") from exc
        if hello.protocol_version != PROTOCOL_VERSION:
            raise BeginRefused(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"protocol version mismatch: sender speaks pdbridge.kv.v{hello.protocol_version},"
                " this receiver speaks pdbridge.kv.v1",
            )
        transfer = self.store.lookup(hello.transfer_id)
        if not hello.session or hello.session != transfer.session:
            raise BeginRefused(
                grpc.StatusCode.PERMISSION_DENIED,
                f"bulk: session does not match the Begin of transfer {hello.transfer_id!r}",
            )
        self.transfer_id = hello.transfer_id
        self._ack(0, pb.ACK_READY, transfer.contiguous)

    def _chunk_head(self, head: bytes) -> None:
        try:
            chunk = pb.Chunk.FromString(head)
        except DecodeError as exc:
            raise ChunkRejected("chunk: malformed Chunk frame") from exc
        if chunk.payload:
            raise ChunkRejected("chunk: the payload follows the head on the bulk path")
        if chunk.transfer_id != self.transfer_id:
            raise ChunkRejected(
                f"chunk.transfer_id {chunk.transfer_id!r} is not this connection's transfer"
            )
        codec = PB_TO_CODEC.get(chunk.codec)
        if codec is None:
            raise ChunkRejected(f"chunk.codec {chunk.codec} is unknown")
        transfer = self.store.lookup(chunk.transfer_id)
        # Everything that can be refused from the head is refused before a payload byte is
        # read or a buffer is sized for it (oversize, longer than declared, unknown layer).
        self.store.check_chunk(transfer, chunk)
        if self.payload_len > max_payload(codec, chunk.raw_length):
            raise ChunkRejected(
                f"chunk {chunk.seq}: payload of {self.payload_len} bytes exceeds the bound for "
                f"raw_length {chunk.raw_length}"
            )
        if len(self.payload) < self.payload_len:
            self.payload = bytearray(self.payload_len)  # grows to the largest chunk, once
        self.chunk = chunk
        self.state, self.got = "payload", 0

    def _payload_complete(self) -> None:
        chunk = self.chunk
        transfer = self.store.lookup(self.transfer_id)
        payload = memoryview(self.payload)[: self.payload_len]
        verdict = self.store.check_chunk(transfer, chunk)
        if verdict == "busy":
            self._ack(
                chunk.seq, pb.ACK_BUSY, transfer.contiguous, "receiver memory budget exhausted"
            )
        elif verdict == "duplicate":
            self._ack(chunk.seq, pb.ACK_OK, transfer.contiguous)
        elif chunk.raw_length > _THREAD_DECODE_BYTES and chunk.codec != pb.CODEC_NONE:
            # Decompression takes milliseconds: off the loop, with reading paused so the
            # payload buffer stays untouched until the decoder is done with it.
            self.transport.pause_reading()  # type: ignore[union-attr]
            self.decoding = asyncio.ensure_future(self._decode_async(chunk, payload))
            return
        else:
            try:
                raw = decode_chunk(*self._decode_args(chunk, payload))
            except CorruptChunk as exc:
                self._corrupt(chunk, exc)
            else:
                self._decode(chunk, payload, raw)
        self._expect("prefix", PREFIX.size)

    def _decode_args(self, chunk: Any, payload: memoryview) -> tuple[Any, ...]:
        kind = self.store.lookup(self.transfer_id).checksum_kind
        return (chunk, payload, kind, self.server.options.max_chunk_bytes)

    def _decode(self, chunk: Any, payload: memoryview, raw: Any) -> None:
        transfer = self.store.lookup(self.transfer_id)
        self.store.accept(transfer, chunk, raw, len(payload))  # copies only what it keeps
        self._ack(chunk.seq, pb.ACK_OK, transfer.contiguous)

    async def _decode_async(self, chunk: Any, payload: memoryview) -> None:
        try:
            args = self._decode_args(chunk, payload)
            try:
                raw = await asyncio.to_thread(decode_chunk, *args)
            except CorruptChunk as exc:
                self._corrupt(chunk, exc)
            else:
                self._decode(chunk, payload, raw)
        except ChunkRejected as exc:
            self.metrics.invalid.labels(ROLE).inc()
            self._refuse(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except BeginRefused as exc:
            self._refuse(exc.code, exc.detail)
        finally:
            del payload
            self.decoding = None
        if self.closing or self.transport is None:
            return
        self._expect("prefix", PREFIX.size)
        self._feed()
        if self.closing or self.decoding is not None:
            return
        if self.eof:
            self._close_when_idle()
            return
        self.transport.resume_reading()  # type: ignore[attr-defined]

    def _corrupt(self, chunk: Any, exc: Exception) -> None:
        self.metrics.checksum_failures.labels(ROLE).inc()
        log.warning(
            "chunk_corrupt transfer_id=%s seq=%d path=bulk error=%s",
            chunk.transfer_id,
            chunk.seq,
            exc,
        )
        contiguous = self.store.lookup(self.transfer_id).contiguous
        self._ack(chunk.seq, pb.ACK_CORRUPT, contiguous, str(exc))

    # -- replies --------------------------------------------------------------------------
    def _send(self, ack: Any) -> None:
        if self.transport is None or self.transport.is_closing():
            return
        data = ack.SerializeToString()
        self.transport.write(ACK_PREFIX.pack(len(data)) + data)  # type: ignore[attr-defined]

    def _ack(self, seq: int, status: int, contiguous: int, detail: str = "") -> None:
        self._send(pb.Ack(seq=seq, status=status, contiguous=contiguous, detail=detail))

    def _refuse(self, code: grpc.StatusCode, detail: str) -> None:
        """Tell the sender why (ACK_REFUSED) and close this connection only."""
        if code is grpc.StatusCode.INVALID_ARGUMENT:
            log.warning("frame_invalid peer=%s path=bulk error=%s", self.peer, detail)
        else:
            log.warning("bulk_refused peer=%s code=%s detail=%s", self.peer, code.name, detail)
        self._send(pb.Ack(status=pb.ACK_REFUSED, code=code.value[0], detail=detail))
        self.closing = True
        if self.transport is not None:
            self.transport.close()  # after the refusal is flushed
        self._release()

    def _close_when_idle(self) -> None:
        if self.decoding is None and self.transport is not None:
            self.transport.close()

    def abort(self) -> None:
        if self.handshake is not None:
            self.handshake.cancel()
        if self.transport is not None:
            self.transport.abort()  # type: ignore[attr-defined]
        self._gone()

    def _release(self) -> None:
        self.payload = bytearray()  # a refused or closed connection holds no buffer
        self.chunk = None

    def _gone(self) -> None:
        self.closing = True
        if self.hello_timer is not None:
            self.hello_timer.cancel()
        if self.decoding is not None:
            self.decoding.cancel()
        self._release()
        self.server.connections.discard(self)


class _Gate(asyncio.Protocol):
    """Holds what a TLS connection delivers between its handshake and the allowlist check."""

    LIMIT = 16 << 20

    def __init__(self) -> None:
        self.data: list[bytes] = []
        self.size = 0
        self.lost = False
        self.overflow = False

    def data_received(self, data: bytes) -> None:
        self.size += len(data)
        if self.size > self.LIMIT:
            self.overflow = True
            return
        self.data.append(data)

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True


# -- sender ------------------------------------------------------------------------------
class BulkStream:
    """One sender data connection, standing in for a gRPC Push call: ``send`` a chunk's
    head and payload, ``read`` the next Ack (``eof`` at the end), ``done_writing``,
    ``cancel``. Plain TCP uses the loop's non-blocking socket calls with ``sendmsg`` of
    memoryviews (asyncio's transports would copy every partially written payload into
    their buffer); TLS uses an asyncio stream (encryption copies anyway).

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
            self._wsock = self._sock.dup()
            self._wsock.settimeout(_SEND_TIMEOUT_S)
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
        writer itself: in the worker thread for plaintext)."""
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
        if _THREAD_SEND and self._wsock is not None:
            await self._until_dead(self._loop.run_in_executor(None, self._send_rest, parts))
            return
        if callable(parts):
            parts = parts()
        # One sendmsg for head and payload (no copy of the payload: memoryviews); whatever
        # the socket did not take goes out with sock_sendall of the remaining view.
        try:
            sent = self._sock.sendmsg(parts)
        except (BlockingIOError, InterruptedError):
            sent = 0
        rest = []
        for part in parts:
            if sent >= len(part):
                sent -= len(part)
                continue
            rest.append(memoryview(part)[sent:])
            sent = 0
        for view in rest:
            await self._until_dead(self._loop.sock_sendall(self._sock, view))

    def _send_rest(self, parts: Any) -> None:
        """Blocking, in a worker thread: ``sendall`` on a duplicate of the socket that has
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
            for part in parts:
                if sent >= len(part):
                    sent -= len(part)
                    continue
                wsock.sendall(memoryview(part)[sent:])
                sent = 0
        finally:
            with self._wlock:
                self._wbusy = False
                if self._wsock is None:
                    wsock.close()

    async def send(self, parts: Callable[[], tuple[bytes, memoryview]]) -> None:
        """Write one chunk; ``parts`` returns its head and payload and is called by the
        writer (see OutChunk.bulk_parts). Returns once the kernel took the bytes."""

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

    async def read(self) -> Any:
        """The next Ack, or ``eof`` when the receiver closed the stream cleanly."""
        while True:
            if len(self._rbuf) >= ACK_PREFIX.size:
                (length,) = ACK_PREFIX.unpack_from(self._rbuf)
                if length > MAX_ACK:
                    raise BulkBroken(f"ack frame of {length} bytes")
                end = ACK_PREFIX.size + length
                if len(self._rbuf) >= end:
                    try:
                        ack = pb.Ack.FromString(bytes(self._rbuf[ACK_PREFIX.size : end]))
                    except DecodeError as exc:
                        raise BulkBroken("malformed ack frame") from exc
                    del self._rbuf[:end]
                    if ack.status == pb.ACK_REFUSED:
                        code = _CODES.get(ack.code, grpc.StatusCode.UNKNOWN)
                        raise BulkRefused(code, ack.detail)
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
        if self._sock is not None:
            # Unregister first: the loop must not keep watching a closed (reusable) fd.
            fd = self._sock.fileno()
            if fd >= 0:
                self._loop.remove_reader(fd)
                self._loop.remove_writer(fd)
                with contextlib.suppress(OSError):  # wakes a worker thread blocked in send
                    self._sock.shutdown(socket.SHUT_RDWR)
            self._loop.call_soon(self._sock.close)
            with self._wlock:
                wsock, self._wsock = self._wsock, None
                if wsock is not None and not self._wbusy:
                    wsock.close()
        elif self._writer is not None:
            self._writer.transport.abort()


def is_certificate_error(exc: BaseException) -> bool:
    """A TLS failure that no retry can fix (our certificate refused, or theirs)."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        return True
    return isinstance(exc, ssl.SSLError) and "CERTIFICATE" in (exc.reason or "").upper()

"""The receiver's end of the bulk data path (wire format: :mod:`grpc_kv.bulk`).

:class:`BulkServer` is started by :class:`grpc_kv.receiver.ReceiverServer` when
``ReceiverOptions.bulk`` is on; it runs on the receiver's asyncio loop and shares its
:class:`~grpc_kv.store.TransferStore`, so a chunk that arrives here is verified, budgeted,
stored and acknowledged exactly as one that arrives on a gRPC Push stream. Every refusal
(ACK_REFUSED with a gRPC status code) ends that connection only.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import platform
import re
import socket
import sys
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from grpc_kv.alloc import owned_buffer
from grpc_kv.bulk import (
    ACK_PREFIX,
    HANDSHAKE_TIMEOUT_S,
    MAGIC,
    MAX_HEAD,
    PREFIX,
)
from grpc_kv.chunks import ChunkRejected, decode_chunk
from grpc_kv.codec import PB_TO_CODEC, Codec, CorruptChunk, max_payload
from grpc_kv.metrics import LinkMetrics
from grpc_kv.options import ReceiverOptions
from grpc_kv.protocol import PROTOCOL_VERSION, pb
from grpc_kv.store import ROLE, BeginRefused, TransferStore
from grpc_kv.tls import PeerRejected, TLSConfig

log = logging.getLogger("grpc_kv.bulk")

#: Chunks above this many bytes that need decompressing are decoded in a worker thread.
_THREAD_DECODE_BYTES = 256 * 1024
#: Plaintext: while a payload arrives, the kernel wakes the loop only once this many of its
#: bytes (or all that remain of it) are waiting (``SO_RCVLOWAT``), not for every segment.
RCVLOWAT = 1 << 20


def _kernel_grows_rcvbuf_for_lowat() -> bool:
    """Linux >= 4.18 raises a socket's receive buffer to hold its SO_RCVLOWAT mark (and caps
    the mark); on older kernels a mark above what the buffer can hold is never reached."""
    found = re.match(r"(\d+)\.(\d+)", platform.release())
    if sys.platform != "linux" or found is None:
        return False
    return (int(found[1]), int(found[2])) >= (4, 18)


_FOLLOW_LOWAT = _kernel_grows_rcvbuf_for_lowat()


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
    (or from the TLS record decryption) and never passes through an intermediate one.

    On plaintext connections the socket's receive low-water mark follows the frame: up to
    ``RCVLOWAT`` while a payload arrives, never more than what remains of it, and 1 byte
    for the small fields. Without it the loop woke for every 64 KiB segment on loopback,
    and those wakeups, not the copy, were most of the receiver's CPU per byte
    (docs/kv-link.md, "Performance")."""

    def __init__(self, server: BulkServer) -> None:
        self.server = server
        self.store = server.store
        self.metrics = server.metrics
        self.transport: asyncio.BaseTransport | None = None
        self.peer = "?"
        self.small = bytearray(max(MAX_HEAD, len(MAGIC), PREFIX.size))
        self.payload: bytearray | memoryview = bytearray()
        #: The current payload is received into a buffer of its own that the store keeps.
        self.lend = False
        self.state = "magic"
        self.need = len(MAGIC)
        self.got = 0
        self.head_len = 0
        self.payload_len = 0
        self.transfer_id = ""  # set by the hello
        self.counted = ""  # the sending node this connection is counted for (store.stream_*)
        self.chunk: Any = None
        self.closing = False
        self.eof = False
        self.decoding: asyncio.Task[None] | None = None
        self.handshake: asyncio.Task[None] | None = None
        self.backlog: list[bytes] = []
        self.hello_timer: asyncio.TimerHandle | None = None
        self.sock: Any = None  # plaintext only: the socket whose SO_RCVLOWAT follows frames
        self.lowat = 1

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
            if self.server.tls.insecure and _FOLLOW_LOWAT:
                # Not under TLS: a record partly decrypted already would make the bytes
                # left on the socket fewer than the payload's remainder, and a mark above
                # them would never be reached.
                self.sock = sock
        # A connection must name its transfer soon: an idle or silent one is not kept.
        self.hello_timer = asyncio.get_running_loop().call_later(
            HANDSHAKE_TIMEOUT_S, self._hello_overdue
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
                ssl_handshake_timeout=HANDSHAKE_TIMEOUT_S,
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
            self.server.tls.check_peercert(tls.get_extra_info("peercert"))
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
        self._follow_lowat()

    def _follow_lowat(self) -> None:
        """Set SO_RCVLOWAT for what the parser waits for now (see the class docstring). A
        mark above what will ever arrive would stall the connection, hence the remainder
        cap; a platform that refuses the option just keeps waking per segment."""
        if self.sock is None:
            return
        want = 1
        if self.state == "payload":
            want = max(1, min(self.payload_len - self.got, RCVLOWAT))
        if want != self.lowat:
            try:
                self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, want)
            except OSError:
                self.sock = None
                return
            self.lowat = want

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
        if transfer.peer and not self.counted:
            # The hello proves the connection is the Begin's sender: it keeps its node's
            # transfers alive (ReceiverOptions.sender_lost_s) like a Push stream does.
            self.counted = transfer.peer
            self.store.stream_opened(transfer.peer)
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
        # Every bound is checked before a payload byte is read or a buffer is sized for it
        # (oversize, longer than its raw length allows); where the chunk lands (its layer,
        # its offset) only once its checksum, which covers those fields, has passed.
        self.store.check_chunk(transfer, chunk)
        if self.payload_len > max_payload(codec, chunk.raw_length):
            raise ChunkRejected(
                f"chunk {chunk.seq}: payload of {self.payload_len} bytes exceeds the bound for "
                f"raw_length {chunk.raw_length}"
            )
        # An uncompressed chunk that a consumer will read is received straight into a buffer
        # of its own, which the store keeps as it is: the kernel's copy is the only one.
        # Otherwise (compressed, or a loopback test that discards) into the connection's
        # reused buffer, which grows to the largest chunk once.
        self.lend = codec is Codec.NONE and not transfer.discard
        if self.lend:
            self.payload = owned_buffer(self.payload_len)
        elif len(self.payload) < self.payload_len:
            self.payload = bytearray(self.payload_len)
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
        transfer = self.store.lookup(self.transfer_id)
        return (
            chunk,
            payload,
            transfer.checksum_kind,
            self.server.options.max_chunk_bytes,
            transfer.header_digest,
        )

    def _decode(self, chunk: Any, payload: memoryview, raw: Any) -> None:
        transfer = self.store.lookup(self.transfer_id)
        # Copies what it keeps, unless this connection lends it the buffer.
        self.store.accept(transfer, chunk, raw, len(payload), owned=self.lend)
        if self.lend:
            self.payload = bytearray()  # the store's now: never received into again
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
        self._follow_lowat()
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
        if self.counted:
            self.store.stream_closed(self.counted)
            self.counted = ""
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

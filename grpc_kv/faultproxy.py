"""A userspace TCP fault proxy in the style of Toxiproxy (asyncio), for tests and drills.

    proxy = FaultProxy(upstream="127.0.0.1:7070")
    port = await proxy.start()                 # clients dial 127.0.0.1:port
    proxy.add(Latency(ms=40))                  # toxics apply to live and new connections
    proxy.cut("reset")                         # sever: reset | blackhole | refuse
    proxy.restore()
    await proxy.stop()

Toxics (each has ``direction``: ``upstream`` = client->server, ``downstream``, or ``both``):
:class:`Latency`, :class:`Bandwidth`, :class:`Slicer`, :class:`Flip` (one byte at chosen
offsets, or after each distinct occurrence of a pattern), :class:`Drop` (lose the reads
holding a pattern, keep the connection), :class:`CloseAfter` (close the
connection after N bytes). Cuts: ``reset`` closes every connection with RST and refuses
new ones, ``blackhole`` keeps connections open but drops everything (a dead path whose endpoints
never learn it; bytes sent meanwhile are lost, so those connections stay broken after
``restore``), ``refuse`` only refuses new connections. Counters in :attr:`stats`.

Used by the KV-link tests, and meant for the gateway tests and drills (``pdbridge kv proxy``).
Runs in the caller's event loop; nothing blocks. The proxy never raises into its caller for
a peer's I/O error: the affected connection is closed and counted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import socket
import struct
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

log = logging.getLogger("grpc_kv.faultproxy")

READ_SIZE = 64 * 1024
#: Bytes one direction of a connection may hold between reading and delivering. Without a
#: latency toxic delivery only waits for the next hop to drain, so more would only pile up
#: in this process's memory (the agent's, on the KV path) while the sender is pushed back
#: all the same; with one, enough for the bytes in flight during the delay (256 reads).
PIPE_BYTES = 1 << 20
PIPE_BYTES_DELAYED = 256 * READ_SIZE
DIRECTIONS = ("upstream", "downstream", "both")


@dataclass
class Toxic:
    """Base class. ``applies(direction)`` picks the pumps it acts on. Subclasses transform
    a pump's data (``transform``) or pace its writes (``delay_s``/``pace``); every hook is
    called from the pump's task and must not block."""

    direction: str = "both"

    def __post_init__(self) -> None:
        if self.direction not in DIRECTIONS:
            raise ValueError(f"direction: must be one of {', '.join(DIRECTIONS)}")

    def applies(self, direction: str) -> bool:
        return self.direction in ("both", direction)


@dataclass
class Latency(Toxic):
    """Delay every byte by ``ms`` (+- ``jitter_ms``) without limiting throughput."""

    ms: float = 0.0
    jitter_ms: float = 0.0


@dataclass
class Bandwidth(Toxic):
    """Limit throughput to ``bytes_per_s`` per direction, shared by all connections (a WAN's
    capacity: N parallel streams split it rather than getting N times it)."""

    bytes_per_s: float = 0.0
    # When each direction's pipe is free again (monotonic seconds): a virtual clock shared by
    # every connection's writer, so their pieces go out one after another at the rate.
    _free_at: dict[str, float] = field(default_factory=dict, repr=False, compare=False)

    def reserve(self, direction: str, size: int) -> float:
        """Book ``size`` bytes on ``direction``; returns the seconds to wait before sending."""
        now = time.monotonic()
        free_at = max(self._free_at.get(direction, now), now) + size / self.bytes_per_s
        self._free_at[direction] = free_at
        return free_at - now


@dataclass
class Slicer(Toxic):
    """Deliver data in slices of ``size`` bytes with ``delay_ms`` between them."""

    size: int = 1
    delay_ms: float = 0.0


@dataclass
class CloseAfter(Toxic):
    """Forward ``bytes`` bytes of a connection (per direction), then close it (``reset``:
    with RST)."""

    bytes: int = 0
    reset: bool = True


@dataclass
class Flip(Toxic):
    """Flip single bytes (xor ``mask``: 0xFF by default, one bit with 0x01, 0x02 ...): at
    absolute stream ``offsets`` of each connection, at every multiple of ``every`` bytes of
    each connection (``every``, ``2 * every`` ...: silent corruption spread over a stream, its
    first ``every`` bytes -- connection preamble, headers -- left alone), or one byte of each
    *distinct* occurrence of ``pattern``, told apart by the ``context`` bytes that follow it
    (so a resent copy of the same data passes). ``at`` places that byte relative to the end of
    the occurrence: -1 (default) its last byte, 0 the first byte after it (a field's value
    after its tag, in a protobuf head). At most ``limit`` flips in total (None = no limit)."""

    offsets: tuple[int, ...] = ()
    pattern: bytes = b""
    context: int = 8
    limit: int | None = None
    every: int = 0
    mask: int = 0xFF
    at: int = -1
    flipped: int = 0
    _seen: set[bytes] = field(default_factory=set, repr=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.every < 0:
            raise ValueError("every: must not be negative")
        if not 0 < self.mask <= 0xFF:
            raise ValueError("mask: 1..255 (the bits to flip in one byte)")
        if self.pattern and not -len(self.pattern) <= self.at < self.context:
            raise ValueError("at: inside the pattern or its context")

    def exhausted(self) -> bool:
        return self.limit is not None and self.flipped >= self.limit

    def transform(self, data: bytearray, stream_offset: int) -> None:
        for offset in self.offsets:
            if stream_offset <= offset < stream_offset + len(data) and not self.exhausted():
                data[offset - stream_offset] ^= self.mask
                self.flipped += 1
        if self.every:
            first = max(1, -(-stream_offset // self.every)) * self.every
            for offset in range(first, stream_offset + len(data), self.every):
                if self.exhausted():
                    break
                data[offset - stream_offset] ^= self.mask
                self.flipped += 1
        if not self.pattern:
            return
        start = 0
        while not self.exhausted():
            index = data.find(self.pattern, start)
            if index < 0:
                return
            end = index + len(self.pattern)
            start = end
            if end + self.context > len(data):
                continue  # context straddles a read: leave this occurrence alone
            key = bytes(data[end : end + self.context])
            if key in self._seen:
                continue
            self._seen.add(key)
            data[end + self.at] ^= self.mask
            self.flipped += 1


@dataclass
class Drop(Toxic):
    """Drop each whole read that holds ``pattern``, at most ``limit`` of them, and go on
    forwarding: a path that lost some frames yet kept the connection (what a black hole
    restored leaves behind for the frames sent during it). Reads follow the peer's writes,
    so a dropped read is usually whole frames and the stream stays parseable."""

    pattern: bytes = b""
    limit: int = 1
    dropped: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.pattern:
            raise ValueError("pattern: required (the bytes whose read is dropped)")

    def drops(self, data: bytes | bytearray) -> bool:
        if self.dropped >= self.limit or self.pattern not in data:
            return False
        self.dropped += 1
        return True


@dataclass
class ProxyStats:
    connections: int = 0
    refused: int = 0
    resets: int = 0
    bytes_upstream: int = 0
    bytes_downstream: int = 0
    #: The most bytes any one direction of a connection held at once.
    buffered_peak: int = 0


class _Pipe:
    """One direction's reads on their way to delivery: a FIFO of ``(due, bytes)`` bounded in
    bytes, so a slow next hop pushes back on the sender instead of growing the proxy."""

    def __init__(self, stats: ProxyStats) -> None:
        self._items: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue()
        self._room = asyncio.Event()
        self._stats = stats
        self._delivering = True
        self.bytes = 0

    async def put(self, item: tuple[float, bytes], limit: int) -> None:
        """Queue ``item`` once there is room; ConnectionError when delivery has ended (the
        next hop failed), which ends the reading side too."""
        while self._delivering and self.bytes and self.bytes + len(item[1]) > limit:
            self._room.clear()
            await self._room.wait()
        if not self._delivering:
            raise ConnectionError("the next hop is gone")
        self.bytes += len(item[1])
        self._stats.buffered_peak = max(self._stats.buffered_peak, self.bytes)
        self._items.put_nowait(item)

    def close(self) -> None:
        self._items.put_nowait(None)

    def stop(self) -> None:
        """Delivery ended: wake and refuse a reader waiting for room."""
        self._delivering = False
        self._room.set()

    async def get(self) -> tuple[float, bytes] | None:
        item = await self._items.get()
        if item is not None:
            self.bytes -= len(item[1])
            self._room.set()
        return item


class _Conn:
    def __init__(self, client: asyncio.StreamWriter, server: asyncio.StreamWriter) -> None:
        self.client = client
        self.server = server
        self.tasks: list[asyncio.Task[None]] = []

    def abort(self, rst: bool) -> None:
        for writer in (self.client, self.server):
            _abort(writer, rst)


def _abort(writer: asyncio.StreamWriter, rst: bool) -> None:
    sock = writer.get_extra_info("socket")
    if rst and sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


class FaultProxy:
    """See module docstring. ``upstream`` and ``listen`` are ``host:port`` strings."""

    def __init__(self, upstream: str, listen: str = "127.0.0.1:0") -> None:
        self.upstream = _split(upstream, "upstream")
        self.listen = _split(listen, "listen")
        self.toxics: list[Toxic] = []
        self.stats = ProxyStats()
        self.mode: str | None = None  # None | "reset" | "blackhole" | "refuse"
        self.port: int | None = None
        self._server: asyncio.Server | None = None
        self._conns: set[_Conn] = set()
        self._handlers: set[asyncio.Task[None]] = set()
        self._held: set[asyncio.StreamWriter] = set()

    async def start(self) -> int:
        """Listen; returns the bound port."""
        self._server = await asyncio.start_server(self._accept, self.listen[0], self.listen[1])
        self.port = int(self._server.sockets[0].getsockname()[1])
        log.info("proxy_started port=%d upstream=%s:%d", self.port, *self.upstream)
        return self.port

    async def stop(self) -> None:
        """Close the listener and every connection (also black-holed ones) and wait for
        their handlers, so nothing outlives the proxy's event loop."""
        if self._server is not None:
            self._server.close()
        for conn in list(self._conns):
            conn.abort(rst=False)
            for task in conn.tasks:
                task.cancel()
        for writer in list(self._held):
            _abort(writer, rst=False)
        for handler in list(self._handlers):
            handler.cancel()
        await asyncio.gather(*self._handlers, return_exceptions=True)
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2)

    # -- control -------------------------------------------------------------------------
    def add(self, toxic: Toxic) -> Toxic:
        self.toxics.append(toxic)
        return toxic

    def remove(self, toxic: Toxic) -> None:
        self.toxics.remove(toxic)

    def clear(self) -> None:
        """Remove every toxic and restore the link."""
        self.toxics.clear()
        self.mode = None

    def cut(self, mode: str = "reset") -> None:
        """Sever the path: ``reset`` (RST every connection, refuse new ones), ``blackhole``
        (connections stay up, nothing is forwarded), ``refuse`` (new connections only)."""
        if mode not in ("reset", "blackhole", "refuse"):
            raise ValueError("mode: must be reset, blackhole or refuse")
        self.mode = mode
        if mode == "reset":
            for conn in list(self._conns):
                self.stats.resets += 1
                conn.abort(rst=True)
        log.info("proxy_cut port=%s mode=%s", self.port, mode)

    def restore(self) -> None:
        """End a cut; toxics stay."""
        self.mode = None
        log.info("proxy_restored port=%s", self.port)

    @property
    def flips(self) -> int:
        return sum(t.flipped for t in self.toxics if isinstance(t, Flip))

    # -- data path -----------------------------------------------------------------------
    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        handler = asyncio.current_task()
        if handler is not None:
            self._handlers.add(handler)
        try:
            await self._handle(reader, writer)
        except asyncio.CancelledError:
            # stop() cancels handlers; asyncio's stream callback would log the cancellation
            # of a connection callback as an error, so end quietly.
            pass
        finally:
            if handler is not None:
                self._handlers.discard(handler)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.mode in ("reset", "refuse"):
            self.stats.refused += 1
            _abort(writer, rst=True)
            return
        if self.mode == "blackhole":
            # A dead path: the SYN was answered (we cannot un-accept) but nothing flows.
            self._held.add(writer)
            try:
                with contextlib.suppress(OSError):
                    while await reader.read(READ_SIZE):
                        pass
            finally:
                self._held.discard(writer)
                _abort(writer, rst=False)
            return
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        except OSError as exc:
            log.info("proxy_upstream_failed error=%s", exc)
            _abort(writer, rst=True)
            return
        self.stats.connections += 1
        conn = _Conn(writer, up_writer)
        self._conns.add(conn)
        conn.tasks = [
            asyncio.create_task(self._pump(conn, reader, up_writer, "upstream")),
            asyncio.create_task(self._pump(conn, up_reader, writer, "downstream")),
        ]
        try:
            await asyncio.gather(*conn.tasks, return_exceptions=True)
        finally:
            self._conns.discard(conn)
            conn.abort(rst=False)

    async def _pump(
        self,
        conn: _Conn,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        direction: str,
    ) -> None:
        # Reading and writing are decoupled by a pipe so that latency delays bytes
        # without limiting throughput.
        pipe = _Pipe(self.stats)
        sender = asyncio.create_task(self._deliver(conn, pipe, writer, direction))
        try:
            await self._read_side(conn, reader, writer, direction, pipe, sender)
        finally:
            if not sender.done():
                sender.cancel()

    async def _read_side(
        self,
        conn: _Conn,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        direction: str,
        pipe: _Pipe,
        sender: asyncio.Task[None],
    ) -> None:
        offset = 0
        try:
            while True:
                data = await reader.read(READ_SIZE)
                if not data:
                    break
                if self.mode == "blackhole":
                    continue
                buf = bytearray(data)
                for toxic in self._active(direction):
                    if isinstance(toxic, Flip):
                        toxic.transform(buf, offset)
                if any(isinstance(t, Drop) and t.drops(buf) for t in self._active(direction)):
                    offset += len(buf)
                    continue
                closing = None
                for toxic in self._active(direction):
                    if isinstance(toxic, CloseAfter) and offset + len(buf) >= toxic.bytes:
                        buf = buf[: max(toxic.bytes - offset, 0)]
                        closing = toxic
                offset += len(buf)
                delay = sum(
                    t.ms + random.uniform(-t.jitter_ms, t.jitter_ms)  # noqa: S311 - fault jitter
                    for t in self._active(direction)
                    if isinstance(t, Latency)
                )
                limit = PIPE_BYTES_DELAYED if delay > 0 else PIPE_BYTES
                await pipe.put((time.monotonic() + max(delay, 0) / 1000, bytes(buf)), limit)
                if closing is not None:
                    pipe.close()
                    await sender
                    self.stats.resets += 1
                    conn.abort(rst=closing.reset)
                    return
        except (OSError, asyncio.IncompleteReadError):
            pass
        pipe.close()
        with contextlib.suppress(Exception):
            await sender
        with contextlib.suppress(Exception):
            writer.write_eof()

    def _active(self, direction: str) -> Iterable[Toxic]:
        return [t for t in self.toxics if t.applies(direction)]

    async def _deliver(
        self,
        conn: _Conn,
        pipe: _Pipe,
        writer: asyncio.StreamWriter,
        direction: str,
    ) -> None:
        try:
            while (item := await pipe.get()) is not None:
                due, data = item
                wait = due - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                for piece in self._slices(data, direction):
                    if self.mode == "blackhole":
                        break
                    narrowest = min(
                        (
                            t
                            for t in self._active(direction)
                            if isinstance(t, Bandwidth) and t.bytes_per_s > 0
                        ),
                        key=lambda t: t.bytes_per_s,
                        default=None,
                    )
                    if narrowest is not None:
                        # Written after the wait, so the send buffer never runs ahead of it.
                        await asyncio.sleep(narrowest.reserve(direction, len(piece)))
                    writer.write(piece)
                    await writer.drain()
                    if direction == "upstream":
                        self.stats.bytes_upstream += len(piece)
                    else:
                        self.stats.bytes_downstream += len(piece)
                    slicer = next(
                        (t for t in self._active(direction) if isinstance(t, Slicer)), None
                    )
                    if slicer is not None and slicer.delay_ms:
                        await asyncio.sleep(slicer.delay_ms / 1000)
        except (OSError, ConnectionError):
            conn.abort(rst=False)
        finally:
            pipe.stop()

    def _slices(self, data: bytes, direction: str) -> Iterable[bytes]:
        slicer = next((t for t in self._active(direction) if isinstance(t, Slicer)), None)
        if slicer is None or slicer.size <= 0:
            return [data]
        return [data[i : i + slicer.size] for i in range(0, len(data), slicer.size)]


def _split(address: str, name: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"{name}: expected host:port, got {address!r}")
    return host.strip("[]") or "127.0.0.1", int(port)

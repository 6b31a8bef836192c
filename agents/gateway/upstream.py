"""The gateway's HTTP/1.1 client to the engines (the legs).

:class:`Upstream` is a lean asyncio protocol per connection (:mod:`agents.gateway.connpool`,
with its keep-alive pool per engine), the response parsed by ``httptools`` (llhttp,
uvicorn's parser). It replaced aiohttp's client session on the request path because that
client's per-request and per-event machinery (request/response objects, the stream reader's
future per wake-up, the chunked writer's coroutine per event) was most of the gateway's CPU per
relayed stream; see docs/gateway.md, "The relay's hot path".

The request handler opens legs with :meth:`Upstream.open` (returns once the response headers
arrived) and :func:`first_chunk` (the first body bytes, i.e. the moment the engine produced
output), then hands the response to :func:`agents.gateway.proxy.relay`, which pipes the rest
(:meth:`LegResponse.pipe`). Cancellation of the calling task (client disconnect) closes the
upstream connection, which aborts the engine's work.

Failures surface as :class:`LegError` (before output) with a ``cause`` the handler maps to
fallback causes, or as :class:`UpstreamError` / ``TimeoutError`` from a leg's body.
"""

from __future__ import annotations

import asyncio
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

import httptools

from agents.gateway.connpool import Conn, Key, Pool

# Hop-by-hop and framing headers are the gateway's own business, not the engine's.
_HEADERS = b"Accept: */*\r\nAccept-Encoding: identity\r\nContent-Type: application/json\r\n"
_SSE_ERROR_PREFIX = b'data: {"error"'
#: Pull mode (before the relay pipes, and whole small bodies): the bytes a leg buffers before
#: it stops reading from the engine's socket (TCP then holds the engine back).
_PULL_LIMIT = 1 << 20
#: Pipe mode: the client's pending output above which the engine's socket is not read (a slow
#: client holds back its own stream only), and how often a paused pipe looks again.
_PIPE_HIGH = 1 << 18
_PIPE_CHECK_S = 0.005


#: The end of a chunked HTTP/1.1 body.
LAST_CHUNK = b"0\r\n\r\n"


def http_chunk(data: bytes) -> bytes:
    """``data`` framed as one chunk of a chunked HTTP/1.1 body; nothing for empty data (an
    empty chunk would end the body)."""
    return b"%x\r\n%b\r\n" % (len(data), data) if data else b""


class LegError(Exception):
    """An upstream leg failed before producing output. ``cause``: ``timeout`` (the whole
    exchange's deadline), ``first_byte_timeout``, ``idle_timeout``, ``instance_down`` (see
    :class:`InstanceDown`), ``connect``, ``status`` (non-2xx; ``status`` and ``detail`` set)
    or ``stream_error``."""

    def __init__(self, cause: str, status: int | None = None, detail: str = "") -> None:
        super().__init__(f"{cause} {status or ''} {detail}".strip())
        self.cause = cause
        self.status = status
        self.detail = detail


class UpstreamError(Exception):
    """The engine's connection ended or its response was malformed mid-exchange."""


class InstanceDown(UpstreamError):
    """The leg's instance was found unavailable (its health probes failed, or it was ejected)
    while the leg had produced no output: abandoned so that the request can be sent elsewhere
    instead of waiting out its deadline (:meth:`Upstream.abandon`)."""


class FirstByteTimeout(TimeoutError):
    """The leg produced no output within its first-byte deadline."""


class IdleTimeout(TimeoutError):
    """The leg's body stopped: nothing arrived for its idle deadline (while the client kept
    up)."""


def leg_cause(error: BaseException) -> str:
    """The :class:`LegError` cause of a leg's failure before output."""
    if isinstance(error, FirstByteTimeout):
        return "first_byte_timeout"
    if isinstance(error, IdleTimeout):
        return "idle_timeout"
    if isinstance(error, TimeoutError):
        return "timeout"
    if isinstance(error, InstanceDown):
        return "instance_down"
    return "connect"


class _Disconnected(UpstreamError):
    """The connection ended before any byte of the response (a kept-alive connection the
    engine closed as it was reused: retried once on a fresh one)."""


class LegResponse:
    """One exchange with an engine: ``status``, ``headers`` (names lower-case) and
    ``content_length`` once :meth:`Upstream.open` returned it, then the body, read
    (:meth:`readany`, :meth:`read`) or piped to the client (:meth:`pipe`). A read past the
    leg's deadline raises ``TimeoutError`` (:class:`FirstByteTimeout` before its first output,
    :class:`IdleTimeout` when its body stalls); a broken or malformed response
    :class:`UpstreamError`. :meth:`close` returns the connection to the pool when the
    exchange ended cleanly, else aborts it (which aborts the engine's work)."""

    def __init__(self, conn: Conn, loop: asyncio.AbstractEventLoop) -> None:
        self._conn = conn
        self._loop = loop
        self._chunks: list[bytes] = []
        # The body callback is the list's own append: httptools calls it once per HTTP chunk
        # (once per SSE event), and a C method there costs no Python frame per event.
        self.on_body: Callable[[bytes], None] = self._chunks.append
        self._parser = httptools.HttpResponseParser(self)
        self.status = 0
        self.headers: dict[str, str] = {}
        self.content_length: int | None = None
        self.deadline: asyncio.TimerHandle | None = None
        #: The first-byte deadline (until :meth:`begun`), then the idle check.
        self.first_deadline: asyncio.TimerHandle | None = None
        self.idle_s = 0.0
        self._idle: asyncio.TimerHandle | None = None
        self._rx_at = 0.0
        #: Whether the leg produced output (its first body bytes were taken): from then on
        #: it is the client's stream, never abandoned.
        self.started = False
        #: The open legs of its instance (see Upstream.abandon); it leaves on close.
        self.registry: set[LegResponse] | None = None
        self._framed = False  # Content-Length or chunked; else the body ends with the connection
        self._keep_alive = False
        self._got_bytes = False
        self._headers = False
        self._complete = False
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._paused = False
        self._closed = False
        # Pipe mode (see pipe()).
        self._pipe: asyncio.Future[None] | None = None
        self._out: asyncio.WriteTransport | None = None
        self._chunked_out = True
        self._count = False
        self._tail = b""
        self._check: asyncio.TimerHandle | None = None
        self.events = 0
        self.last_at = 0.0

    # -- httptools callbacks (during feed) -----------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        parser = self._parser
        self.status = parser.get_status_code()
        self._keep_alive = parser.should_keep_alive()
        length = self.headers.get("content-length")
        if length is not None:
            self.content_length = int(length)  # llhttp accepted it: digits only
        chunked = "chunked" in self.headers.get("transfer-encoding", "").lower()
        self._framed = length is not None or chunked
        self._headers = True

    def on_message_complete(self) -> None:
        self._complete = True

    # -- connection events ---------------------------------------------------------------
    def feed(self, data: bytes) -> None:
        self._got_bytes = True
        self._rx_at = time.monotonic()
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as error:
            self._fail(UpstreamError(f"malformed response from the engine: {error}"))
            self._conn.abort()
            return
        if self._pipe is not None:
            self._push()
            return
        if self._chunks or self._complete or self._headers:
            self._wake()
        if not self._paused and sum(map(len, self._chunks)) > _PULL_LIMIT:
            self._paused = True
            self._conn.pause()

    def lost(self) -> None:
        if self._complete or self._error is not None:
            return
        if self._headers and not self._framed:
            # A body delimited by the connection's end (HTTP/1.0 style): that end is its end.
            self._complete = True
            self._keep_alive = False
            if self._pipe is not None:
                self._push()
            else:
                self._wake()
            return
        if self._got_bytes:
            self._fail(UpstreamError("the engine closed the connection mid-response"))
        else:
            self._fail(_Disconnected("the engine closed the connection"))

    def expire(self) -> None:
        """The leg's deadline passed: the read in progress (or the next one) raises
        ``TimeoutError``; the reader closes the response."""
        self.deadline = None
        if not self._complete:
            self._fail(TimeoutError())

    def expire_first(self) -> None:
        """The first-byte deadline passed without output."""
        self.first_deadline = None
        if not self.started and not self._complete:
            self._fail(FirstByteTimeout())

    def abandon(self) -> None:
        """Its instance was found unavailable: fail the leg if it produced no output yet."""
        if not self.started and not self._complete:
            self._fail(InstanceDown("the instance was found unavailable"))

    def begun(self) -> None:
        """The leg's first output was taken: its first-byte deadline ends and, with
        ``idle_s``, the idle deadline starts (nothing arriving for ``idle_s`` while the
        reader keeps up fails the leg with :class:`IdleTimeout`)."""
        self.started = True
        if self.first_deadline is not None:
            self.first_deadline.cancel()
            self.first_deadline = None
        if self.idle_s > 0 and not self._complete:
            self._rx_at = time.monotonic()
            self._idle = self._loop.call_later(self.idle_s, self._idle_check)

    def _idle_check(self) -> None:
        self._idle = None
        if self._complete or self._error is not None or self._closed:
            return
        quiet = time.monotonic() - self._rx_at
        if quiet >= self.idle_s and not self._paused:
            self._fail(IdleTimeout())
            return
        # Paused for a slow reader (its own stream held back): not the engine's stall.
        wait = self.idle_s if self._paused else self.idle_s - quiet
        self._idle = self._loop.call_later(max(wait, 0.01), self._idle_check)

    def _fail(self, error: BaseException) -> None:
        if self._error is not None:
            return
        self._error = error
        if self._pipe is not None:
            self._finish_pipe()
        else:
            self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def _wait(self) -> None:
        self._waiter = self._loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    # -- reading -------------------------------------------------------------------------
    async def headers_arrived(self) -> None:
        while not self._headers:
            if self._error is not None:
                raise self._error
            await self._wait()

    async def readany(self) -> bytes:
        """Everything buffered (waits for some); b"" at the end of the body. Bytes that
        arrived before a failure are returned before it is raised."""
        while True:
            chunks = self._chunks
            if chunks:
                data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
                chunks.clear()
                if self._paused:
                    self._paused = False
                    self._conn.resume()
                return data
            if self._error is not None:
                raise self._error
            if self._complete:
                return b""
            await self._wait()

    def at_eof(self) -> bool:
        return self._complete and not self._chunks

    async def read(self) -> bytes:
        parts = []
        while data := await self.readany():
            parts.append(data)
        return b"".join(parts)

    # -- piping --------------------------------------------------------------------------
    async def pipe(self, out: asyncio.WriteTransport, chunked: bool, count_events: bool) -> bytes:
        """Write the rest of the body to ``out`` as it arrives: everything one read of the
        engine's socket delivered goes out in one write, as one HTTP chunk when ``chunked``
        (else as is). Returns the bytes that arrived together with the body's end, for the
        caller to write with the stream's terminator. ``events`` counts SSE ``data:`` lines
        piped, ``last_at`` when the last write left. While ``out`` holds more than
        ``_PIPE_HIGH`` bytes unsent, the engine's socket is not read. Raises like
        :meth:`readany`, and ``ConnectionResetError`` when the client went away."""
        self._out = out
        self._chunked_out = chunked
        self._count = count_events
        self._pipe = self._loop.create_future()
        if self._paused:
            self._paused = False
            self._conn.resume()
        self._push()
        try:
            await self._pipe
        finally:
            self._pipe = None
            if self._check is not None:
                self._check.cancel()
                self._check = None
        if self._error is not None:
            raise self._error
        return self._tail

    def _push(self) -> None:
        if self._complete or self._error is not None:
            self._finish_pipe()
            return
        chunks = self._chunks
        if not chunks:
            return
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        out = self._out
        assert out is not None  # noqa: S101 - set by pipe() before any _push
        if out.is_closing():
            self._fail(ConnectionResetError("the client went away"))
            return
        if self._count:
            self.events += data.count(b"data:")
        out.write(http_chunk(data) if self._chunked_out else data)
        self.last_at = time.monotonic()
        if not self._paused and out.get_write_buffer_size() > _PIPE_HIGH:
            self._paused = True
            self._conn.pause()
            self._check = self._loop.call_later(_PIPE_CHECK_S, self._drained)

    def _drained(self) -> None:
        """While paused for a slow client: read the engine again once the client's output
        went below half the limit (looked at every ``_PIPE_CHECK_S``)."""
        self._check = None
        out = self._out
        if self._pipe is None or out is None or self._error is not None:
            return
        if out.is_closing():
            self._fail(ConnectionResetError("the client went away"))
        elif out.get_write_buffer_size() > _PIPE_HIGH // 2:
            self._check = self._loop.call_later(_PIPE_CHECK_S, self._drained)
        else:
            self._paused = False
            self._conn.resume()

    def _finish_pipe(self) -> None:
        if self._error is None:
            chunks = self._chunks
            self._tail = chunks[0] if len(chunks) == 1 else b"".join(chunks)
            chunks.clear()
            if self._count:
                self.events += self._tail.count(b"data:")
        pipe = self._pipe
        if pipe is not None and not pipe.done():
            pipe.set_result(None)

    # -- the end -------------------------------------------------------------------------
    def close(self) -> None:
        """Idempotent. Returns the connection to the pool after a clean, complete,
        keep-alive exchange; otherwise aborts it."""
        if self._closed:
            return
        self._closed = True
        for timer in (self.deadline, self.first_deadline, self._idle):
            if timer is not None:
                timer.cancel()
        self.deadline = self.first_deadline = self._idle = None
        if self.registry is not None:
            self.registry.discard(self)
            self.registry = None
        conn = self._conn
        conn.leg = None
        if self._complete and self._error is None and self._keep_alive and not conn.closed:
            if self._paused:
                self._paused = False
                conn.resume()
            conn.pool.release(conn)
            return
        conn.abort()
        self._fail(UpstreamError("the leg was closed"))


@dataclass(frozen=True, slots=True)
class _Target:
    key: Key
    host: str
    port: int
    tls: bool
    head: bytes  # "POST <path> HTTP/1.1", Host and the fixed headers


class Upstream:
    """The HTTP client for engine legs (one per gateway process, event-loop only)."""

    def __init__(
        self,
        connect_timeout_s: float,
        ssl_context: ssl.SSLContext | None = None,
        api_key: str | None = None,
    ) -> None:
        self.connect_timeout_s = connect_timeout_s
        # For https engine URLs: a CA bundle and client certificate (mTLS); None: system CAs.
        self.ssl_context = ssl_context
        # The engines' own API key (vLLM --api-key), sent on every leg; the client's
        # Authorization is never forwarded (the fixed headers are the gateway's own).
        self._auth = b"Authorization: Bearer %b\r\n" % api_key.encode("ascii") if api_key else b""
        self._pool = Pool()
        self._targets: dict[str, _Target] = {}
        #: The open legs per engine (host, port, tls), for :meth:`abandon`.
        self._legs: dict[Key, set[LegResponse]] = {}

    async def close(self) -> None:
        self._pool.close()

    def _target(self, url: str) -> _Target:
        target = self._targets.get(url)
        if target is not None:
            return target
        try:
            parts = urlsplit(url)
            tls = parts.scheme == "https"
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError(url)
            port = parts.port or (443 if tls else 80)
        except ValueError as error:
            raise LegError("connect", detail=f"invalid engine URL {url!r}") from error
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        netloc = parts.netloc.rsplit("@", 1)[-1]
        head = f"POST {path} HTTP/1.1\r\nHost: {netloc}\r\n".encode("latin-1") + _HEADERS
        head += self._auth
        target = _Target((parts.hostname, port, tls), parts.hostname, port, tls, head)
        if len(self._targets) >= 1024:  # engine URLs change with configs: keep it bounded
            self._targets.clear()
        self._targets[url] = target
        return target

    async def _connect(
        self, target: _Target, loop: asyncio.AbstractEventLoop, deadline: float
    ) -> Conn:
        context: ssl.SSLContext | None = None
        if target.tls:
            context = self.ssl_context or ssl.create_default_context()
        try:
            async with asyncio.timeout_at(min(deadline, loop.time() + self.connect_timeout_s)):
                _, conn = await loop.create_connection(
                    lambda: Conn(self._pool, target.key),
                    target.host,
                    target.port,
                    ssl=context,
                    server_hostname=target.host if context is not None else None,
                )
        except TimeoutError as error:
            # Not the leg's timeout: nothing was sent, so another instance may take it.
            raise LegError("connect", detail="ConnectTimeout") from error
        return conn

    def abandon(self, url: str) -> int:
        """Fail every open leg to the engine at ``url`` (an instance's base URL) that has
        produced no output yet (:class:`InstanceDown`; the caller retries or falls back):
        called when the instance is found unavailable, so that requests already sent to an
        engine that stopped answering do not wait out their deadlines. Returns how many."""
        parts = urlsplit(url)
        tls = parts.scheme == "https"
        try:
            key = (parts.hostname or "", parts.port or (443 if tls else 80), tls)
        except ValueError:
            return 0
        waiting = [leg for leg in self._legs.get(key, ()) if not leg.started]
        for leg in waiting:
            leg.abandon()
        return len(waiting)

    async def open(
        self,
        url: str,
        body: bytes,
        request_id: str,
        timeout_s: float,
        first_byte_s: float = 0.0,
        idle_s: float = 0.0,
    ) -> LegResponse:
        """POST ``body`` to ``url``; returns the response once its headers arrived (2xx only).
        ``timeout_s`` bounds the whole exchange, body included, by one timer per leg (the
        response's deadline, armed when the request is sent; a new connection's connect is
        bounded by ``connect_timeout_s`` too): a wait past it raises ``TimeoutError``.
        ``first_byte_s`` (0: none) bounds the wait for the leg's first output (until
        :func:`first_chunk` returned it), ``idle_s`` (0: none) the silences of its body
        after that (see :meth:`LegResponse.begun`). Raises :class:`LegError`.

        A kept-alive connection that the engine closed just as it was reused (no byte of
        an answer) is retried once on a new connection: the engine cannot have started the
        work, having closed before reading it or before answering anything."""
        target = self._target(url)
        try:
            rid = request_id.encode("utf-8", "surrogateescape")  # the client's bytes, as sent
        except UnicodeEncodeError:
            rid = request_id.encode("utf-8", "replace")
        request = b"%bX-Request-Id: %b\r\nContent-Length: %d\r\n\r\n%b" % (
            target.head,
            rid,
            len(body),
            body,
        )
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        leg: LegResponse | None = None
        try:
            for attempt in range(2):
                conn = self._pool.take(target.key)
                if conn is None:
                    conn = await self._connect(target, loop, deadline)
                leg = LegResponse(conn, loop)
                conn.leg = leg
                leg.deadline = loop.call_at(deadline, leg.expire)
                if 0 < first_byte_s < timeout_s:
                    leg.first_deadline = loop.call_later(first_byte_s, leg.expire_first)
                leg.idle_s = idle_s
                leg.registry = self._legs.setdefault(target.key, set())
                leg.registry.add(leg)
                assert conn.transport is not None  # noqa: S101 - connected
                conn.transport.write(request)
                try:
                    await leg.headers_arrived()
                    break
                except _Disconnected:
                    leg.close()
                    if not conn.reused or attempt:
                        raise
        except (TimeoutError, InstanceDown) as error:
            if leg is not None:
                leg.close()
            raise LegError(leg_cause(error)) from error
        except (OSError, UpstreamError) as error:
            if leg is not None:
                leg.close()
            raise LegError("connect", detail=type(error).__name__) from error
        except BaseException:
            if leg is not None:
                leg.close()
            raise
        assert leg is not None  # noqa: S101 - the loop ends with a leg or raises
        if leg.status >= 300:
            try:
                detail = (await leg.read())[:2000].decode("utf-8", "replace")
            except (UpstreamError, TimeoutError):
                detail = ""
            finally:
                leg.close()
            raise LegError("status", leg.status, detail)
        return leg

    async def call(self, url: str, body: bytes, request_id: str, timeout_s: float) -> bytes:
        """A whole small exchange (the prefill leg, ``/tokenize``): the response body."""
        response = await self.open(url, body, request_id, timeout_s)
        try:
            return await response.read()
        except (TimeoutError, InstanceDown) as error:
            raise LegError(leg_cause(error)) from error
        except UpstreamError as error:
            raise LegError("stream_error", detail=type(error).__name__) from error
        finally:
            response.close()


async def first_chunk(response: LegResponse) -> bytes:
    """The first body bytes of an opened leg (b"" for an empty body): the leg has begun
    (:meth:`LegResponse.begun`). An SSE stream whose first event is an error counts as a
    failed leg (nothing has reached the client yet). Raises :class:`LegError`; closes the
    response on failure and on cancellation."""
    try:
        chunk = await response.readany()
    except asyncio.CancelledError:
        # The client went away (or the remote path gave up on this leg): close now, which
        # aborts the engine's work and cancels the leg's deadline.
        response.close()
        raise
    except (TimeoutError, InstanceDown) as error:
        response.close()
        raise LegError(leg_cause(error)) from error
    except UpstreamError as error:
        response.close()
        raise LegError("stream_error", detail=type(error).__name__) from error
    if chunk.startswith(_SSE_ERROR_PREFIX):
        response.close()
        raise LegError("status", 500, chunk[:2000].decode("utf-8", "replace"))
    response.begun()
    return chunk

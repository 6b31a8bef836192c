"""The gateway's own HTTP/1.1 server for its hot endpoints.

Who calls it: :func:`agents.gateway.server.start` (``settings.fast_server``, on by default)
listens with :class:`FastServer` instead of aiohttp's site. Every connection starts on a
:class:`FastConnection`, which serves the plain requests of the completions endpoints
itself — ``POST /v1/completions`` or ``/v1/chat/completions``, HTTP/1.1, a ``Content-Length``
body within ``max_body_bytes``, no ``Expect``, ``Upgrade``, ``Transfer-Encoding`` or
``Connection: close`` — through :meth:`Gateway.complete`, exactly as the aiohttp handler
does. At the first request it does not serve (any other endpoint, anything unusual, a
malformed head), it hands the connection to aiohttp for good: the bytes of that request
and the socket go to an aiohttp request handler, which answers from there on (errors, 4xx,
``/metrics``, ``/health``...). So the fast path only ever serves requests whose handling it
shares with aiohttp, and everything it does not know stays aiohttp's.

Why: with the upstream leg already lean (:mod:`agents.gateway.upstream`), aiohttp's server
side (request and response objects, routing, middleware, its writer) was half of the
gateway's CPU per relayed stream. Here a request is its head parsed by ``httptools`` and a
task; the response head and the first chunk leave in one write, the rest is piped.

A client that goes away cancels its request's task (as aiohttp's ``handler_cancellation``),
which closes the upstream legs. Idle connections close after ``_IDLE_S`` (aiohttp's
keep-alive timeout); a request whose head and body have not all arrived within
``request_read_timeout_s`` of its first byte gets 408 and its connection closes (a client
that trickles holds no admission slot meanwhile: admission comes after the body). :meth:`FastServer.close` stops listening, lets in-flight requests
finish within a grace period and then cancels them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
import time
from collections.abc import Callable, Mapping
from http import HTTPStatus
from typing import TYPE_CHECKING

import httptools
from aiohttp import web

from agents.gateway.openai import Kind, error_body
from agents.gateway.proxy import ResponseHead
from agents.gateway.upstream import LAST_CHUNK, http_chunk

if TYPE_CHECKING:
    from agents.gateway.app import Gateway

log = logging.getLogger("pdbridge.gateway")

_HOT: dict[bytes, Kind] = {b"/v1/completions": "completions", b"/v1/chat/completions": "chat"}
#: A request head larger than this is aiohttp's business (it answers 431/400).
_MAX_HEAD = 16 * 1024
#: Bytes a client may send ahead (pipelined) while its request is served before the
#: connection stops reading them.
_MAX_AHEAD = 1 << 20
#: Idle keep-alive connections close after this long (aiohttp's keepalive_timeout).
_IDLE_S = 75.0
_REASONS = {s.value: s.phrase for s in HTTPStatus}


class _Headers(dict[str, str]):
    """A request's headers, names lower-case; lookups by any case (the Mapping that
    :meth:`Gateway.complete` reads, like aiohttp's ``CIMultiDictProxy``)."""

    def get(self, key: str, default: str | None = None) -> str | None:  # type: ignore[override]
        return dict.get(self, key.lower(), default)


class _Head:
    """httptools callbacks for one request head."""

    __slots__ = ("done", "headers", "url")

    def __init__(self) -> None:
        self.headers = _Headers()
        self.url = b""
        self.done = False

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        # Decoded as aiohttp decodes them: utf-8, undecodable bytes kept as surrogates. A
        # repeated header keeps its first value, as aiohttp's ``headers.get`` answers.
        self.headers.setdefault(
            name.decode("latin-1").lower(), value.decode("utf-8", "surrogateescape")
        )

    def on_headers_complete(self) -> None:
        self.done = True


def _head(status: int, headers: Mapping[str, str], framing: bytes) -> bytes:
    lines = "".join([f"{k}: {v}\r\n" for k, v in headers.items()])
    reason = _REASONS.get(status, "Unknown")
    return f"HTTP/1.1 {status} {reason}\r\n{lines}".encode("utf-8", "surrogateescape") + framing


class _FastClient:
    """The client side of a relay on a fast connection (see :class:`proxy.Client`)."""

    response: web.StreamResponse | None = None

    def __init__(self, conn: FastConnection) -> None:
        self.conn = conn
        self.chunked = False
        self.started = False
        self.ended = False

    @property
    def transport(self) -> asyncio.WriteTransport | None:
        return self.conn.transport

    async def begin(self, head: ResponseHead, first: bytes, eof: bool) -> bool:
        transport = self.conn.transport
        if transport is None or transport.is_closing():
            raise ConnectionResetError("the client went away")
        headers = {**head.headers, "Content-Type": head.content_type}
        if head.length is None:
            self.chunked = True
            framing = b"Transfer-Encoding: chunked\r\n\r\n"
            body = http_chunk(first) + (LAST_CHUNK if eof else b"")
        else:
            framing = b"Content-Length: %d\r\n\r\n" % head.length
            body = first
        self.started = True
        self.ended = eof
        transport.write(_head(head.status, headers, framing) + body)
        return self.chunked

    async def end(self, data: bytes) -> None:
        transport = self.conn.transport
        if transport is None or transport.is_closing():
            raise ConnectionResetError("the client went away")
        if self.chunked:
            data = http_chunk(data) + LAST_CHUNK
        self.ended = True
        if data:
            transport.write(data)

    def abort(self) -> None:
        self.conn.abort()


def _serialize(response: web.StreamResponse) -> bytes:
    """A whole ``web.Response`` (the gateway's error and JSON answers) as bytes."""
    body = getattr(response, "body", None)
    data = body if isinstance(body, bytes) else b""
    headers = {
        k: v
        for k, v in response.headers.items()
        if k.lower() not in ("content-length", "transfer-encoding", "connection")
    }
    return _head(response.status, headers, b"Content-Length: %d\r\n\r\n" % len(data)) + data


class FastConnection(asyncio.Protocol):
    """One client connection, served here until its first request that is not a plain hot
    POST (then aiohttp's)."""

    def __init__(self, server: FastServer) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.task: asyncio.Task[None] | None = None
        self.paused = False
        self.closing = False
        self.idle_since = time.monotonic()
        #: When the first byte of a request not yet whole arrived (None: no such request).
        self.pending_since: float | None = None

    # -- transport events ----------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        self.server.connections.add(self)

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        if self.task is None:
            self._next()
        elif len(self.buffer) > _MAX_AHEAD and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()

    def eof_received(self) -> bool | None:
        return None  # the client closed its side: close ours too (cancels its request)

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.connections.discard(self)
        self.transport = None
        if self.task is not None:
            # The client went away: cancel its request, which closes the upstream legs.
            self.task.cancel()

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    # -- requests ------------------------------------------------------------------------
    def _next(self) -> None:
        """Start serving the request at the front of the buffer when it is complete (or
        hand the connection over when it is not one the fast path serves)."""
        buffer = self.buffer
        end = buffer.find(b"\r\n\r\n")
        if end < 0:
            # A head too long, or one ended by bare line feeds (never a CRLF head's end), is
            # aiohttp's to answer: waiting for CRLFs that never come would hang the client.
            if len(buffer) > _MAX_HEAD or b"\n\n" in buffer:
                self._handover()
            elif self.pending_since is None:
                self.pending_since = time.monotonic()
            return
        head = _Head()
        parser = httptools.HttpRequestParser(head)
        try:
            parser.feed_data(bytes(buffer[: end + 4]))
        except httptools.HttpParserError:
            self._handover()  # aiohttp answers the malformed request
            return
        headers = head.headers
        kind = _HOT.get(head.url)
        length = headers.get("content-length")
        if (
            not head.done
            or kind is None
            or parser.get_method() != b"POST"
            or parser.get_http_version() != "1.1"
            or not parser.should_keep_alive()
            or length is None
            or not (length.isascii() and length.isdigit())
            or int(length) > self.server.max_body_bytes
            or "transfer-encoding" in headers
            or "expect" in headers
            or "upgrade" in headers
        ):
            self._handover()
            return
        total = end + 4 + int(length)
        if len(buffer) < total:
            if self.pending_since is None:
                self.pending_since = time.monotonic()
            return  # the body is still arriving
        body = bytes(buffer[end + 4 : total])
        del buffer[:total]
        self.pending_since = None
        self.task = asyncio.get_running_loop().create_task(self._serve(kind, headers, body))

    async def _serve(self, kind: Kind, headers: _Headers, body: bytes) -> None:
        client = _FastClient(self)

        async def read() -> bytes:
            return body

        try:
            try:
                response = await self.server.gateway.complete(kind, headers, read, client)
            except (asyncio.CancelledError, ConnectionResetError):
                raise
            except Exception:
                # The last line of defence, as aiohttp's error middleware: an OpenAI-style
                # 500 when nothing was sent yet, else the connection is dropped.
                log.exception("gateway.unhandled_error", extra={"path": ROUTE_OF[kind]})
                if client.started:
                    self.abort()
                    return
                response = web.Response(
                    status=500,
                    body=error_body("internal gateway error", "server_error"),
                    content_type="application/json",
                )
            transport = self.transport
            if transport is None or transport.is_closing():
                return
            if response is not None:
                transport.write(_serialize(response))
            elif not client.ended:
                self.abort()  # a body that could not be completed
                return
        except (asyncio.CancelledError, ConnectionResetError):
            self.abort()
            return
        finally:
            self.task = None
        self.idle_since = time.monotonic()
        if self.closing:
            if self.transport is not None:
                self.transport.close()
            return
        if self.paused and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()
        if self.buffer:
            self._next()

    def _handover(self) -> None:
        """From now on aiohttp serves this connection, starting with the buffered bytes."""
        transport = self.transport
        if transport is None:
            return
        self.server.connections.discard(self)
        handler = self.server.aiohttp_server()
        transport.set_protocol(handler)
        handler.connection_made(transport)
        data, self.buffer = bytes(self.buffer), bytearray()
        self.transport = None
        if data:
            handler.data_received(data)
        if self.paused:
            transport.resume_reading()


ROUTE_OF = {kind: path.decode() for path, kind in _HOT.items()}


class FastServer:
    """The listening socket(s) and the fast connections; ``aiohttp_server`` makes the
    aiohttp request handler a connection is handed to."""

    def __init__(self, gateway: Gateway, aiohttp_server: Callable[[], asyncio.Protocol]) -> None:
        self.gateway = gateway
        self.aiohttp_server = aiohttp_server
        self.max_body_bytes = gateway.settings.max_body_bytes
        self.connections: set[FastConnection] = set()
        self._server: asyncio.Server | None = None
        self._sweep: asyncio.Task[None] | None = None

    async def start(self, host: str, port: int, ssl_context: ssl.SSLContext | None) -> int:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: FastConnection(self), host, port, ssl=ssl_context, backlog=2048
        )
        self._sweep = loop.create_task(self._close_idle())
        return int(self._server.sockets[0].getsockname()[1])

    async def _close_idle(self) -> None:
        """Close the connections idle past ``_IDLE_S`` and answer 408 to those whose
        request has not all arrived within ``request_read_timeout_s``."""
        read_s = self.gateway.settings.request_read_timeout_s
        while True:
            await asyncio.sleep(min(_IDLE_S, read_s) / 5)
            now = time.monotonic()
            for conn in list(self.connections):
                transport = conn.transport
                if conn.task is not None or transport is None:
                    continue
                if conn.pending_since is not None and now - conn.pending_since > read_s:
                    log.info("gateway.request_read_timeout", extra={"read_timeout_s": read_s})
                    doc = error_body(
                        f"the request did not arrive within {read_s:g} s (request_read_timeout_s)",
                        "invalid_request_error",
                        None,
                        "request_timeout",
                    )
                    head = {"Content-Type": "application/json", "Connection": "close"}
                    transport.write(
                        _head(408, head, b"Content-Length: %d\r\n\r\n" % len(doc)) + doc
                    )
                    transport.close()
                elif conn.idle_since < now - _IDLE_S:
                    transport.close()

    async def close(self, grace_s: float) -> None:
        """Stop listening; idle connections close now, busy ones after their response (or
        are cancelled after ``grace_s``)."""
        if self._sweep is not None:
            self._sweep.cancel()
        if self._server is not None:
            self._server.close()
        for conn in list(self.connections):
            conn.closing = True
            if conn.task is None and conn.transport is not None:
                conn.transport.close()
        deadline = time.monotonic() + grace_s
        while any(c.task is not None for c in self.connections) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for conn in list(self.connections):
            if conn.task is not None:
                conn.task.cancel()
            conn.abort()
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 1.0)

"""Serve a WSGI application from an ASGI server the way a buffering reverse proxy would: no
client, however slow, ever holds one of the application's threads.

Why: a WSGI application runs one request per thread. Under a threaded WSGI server (gunicorn
``gthread``) the thread is taken when the connection is accepted and held while the client
sends its TLS handshake, its headers and its body, and again while it reads the response: 8
clients that trickle, or 12 that connect and say nothing, held every thread of the testbed's
console and it answered nothing else (#44). nginx in front of gunicorn avoids that by buffering
both ways; :class:`BufferedWSGI` does the same inside the ASGI server, which handles every
connection in its event loop (TLS handshake and headers under the server's own deadlines,
:mod:`pdbridge.console_server`):

1. the request body is read whole in the event loop, within ``body_timeout_s`` in all (else
   ``408``) and up to ``max_body_bytes`` (else ``413``, refused from ``Content-Length`` before a
   byte is read when it says so);
2. only then does the WSGI application run, on a pool of ``threads`` threads; it returns a
   whole response (the console streams none), so the thread is back in the pool as soon as the
   view returns;
3. the response goes back from the event loop within ``send_timeout_s`` in all; a client that
   does not take it in time has its connection closed (the thread was freed long before).

The ASGI server's own deadlines (TLS handshake, headers and keep-alive) cover what happens
before a request exists. HTTP/1.1 only (the server is configured for it). ``HEAD`` responses
lose their body here, as a WSGI server's would; a response without ``Content-Length`` gets one.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import sys
from collections.abc import Awaitable, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("pdbridge.console_server")

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
StartResponse = Callable[..., Callable[[bytes], None]]
WSGIApp = Callable[[dict[str, Any], StartResponse], Iterable[bytes]]

#: Statuses whose responses never carry a body (RFC 9110 6.4.1).
_NO_BODY = {204, 304}


class _Disconnected(Exception):
    """The client went away before its request body was complete."""


class _TooLarge(Exception):
    """The request body is over ``max_body_bytes``."""


@dataclass(frozen=True)
class _Response:
    """What the WSGI application answered, whole."""

    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes


class BufferedWSGI:
    """An ASGI application serving the WSGI application ``app`` (see the module docstring).

    Called by the ASGI server for every connection's requests and for its lifespan; every
    coroutine runs on the server's event loop and never blocks it: the WSGI application runs on
    this object's own thread pool (created at lifespan start-up, or at the first request when the
    server sends no lifespan events). Failures surface as responses: ``408`` (body too slow),
    ``413`` (body too large), ``500`` (the application raised before answering; logged with its
    traceback), or a closed connection (the client did not take the response in time)."""

    def __init__(
        self,
        app: WSGIApp,
        *,
        threads: int = 8,
        max_body_bytes: int = 16 * 1024 * 1024,
        body_timeout_s: float = 30.0,
        send_timeout_s: float = 30.0,
    ) -> None:
        if threads < 1:
            raise ValueError(f"threads: at least 1, got {threads}")
        self.app = app
        self.threads = threads
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s
        self.send_timeout_s = send_timeout_s
        self._pool: ThreadPoolExecutor | None = None

    @property
    def pool(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="console-app")
        return self._pool

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
        elif scope["type"] == "http":
            await self._http(scope, receive, send)
        # Anything else (websocket): not served; returning closes it.

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                _ = self.pool
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self._pool is not None:
                    # Requests still running had the server's graceful period already.
                    self._pool.shutdown(wait=False, cancel_futures=True)
                    self._pool = None
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _http(self, scope: Scope, receive: Receive, send: Send) -> None:
        declared = _header(scope, b"content-length")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            await _plain(send, 413, f"request body over {self.max_body_bytes} bytes")
            return
        try:
            body = await asyncio.wait_for(_read_body(receive, self.max_body_bytes),
                                          self.body_timeout_s)  # fmt: skip
        except TimeoutError:
            log.warning(
                "console_server.body_timeout",
                extra={"client": _client(scope), "path": scope.get("path"),
                       "timeout_s": self.body_timeout_s},
            )  # fmt: skip
            await _plain(send, 408, f"request body not received within {self.body_timeout_s:g} s")
            return
        except _TooLarge:
            await _plain(send, 413, f"request body over {self.max_body_bytes} bytes")
            return
        except _Disconnected:
            return
        loop = asyncio.get_running_loop()
        try:
            response = await loop.run_in_executor(
                self.pool, self._run_app, wsgi_environ(scope, body)
            )
        except Exception:
            log.exception("console_server.app_error", extra={"path": scope.get("path")})
            await _plain(send, 500, "internal server error")
            return
        await self._respond(scope, send, response)

    def _run_app(self, environ: dict[str, Any]) -> _Response:
        """In a pool thread: call the application and collect its whole response."""
        head: list[Any] = []
        written: list[bytes] = []

        def start_response(
            status: str, headers: list[tuple[str, str]], exc_info: Any = None
        ) -> Callable[[bytes], None]:
            # Nothing is sent before the application returns, so a second call (exc_info,
            # PEP 3333) simply replaces the head.
            head[:] = [
                int(status.split(" ", 1)[0]),
                [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers],
            ]
            return written.append

        result = self.app(environ, start_response)
        try:
            chunks = written + [bytes(chunk) for chunk in result]
        finally:
            close = getattr(result, "close", None)
            if close is not None:
                close()
        if not head:
            raise RuntimeError("the WSGI application returned without calling start_response")
        return _Response(head[0], head[1], b"".join(chunks))

    async def _respond(self, scope: Scope, send: Send, response: _Response) -> None:
        headers = response.headers
        body = response.body
        if response.status in _NO_BODY or response.status < 200:
            body = b""
        elif not any(name == b"content-length" for name, _ in headers):
            headers = [*headers, (b"content-length", str(len(body)).encode())]
        if scope.get("method") == "HEAD":
            body = b""
        messages: list[Message] = [
            {"type": "http.response.start", "status": response.status, "headers": headers},
            {"type": "http.response.body", "body": body, "more_body": False},
        ]
        try:
            await asyncio.wait_for(_send_all(send, messages), self.send_timeout_s)
        except TimeoutError:  # (an OSError too: first)
            # Returning without completing the response makes the server close the connection.
            log.warning(
                "console_server.send_timeout",
                extra={"client": _client(scope), "path": scope.get("path"),
                       "bytes": len(body), "timeout_s": self.send_timeout_s},
            )  # fmt: skip
        except OSError:
            pass  # the client went away (a reset, a TLS close): nobody to answer


async def _send_all(send: Send, messages: list[Message]) -> None:
    for message in messages:
        await send(message)


async def _read_body(receive: Receive, limit: int) -> bytes:
    body = bytearray()
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise _Disconnected
        body += message.get("body", b"")
        if len(body) > limit:
            raise _TooLarge
        if not message.get("more_body", False):
            return bytes(body)


async def _plain(send: Send, status: int, text: str) -> None:
    """A short text answer; a client that is gone by then gets nothing (no error either)."""
    body = f"{text}\n".encode()
    headers = [
        (b"content-type", b"text/plain; charset=utf-8"),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),
    ]
    with contextlib.suppress(OSError):
        await _send_all(send, [
            {"type": "http.response.start", "status": status, "headers": headers},
            {"type": "http.response.body", "body": body, "more_body": False},
        ])  # fmt: skip


def _header(scope: Scope, name: bytes) -> str:
    for key, value in scope.get("headers", []):
        if key.lower() == name:
            return bytes(value).decode("latin-1").strip()
    return ""


def _client(scope: Scope) -> str:
    client = scope.get("client")
    return f"{client[0]}:{client[1]}" if client else ""


def wsgi_environ(scope: Scope, body: bytes) -> dict[str, Any]:
    """The PEP 3333 environ of an ASGI HTTP ``scope`` whose body was read whole: strings are
    "bytes as latin-1", the path is percent-decoded, repeated headers are joined (``Cookie``
    with ``; ``), header names with an underscore are dropped, and ``CONTENT_LENGTH`` is the body actually read (a chunked upload too)."""
    server = scope.get("server") or ("localhost", 80)
    root = scope.get("root_path", "")
    path = scope["path"]
    if root and path.startswith(root):
        path = path[len(root) :] or "/"
    environ: dict[str, Any] = {
        "REQUEST_METHOD": scope["method"],
        "SCRIPT_NAME": root.encode("utf-8").decode("latin-1"),
        "PATH_INFO": path.encode("utf-8").decode("latin-1"),
        "QUERY_STRING": bytes(scope.get("query_string", b"")).decode("latin-1"),
        "SERVER_NAME": str(server[0]),
        "SERVER_PORT": str(server[1]) if server[1] is not None else "",
        "SERVER_PROTOCOL": f"HTTP/{scope.get('http_version', '1.1')}",
        "wsgi.version": (1, 0),
        "wsgi.url_scheme": scope.get("scheme", "http"),
        "wsgi.input": io.BytesIO(body),
        "wsgi.errors": sys.stderr,
        "wsgi.multithread": True,
        "wsgi.multiprocess": True,
        "wsgi.run_once": False,
    }
    client = scope.get("client")
    if client:
        environ["REMOTE_ADDR"], environ["REMOTE_PORT"] = str(client[0]), str(client[1])
    for raw_name, raw_value in scope.get("headers", []):
        if b"_" in bytes(raw_name):
            continue  # X_Forwarded_Proto would pass for X-Forwarded-Proto: dropped, as gunicorn does
        name = bytes(raw_name).decode("latin-1").upper().replace("-", "_")
        value = bytes(raw_value).decode("latin-1")
        if name == "CONTENT_LENGTH":
            continue  # set from the body below
        key = name if name == "CONTENT_TYPE" else f"HTTP_{name}"
        if key in environ:
            value = environ[key] + ("; " if key == "HTTP_COOKIE" else ",") + value
        environ[key] = value
    if body or _header(scope, b"content-length") or _header(scope, b"transfer-encoding"):
        environ["CONTENT_LENGTH"] = str(len(body))
    return environ

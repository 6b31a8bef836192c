"""Slow clients against an HTTP(S) listener, and probes timed beside them (helper of
``bench/console_server.py`` and ``tests/test_console_server.py``).

The pressure that stalled the console (#44), and the rest of its family:

* ``idle``: a TCP connection that says nothing (no TLS ClientHello, no request);
* ``handshake``: the TLS ClientHello trickled a byte at a time (with ``tls=False``: the request
  head instead);
* ``headers``: the handshake done at once, then the request head a byte at a time;
* ``body``: a whole request head, then its body a byte at a time (a login form, which the
  console reads: it passes the CSRF origin and cookie checks);
* ``reader``: large responses asked for (pipelined) and never read.

Every slow client re-opens its connection as soon as the server closes it, as a real one (or an
attacker) would, so the pressure lasts as long as :class:`SlowClients` is open, whatever the
server's deadlines. Probes are ordinary GETs on fresh connections, one after another, each with
its own deadline: :func:`probe_many`.
"""

from __future__ import annotations

import contextlib
import select
import socket
import ssl
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from types import TracebackType
from urllib.parse import urlsplit

KINDS = ("idle", "handshake", "headers", "body", "reader")
#: The largest static file the console serves (whitenoise): what ``reader`` clients ask for.
READER_PATH = "/static/console/vendor/plotly-basic-4.1.1.min.js"


@dataclass
class Pressure:
    """What the slow clients did, by kind: connections opened, and closed by the server."""

    opened: dict[str, int] = field(default_factory=dict)
    closed_by_server: dict[str, int] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def count(self, kind: str, *, opened: int = 0, closed: int = 0) -> None:
        with self.lock:
            self.opened[kind] = self.opened.get(kind, 0) + opened
            self.closed_by_server[kind] = self.closed_by_server.get(kind, 0) + closed

    def closed(self, kind: str) -> int:
        with self.lock:
            return self.closed_by_server.get(kind, 0)


class SlowClients:
    """``counts[kind]`` slow clients of each kind against ``host:port``, each in a daemon
    thread. A context manager: the clients run between ``__enter__`` and ``__exit__``;
    :meth:`wait_connected` blocks until each has connected once."""

    def __init__(
        self,
        host: str,
        port: int,
        counts: dict[str, int],
        *,
        tls: bool = True,
        byte_every_s: float = 0.25,
        server_hostname: str = "localhost",
    ) -> None:
        unknown = set(counts) - set(KINDS)
        if unknown:
            raise ValueError(f"counts: unknown kinds {sorted(unknown)} (known: {KINDS})")
        self.host, self.port, self.counts = host, port, counts
        self.tls = tls
        self.byte_every_s = byte_every_s
        self.server_hostname = server_hostname
        self.stop = threading.Event()
        self.pressure = Pressure()
        self._connected = threading.Semaphore(0)
        self._threads: list[threading.Thread] = []
        # The slow clients never verify the server: they never get far enough for it to matter.
        self._context = ssl.create_default_context()
        self._context.check_hostname = False
        self._context.verify_mode = ssl.CERT_NONE

    def __enter__(self) -> SlowClients:
        for kind in KINDS:
            for index in range(self.counts.get(kind, 0)):
                thread = threading.Thread(
                    target=self._run, args=(kind,), name=f"slow-{kind}-{index}", daemon=True
                )
                thread.start()
                self._threads.append(thread)
        return self

    def wait_connected(self, timeout: float) -> None:
        """Block until every slow client has connected once (TimeoutError after ``timeout``)."""
        deadline = time.monotonic() + timeout
        for _ in self._threads:
            if not self._connected.acquire(timeout=max(0.0, deadline - time.monotonic())):
                raise TimeoutError(f"slow clients did not connect to {self.host}:{self.port}")

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop.set()
        for thread in self._threads:
            thread.join(timeout=5)

    def _run(self, kind: str) -> None:
        """One slow client: connect, hold the ``kind`` way, again when the server closes."""
        first = True
        while not self.stop.is_set():
            try:
                sock = socket.create_connection((self.host, self.port), timeout=5)
            except OSError:
                self.stop.wait(0.2)
                continue
            self.pressure.count(kind, opened=1)
            if first:
                self._connected.release()
                first = False
            try:
                closed = self._hold(sock, kind)
            except OSError:
                closed = True
            finally:
                sock.close()
            if closed:
                self.pressure.count(kind, closed=1)

    def _hold(self, sock: socket.socket, kind: str) -> bool:
        """Keep ``sock`` busy the ``kind`` way until the server closes it (True) or we stop."""
        if kind == "idle":
            return self._wait_closed(sock)
        if not self.tls:
            return self._hold_plain(sock, kind)
        incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        tls = self._context.wrap_bio(incoming, outgoing, server_hostname=self.server_hostname)
        if kind == "handshake":
            with contextlib.suppress(ssl.SSLWantReadError):
                tls.do_handshake()
            return self._trickle(sock, _bytewise(outgoing.read()))
        sock.settimeout(5)
        while True:  # the whole handshake at once
            try:
                tls.do_handshake()
                break
            except ssl.SSLWantReadError:
                sock.sendall(outgoing.read())
                data = sock.recv(65536)
                if not data:
                    return True
                incoming.write(data)
        sock.sendall(outgoing.read())
        head, slow = self._request(kind)
        tls.write(head)
        sock.sendall(outgoing.read())
        if kind == "reader":
            return self._wait_closed(sock, read=False)
        # One TLS record per plaintext byte: the server decrypts a byte at a time.
        return self._trickle(sock, _records(tls, outgoing, slow))

    def _hold_plain(self, sock: socket.socket, kind: str) -> bool:
        head, slow = self._request("headers" if kind == "handshake" else kind)
        sock.sendall(head)
        if kind == "reader":
            return self._wait_closed(sock, read=False)
        return self._trickle(sock, _bytewise(slow))

    def _request(self, kind: str) -> tuple[bytes, bytes]:
        """What a ``kind`` client sends: the part sent at once, and the part trickled."""
        host = f"{self.server_hostname}:{self.port}"
        if kind == "reader":  # pipelined: more to hold than any socket buffer
            return f"GET {READER_PATH} HTTP/1.1\r\nHost: {host}\r\n\r\n".encode() * 20, b""
        if kind == "body":
            origin = f"{'https' if self.tls else 'http'}://{host}"
            head = (
                f"POST /login/ HTTP/1.1\r\nHost: {host}\r\nOrigin: {origin}\r\n"
                f"Referer: {origin}/login/\r\nCookie: csrftoken={'a' * 32}\r\n"
                "Content-Type: application/x-www-form-urlencoded\r\n"
                "Content-Length: 1000000\r\n\r\n"
            )
            return head.encode(), b"csrfmiddlewaretoken=" + b"a" * 999_980
        return b"", f"GET /healthz HTTP/1.1\r\nHost: {host}\r\nX-Pad: ".encode() + b"x" * 999_000

    def _trickle(self, sock: socket.socket, pieces: Iterable[bytes]) -> bool:
        """Send ``pieces`` one every ``byte_every_s`` until the server closes (True)."""
        sock.settimeout(self.byte_every_s)
        for piece in pieces:
            if self.stop.is_set():
                return False
            sock.sendall(piece)
            try:
                if sock.recv(65536) == b"":
                    return True
            except TimeoutError:
                continue
        return self._wait_closed(sock)

    def _wait_closed(self, sock: socket.socket, *, read: bool = True) -> bool:
        """Wait until the server closes ``sock`` (True) or we stop. ``read=False`` never reads
        (a stalled reader): only a reset or an error is noticed."""
        sock.settimeout(0.25)
        while not self.stop.is_set():
            if not read:
                if select.select([], [], [sock], 0.25)[2]:
                    return True
                continue
            try:
                if sock.recv(65536) == b"":
                    return True
            except TimeoutError:
                continue
        return False


def _bytewise(data: bytes) -> Iterator[bytes]:
    return (data[i : i + 1] for i in range(len(data)))


def _records(tls: ssl.SSLObject, outgoing: ssl.MemoryBIO, plain: bytes) -> Iterator[bytes]:
    for index in range(len(plain)):
        tls.write(plain[index : index + 1])
        yield outgoing.read()


@dataclass(frozen=True)
class ProbeResult:
    """One probe: answered in time (and its status), or not, and how long it took."""

    answered: bool
    status: int
    seconds: float
    error: str = ""


def probe(url: str, context: ssl.SSLContext | None, timeout: float) -> ProbeResult:
    """One GET of ``url`` on a fresh connection (HTTPS with ``context``); answered when a status
    line came back within ``timeout`` seconds in all (connect, handshake, request, head)."""
    parts = urlsplit(url)
    host = parts.hostname or "localhost"
    port = parts.port or (443 if parts.scheme == "https" else 80)
    start = time.monotonic()
    deadline = start + timeout
    conn: socket.socket | None = None
    try:
        conn = socket.create_connection((host, port), timeout=timeout)
        conn.settimeout(max(0.01, deadline - time.monotonic()))
        if parts.scheme == "https":
            conn = (context or ssl.create_default_context()).wrap_socket(conn, server_hostname=host)
        request = f"GET {parts.path or '/'} HTTP/1.1\r\nHost: {parts.netloc}\r\n"
        conn.sendall(f"{request}Connection: close\r\n\r\n".encode())
        head = b""
        while b"\r\n" not in head:
            conn.settimeout(max(0.01, deadline - time.monotonic()))
            chunk = conn.recv(4096)
            if not chunk:
                raise ConnectionError("closed before a status line")
            head += chunk
        return ProbeResult(True, int(head.split(b" ", 2)[1]), time.monotonic() - start)
    except (OSError, ValueError, IndexError) as exc:
        return ProbeResult(False, 0, time.monotonic() - start, f"{type(exc).__name__}: {exc}")
    finally:
        if conn is not None:
            conn.close()


def probe_many(
    url: str, context: ssl.SSLContext | None, count: int = 10, timeout: float = 2.0
) -> list[ProbeResult]:
    """``count`` probes one after another, each with its own ``timeout``."""
    return [probe(url, context, timeout) for _ in range(count)]

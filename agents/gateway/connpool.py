"""The upstream client's connections to the engines and their keep-alive pool.

:class:`Conn` is the asyncio protocol of one connection; it carries one exchange at a time (a
:class:`agents.gateway.upstream.LegResponse`, fed the bytes that arrive) and waits in the
:class:`Pool` between exchanges. Who uses it: :class:`agents.gateway.upstream.Upstream` only.
Event-loop only.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from agents.gateway.upstream import LegResponse

#: An idle kept-alive connection is closed after this long (engines' servers close theirs
#: after 75 s (aiohttp) or 5 s (uvicorn); a connection reused just as the engine closes it is
#: retried once, see :meth:`agents.gateway.upstream.Upstream.open`).
IDLE_S = 15.0

Key = tuple[str, int, bool]


class Conn(asyncio.Protocol):
    """One connection to an engine. It carries one exchange at a time (``leg``) and waits in
    the pool between exchanges."""

    def __init__(self, pool: Pool, key: Key) -> None:
        self.pool = pool
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.leg: LegResponse | None = None
        self.closed = False
        self.reused = False
        self.idle_at = 0.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.pool.live.add(self)

    def data_received(self, data: bytes) -> None:
        leg = self.leg
        if leg is None:
            # Bytes outside an exchange: the connection's state is unknown, never reuse it.
            self.abort()
            return
        leg.feed(data)

    def eof_received(self) -> bool | None:
        return None  # the engine closed its side: close ours too (connection_lost follows)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.pool.forget(self)
        if self.leg is not None:
            self.leg.lost()

    def abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()

    def pause(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.resume_reading()


class Pool:
    """Kept-alive connections per (host, port, tls), most recently used first. No limit on
    their number: the gateway must never queue requests behind its own client; back-pressure
    belongs to the engines and the fallback budget."""

    def __init__(self) -> None:
        self.idle: dict[Key, list[Conn]] = {}
        self.live: set[Conn] = set()
        self._sweep: asyncio.TimerHandle | None = None

    def take(self, key: Key) -> Conn | None:
        conns = self.idle.get(key)
        while conns:
            conn = conns.pop()
            if not conn.closed and conn.transport is not None and not conn.transport.is_closing():
                conn.reused = True
                return conn
        return None

    def release(self, conn: Conn) -> None:
        conn.idle_at = time.monotonic()
        self.idle.setdefault(conn.key, []).append(conn)
        if self._sweep is None:
            self._sweep = asyncio.get_running_loop().call_later(IDLE_S, self._expire)

    def forget(self, conn: Conn) -> None:
        self.live.discard(conn)
        conns = self.idle.get(conn.key)
        if conns and conn in conns:
            conns.remove(conn)

    def _expire(self) -> None:
        self._sweep = None
        cutoff = time.monotonic() - IDLE_S
        remaining = False
        for conns in self.idle.values():
            for conn in [c for c in conns if c.idle_at <= cutoff]:
                conns.remove(conn)
                conn.closed = True
                if conn.transport is not None:
                    conn.transport.close()
            remaining = remaining or bool(conns)
        if remaining:
            self._sweep = asyncio.get_running_loop().call_later(IDLE_S, self._expire)

    def close(self) -> None:
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
        self.idle.clear()
        for conn in list(self.live):
            conn.abort()
        self.live.clear()

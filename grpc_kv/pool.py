"""Long-lived KV links per destination, shared by the transfers of one process: the reference
engine's prefill side and pdbridge's vLLM connector. Re-exported by :mod:`grpc_kv.api`."""

from __future__ import annotations

import asyncio
import time

from grpc_kv.link import Link
from grpc_kv.options import LinkOptions
from grpc_kv.tls import TLSConfig


class LinkPool:
    """The engine's long-lived grpc_kv links, one per destination ``host:port``.

    Transfers to the same decode receiver share its connections: no TCP and TLS handshakes
    (several WAN round trips) on each request's path, a steady number of descriptors, and one
    token bucket so the link's utilisation ceiling holds across concurrent transfers rather
    than per transfer. A broken connection is replaced by the link itself (reconnect, resume).
    A link older than ``max_age_s`` is retired: new transfers get a fresh one, which reads the
    certificate files again (rotation), and the old one closes when its last transfer ends;
    so is a link handed back after a failed transfer (``release(link, failed=True)``).
    Used only on the event loop (grpc.aio channels belong to the loop that made them).
    """

    def __init__(self, options: LinkOptions, tls: TLSConfig, max_age_s: float = 300.0) -> None:
        self.options = options
        self.tls = tls
        self.max_age_s = max_age_s
        self._current: dict[str, tuple[Link, float]] = {}
        self._users: dict[Link, int] = {}
        self._retired: set[Link] = set()
        self._closing: set[asyncio.Future[None]] = set()

    def acquire(self, target: str) -> Link:
        link, born = self._current.get(target, (None, 0.0))
        if link is not None and time.monotonic() - born > self.max_age_s:
            del self._current[target]
            self._retire(link)
            link = None
        if link is None:
            link = Link(target, self.options, self.tls)
            self._current[target] = (link, time.monotonic())
        self._users[link] = self._users.get(link, 0) + 1
        return link

    async def release(self, link: Link, failed: bool = False) -> None:
        """Hand ``link`` back. ``failed``: a transfer on it failed, so it is retired: its
        connections may carry damage that gRPC's reconnects and keepalive never notice (a
        corrupted byte in HTTP/2 header compression state is one such), and the next
        transfer to this destination gets new connections instead of up to ``max_age_s`` of
        the same failure."""
        self._users[link] -= 1
        if failed and self._current.get(link.target, (None, 0.0))[0] is link:
            del self._current[link.target]
            self._retired.add(link)
        if link in self._retired and not self._users[link]:
            await self._close(link)

    def _retire(self, link: Link) -> None:
        self._retired.add(link)
        if not self._users.get(link):
            task = asyncio.ensure_future(self._close(link))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    async def _close(self, link: Link) -> None:
        self._retired.discard(link)
        self._users.pop(link, None)
        await link.close()

    @property
    def links(self) -> int:
        """Open links (current and retired ones still carrying a transfer)."""
        return len(self._users)

    async def close(self) -> None:
        links = [link for link, _ in self._current.values()] + list(self._retired)
        self._current.clear()
        await asyncio.gather(*(self._close(link) for link in links), return_exceptions=True)

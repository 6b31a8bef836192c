"""Shipping request traces to the console: every ``trace_ship_interval_s`` the traces queued
by the ring (:class:`agents.gateway.trace.TraceRing`: sampled, plus every fallback, failover
and error) are POSTed to ``/api/telemetry/traces/`` in batches of at most
:data:`pdproto.trace.MAX_TRACES_PER_BATCH`, with the gateway's console token (a node token:
the console knows which node, hence which clock skew, the traces come from).

Who calls it: :func:`agents.gateway.server.start` runs :meth:`TraceShipper.run` as a
background task when the gateway polls a console. A console that is down or refuses a batch
costs nothing on the request path: the batch goes back to the queue (bounded; what does not
fit is dropped and counted) and is tried again at the next interval. Never raises from
``run``.
"""

from __future__ import annotations

import asyncio
import logging
import ssl

import aiohttp

from agents.gateway.trace import TraceRing
from pdproto.trace import CONSOLE_TRACES_PATH, MAX_TRACES_PER_BATCH

log = logging.getLogger("pdbridge.gateway.traces")


class TraceShipper:
    """POSTs queued traces to the console. Event-loop only."""

    def __init__(
        self,
        *,
        ring: TraceRing,
        console_url: str,
        token: str | None,
        interval_s: float,
        ssl_context: ssl.SSLContext | None = None,
        timeout_s: float = 10.0,
    ) -> None:
        self.ring = ring
        self.url = console_url.rstrip("/") + CONSOLE_TRACES_PATH
        self.headers = {"Content-Type": "application/json"}
        if token:
            is_scheme = token.startswith(("Token ", "Bearer "))
            self.headers["Authorization"] = token if is_scheme else f"Bearer {token}"
        self.interval_s = interval_s
        self.ssl_context = ssl_context
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.shipped = 0
        self.failed_batches = 0

    async def ship_once(self, session: aiohttp.ClientSession) -> int:
        """Send what is queued, batch by batch; the number of traces the console took. Stops
        at the first batch that fails (it is put back)."""
        sent = 0
        while self.ring.queued:
            batch = self.ring.take_batch(MAX_TRACES_PER_BATCH)
            body = {"traces": [trace.to_json() for trace in batch]}
            try:
                async with session.post(
                    self.url,
                    json=body,
                    headers=self.headers,
                    timeout=self.timeout,
                    ssl=self.ssl_context if self.ssl_context is not None else True,
                ) as response:
                    if response.status >= 300:
                        detail = (await response.text())[:300]
                        raise RuntimeError(f"status {response.status}: {detail}")
            except (aiohttp.ClientError, TimeoutError, RuntimeError) as error:
                self.failed_batches += 1
                self.ring.ship_failures += 1
                self.ring.requeue(batch)
                log.warning(
                    "gateway.trace_ship_failed",
                    extra={"url": self.url, "traces": len(batch), "error": str(error)[:300]},
                )
                break
            sent += len(batch)
        self.shipped += sent
        self.ring.shipped += sent
        return sent

    async def run(self, session: aiohttp.ClientSession) -> None:
        """Ship every ``interval_s`` until cancelled."""
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.ship_once(session)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("gateway.trace_ship_crashed")

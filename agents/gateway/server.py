"""Running a gateway: the listening server (the gateway's own for plain completions
requests in front of aiohttp's, see :mod:`agents.gateway.fastpath`; on both a client
disconnect cancels the request's upstream legs) and its background loops — config polling,
engine-metrics scraping for queue depth, and threshold re-tuning.

Who calls it: the CLI (:func:`serve_forever`) and tests (:func:`start`, which returns a
:class:`RunningGateway` to stop). Loops log and continue on errors; they never stop serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from agents.gateway.access import AccessPoller
from agents.gateway.app import Gateway, build_app
from agents.gateway.fastpath import FastServer
from agents.gateway.poller import ConfigPoller
from agents.gateway.traceship import TraceShipper

log = logging.getLogger("pdbridge.gateway")

_QUEUE_METRIC = "vllm:num_requests_waiting"


def parse_queue_depth(text: str) -> float | None:
    """Sum of ``vllm:num_requests_waiting`` samples in a Prometheus text page (None if absent)."""
    total, seen = 0.0, False
    for line in text.splitlines():
        if line.startswith(_QUEUE_METRIC) and (
            len(line) == len(_QUEUE_METRIC) or line[len(_QUEUE_METRIC)] in "{ "
        ):
            try:
                total += float(line.rsplit(" ", 1)[1])
                seen = True
            except (IndexError, ValueError):
                continue
    return total if seen else None


async def scrape_once(gateway: Gateway, session: aiohttp.ClientSession, timeout_s: float) -> None:
    """Refresh each remote site's queue depth from its engines' ``/metrics``. An engine that
    does not answer keeps its site's last value (its breaker, not the scraper, judges it)."""
    config = gateway.router.config
    if config is None:
        return
    timeout = aiohttp.ClientTimeout(total=timeout_s)

    async def one(url: str) -> float | None:
        try:
            async with session.get(f"{url}/metrics", timeout=timeout) as response:
                if response.status != 200:
                    return None
                return parse_queue_depth(await response.text())
        except (aiohttp.ClientError, TimeoutError):
            return None

    for site in config.prefill:
        depths = await asyncio.gather(*(one(i.url) for i in site.instances if not i.drained))
        known = [d for d in depths if d is not None]
        stats = gateway.router.stats.get(site.name)
        if known and stats is not None:
            stats.scraped_queue = sum(known)


async def probe_once(gateway: Gateway, session: aiohttp.ClientSession, timeout_s: float) -> None:
    """One round of active health probes: ``GET <engine>/health`` of every instance of every
    pool (an engine in two pools is probed once), each bounded by ``timeout_s``; anything but
    a 200 in time is a failed probe (see :mod:`agents.gateway.health`)."""
    router = gateway.router
    members: dict[str, list[tuple[str, str]]] = {}
    for (role, site), pool in router.pools.items():
        # A drained instance's engine may be stopped by plan: probing it would only mark it
        # unhealthy (it starts afresh when it rejoins).
        for url in pool.in_rotation():
            members.setdefault(url, []).append((role, site))
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    context = gateway.upstream.ssl_context
    options: dict[str, Any] = {} if context is None else {"ssl": context}

    async def one(url: str) -> bool:
        try:
            async with session.get(f"{url}/health", timeout=timeout, **options) as response:
                return response.status == 200
        except (aiohttp.ClientError, TimeoutError, OSError):
            return False

    urls = list(members)
    results = await asyncio.gather(*(one(url) for url in urls))
    for url, ok in zip(urls, results, strict=True):
        for role, site in members[url]:
            router.probed(role, site, url, ok)


async def _every(interval_s: float, step: Callable[[], Awaitable[None]], name: str) -> None:
    while True:
        await asyncio.sleep(interval_s)
        try:
            await step()
        except asyncio.CancelledError:
            raise
        except Exception:
            # A failing loop iteration must not end the loop for the life of the process.
            log.exception("gateway.loop_failed", extra={"loop": name})


@dataclass
class RunningGateway:
    """A started gateway: its port and what to stop."""

    gateway: Gateway
    runner: web.AppRunner
    port: int
    session: aiohttp.ClientSession
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    fast: FastServer | None = None

    async def stop(self, grace_s: float = 5.0) -> None:
        """Stop the loops, then the server (in-flight requests get ``grace_s`` to finish)."""
        for task in self.tasks:
            task.cancel()
        for task in self.tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self.fast is not None:
            await self.fast.close(grace_s)
        await self.runner.shutdown()
        await self.runner.cleanup()
        await self.session.close()


async def start(
    gateway: Gateway,
    *,
    poller: ConfigPoller | None = None,
    ssl_server: ssl.SSLContext | None = None,
    access: AccessPoller | None = None,
    shipper: TraceShipper | None = None,
) -> RunningGateway:
    """Load the first config (poller: console, else last good on disk) and the client keys
    (``access``: the same), listen, start loops. A gateway without any config still starts:
    it answers 503 until one arrives."""
    settings = gateway.settings
    session = aiohttp.ClientSession()
    if poller is not None and not await poller.start(session):
        log.error("gateway.no_config", extra={"url": poller.url})
    if access is not None and not await access.start(session):
        log.warning("gateway.no_console_client_keys", extra={"url": access.url})
    app = build_app(gateway)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=5.0)
    await runner.setup()
    fast: FastServer | None = None
    if settings.fast_server and runner.server is not None:
        # The gateway's own server in front: it serves the completions endpoints' plain
        # requests and hands every other connection to aiohttp's (runner.server).
        fast = FastServer(gateway, runner.server)
        port = await fast.start(settings.host, settings.port, ssl_server)
    else:
        site = web.TCPSite(
            runner,
            settings.host,
            settings.port,
            ssl_context=ssl_server,
            backlog=2048,
        )
        await site.start()
        port = int(runner.addresses[0][1])
    running = RunningGateway(gateway, runner, port, session, fast=fast)

    async def retune() -> None:
        change = gateway.router.retune()
        if change is not None:
            gateway.metrics.threshold_changes.labels(
                "up" if change[1] > change[0] else "down"
            ).inc()
        gateway.refresh_gauges()

    if poller is not None:
        running.tasks.append(asyncio.create_task(poller.run(session)))
    if access is not None:
        running.tasks.append(asyncio.create_task(access.run(session)))
    if shipper is not None:
        running.tasks.append(asyncio.create_task(shipper.run(session)))
    if gateway.keys.keys_file is not None:

        async def reload_keys() -> None:
            gateway.keys.reload_file()

        running.tasks.append(
            asyncio.create_task(_every(settings.poll_interval_s, reload_keys, "client_keys"))
        )
    if settings.scrape_interval_s > 0:
        running.tasks.append(
            asyncio.create_task(
                _every(
                    settings.scrape_interval_s, lambda: scrape_once(gateway, session, 1.0), "scrape"
                )
            )
        )
    if settings.health_check_interval_s > 0:
        running.tasks.append(
            asyncio.create_task(
                _every(
                    settings.health_check_interval_s,
                    lambda: probe_once(gateway, session, settings.health_check_timeout_s),
                    "health_check",
                )
            )
        )
    running.tasks.append(asyncio.create_task(_every(settings.retune_interval_s, retune, "retune")))
    loop = type(asyncio.get_running_loop())
    log.info(
        "gateway.listening",
        extra={
            "host": settings.host,
            "port": port,
            "event_loop": loop.__module__.split(".")[0],
            "fast_server": fast is not None,
            "client_keys_required": gateway.keys.required,
        },
    )
    return running


async def serve_forever(
    gateway: Gateway,
    *,
    poller: ConfigPoller | None,
    ssl_server: ssl.SSLContext | None,
    access: AccessPoller | None = None,
    shipper: TraceShipper | None = None,
) -> None:
    """Run until SIGINT/SIGTERM, then stop gracefully."""
    running = await start(
        gateway, poller=poller, ssl_server=ssl_server, access=access, shipper=shipper
    )
    # What exists now (modules, config, metric families) lives as long as the process: kept
    # out of the collector, a full collection walks only the in-flight requests' objects, so
    # its pause (which every open stream feels as inter-token delay) stays short.
    gc.collect()
    gc.freeze()
    print(f"pdbridge gateway listening on {gateway.settings.host}:{running.port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    await stop.wait()
    log.info("gateway.stopping")
    await running.stop()

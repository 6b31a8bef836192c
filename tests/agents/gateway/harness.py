"""Starts engine test doubles and a real gateway server on loopback inside one event loop, for
the gateway's HTTP tests (each test runs its scenario with ``asyncio.run``)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import aiohttp

from agents.gateway.app import Gateway
from agents.gateway.config import GatewaySettings, parse_snapshot
from agents.gateway.poller import ConfigPoller
from agents.gateway.server import RunningGateway, start
from tests.agents.gateway.engine_double import EngineDouble, KvStore
from tests.agents.gateway.snapshots import snapshot

FAST = GatewaySettings(
    host="127.0.0.1",
    port=0,
    poll_interval_s=0.2,
    scrape_interval_s=0,
    retune_interval_s=3600,
    breaker_min_requests=4,
    breaker_consecutive_failures=3,
    breaker_ejection_base_s=30,
    fallback_rate_per_s=100,
    fallback_burst=100,
)


@dataclass
class Env:
    """A running gateway with one decode and one prefill double."""

    gateway: Gateway
    running: RunningGateway
    decode: EngineDouble
    prefill: EngineDouble
    client: aiohttp.ClientSession
    url: str

    async def post(
        self, body: dict[str, Any], path: str = "/v1/completions", **headers: str
    ) -> tuple[int, Any, bytes]:
        async with self.client.post(self.url + path, json=body, headers=headers) as r:
            return r.status, r.headers.copy(), await r.read()

    async def metrics(self) -> str:
        async with self.client.get(self.url + "/metrics") as r:
            return await r.text()


def completion(prompt: str = "hello", **extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "prompt": prompt, "max_tokens": 5, **extra}


LONG = "word " * 200  # ~250 tokens by the 4-characters estimate; threshold is 100


@asynccontextmanager
async def gateway_env(
    settings: GatewaySettings = FAST,
    console_url: str | None = None,
    state_dir: str | None = None,
    kv_timeout_s: float = 1.0,
    kv_mode: str | None = None,
    **routing: Any,
) -> AsyncIterator[Env]:
    """Doubles + gateway. With ``console_url`` the gateway polls it (its snapshot must name the
    doubles, so the caller serves it); otherwise a static snapshot is applied."""
    kv = KvStore()
    decode = await EngineDouble("decode", kv, kv_timeout_s).start()
    prefill = await EngineDouble("prefill", kv, kv_timeout_s).start()
    if state_dir is not None:
        settings = dataclasses.replace(settings, state_dir=state_dir)
    gateway = Gateway(settings)
    poller = None
    if console_url is None:
        gateway.apply(
            parse_snapshot(
                snapshot(
                    decode_urls=(decode.url,),
                    prefill_sites={"remote": (prefill.url,)},
                    kv_mode=kv_mode,
                    **routing,
                )
            )
        )
    else:
        from pathlib import Path

        poller = ConfigPoller(
            console_url=console_url,
            deployment_id=1,
            token="node-token",
            interval_s=settings.poll_interval_s,
            state_dir=Path(settings.state_dir),
            apply=gateway.apply,
            on_result=lambda result: gateway.metrics.config_polls.labels(result).inc(),
        )
    running = await start(gateway, poller=poller)
    client = aiohttp.ClientSession()
    env = Env(gateway, running, decode, prefill, client, f"http://127.0.0.1:{running.port}")
    try:
        yield env
    finally:
        await client.close()
        await running.stop()
        await decode.stop()
        await prefill.stop()


@asynccontextmanager
async def serving(
    data: dict[str, Any], settings: GatewaySettings = FAST
) -> AsyncIterator[tuple[RunningGateway, aiohttp.ClientSession, str]]:
    """A gateway serving a given snapshot (engines started by the caller)."""
    gateway = Gateway(settings)
    gateway.apply(parse_snapshot(data))
    running = await start(gateway)
    client = aiohttp.ClientSession()
    try:
        yield running, client, f"http://127.0.0.1:{running.port}"
    finally:
        await client.close()
        await running.stop()


def sse_text(raw: bytes) -> str:
    """The concatenated text of an SSE completions stream."""
    out = []
    for line in raw.decode().splitlines():
        if line.startswith("data: {"):
            event = json.loads(line[6:])
            for choice in event.get("choices", []):
                out.append(choice.get("text") or choice.get("delta", {}).get("content", ""))
    return "".join(out)

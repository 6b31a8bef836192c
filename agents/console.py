"""The agent's HTTP client of the console: heartbeats and config snapshots.

Contracts (agreed with the console): ``POST /api/heartbeats/`` and
``GET /api/deployments/{id}/config/?version=N``, both with ``Authorization: Bearer <node
token>``. Children keep running whatever the console does; an unreachable console only makes
the heartbeat loop back off.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import ssl
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp

from agents.config import ConsoleConfig
from agents.launch import LaunchError

log = logging.getLogger("pdbridge.agent.console")


#: The least time between two heartbeats when one is asked for early (``beat_soon``).
MIN_BEAT_GAP_S = 1.0


def utc_now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


class ConsoleClient:
    """Talks to the console over HTTP(S). Coroutines, never blocking the loop; every request
    has ``console.timeout_s`` as its deadline."""

    def __init__(self, config: ConsoleConfig, token: str) -> None:
        self.config = config
        self.token = token
        self._ssl: ssl.SSLContext | bool = True
        if config.ca:
            self._ssl = ssl.create_default_context(cafile=config.ca)
        self.session: aiohttp.ClientSession | None = None
        self.last_response: dict[str, Any] = {}
        self.failures = 0
        self._wake = asyncio.Event()
        self.sent = 0

    @property
    def enabled(self) -> bool:
        return bool(self.config.url)

    def _session(self) -> aiohttp.ClientSession:
        if self.session is None:
            self.session = aiohttp.ClientSession(
                headers={"Authorization": f"Bearer {self.token}"},
                timeout=aiohttp.ClientTimeout(total=self.config.timeout_s),
            )
        return self.session

    def _url(self, path: str) -> str:
        return self.config.url.rstrip("/") + path

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()

    async def fetch_snapshot(self, deployment_id: int, version: int, state_dir: Path) -> Path:
        """Fetch a config snapshot and store it as JSON; returns its path.

        Raises LaunchError: NOT_FOUND (field config_version) for an unknown version,
        FAILED_PRECONDITION when the console is not configured or unreachable.
        """
        if not self.enabled:
            raise LaunchError(
                "config_version",
                "this agent has no console.url to fetch it from",
                "FAILED_PRECONDITION",
            )
        url = self._url(f"/api/deployments/{deployment_id}/config/")
        try:
            async with self._session().get(
                url, params={"version": str(version)}, ssl=self._ssl
            ) as resp:
                if resp.status == 404:
                    raise LaunchError(
                        "config_version",
                        f"deployment {deployment_id} has no config version {version}",
                        "NOT_FOUND",
                    )
                if resp.status != 200:
                    raise LaunchError(
                        "config_version",
                        f"console answered {resp.status} for {url}",
                        "FAILED_PRECONDITION",
                    )
                body = await resp.json()
        except LaunchError:
            raise
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            raise LaunchError(
                "config_version", f"console unreachable: {exc!r}", "UNAVAILABLE"
            ) from None
        path = state_dir / "snapshots" / f"deployment-{deployment_id}-v{version}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(body, indent=1))
        return path

    async def heartbeat(self, body: dict[str, Any]) -> dict[str, Any]:
        """POST one heartbeat; returns the console's answer. Raises on any failure. A
        kept-alive connection the console closed just as it was reused (``Server
        disconnected``) is retried once on a new connection (a heartbeat is a report: recorded
        twice, it does no harm) -- without this, that race cost a back-off of twice the
        interval and the node was marked ``degraded`` while it was fine."""
        retried = False
        while True:
            try:
                async with self._session().post(
                    self._url("/api/heartbeats/"), json=body, ssl=self._ssl
                ) as resp:
                    if resp.status != 200:
                        text = (await resp.text())[:300]
                        raise RuntimeError(f"heartbeat answered {resp.status}: {text}")
                    answer: dict[str, Any] = await resp.json()
                    return answer
            except aiohttp.ServerDisconnectedError:
                if retried:
                    raise
                retried = True
                log.info("agent.heartbeat_reconnect")

    def beat_soon(self) -> None:
        """Send the next heartbeat now (a child changed state), not at the end of the
        interval; a failing console's back-off still holds (see :meth:`heartbeat_loop`)."""
        if self.failures == 0:
            self._wake.set()

    async def heartbeat_loop(
        self, build: Callable[[], dict[str, Any]], on_failure: Callable[[], None]
    ) -> None:
        """Beat forever: every ``interval_s`` the console asks for, and at once after
        :meth:`beat_soon`; on failure back off exponentially up to ``console.backoff_max_s``.
        Cancel the task to stop it."""
        interval = self.config.heartbeat_interval_s
        delay = interval
        while True:
            try:
                self.last_response = await self.heartbeat(build())
                self.sent += 1
                self.failures = 0
                interval = float(self.last_response.get("interval_s") or interval)
                delay = interval
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self.failures += 1
                on_failure()
                delay = min(interval * 2 ** min(self.failures, 10), self.config.backoff_max_s)
                log.warning(
                    "agent.heartbeat_failed",
                    extra={"failures": self.failures, "retry_in_s": delay, "error": str(exc)},
                )
            # A wake-up (beat_soon) ends the wait early, but beats stay MIN_BEAT_GAP_S apart:
            # a crash-looping child changes state several times a second.
            self._wake.clear()
            floor = min(MIN_BEAT_GAP_S, delay)
            await asyncio.sleep(floor)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), delay - floor)

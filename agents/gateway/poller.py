"""Config polling: ``GET /api/deployments/{id}/config/`` with ``If-None-Match`` every
``poll_interval_s``; a new, valid snapshot is applied atomically (one reference swap) and
written to disk as the last good config; a 304 costs nothing; any failure (console down,
5xx, invalid snapshot) is logged and counted, and the gateway keeps serving with what it has.
At start, when the console cannot be reached, the last good config on disk is used.

Who calls it: :mod:`agents.gateway.app` starts :meth:`ConfigPoller.run` as a background task.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import ssl
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp

from agents.gateway.config import ConfigError, DeploymentConfig, parse_snapshot

log = logging.getLogger("pdbridge.gateway.config")


class ConfigPoller:
    """Polls one deployment's config snapshot. Event-loop only; never raises from ``run``."""

    def __init__(
        self,
        *,
        console_url: str,
        deployment_id: int,
        token: str | None,
        interval_s: float,
        state_dir: Path,
        apply: Callable[[DeploymentConfig], None],
        on_result: Callable[[str], None] = lambda result: None,
        ssl_context: ssl.SSLContext | None = None,
        timeout_s: float = 5.0,
    ) -> None:
        self.url = f"{console_url.rstrip('/')}/api/deployments/{deployment_id}/config/"
        self.deployment_id = deployment_id
        self.interval_s = interval_s
        self.state_path = state_dir / f"deployment-{deployment_id}.json"
        self.apply = apply
        self.on_result = on_result
        self.ssl_context = ssl_context
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.etag: str | None = None
        self.headers = {"Accept": "application/json"}
        if token:
            # A bare value is a node token; "Token <key>" (a user token) passes as is.
            is_scheme = token.startswith(("Token ", "Bearer "))
            self.headers["Authorization"] = token if is_scheme else f"Bearer {token}"

    async def poll_once(self, session: aiohttp.ClientSession) -> str:
        """One poll; returns ``applied``, ``unchanged``, ``error`` or ``invalid``."""
        headers = dict(self.headers)
        if self.etag:
            headers["If-None-Match"] = self.etag
        try:
            async with session.get(
                self.url, headers=headers, timeout=self.timeout, ssl=self.ssl_context or True
            ) as response:
                if response.status == 304:
                    return self._result("unchanged")
                if response.status != 200:
                    log.warning(
                        "gateway.config_poll_failed",
                        extra={"url": self.url, "status": response.status},
                    )
                    return self._result("error")
                data = await response.json(content_type=None)
                etag = response.headers.get("ETag")
        except (aiohttp.ClientError, TimeoutError, ValueError) as error:
            log.warning("gateway.config_poll_failed", extra={"url": self.url, "error": repr(error)})
            return self._result("error")
        try:
            config = parse_snapshot(data)
        except ConfigError as error:
            log.error("gateway.config_invalid", extra={"url": self.url, "error": str(error)})
            return self._result("invalid")
        self.apply(config)
        self.etag = etag or f'"{config.version}"'
        self._save(data)
        log.info(
            "gateway.config_applied",
            extra={"version": config.version, "source": "console", "etag": self.etag},
        )
        return self._result("applied")

    def _result(self, result: str) -> str:
        self.on_result(result)
        return result

    def _save(self, data: Any) -> None:
        """Write the last good snapshot atomically (temp file + rename)."""
        try:
            self.state_path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.state_path.with_suffix(".tmp")
            tmp.write_text(json.dumps({"etag": self.etag, "snapshot": data}))
            os.replace(tmp, self.state_path)
        except OSError as error:
            log.error(
                "gateway.config_save_failed",
                extra={"path": str(self.state_path), "error": repr(error)},
            )

    def load_last_good(self) -> DeploymentConfig | None:
        """The snapshot saved by an earlier run (None when absent or unreadable). Its ETag is
        not reused: the first poll after it fetches the current snapshot in full."""
        try:
            saved = json.loads(self.state_path.read_text())
            config = parse_snapshot(saved["snapshot"])
        except (OSError, ValueError, KeyError, TypeError) as error:
            log.warning(
                "gateway.last_good_unavailable",
                extra={"path": str(self.state_path), "error": repr(error)},
            )
            return None
        self.apply(config)
        log.info(
            "gateway.config_applied",
            extra={"version": config.version, "source": "last_good", "path": str(self.state_path)},
        )
        return config

    async def start(self, session: aiohttp.ClientSession) -> bool:
        """First load: the console, else the last good copy. True when a config is in place."""
        if await self.poll_once(session) == "applied":
            return True
        return self.load_last_good() is not None

    async def run(self, session: aiohttp.ClientSession) -> None:
        """Poll forever (until cancelled)."""
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.poll_once(session)
            except asyncio.CancelledError:
                raise
            except Exception:
                # A bug in one poll must not stop polling for the life of the process.
                log.exception("gateway.config_poll_crashed")

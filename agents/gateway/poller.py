"""Config polling: ``GET /api/deployments/{id}/config/`` with ``If-None-Match`` every
``poll_interval_s``; a new, valid snapshot is applied atomically (one reference swap) and
written to disk as the last good config; a 304 costs nothing; any failure (console down,
5xx, invalid snapshot) is logged and counted, and the gateway keeps serving with what it has.
At start, when the console cannot be reached, the last good config on disk is used.
The polling itself is :class:`agents.gateway.polling.DocumentPoller`'s.

Who calls it: :mod:`agents.gateway.app` starts :meth:`ConfigPoller.run` as a background task.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any, Unpack

import aiohttp

from agents.gateway.config import DeploymentConfig, parse_snapshot
from agents.gateway.polling import DocumentPoller, PollOptions

log = logging.getLogger("pdbridge.gateway.config")


class ConfigPoller(DocumentPoller[DeploymentConfig]):
    """Polls one deployment's config snapshot. Event-loop only; never raises from ``run``."""

    document = "config"
    state_prefix = "deployment"
    logger = log
    poll_failed_event = "gateway.config_poll_failed"
    invalid_event = "gateway.config_invalid"
    save_failed_event = "gateway.config_save_failed"
    crashed_event = "gateway.config_poll_crashed"

    def __init__(
        self,
        *,
        apply: Callable[[DeploymentConfig], None],
        on_result: Callable[[str], None] = lambda result: None,
        **options: Unpack[PollOptions],
    ) -> None:
        super().__init__(on_result=on_result, **options)
        self.apply = apply

    def parse(self, data: Any) -> DeploymentConfig:
        return parse_snapshot(data)

    def install(self, parsed: DeploymentConfig) -> None:
        self.apply(parsed)

    def etag_for(self, parsed: DeploymentConfig, etag: str | None) -> str | None:
        # A console without ETags still gets a validator: the snapshot's version.
        return etag or f'"{parsed.version}"'

    def stored(self, data: Any) -> Any:
        return {"etag": self.etag, "snapshot": data}

    def log_applied(self, parsed: DeploymentConfig) -> None:
        log.info(
            "gateway.config_applied",
            extra={"version": parsed.version, "source": "console", "etag": self.etag},
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

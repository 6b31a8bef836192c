"""ETag polling of one console document of a deployment
(``GET /api/deployments/{id}/<document>/``), shared by the config poller
(:class:`agents.gateway.poller.ConfigPoller`) and the client-key poller
(:class:`agents.gateway.access.AccessPoller`).

A poll sends ``If-None-Match`` with the last ETag: a 304 costs nothing; a 200 is parsed, applied
and written to ``state_dir`` as the last good copy; any failure (console down, non-200, a
document that does not parse) is logged and the poller keeps what it has.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import ssl
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar, Generic, NotRequired, TypedDict, TypeVar, Unpack

import aiohttp

from agents.gateway.config import ConfigError

T = TypeVar("T")


class PollOptions(TypedDict):
    """The constructor keywords both pollers take, besides what each applies to."""

    #: The console's base URL (a trailing ``/`` is ignored).
    console_url: str
    deployment_id: int
    #: A node token (sent as ``Bearer <token>``) or a value with its scheme
    #: (``Token <key>``, ``Bearer <token>``) sent as is; None sends no ``Authorization``.
    token: str | None
    #: Seconds between two polls in :meth:`DocumentPoller.run`.
    interval_s: float
    #: Where the last good copy is written (created when missing).
    state_dir: Path
    #: TLS for the console; None: the default verification.
    ssl_context: NotRequired[ssl.SSLContext | None]
    #: Total time one poll may take; default 5.0.
    timeout_s: NotRequired[float]


def _ignore(result: str) -> None:
    """The default result callback."""


class DocumentPoller(Generic[T]):
    """Polls one console document with ``ETag`` / ``If-None-Match``.

    Who calls it: the gateway's start-up code calls the subclass's ``start`` once, then runs
    :meth:`run` as a background task. Event-loop only. :meth:`poll_once` never raises for a
    network, HTTP or document error: it returns ``applied``, ``unchanged``, ``error`` or
    ``invalid`` (also passed to ``on_result``) and logs why; :meth:`run` never raises but on
    cancellation.

    A subclass sets the class attributes (its URL path segment, state file prefix, logger and
    event names) and supplies :meth:`parse` (raises ConfigError), :meth:`install` (applies the
    parsed document; no I/O) and :meth:`log_applied`; it may override :meth:`etag_for` and
    :meth:`stored` (what the state file holds).
    """

    #: The URL's last segment: ``/api/deployments/{id}/<document>/``.
    document: ClassVar[str]
    #: The state file is ``<state_prefix>-{id}.json`` under ``state_dir``.
    state_prefix: ClassVar[str]
    logger: ClassVar[logging.Logger]
    poll_failed_event: ClassVar[str]
    invalid_event: ClassVar[str]
    save_failed_event: ClassVar[str]
    crashed_event: ClassVar[str]

    def __init__(
        self, *, on_result: Callable[[str], None] = _ignore, **options: Unpack[PollOptions]
    ) -> None:
        deployment_id = options["deployment_id"]
        console_url = options["console_url"].rstrip("/")
        self.url = f"{console_url}/api/deployments/{deployment_id}/{self.document}/"
        self.deployment_id = deployment_id
        self.interval_s = options["interval_s"]
        self.state_path = options["state_dir"] / f"{self.state_prefix}-{deployment_id}.json"
        self.on_result = on_result
        self.ssl_context = options.get("ssl_context")
        self.timeout = aiohttp.ClientTimeout(total=options.get("timeout_s", 5.0))
        self.etag: str | None = None
        self.headers = {"Accept": "application/json"}
        token = options["token"]
        if token:
            # A bare value is a node token; "Token <key>" (a user token) passes as is.
            is_scheme = token.startswith(("Token ", "Bearer "))
            self.headers["Authorization"] = token if is_scheme else f"Bearer {token}"

    def parse(self, data: Any) -> T:
        """The fetched JSON -> the parsed document. Raises ConfigError."""
        raise NotImplementedError

    def install(self, parsed: T) -> None:
        """Apply a parsed document (called before the ETag and the state file are updated)."""
        raise NotImplementedError

    def log_applied(self, parsed: T) -> None:
        """Log a document fetched from the console and applied (after it is saved)."""
        raise NotImplementedError

    def etag_for(self, parsed: T, etag: str | None) -> str | None:
        """The ETag to send next time; by default the response's."""
        return etag

    def stored(self, data: Any) -> Any:
        """What the state file holds for a fetched document; by default the document."""
        return data

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
                    self.logger.warning(
                        self.poll_failed_event,
                        extra={"url": self.url, "status": response.status},
                    )
                    return self._result("error")
                data = await response.json(content_type=None)
                etag = response.headers.get("ETag")
        except (aiohttp.ClientError, TimeoutError, ValueError) as error:
            self.logger.warning(
                self.poll_failed_event, extra={"url": self.url, "error": repr(error)}
            )
            return self._result("error")
        try:
            parsed = self.parse(data)
        except ConfigError as error:
            self.logger.error(self.invalid_event, extra={"url": self.url, "error": str(error)})
            return self._result("invalid")
        self.install(parsed)
        self.etag = self.etag_for(parsed, etag)
        self._save(self.stored(data))
        self.log_applied(parsed)
        return self._result("applied")

    def _result(self, result: str) -> str:
        self.on_result(result)
        return result

    def _save(self, content: Any) -> None:
        """Write the last good copy atomically (temp file + rename)."""
        try:
            self.state_path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.state_path.with_suffix(".tmp")
            tmp.write_text(json.dumps(content))
            os.replace(tmp, self.state_path)
        except OSError as error:
            self.logger.error(
                self.save_failed_event,
                extra={"path": str(self.state_path), "error": repr(error)},
            )

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
                self.logger.exception(self.crashed_event)

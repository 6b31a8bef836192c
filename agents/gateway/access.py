"""Client API keys at the gateway, and the engines' own API key upstream.

Client keys. A client sends ``Authorization: Bearer <key>`` (OpenAI's convention). The gateway
never holds a key itself, only the sha256 hex of each key with the key's name; it hashes the
presented key and looks the hash up. Keys come from two sources, merged:

* the console (``GET /api/deployments/{id}/gateway-access/``, polled by :class:`AccessPoller`
  every ``poll_interval_s``): the deployment's active keys and its ``require_client_keys``
  flag. A revoked key stops working at the first poll after the revocation.
* the environment: ``PDBRIDGE_GATEWAY_CLIENT_KEYS`` (``name:sha256`` items separated by commas)
  and ``PDBRIDGE_GATEWAY_CLIENT_KEYS_FILE`` (a file of ``name:sha256`` lines, ``#`` comments;
  re-read when it changes, see :class:`KeysFile`).

Keys are required when the settings say so (``require_client_keys: true``) or the console's
flag does; otherwise every request is served, named by its key when it sent a valid one and
``anonymous`` otherwise (clients that send a placeholder such as vLLM's ``EMPTY`` keep working).
A refused request gets 401 in OpenAI's error shape (:func:`unauthorized_body`). Failures to
reach the console never loosen the check: the gateway keeps the last key set it had (also
across restarts, from ``state_dir``).

Engine key. ``PDBRIDGE_ENGINE_API_KEY`` or ``PDBRIDGE_ENGINE_API_KEY_FILE``
(:mod:`agents.engines.apikey`, shared with the node agent) is the key the engines were started with (vLLM ``--api-key``); the gateway's upstream client
sends it on every leg. The client's own ``Authorization`` is never forwarded.

Who calls it: the CLI (builds :class:`ClientKeys` and reads the engine key at start), the
request handler (:meth:`ClientKeys.admit`, event-loop only, no I/O), :mod:`agents.gateway.server`
(runs the poller and the file reload). Errors in the environment surface as
:class:`~agents.gateway.config.ConfigError` naming the variable (the gateway refuses to start).
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Unpack

import aiohttp
from aiohttp import web

from agents.engines import apikey
from agents.gateway.config import ConfigError
from agents.gateway.logs import client_key_var
from agents.gateway.metrics import GatewayMetrics
from agents.gateway.openai import error_body
from agents.gateway.polling import DocumentPoller, PollOptions

log = logging.getLogger("pdbridge.gateway.access")

CLIENT_KEYS_ENV = "PDBRIDGE_GATEWAY_CLIENT_KEYS"
CLIENT_KEYS_FILE_ENV = "PDBRIDGE_GATEWAY_CLIENT_KEYS_FILE"

#: The name a request gets when keys are not required and it sent no valid key.
ANONYMOUS = "anonymous"
#: Key names: what operators choose (a metric label, so short and plain).
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_MISSING = (
    "You didn't provide an API key. You need to provide your API key in an Authorization "
    "header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY)."
)
_INVALID = "Incorrect API key provided."


def key_hash(key: str) -> str:
    """The stored form of a key: sha256 hex. Keys are 256-bit random strings, so a fast hash
    is enough (nothing to brute-force); the console computes the same."""
    return hashlib.sha256(key.encode()).hexdigest()


def parse_key_lines(text: str, where: str, separator: str = "\n") -> dict[str, str]:
    """``name:sha256`` items (one per line, or ``separator``-separated) -> {sha256: name}.
    Blank items and ``#`` comments are skipped. Raises ConfigError naming ``where``."""
    keys: dict[str, str] = {}
    for number, raw in enumerate(text.split(separator), 1):
        item = raw.split("#", 1)[0].strip()
        if not item:
            continue
        name, _, digest = item.partition(":")
        name, digest = name.strip(), digest.strip().lower()
        if not _NAME.match(name):
            raise ConfigError(
                f"{where}: item {number}: the name must be 1-64 letters, digits, '_', '.', '-'"
            )
        if not _SHA256.match(digest):
            raise ConfigError(
                f"{where}: item {number}: expected name:sha256 (64 hex digits of the key's "
                "sha256, never the key itself)"
            )
        keys[digest] = name
    return keys


class KeysFile:
    """``PDBRIDGE_GATEWAY_CLIENT_KEYS_FILE``: read at start (an error refuses the start) and
    again whenever its modification time or size changes (an unreadable or invalid file
    after start is logged and the keys read before are kept)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._stamp: tuple[float, int] | None = None
        self.keys: dict[str, str] = {}

    def load(self) -> dict[str, str]:
        """Read the file now. Raises ConfigError."""
        try:
            stat = self.path.stat()
            text = self.path.read_text()
        except OSError as error:
            raise ConfigError(f"{CLIENT_KEYS_FILE_ENV}: {self.path}: {error.strerror}") from error
        self.keys = parse_key_lines(text, f"{CLIENT_KEYS_FILE_ENV} ({self.path})")
        self._stamp = (stat.st_mtime, stat.st_size)
        return self.keys

    def changed(self) -> bool:
        """Whether the file differs from what was read (a missing file counts as changed)."""
        try:
            stat = self.path.stat()
        except OSError:
            return True
        return (stat.st_mtime, stat.st_size) != self._stamp


class KeyRefused(Exception):
    """A request without a valid key where keys are required. ``reason``: missing|invalid."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason

    def body(self) -> bytes:
        return unauthorized_body(self.reason)


def unauthorized_body(reason: str) -> bytes:
    """The 401 document, OpenAI's shape and code."""
    message = _MISSING if reason == "missing" else _INVALID
    return error_body(message, "invalid_request_error", None, "invalid_api_key")


class ClientKeys:
    """The key set requests are checked against: the environment's keys and the console's,
    merged (same hash in both: the console's name wins). Replaced whole on each change, so
    a check never sees half a set."""

    def __init__(
        self,
        *,
        require: bool = False,
        local: Mapping[str, str] | None = None,
        keys_file: KeysFile | None = None,
    ) -> None:
        self.require_setting = require
        self.keys_file = keys_file
        self._env = dict(local or {})
        self._file = dict(keys_file.keys) if keys_file is not None else {}
        self._console: dict[str, str] = {}
        self.console_required = False
        self.names: dict[str, str] = {}
        self._merge()

    @classmethod
    def from_environ(cls, environ: Mapping[str, str], *, require: bool) -> ClientKeys:
        """Keys from ``PDBRIDGE_GATEWAY_CLIENT_KEYS`` and ``..._FILE``. Raises ConfigError."""
        local = parse_key_lines(environ.get(CLIENT_KEYS_ENV, ""), CLIENT_KEYS_ENV, ",")
        keys_file = None
        if environ.get(CLIENT_KEYS_FILE_ENV):
            keys_file = KeysFile(environ[CLIENT_KEYS_FILE_ENV])
            keys_file.load()
        return cls(require=require, local=local, keys_file=keys_file)

    @property
    def required(self) -> bool:
        return self.require_setting or self.console_required

    def _merge(self) -> None:
        self.names = {**self._env, **self._file, **self._console}

    def set_console(self, *, required: bool, keys: Mapping[str, str]) -> None:
        """Install the console's view (the access document, parsed)."""
        self._console = dict(keys)
        self.console_required = required
        self._merge()

    def reload_file(self) -> bool:
        """Re-read the keys file when it changed; True when the key set changed."""
        if self.keys_file is None or not self.keys_file.changed():
            return False
        try:
            keys = self.keys_file.load()
        except ConfigError as error:
            log.error("gateway.client_keys_file_invalid", extra={"error": str(error)})
            return False
        if keys == self._file:
            return False
        self._file = dict(keys)
        self._merge()
        log.info("gateway.client_keys_reloaded", extra={"source": "file", "keys": len(keys)})
        return True

    def admit(self, authorization: str | None) -> str:
        """The name of the request's key (:data:`ANONYMOUS` when keys are not required and it
        has none that is valid); raises :class:`KeyRefused` when they are required."""
        name = None
        if authorization:
            scheme, _, token = authorization.partition(" ")
            token = token.strip()
            if scheme.lower() == "bearer" and token:
                name = self.names.get(key_hash(token))
        if name is not None:
            return name
        if not self.required:
            return ANONYMOUS
        raise KeyRefused("invalid" if authorization else "missing")


def admit(
    keys: ClientKeys,
    metrics: GatewayMetrics,
    headers: Mapping[str, str],
    base_headers: Mapping[str, str] | None = None,
) -> web.Response | None:
    """The request handler's check: None when the request is admitted (its key's name is
    then in the request's log lines and counted), else the 401 to answer."""
    try:
        name = keys.admit(headers.get("authorization"))
    except KeyRefused as refused:
        metrics.client_key_refused(refused.reason)
        log.info("gateway.client_key_refused", extra={"reason": refused.reason})
        return web.Response(
            status=401,
            body=refused.body(),
            content_type="application/json",
            headers={**(base_headers or {}), "WWW-Authenticate": "Bearer"},
        )
    client_key_var.set(name)
    metrics.client_request(name)
    return None


def parse_access(data: Any) -> tuple[bool, dict[str, str]]:
    """The console's access document -> (require_client_keys, {sha256: name}). Raises
    ConfigError naming the field."""
    if not isinstance(data, Mapping):
        raise ConfigError("access: must be a JSON object")
    required = data.get("require_client_keys", False)
    if not isinstance(required, bool):
        raise ConfigError("access.require_client_keys: must be true or false")
    items = data.get("keys", [])
    if not isinstance(items, list):
        raise ConfigError("access.keys: must be a list")
    keys: dict[str, str] = {}
    for i, item in enumerate(items):
        if not isinstance(item, Mapping):
            raise ConfigError(f"access.keys[{i}]: must be an object")
        name, digest = item.get("name"), item.get("sha256")
        if not isinstance(name, str) or not _NAME.match(name):
            raise ConfigError(f"access.keys[{i}].name: invalid key name {name!r}")
        if not isinstance(digest, str) or not _SHA256.match(digest):
            raise ConfigError(f"access.keys[{i}].sha256: must be 64 lower-case hex digits")
        keys[digest] = name
    return required, keys


class AccessPoller(DocumentPoller[tuple[bool, dict[str, str]]]):
    """Polls the deployment's client-key document (``ETag`` / ``If-None-Match``, as the config
    poller; the polling is :class:`agents.gateway.polling.DocumentPoller`'s). Event-loop only;
    ``run`` never raises. A failed or invalid poll keeps the key set in place; a new one is
    applied and saved in ``state_dir`` (hashes only)."""

    document = "gateway-access"
    state_prefix = "gateway-access"
    logger = log
    poll_failed_event = "gateway.access_poll_failed"
    invalid_event = "gateway.access_invalid"
    save_failed_event = "gateway.access_save_failed"
    crashed_event = "gateway.access_poll_crashed"

    def __init__(self, *, keys: ClientKeys, **options: Unpack[PollOptions]) -> None:
        super().__init__(**options)
        self.keys = keys

    def parse(self, data: Any) -> tuple[bool, dict[str, str]]:
        return parse_access(data)

    def install(self, parsed: tuple[bool, dict[str, str]]) -> None:
        required, keys = parsed
        self.keys.set_console(required=required, keys=keys)

    def log_applied(self, parsed: tuple[bool, dict[str, str]]) -> None:
        required, keys = parsed
        log.info(
            "gateway.client_keys_applied",
            extra={"source": "console", "required": required, "keys": len(keys)},
        )

    def load_last_good(self) -> bool:
        """Apply the document saved by an earlier run; False when there is none."""
        try:
            required, keys = parse_access(json.loads(self.state_path.read_text()))
        except (OSError, ValueError) as error:
            log.info(
                "gateway.access_last_good_unavailable",
                extra={"path": str(self.state_path), "error": repr(error)},
            )
            return False
        self.keys.set_console(required=required, keys=keys)
        log.info(
            "gateway.client_keys_applied",
            extra={"source": "last_good", "required": required, "keys": len(keys)},
        )
        return True

    async def start(self, session: aiohttp.ClientSession) -> bool:
        """First load: the console, else the last good copy."""
        if await self.poll_once(session) == "applied":
            return True
        return self.load_last_good()


def engine_api_key(environ: Mapping[str, str]) -> str | None:
    """The engines' key for the upstream legs (:func:`agents.engines.apikey.engine_api_key`);
    raises ConfigError naming the variable."""
    try:
        return apikey.engine_api_key(environ)
    except ValueError as error:
        raise ConfigError(str(error)) from error

"""The engines' own API key (vLLM ``--api-key``), shared by the gateway (sends it on every
leg) and the node agent (starts engines with it): ``PDBRIDGE_ENGINE_API_KEY``, or the file
named by ``PDBRIDGE_ENGINE_API_KEY_FILE``. Secrets come from the environment or a secret file,
never from the repository or the console. Pure; no I/O beyond reading that file."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

ENGINE_KEY_ENV = "PDBRIDGE_ENGINE_API_KEY"
ENGINE_KEY_FILE_ENV = "PDBRIDGE_ENGINE_API_KEY_FILE"


def engine_api_key(environ: Mapping[str, str]) -> str | None:
    """The key (surrounding whitespace stripped), or None when neither variable is set.
    Raises ValueError naming the variable: both set, an unreadable file, an empty key, or one
    that cannot travel in an HTTP header (spaces, control characters)."""
    value, path = environ.get(ENGINE_KEY_ENV), environ.get(ENGINE_KEY_FILE_ENV)
    if value and path:
        raise ValueError(f"{ENGINE_KEY_ENV} and {ENGINE_KEY_FILE_ENV}: set one, not both")
    where = ENGINE_KEY_ENV
    if path:
        where = ENGINE_KEY_FILE_ENV
        try:
            value = Path(path).read_text()
        except OSError as error:
            raise ValueError(f"{where}: {path}: {error.strerror}") from error
    if value is None:
        return None
    key = value.strip()
    if not key or any(c.isspace() or not c.isprintable() for c in key):
        raise ValueError(f"{where}: must be one non-empty token without spaces")
    return key

"""Fallback causes read off a failed leg: what the engine's error says went wrong.

Pure functions of a :class:`agents.gateway.upstream.LegError` (its cause and its body), called
by the serving path of :mod:`agents.gateway.app` once per failed leg.
"""

from __future__ import annotations

import json
from typing import Any

from agents.gateway.upstream import LegError
from pdproto.kv import KV_IMPORT_REFUSED, KV_PEER_REFUSED


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def error_code(error: BaseException) -> str | None:
    """The ``error.code`` of a failed leg's OpenAI-shaped body (None when it has none)."""
    if not isinstance(error, LegError):
        return None
    doc = _json(error.detail)
    body = doc.get("error") if isinstance(doc, dict) else None
    code = body.get("code") if isinstance(body, dict) else None
    return code if isinstance(code, str) else None


def kv_cause(error: BaseException) -> str | None:
    """The fallback cause of a decode leg that failed naming the KV (None when it did not):
    ``kv_import_refused`` when the engine refused the transfer's manifest (its error code
    says so), else ``kv_transfer``."""
    if not (isinstance(error, LegError) and "kv" in error.detail.lower()):
        return None
    return KV_IMPORT_REFUSED if error_code(error) == KV_IMPORT_REFUSED else "kv_transfer"


def prefill_cause(error: BaseException) -> str:
    """The fallback cause of a failed prefill leg: ``prefill_timeout``, ``kv_peer_refused``
    (the decode site's KV receiver refused the prefill engine: TLS or allowlist, named in
    the engine's error) or ``prefill_error``."""
    if isinstance(error, LegError) and error.cause == "timeout":
        return "prefill_timeout"
    return KV_PEER_REFUSED if error_code(error) == KV_PEER_REFUSED else "prefill_error"

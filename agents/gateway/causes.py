"""Fallback causes read off a failed leg: what the engine's error says went wrong.

Pure functions of a :class:`agents.gateway.upstream.LegError` (its cause and its body), called
by the serving path of :mod:`agents.gateway.app` once per failed leg.
"""

from __future__ import annotations

import json
from typing import Any

from agents.gateway.upstream import LegError
from pdproto.kv import KV_IMPORT_REFUSED, KV_PEER_REFUSED, KV_TIMEOUT, KV_UNREACHABLE


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
    ``kv_import_refused`` when the engine refused the transfer's manifest, ``kv_timeout``
    when the KV missed its deadline (the engine's error code says which), else
    ``kv_transfer`` (rejected, failed verification, lost)."""
    if not (isinstance(error, LegError) and "kv" in error.detail.lower()):
        return None
    code = error_code(error)
    if code in (KV_IMPORT_REFUSED, KV_TIMEOUT):
        return code
    return "kv_transfer"


def prefill_cause(error: BaseException) -> str:
    """The fallback cause of a failed prefill leg: ``prefill_timeout`` (the gateway's own
    wait ran out), ``kv_peer_refused`` (the decode site's KV receiver refused the prefill
    engine: TLS or allowlist, named in the engine's error), ``kv_unreachable`` (the engine
    could not reach that receiver at all: it is down or the path is cut), ``kv_timeout`` (the engine's send
    missed the deployment's KV deadline: a slow link or prefill, not damaged KV) or
    ``prefill_error``."""
    if isinstance(error, LegError) and error.cause == "timeout":
        return "prefill_timeout"
    code = error_code(error)
    if code in (KV_PEER_REFUSED, KV_UNREACHABLE, KV_TIMEOUT):
        return code
    return "prefill_error"

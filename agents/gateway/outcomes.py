"""What a failed leg becomes: the exceptions the serving path raises between its steps
(:class:`Fallback`, :class:`Rejected`), the judgements of a :class:`LegError` (the request's
fault, the instance's, worth a retry elsewhere), and the client's answer to a leg that failed
before output. Pure; called by :mod:`agents.gateway.app` per failed leg.
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from agents.gateway.admission import CLIENT_LIMIT, Admission
from agents.gateway.causes import kv_cause
from agents.gateway.openai import error_body
from agents.gateway.upstream import LegError


class Fallback(Exception):
    """The remote path failed before the first byte; ``cause`` labels the fallback;
    ``exclude``: decode instances the fallback must not use (the remote decode leg failed
    there)."""

    def __init__(self, cause: str, exclude: frozenset[str] = frozenset()) -> None:
        super().__init__(cause)
        self.cause = cause
        self.exclude = exclude


class Rejected(Exception):
    """An engine refused the request itself (a 4xx other than 408/429): relayed as is."""

    def __init__(self, error: LegError) -> None:
        super().__init__(str(error))
        self.error = error


def rejects_request(error: LegError) -> bool:
    # 401/403: the engine refused the gateway's engine key, not the client's request.
    return error.status is not None and 400 <= error.status < 500 and error.status not in (
        401, 403, 408, 429,
    )  # fmt: skip


_AT_INSTANCE = frozenset(
    ("connect", "timeout", "first_byte_timeout", "idle_timeout", "instance_down", "stream_error")
)


def instance_fault(error: BaseException) -> bool:
    """Whether a failed leg counts against its instance's health: it could not connect,
    timed out (whole, first byte or idle), broke before output, was abandoned because its
    instance was found down, or answered 5xx -- unless the 5xx is a KV verdict (the
    transfer's fault, not the engine's)."""
    if not isinstance(error, LegError):
        return False
    if error.cause in _AT_INSTANCE:
        return True
    return error.status is not None and error.status >= 500 and kv_cause(error) is None


def retryable(error: LegError) -> bool:
    """Whether a decode leg that failed before output may be sent to another instance: not
    the whole exchange's timeout (the request's time is spent; a first-byte timeout leaves
    the rest of it) and not the engine's verdict on the request (4xx) or on its KV."""
    return error.cause != "timeout" and instance_fault(error)


def leg_error_response(error: LegError, path: str, request_id: str) -> web.Response:
    """The client's answer to a leg that failed before output: the engine's own 4xx body, or
    an OpenAI-style 502."""
    headers = {"x-request-id": request_id, "x-pdbridge-path": path}
    if rejects_request(error):
        assert error.status is not None  # noqa: S101 - implied by _rejects_request
        doc = error.detail.encode() or error_body("rejected by the engine", "invalid_request_error")
        return json_response(error.status, doc, headers)
    message = f"the decode engine failed: {error.cause} {error.status or ''}".strip()
    return json_response(
        502, error_body(message, "upstream_error", None, "upstream_error"), headers
    )


def json_or_none(body: bytes) -> Any:
    """A JSON body decoded, or None when it is not JSON."""
    try:
        return json.loads(body)
    except ValueError:
        return None


def json_response(status: int, body: bytes, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(status=status, body=body, content_type="application/json", headers=headers)


def overloaded_response(
    admission: Admission, reason: str, retry_after_s: int, headers: dict[str, str]
) -> web.Response:
    """The 429 of admission control, in OpenAI's rate-limit error shape, with Retry-After."""
    if reason == CLIENT_LIMIT:
        message = (
            f"this client address holds its limit of {admission.max_per_client} requests "
            f"served or waiting ({reason}); retry later"
        )
    else:
        message = (
            f"the gateway is serving its limit of {admission.max_in_flight} requests with "
            f"{admission.queued} waiting ({reason}); retry later"
        )
    doc = error_body(
        message,
        "requests",
        None,
        "rate_limit_exceeded",
    )
    return json_response(429, doc, {**headers, "retry-after": str(max(retry_after_s, 1))})

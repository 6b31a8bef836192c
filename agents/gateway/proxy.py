"""Upstream legs and the pass-through relay.

:class:`Upstream` owns the aiohttp client session to the engines. The request handler opens
legs with :meth:`Upstream.open` (returns once the response headers arrived) and
:func:`first_chunk` (the first body bytes, i.e. the moment the engine produced output), then
hands the response to :func:`relay`, which copies bytes to the client as they arrive —
never buffering a whole stream. Cancellation of the calling task (client disconnect) closes
the upstream connection, which aborts the engine's work.

Failures surface as :class:`LegError` with a ``cause`` the handler maps to fallback causes.
"""

from __future__ import annotations

import asyncio
import json
import ssl
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

# Hop-by-hop and framing headers are the gateway's own business, not the engine's.
_HEADERS = {"Accept": "*/*", "Accept-Encoding": "identity", "Content-Type": "application/json"}
_SSE_ERROR_PREFIX = b'data: {"error"'


class LegError(Exception):
    """An upstream leg failed before producing output. ``cause``: ``timeout``, ``connect``,
    ``status`` (non-2xx; ``status`` and ``detail`` set) or ``stream_error``."""

    def __init__(self, cause: str, status: int | None = None, detail: str = "") -> None:
        super().__init__(f"{cause} {status or ''} {detail}".strip())
        self.cause = cause
        self.status = status
        self.detail = detail


class LegResponse(aiohttp.ClientResponse):
    """An upstream response carrying its leg's deadline (see :meth:`Upstream.open`);
    closing it cancels the deadline."""

    deadline: asyncio.TimerHandle | None = None

    def close(self) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None
        super().close()


def _expire(response: LegResponse) -> None:
    """The leg's deadline passed: the read in progress (or the next one) raises TimeoutError;
    the reader closes the response."""
    response.deadline = None
    if not response.content.is_eof():
        response.content.set_exception(TimeoutError())


class Upstream:
    """The HTTP client for engine legs (one per gateway process, event-loop only)."""

    def __init__(self, connect_timeout_s: float, ssl_context: ssl.SSLContext | None = None) -> None:
        self.connect_timeout_s = connect_timeout_s
        # For https engine URLs: a CA bundle and client certificate (mTLS); None: system CAs.
        self.ssl: ssl.SSLContext | bool = ssl_context or True
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            # No pool limit: the gateway must never queue requests behind its own connector;
            # back-pressure belongs to the engines and the fallback budget.
            connector = aiohttp.TCPConnector(limit=0, limit_per_host=0, ttl_dns_cache=60)
            self._session = aiohttp.ClientSession(
                connector=connector,
                auto_decompress=False,
                skip_auto_headers=("User-Agent",),
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.connect_timeout_s),
                response_class=LegResponse,
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def open(
        self, url: str, body: bytes, request_id: str, timeout_s: float
    ) -> aiohttp.ClientResponse:
        """POST ``body`` to ``url``; returns the response once its headers arrived (2xx only).
        ``timeout_s`` bounds the whole exchange, body included. Raises :class:`LegError`.

        The bound is one timer per leg, not aiohttp's ``total`` timeout: that one enters a
        timer context on every read of the body, about 5 % of the relay's CPU per streamed
        event. Until the headers arrived ``asyncio.timeout_at`` holds it, then the response's
        deadline (:class:`LegResponse`): a read past it raises ``TimeoutError`` as before."""
        headers = {**_HEADERS, "X-Request-Id": request_id}
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=self.connect_timeout_s)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        try:
            async with asyncio.timeout_at(deadline):
                response = await self.session.post(
                    url, data=body, headers=headers, timeout=timeout, ssl=self.ssl
                )
        except TimeoutError as error:
            raise LegError("timeout") from error
        except aiohttp.ClientError as error:
            raise LegError("connect", detail=type(error).__name__) from error
        if isinstance(response, LegResponse):
            response.deadline = loop.call_at(deadline, _expire, response)
        if response.status >= 300:
            try:
                detail = (await response.read())[:2000].decode("utf-8", "replace")
            except (aiohttp.ClientError, TimeoutError):
                detail = ""
            finally:
                response.close()
            raise LegError("status", response.status, detail)
        return response

    async def call(self, url: str, body: bytes, request_id: str, timeout_s: float) -> bytes:
        """A whole small exchange (the prefill leg, ``/tokenize``): the response body."""
        response = await self.open(url, body, request_id, timeout_s)
        try:
            return await response.read()
        except TimeoutError as error:
            raise LegError("timeout") from error
        except aiohttp.ClientError as error:
            raise LegError("stream_error", detail=type(error).__name__) from error
        finally:
            response.close()


async def first_chunk(response: aiohttp.ClientResponse) -> bytes:
    """The first body bytes of an opened leg (b"" for an empty body). An SSE stream whose
    first event is an error counts as a failed leg (nothing has reached the client yet).
    Raises :class:`LegError`; closes the response on failure and on cancellation."""
    try:
        chunk = await response.content.readany()
    except asyncio.CancelledError:
        # The client went away (or the remote path gave up on this leg): close now, which
        # aborts the engine's work and cancels the leg's deadline.
        response.close()
        raise
    except TimeoutError as error:
        response.close()
        raise LegError("timeout") from error
    except aiohttp.ClientError as error:
        response.close()
        raise LegError("stream_error", detail=type(error).__name__) from error
    if chunk.startswith(_SSE_ERROR_PREFIX):
        response.close()
        raise LegError("status", 500, chunk[:2000].decode("utf-8", "replace"))
    return chunk


@dataclass(slots=True)
class RelayResult:
    """What the relay saw: when the first byte left (monotonic), when the last did, how many
    SSE events, whether the upstream ended cleanly (False: an error after the first byte)."""

    first_at: float
    last_at: float
    events: int
    ok: bool


def sse_error_event(message: str, code: str) -> bytes:
    """An OpenAI-style error event for a stream that fails after its first byte."""
    doc = {"error": {"message": message, "type": "upstream_error", "param": None, "code": code}}
    return b"data: " + json.dumps(doc).encode() + b"\n\n"


async def relay(
    request: web.Request,
    upstream: aiohttp.ClientResponse,
    first: bytes,
    headers: dict[str, str],
) -> tuple[web.StreamResponse, RelayResult]:
    """Copy an opened upstream response to the client chunk by chunk. Headers go out with the
    first chunk. A failure after that is an SSE error event (streams) or an aborted
    connection (other bodies: the client sees a short body, never a silent truncation).
    The upstream response is always closed on return or cancellation."""
    content_type = upstream.headers.get("Content-Type", "application/json")
    is_sse = content_type.startswith("text/event-stream")
    response = web.StreamResponse(status=upstream.status, headers=headers)
    response.content_type = content_type.split(";")[0]
    if not is_sse and upstream.content_length is not None:
        response.content_length = upstream.content_length
    if is_sse:
        response.headers["Cache-Control"] = "no-cache"
    content = upstream.content
    try:
        await response.prepare(request)
        events = first.count(b"data:") if is_sse else 0
        ok = True
        # Each chunk is written as soon as it was read (never held back), and each read takes
        # everything the upstream connection has buffered by then. When the upstream's end
        # came with the bytes just read, they go out with the response's end in one write:
        # the last event and the stream's terminator in one syscall and one segment.
        if content.at_eof():
            await response.write_eof(first)
            first_at = last_at = time.monotonic()
            return response, RelayResult(first_at, last_at, events, ok)
        await response.write(first)
        first_at = last_at = time.monotonic()
        try:
            while chunk := await content.readany():
                if is_sse:
                    events += chunk.count(b"data:")
                if content.at_eof():
                    await response.write_eof(chunk)
                    last_at = time.monotonic()
                    return response, RelayResult(first_at, last_at, events, ok)
                await response.write(chunk)
            last_at = time.monotonic()
        except (aiohttp.ClientError, TimeoutError) as error:
            ok = False
            last_at = time.monotonic()
            if is_sse:
                await response.write(
                    sse_error_event(f"upstream failed: {type(error).__name__}", "upstream_error")
                )
            elif request.transport is not None:
                request.transport.abort()
                return response, RelayResult(first_at, last_at, events, ok)
        await response.write_eof()
        return response, RelayResult(first_at, last_at, events, ok)
    finally:
        upstream.close()


def leg_body(body: dict[str, Any], kv: dict[str, Any], prefill: bool) -> bytes:
    """The body of a disaggregated leg: the client's request with ``kv_transfer_params``; the
    prefill leg is non-streaming, one token (vLLM's disaggregated-proxy convention)."""
    leg = dict(body)
    leg["kv_transfer_params"] = kv
    if prefill:
        leg["stream"] = False
        leg["max_tokens"] = 1
        for key in ("stream_options", "min_tokens", "max_completion_tokens"):
            leg.pop(key, None)
    return json.dumps(leg).encode()

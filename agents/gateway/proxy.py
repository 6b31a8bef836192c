"""The pass-through relay: an opened upstream leg (:mod:`agents.gateway.upstream`) copied to
the client.

:func:`relay` writes the first chunk through the client (:class:`Client`: aiohttp's response,
:class:`AiohttpClient`, or a connection of the gateway's own server,
``agents.gateway.fastpath``), which sends the headers with it, then *pipes* the rest: each
time the upstream connection delivers bytes, the body they carry goes to the client's
transport at once, re-framed as one HTTP chunk (never held back, never buffered whole; the end
of the body leaves with the stream's terminator in one write). A failure after the first byte
is an SSE error event or an aborted connection, never a silent truncation.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any, Protocol

from aiohttp import web

from agents.gateway.upstream import IdleTimeout, LegResponse, UpstreamError


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


@dataclass(frozen=True, slots=True)
class ResponseHead:
    """The status line and headers of a relayed response: ``length`` None for a body of
    unknown length (chunked, or SSE)."""

    status: int
    headers: dict[str, str]
    content_type: str
    length: int | None


class Client(Protocol):
    """Where a relayed response goes: aiohttp's response (:class:`AiohttpClient`) or a
    connection of the gateway's own server (``agents.gateway.fastpath``)."""

    #: What a request handler returns for the response sent (None: the fast path's own).
    response: web.StreamResponse | None

    @property
    def transport(self) -> asyncio.WriteTransport | None: ...

    async def begin(self, head: ResponseHead, first: bytes, eof: bool) -> bool:
        """Send ``head`` and ``first`` (in one write); with ``eof`` also the end of the
        response. Returns whether the body is chunked (the framing the relay's
        pipe must write in)."""
        ...

    async def end(self, data: bytes) -> None:
        """Send ``data`` and the end of the response (in one write)."""
        ...

    def abort(self) -> None:
        """Drop the client's connection (a body that cannot be completed)."""
        ...


class AiohttpClient:
    """The client side of a relay served by aiohttp (the hot endpoints' requests that the
    fast path hands over, and every request when ``fast_server`` is off)."""

    def __init__(self, request: web.Request) -> None:
        self.request = request
        self.response: web.StreamResponse | None = None

    @property
    def transport(self) -> asyncio.WriteTransport | None:
        return self.request.transport

    async def begin(self, head: ResponseHead, first: bytes, eof: bool) -> bool:
        response = self.response = web.StreamResponse(status=head.status, headers=head.headers)
        response.content_type = head.content_type
        if head.length is not None:
            response.content_length = head.length
        await response.prepare(self.request)
        # aiohttp sends the headers with the first write, and the last chunk with the
        # stream's terminator when both come together.
        if eof:
            await response.write_eof(first)
            return False
        await response.write(first)
        # aiohttp chose the framing when it prepared the response (chunked for HTTP/1.1
        # without a length); the relay's pipe follows it.
        return response.headers.get("Transfer-Encoding", "").lower() == "chunked"

    async def end(self, data: bytes) -> None:
        assert self.response is not None  # noqa: S101 - begin() came first
        await self.response.write_eof(data)

    def abort(self) -> None:
        if self.request.transport is not None:
            self.request.transport.abort()


async def relay(
    client: Client, upstream: LegResponse, first: bytes, headers: dict[str, str]
) -> RelayResult:
    """Copy an opened upstream response to the client chunk by chunk. Headers go out with the
    first chunk; the rest is piped (:meth:`LegResponse.pipe`) to the client's transport as it
    arrives, and the bytes that came with the upstream's end leave with the response's end in
    one write. A failure after the first byte is an SSE error event (streams) or an aborted
    connection (other bodies: the client sees a short body, never a silent truncation).
    The upstream response is always closed on return or cancellation."""
    content_type = upstream.headers.get("content-type", "application/json")
    is_sse = content_type.startswith("text/event-stream")
    headers = dict(headers)
    if is_sse:
        headers["Cache-Control"] = "no-cache"
    length = None if is_sse else upstream.content_length
    try:
        events = first.count(b"data:") if is_sse else 0
        eof = upstream.at_eof()
        head = ResponseHead(upstream.status, headers, content_type.split(";")[0], length)
        chunked = await client.begin(head, first, eof)
        first_at = time.monotonic()
        if eof:
            return RelayResult(first_at, first_at, events, True)
        transport = client.transport
        if transport is None or transport.is_closing():
            raise ConnectionResetError("the client went away")
        try:
            tail = await upstream.pipe(transport, chunked, is_sse)
        except (UpstreamError, TimeoutError) as error:
            last_at = max(upstream.last_at, first_at)
            events += upstream.events
            if not is_sse:
                client.abort()
                return RelayResult(first_at, last_at, events, False)
            await client.end(sse_error_event(_failure(upstream, error), "upstream_error"))
            return RelayResult(first_at, last_at, events, False)
        await client.end(tail)
        return RelayResult(first_at, time.monotonic(), events + upstream.events, True)
    finally:
        upstream.close()


def _failure(upstream: LegResponse, error: BaseException) -> str:
    """The error event's message for a stream that failed after its first byte."""
    if isinstance(error, IdleTimeout):
        return f"the engine sent nothing for {upstream.idle_s:g} s (idle_timeout_s)"
    return f"upstream failed: {type(error).__name__}"


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

"""The gateway's request handling and aiohttp application: OpenAI-compatible endpoints that
route each request to the remote path (prefill leg at a remote site + decode leg at the local
decode pool, sent concurrently: :mod:`agents.gateway.remote`, with failover across prefill
sites) or the local path, with budgeted fallback, pass-through streaming, metrics and
``/debug/routing``.

Who calls it: :mod:`agents.gateway.cli` (``pdbridge gateway``) and tests, through
:func:`build_app`; the completions requests that the gateway's own server takes
(:mod:`agents.gateway.fastpath`) come to :meth:`Gateway.complete` directly, the same
handling as aiohttp's handler. A request never gets a traceback: client errors are OpenAI-style 4xx,
upstream failures before the first byte fall back or become 502/503, after it an error event.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import ssl
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from aiohttp import web

from agents.gateway.access import ClientKeys, admit
from agents.gateway.admission import Admission
from agents.gateway.budget import FallbackBudget
from agents.gateway.config import DeploymentConfig, GatewaySettings
from agents.gateway.endpoints import Endpoints
from agents.gateway.length import capped, context_error, needs_count
from agents.gateway.logs import request_id_var
from agents.gateway.metrics import GatewayMetrics
from agents.gateway.openai import Kind, ParsedRequest, RequestError, error_body, parse_body
from agents.gateway.outcomes import (
    Fallback,
    Rejected,
    instance_fault,
    json_response,
    leg_error_response,
    overloaded_response,
    rejects_request,
    retryable,
)
from agents.gateway.prefix import PrefixIndex
from agents.gateway.proxy import AiohttpClient, Client, relay
from agents.gateway.remote import ROUTES, Call, RemotePath, route_headers
from agents.gateway.state import Router
from agents.gateway.trace import Trace, TraceCollector, TraceRing, new_trace
from agents.gateway.upstream import LegError, Upstream, first_chunk
from pdproto.trace import TRACE_PATH

log = logging.getLogger("pdbridge.gateway")

GATEWAY_KEY = web.AppKey("gateway", object)


class Gateway(Endpoints, RemotePath):
    """Request handling. One instance per process; holds the router, budget, metrics, client."""

    def __init__(
        self,
        settings: GatewaySettings,
        router: Router | None = None,
        upstream_ssl: ssl.SSLContext | None = None,
        keys: ClientKeys | None = None,
        engine_api_key: str | None = None,
        debug_token: str | None = None,
    ) -> None:
        self.settings = settings
        #: Bearer token of ``/debug/traces`` (None: the endpoint refuses every caller).
        self.debug_token = debug_token
        self.traces = TraceRing(settings.trace_ring_size)
        self.router = router or Router(settings)
        self.metrics = GatewayMetrics()
        self.metrics.registry.register(TraceCollector(self.traces))
        self.router.on_eject = self.metrics.ejected
        self.router.on_failure = self.metrics.leg_failed
        self.router.on_probe = self.metrics.probed
        self.router.on_unavailable = self._abandon_legs
        self.keys = keys or ClientKeys(require=settings.require_client_keys)
        self.upstream = Upstream(settings.connect_timeout_s, upstream_ssl, engine_api_key)
        block = settings.prefix_block_tokens
        self.prefix_text = PrefixIndex(
            max(int(block * settings.chars_per_token), 1), settings.prefix_index_blocks
        )
        self.prefix_ids = PrefixIndex(block, settings.prefix_index_blocks)
        self.admission = Admission(
            settings.max_in_flight_requests,
            settings.max_queued_requests,
            settings.admission_queue_timeout_s,
            settings.max_in_flight_per_client,
        )
        self.budget = FallbackBudget(
            rate=settings.fallback_rate_per_s,
            burst=settings.fallback_burst,
            max_wait_s=settings.fallback_max_wait_s,
            max_waiters=settings.fallback_max_waiters,
            clock=time.monotonic,
        )

    # -- configuration -------------------------------------------------------------------
    def apply(self, config: DeploymentConfig) -> None:
        """Install a snapshot (from the poller or a static file)."""
        self.router.apply(config)
        self.metrics.config_version.set(config.version)
        self.metrics.share.set(config.remote_share_percent / 100)
        self.metrics.kill_switch.set(1 if config.kill_switch else 0)
        self.metrics.threshold.set(self.router.tuner.effective(config.threshold_tokens))

    def _abandon_legs(self, role: str, site: str, url: str, why: str) -> None:
        """An instance was found unavailable: the legs waiting on it for their first output
        fail now (``instance_down``) and are retried or fall back, instead of waiting out
        their deadlines at an engine that stopped answering -- a decode instance's only when
        another decode instance is available to take them."""
        pool = self.router.pool(role, site)
        if role == "decode" and (pool is None or pool.healthy_count() == 0):
            # No other decode instance to take them: an overloaded engine whose probes time out
            # is still the best place for its waiting legs (abandoned, they could only fail).
            return
        abandoned = self.upstream.abandon(url)
        if abandoned:
            log.warning(
                "gateway.legs_abandoned",
                extra={"role": role, "site": site, "url": url, "why": why, "legs": abandoned},
            )

    # -- plain endpoints -----------------------------------------------------------------
    # -- completions ---------------------------------------------------------------------
    def handler(self, kind: Kind) -> Any:
        async def handle(request: web.Request) -> web.StreamResponse:
            return await self.generate(request, kind)

        return handle

    async def generate(self, request: web.Request, kind: Kind) -> web.StreamResponse:
        """One completions/chat request served by aiohttp, end to end."""

        async def read() -> bytes:
            try:
                return await request.read()
            except web.HTTPRequestEntityTooLarge as error:
                raise RequestError(
                    413,
                    f"the request body exceeds {self.settings.max_body_bytes} bytes",
                    None,
                    "body_too_large",
                ) from error

        client = AiohttpClient(request)
        response = await self.complete(kind, request.headers, read, client)
        if response is None:
            response = client.response
        assert response is not None  # noqa: S101 - aiohttp's client keeps what it sent
        return response

    async def complete(
        self,
        kind: Kind,
        headers: Mapping[str, str],
        read: Callable[[], Awaitable[bytes]],
        client: Client,
    ) -> web.StreamResponse | None:
        """One completions/chat request, end to end, whichever server received it:
        ``headers`` (case-insensitive lookups), ``read`` gives the body (raises
        :class:`RequestError` for one too large), relayed responses go to ``client``.
        Returns the response to send (errors), or None when it was relayed to ``client``."""
        arrived = time.monotonic()
        # 128 random bits in hex, as a uuid4's hex (a third of its cost).
        request_id = headers.get("x-request-id") or os.urandom(16).hex()
        request_id_var.set(request_id)
        base_headers = {"x-request-id": request_id}
        refused = admit(self.keys, self.metrics, headers, base_headers)
        if refused is not None:
            return refused
        config = self.router.config
        if config is None:
            return json_response(
                503,
                error_body("the gateway has no configuration yet", "service_unavailable"),
                base_headers,
            )
        # The body first: a client that sends a head and nothing more holds no slot.
        read_s = self.settings.request_read_timeout_s
        try:
            async with asyncio.timeout(read_s):
                raw = await read()
        except (RequestError, TimeoutError) as error:
            if isinstance(error, TimeoutError):
                error = RequestError(
                    408,
                    f"the request body did not arrive within {read_s:g} s (request_read_timeout_s)",
                    None,
                    "request_timeout",
                )
            self.metrics.request("local", "client_error")
            # The connection's framing is lost with the unread body: it closes.
            return json_response(
                error.status, error.body(), {**base_headers, "connection": "close"}
            )
        address = _address(client)
        refusal = await self.admission.acquire(address)
        if refusal is not None:
            return self._overloaded(refusal, base_headers)
        trace = new_trace(request_id, kind, arrived) if self.traces.size > 0 else None
        response: web.StreamResponse | None = None
        try:
            if trace is not None:
                trace.mark("admitted")
            response = await self._admitted(
                kind, headers, raw, client, arrived, request_id, config, trace
            )
            return response
        finally:
            self.admission.release(address)
            if trace is not None:
                # A relayed answer went out with its engine's 200 (errors are returned).
                trace.status = response.status if response is not None else 200
                trace.outcome = trace.outcome or "canceled"
                self.traces.add(trace)

    def _overloaded(self, reason: str, headers: dict[str, str]) -> web.Response:
        """The 429 of admission control, counted and logged."""
        self.metrics.admission_rejections.labels(reason).inc()
        a = self.admission
        log.warning(
            "gateway.admission_refused",
            extra={"reason": reason, "in_flight": a.in_flight, "queued": a.queued},
        )
        return overloaded_response(a, reason, self.settings.admission_retry_after_s, headers)

    async def _admitted(
        self,
        kind: Kind,
        headers: Mapping[str, str],
        raw: bytes,
        client: Client,
        arrived: float,
        request_id: str,
        config: DeploymentConfig,
        trace: Trace | None = None,
    ) -> web.StreamResponse | None:
        """:meth:`complete` past admission: parse, route, serve."""
        base_headers = {"x-request-id": request_id}
        try:
            body, parsed = parse_body(raw, kind, config.model_name)
        except RequestError as error:
            self.metrics.request("local", "client_error")
            if trace is not None:
                trace.path, trace.outcome = "local", "client_error"
            return json_response(error.status, error.body(), base_headers)
        key = headers.get(self.settings.sticky_key_header) or parsed.user or request_id
        prompt_tokens, exact = await self._prompt_tokens(parsed, config, request_id)
        # Only an exact count is refused (see agents.gateway.length).
        too_long = exact and context_error(
            kind, prompt_tokens, parsed.max_tokens, config.max_model_len
        )
        if trace is not None:
            trace.stream, trace.prompt_tokens = parsed.stream, prompt_tokens
        if too_long:
            self.metrics.request("local", "client_error")
            if trace is not None:
                trace.path, trace.outcome = "local", "client_error"
            return json_response(400, too_long.body(), base_headers)
        decision = self.router.decide(
            config, key, prompt_tokens, self._cached_tokens(parsed, config)
        )
        self.metrics.decision(decision.path, decision.reason)
        call = Call(client, kind, arrived, request_id, raw, body, parsed, config, decision, trace)
        if decision.path == "remote":
            return await self._remote(call)
        if decision.wants_remote:
            return await self._fallback(call, decision.reason)
        return await self._serve(call, "local")

    def _chars_per_token(self, config: DeploymentConfig) -> float:
        """The model's tokenizer ratio from the snapshot, else the gateway's setting."""
        return config.chars_per_token or self.settings.chars_per_token

    def _cached_tokens(self, parsed: ParsedRequest, config: DeploymentConfig) -> int:
        """Estimated tokens of the prompt already cached at the decode pool (0 when the
        estimate is off); the prompt is remembered for the requests that follow."""
        if not self.settings.prefix_cache_estimate:
            return 0
        if parsed.token_ids is not None:
            cached = self.prefix_ids.cached_units(parsed.token_ids)
            self.prefix_ids.remember(parsed.token_ids)
            return cached
        if not parsed.text:
            return 0
        cached_chars = self.prefix_text.cached_units(parsed.text)
        self.prefix_text.remember(parsed.text)
        return int(cached_chars / self._chars_per_token(config))

    async def _prompt_tokens(
        self, parsed: ParsedRequest, config: DeploymentConfig, request_id: str
    ) -> tuple[int, bool]:
        """(length, exact): exact for token-id prompts; else an estimate from characters
        (capped at the model's context), made exact by the decode engine's ``/tokenize``
        when the estimate is over the context, or near the threshold with ``tokenize`` on."""
        if parsed.prompt_tokens is not None:
            return parsed.prompt_tokens, True
        raw_estimate = int(parsed.prompt_chars / self._chars_per_token(config) + 0.5)
        estimate = capped(raw_estimate, config.max_model_len)
        threshold = self.router.tuner.effective(config.threshold_tokens)
        if not parsed.text or not needs_count(
            raw_estimate, parsed.max_tokens, threshold, config.max_model_len, self.settings.tokenize
        ):
            return estimate, False
        instance = self.router.pick_decode(config)
        if instance is None:
            return estimate, False
        payload = json.dumps({"model": config.model_name, "prompt": parsed.text}).encode()
        try:
            raw = await self.upstream.call(
                f"{instance.url}/tokenize", payload, request_id, self.settings.connect_timeout_s * 2
            )
            return int(json.loads(raw)["count"]), True
        except (LegError, ValueError, KeyError, TypeError) as error:
            log.info("gateway.tokenize_failed", extra={"url": instance.url, "error": repr(error)})
            return estimate, False

    # -- serving -------------------------------------------------------------------------
    async def _serve(
        self, call: Call, path: str, exclude: frozenset[str] = frozenset()
    ) -> web.StreamResponse | None:
        """Serve on ``path``: the remote legs, or one local leg (``local``/``fallback``) --
        sent again to another decode instance (``decode_retries``) when it failed at its
        instance before any byte reached the client. ``exclude``: instances not to use. A
        ``local`` request of a deployment with a local prefill pool goes through it first
        (:meth:`RemotePath._local_legs`); the one local leg serves it when that cannot.
        Raises :class:`Fallback` from the remote path before anything reached the client."""
        request_id, kind, config = call.request_id, call.kind, call.config
        pool = config.decode.name
        decode = self.router.pick_decode(config, exclude) or self.router.pick_decode(config)
        assert decode is not None  # noqa: S101 - a decode pool has at least one instance
        self.metrics.begin(path)
        self.router.begin(decode.url)
        outcome, ttft, tpot = "upstream_error", None, None
        try:
            if path == "remote":
                upstream, first = await self._remote_legs(call, decode)
                self.metrics.remote_served(
                    call.decision.site or "", "failover" if call.failover else "first"
                )
            else:
                served = None
                if path == "local" and self.router.local_prefill_in_rotation(config):
                    try:
                        served = await self._local_legs(call, decode)
                    except Fallback as skipped:
                        # The decode engine prefills it itself; on another instance when
                        # this one failed the decode leg.
                        exclude |= skipped.exclude
                        again = (
                            self.router.pick_decode(config, exclude)
                            if decode.url in exclude
                            else None
                        )
                        if again is not None:
                            self.router.end(decode.url)
                            decode = again
                            self.router.begin(decode.url)
                tried, retries = set(exclude), self.settings.decode_retries
                while served is None:
                    if call.trace is not None:
                        call.trace.decode_instance = decode.name
                        call.trace.mark("decode_sent")
                    try:
                        # The local path forwards the client's bytes unchanged; a retry
                        # has what is left of the request's time.
                        settings = self.settings
                        upstream = await self.upstream.open(
                            f"{decode.url}{ROUTES[kind]}",
                            call.raw,
                            request_id,
                            settings.request_timeout_s - (time.monotonic() - call.arrived),
                            settings.first_byte_timeout_s if call.parsed.stream else 0.0,
                            settings.idle_timeout_s,
                        )
                        first = await first_chunk(upstream)
                        if call.trace is not None:
                            call.trace.mark("decode_first_byte")
                        self.router.leg_ok("decode", pool, decode.url)
                        break
                    except LegError as error:
                        log.warning(
                            "gateway.local_leg_failed",
                            extra={"url": decode.url, "cause": error.cause, "status": error.status},
                        )
                        if not instance_fault(error):
                            self.router.leg_ok("decode", pool, decode.url)
                            if rejects_request(error):
                                outcome = "client_error"
                            return leg_error_response(error, path, request_id)
                        self.router.leg_failed("decode", pool, decode.url, error.cause)
                        tried.add(decode.url)
                        again = None
                        if retries > 0 and retryable(error):
                            again = self.router.pick_decode(config, frozenset(tried))
                        if again is None:
                            return leg_error_response(error, path, request_id)
                        retries -= 1
                        self.metrics.retry("decode", error.cause)
                        log.info(
                            "gateway.decode_retry",
                            extra={"from": decode.url, "to": again.url, "cause": error.cause},
                        )
                        self.router.end(decode.url)
                        decode = again
                        self.router.begin(decode.url)
                if served is not None:
                    upstream, first = served
            result = await relay(call.client, upstream, first, route_headers(call, path))
            outcome = "ok" if result.ok else "upstream_error"
            ttft = result.first_at - call.arrived
            if call.trace is not None:
                call.trace.mark("first_byte", result.first_at)
            if call.parsed.stream and path != "fallback" and call.failover is None:
                # A streamed answer's first byte is its first token (a body's is its last).
                self.router.ttft_sample(config, path, call.decision.incremental_tokens, ttft)
            if result.events > 1:
                tpot = (result.last_at - result.first_at) / (result.events - 1)
            return call.client.response
        except Rejected as rejected:
            outcome = "client_error"
            return leg_error_response(rejected.error, path, request_id)
        except Fallback:
            outcome = ""
            raise
        except asyncio.CancelledError:
            outcome = "canceled"
            raise
        except ConnectionResetError:
            outcome = "canceled"
            raise
        finally:
            self.router.end(decode.url)
            if outcome:
                self.metrics.finish(path, outcome, ttft, time.monotonic() - call.arrived, tpot)
            else:
                self.metrics.abandon(path)
            if call.trace is not None and outcome:
                call.trace.path, call.trace.outcome = path, outcome
                call.trace.mark("done")
            log.debug(
                "gateway.request_done", extra={"path": path, "outcome": outcome or "fallback"}
            )

    async def _fallback(
        self, call: Call, cause: str, exclude: frozenset[str] = frozenset()
    ) -> web.StreamResponse | None:
        """Serve by local prefill within the budget (503 with retry-after beyond it)."""
        headers = route_headers(call, "fallback")
        if call.trace is not None:
            call.trace.path, call.trace.fallback_cause = "fallback", cause
            call.trace.outcome = "rejected"  # until served
        if not call.config.fallback_to_local_prefill:
            self.metrics.request("fallback", "rejected")
            doc = error_body(
                f"the remote path is unavailable ({cause}) and fallback is disabled",
                "service_unavailable",
                None,
                cause,
            )
            return json_response(503, doc, headers)
        if not await self.budget.acquire():
            self.metrics.budget_rejections.inc()
            self.metrics.request("fallback", "rejected")
            retry_after = self.budget.retry_after_s()
            log.warning(
                "gateway.fallback_budget_spent",
                extra={"cause": cause, "retry_after_s": retry_after},
            )
            doc = error_body(
                "local prefill capacity for fallback is exhausted; retry later",
                "service_unavailable",
                None,
                "fallback_budget_exhausted",
            )
            return json_response(503, doc, {**headers, "retry-after": str(retry_after)})
        self.metrics.fallback(cause)
        log.info("gateway.fallback", extra={"cause": cause, "site": call.decision.site})
        if call.trace is not None:
            call.trace.outcome = ""
        return await self._serve(call, "fallback", exclude)


def _address(client: Client) -> str:
    """The client's IP address ("" when unknown), the key of the per-client admission cap."""
    transport = client.transport
    peer = transport.get_extra_info("peername") if transport is not None else None
    return str(peer[0]) if isinstance(peer, tuple) and peer else ""


@web.middleware
async def _errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """Last line of defence: an unexpected exception becomes an OpenAI-style 500, logged."""
    try:
        return await handler(request)
    except web.HTTPException as error:
        if error.status >= 400:
            return json_response(error.status, error_body(error.reason, "invalid_request_error"))
        raise
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:
        log.exception("gateway.unhandled_error", extra={"path": request.path})
        return json_response(500, error_body("internal gateway error", "server_error"))


def build_app(gateway: Gateway) -> web.Application:
    """The aiohttp application. Background tasks (polling, scraping, re-tuning) are added
    by the caller through ``app.cleanup_ctx``; the upstream session closes on cleanup."""
    app = web.Application(middlewares=[_errors], client_max_size=gateway.settings.max_body_bytes)
    app.router.add_post(ROUTES["completions"], gateway.handler("completions"))
    app.router.add_post(ROUTES["chat"], gateway.handler("chat"))
    app.router.add_get("/v1/models", gateway.models)
    app.router.add_get("/health", gateway.health)
    app.router.add_get("/metrics", gateway.prometheus)
    app.router.add_get("/debug/routing", gateway.debug_routing)
    app.router.add_get(TRACE_PATH, gateway.debug_traces)
    app.router.add_get(TRACE_PATH + "/{request_id}", gateway.debug_trace)

    async def close_upstream(app: web.Application) -> None:
        await gateway.upstream.close()

    app.on_cleanup.append(close_upstream)
    app[GATEWAY_KEY] = gateway
    return app

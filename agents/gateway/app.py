"""The gateway's request handling and aiohttp application: OpenAI-compatible endpoints that
route each request to the remote path (prefill leg at a remote site + decode leg at the local
decode pool, sent concurrently) or the local path, with budgeted fallback, pass-through
streaming, metrics and ``/debug/routing``.

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
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from agents.gateway.access import ClientKeys, admit
from agents.gateway.admission import Admission
from agents.gateway.budget import FallbackBudget
from agents.gateway.causes import kv_cause, prefill_cause
from agents.gateway.config import DeploymentConfig, GatewaySettings, Instance
from agents.gateway.decision import Decision
from agents.gateway.length import capped, context_error, needs_count
from agents.gateway.logs import request_id_var
from agents.gateway.metrics import GatewayMetrics
from agents.gateway.openai import Kind, ParsedRequest, RequestError, error_body, parse_request
from agents.gateway.prefix import PrefixIndex
from agents.gateway.proxy import (
    AiohttpClient,
    Client,
    LegError,
    LegResponse,
    Upstream,
    first_chunk,
    leg_body,
    relay,
)
from agents.gateway.state import Router
from pdproto.kv import KV_PEER_REFUSED, PULL_PREFILL_KV, pulled_kv_params, push_kv_params

log = logging.getLogger("pdbridge.gateway")

GATEWAY_KEY = web.AppKey("gateway", object)

ROUTES = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


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


def _rejects_request(error: LegError) -> bool:
    # 401/403: the engine refused the gateway's engine key, not the client's request.
    return error.status is not None and 400 <= error.status < 500 and error.status not in (
        401, 403, 408, 429,
    )  # fmt: skip


def _instance_fault(error: BaseException) -> bool:
    """Whether a failed leg counts against its instance's health: it could not connect,
    timed out, broke before output or answered 5xx -- unless the 5xx is a KV verdict (the
    transfer's fault, not the engine's)."""
    if not isinstance(error, LegError):
        return False
    if error.cause in ("connect", "timeout", "stream_error"):
        return True
    return error.status is not None and error.status >= 500 and kv_cause(error) is None


def _retryable(error: LegError) -> bool:
    """Whether a decode leg that failed before output may be sent to another instance: not
    a timeout (the request's whole time is spent) and not the engine's verdict on the
    request (4xx) or on its KV."""
    return error.cause != "timeout" and _instance_fault(error)


def _leg_error_response(error: LegError, path: str, request_id: str) -> web.Response:
    """The client's answer to a leg that failed before output: the engine's own 4xx body, or
    an OpenAI-style 502."""
    headers = {"x-request-id": request_id, "x-pdbridge-path": path}
    if _rejects_request(error):
        assert error.status is not None  # noqa: S101 - implied by _rejects_request
        doc = error.detail.encode() or error_body("rejected by the engine", "invalid_request_error")
        return _json(error.status, doc, headers)
    message = f"the decode engine failed: {error.cause} {error.status or ''}".strip()
    return _json(502, error_body(message, "upstream_error", None, "upstream_error"), headers)


@dataclass(frozen=True, slots=True)
class _Call:
    """One request as the serving methods need it."""

    client: Client
    kind: Kind
    arrived: float
    request_id: str
    raw: bytes
    body: dict[str, Any]
    parsed: ParsedRequest
    config: DeploymentConfig
    decision: Decision


def _json_or_none(body: bytes) -> Any:
    """A JSON body decoded, or None when it is not JSON."""
    try:
        return json.loads(body)
    except ValueError:
        return None


def _json(status: int, body: bytes, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(status=status, body=body, content_type="application/json", headers=headers)


class Gateway:
    """Request handling. One instance per process; holds the router, budget, metrics, client."""

    def __init__(
        self,
        settings: GatewaySettings,
        router: Router | None = None,
        upstream_ssl: ssl.SSLContext | None = None,
        keys: ClientKeys | None = None,
        engine_api_key: str | None = None,
    ) -> None:
        self.settings = settings
        self.router = router or Router(settings)
        self.metrics = GatewayMetrics()
        self.router.on_eject = self.metrics.ejected
        self.router.on_failure = self.metrics.leg_failed
        self.router.on_probe = self.metrics.probed
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

    # -- plain endpoints -----------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        """``ok``; ``degraded`` (200) when an instance is out or a prefill pool has none
        available (requests are served locally); ``unhealthy`` (503) when the decode pool
        has none available, or without a config."""
        config = self.router.config
        if config is None:
            return web.json_response({"status": "no_config"}, status=503)
        pools = [
            {k: v for k, v in p.snapshot().items() if k != "instances"}
            for p in self.router.pools.values()
        ]
        status = "ok"
        if any(p["healthy"] < p["total"] for p in pools):
            status = "degraded"
        if any(p["role"] == "decode" and p["healthy"] == 0 for p in pools):
            status = "unhealthy"
        doc = {"status": status, "config_version": config.version, "pools": pools}
        return web.json_response(doc, status=503 if status == "unhealthy" else 200)

    async def models(self, request: web.Request) -> web.Response:
        refused = admit(self.keys, self.metrics, request.headers)
        if refused is not None:
            return refused
        config = self.router.config
        data = [] if config is None else [
            {"id": config.model_name, "object": "model", "created": 0, "owned_by": "pdbridge"}
        ]  # fmt: skip
        return web.json_response({"object": "list", "data": data})

    async def prometheus(self, request: web.Request) -> web.Response:
        self.refresh_gauges()
        return web.Response(
            body=generate_latest(self.metrics.registry),
            headers={"Content-Type": CONTENT_TYPE_LATEST},
        )

    async def debug_routing(self, request: web.Request) -> web.Response:
        doc = self.router.debug()
        doc["fallback_budget"] = {
            "tokens": round(self.budget.bucket.tokens, 3),
            "rate_per_s": self.budget.bucket.rate,
            "burst": self.budget.bucket.burst,
            "waiting": self.budget.waiting,
        }
        return web.json_response(doc)

    def refresh_gauges(self) -> None:
        """Breaker and site gauges (computed on scrape, not per request)."""
        router, m = self.router, self.metrics
        m.admission_in_flight.set(self.admission.in_flight)
        m.admission_queued.set(self.admission.queued)
        config = router.config
        if config is None:
            return
        m.threshold.set(router.tuner.effective(config.threshold_tokens))
        for scope, breakers in (
            ("site", router.site_breakers),
            ("instance", router.instance_breakers),
        ):
            for name, breaker in breakers.items():
                m.breaker_state.labels(scope, name).set(
                    {"closed": 0, "half_open": 1, "open": 2}[breaker.state]
                )
                m.breaker_ejections.labels(scope, name).set(breaker.total_ejections)
        for view in router.site_views(config):
            m.site_queue.labels(view.name).set(view.queue_depth)
            m.site_utilization.labels(view.name).set(view.utilization)
        m.pools(router.pools.values(), router.instance_inflight)

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
            return _json(
                503,
                error_body("the gateway has no configuration yet", "service_unavailable"),
                base_headers,
            )
        refusal = await self.admission.acquire()
        if refusal is not None:
            return self._overloaded(refusal, base_headers)
        try:
            return await self._admitted(kind, headers, read, client, arrived, request_id, config)
        finally:
            self.admission.release()

    def _overloaded(self, reason: str, headers: dict[str, str]) -> web.Response:
        """The 429 of admission control (OpenAI's rate-limit error shape)."""
        self.metrics.admission_rejections.labels(reason).inc()
        a = self.admission
        log.warning(
            "gateway.admission_refused",
            extra={"reason": reason, "in_flight": a.in_flight, "queued": a.queued},
        )
        doc = error_body(
            f"the gateway is serving its limit of {a.max_in_flight} requests with "
            f"{a.queued} waiting ({reason}); retry later",
            "requests",
            None,
            "rate_limit_exceeded",
        )
        retry_after = str(max(self.settings.admission_retry_after_s, 1))
        return _json(429, doc, {**headers, "retry-after": retry_after})

    async def _admitted(
        self,
        kind: Kind,
        headers: Mapping[str, str],
        read: Callable[[], Awaitable[bytes]],
        client: Client,
        arrived: float,
        request_id: str,
        config: DeploymentConfig,
    ) -> web.StreamResponse | None:
        """:meth:`complete` past admission: parse, route, serve."""
        base_headers = {"x-request-id": request_id}
        try:
            raw = await read()
            body, parsed = self._parse(raw, kind, config)
        except RequestError as error:
            self.metrics.request("local", "client_error")
            return _json(error.status, error.body(), base_headers)
        key = headers.get(self.settings.sticky_key_header) or parsed.user or request_id
        prompt_tokens, exact = await self._prompt_tokens(parsed, config, request_id)
        # Only an exact count is refused (see agents.gateway.length).
        too_long = exact and context_error(
            kind, prompt_tokens, parsed.max_tokens, config.max_model_len
        )
        if too_long:
            self.metrics.request("local", "client_error")
            return _json(400, too_long.body(), base_headers)
        decision = self.router.decide(config, key, prompt_tokens, self._cached_tokens(parsed))
        self.metrics.decision(decision.path, decision.reason)
        call = _Call(client, kind, arrived, request_id, raw, body, parsed, config, decision)
        exclude: frozenset[str] = frozenset()
        if decision.path == "remote":
            try:
                return await self._serve(call, "remote")
            except Fallback as fallback:
                cause, exclude = fallback.cause, fallback.exclude
        elif decision.wants_remote:
            cause = decision.reason
        else:
            return await self._serve(call, "local")
        return await self._fallback(call, cause, exclude)

    def _parse(
        self, raw: bytes, kind: Kind, config: DeploymentConfig
    ) -> tuple[dict[str, Any], ParsedRequest]:
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as error:
            raise RequestError(
                400, f"the request body is not valid JSON: {error}", None, "invalid_json"
            ) from error
        return body, parse_request(kind, body, config.model_name)

    def _cached_tokens(self, parsed: ParsedRequest) -> int:
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
        return int(cached_chars / self.settings.chars_per_token)

    async def _prompt_tokens(
        self, parsed: ParsedRequest, config: DeploymentConfig, request_id: str
    ) -> tuple[int, bool]:
        """(length, exact): exact for token-id prompts; else an estimate from characters
        (capped at the model's context), made exact by the decode engine's ``/tokenize``
        when the estimate is over the context, or near the threshold with ``tokenize`` on."""
        if parsed.prompt_tokens is not None:
            return parsed.prompt_tokens, True
        raw_estimate = int(parsed.prompt_chars / self.settings.chars_per_token + 0.5)
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
        self, call: _Call, path: str, exclude: frozenset[str] = frozenset()
    ) -> web.StreamResponse | None:
        """Serve on ``path``: the remote legs, or one local leg (``local``/``fallback``) --
        sent again to another decode instance (``decode_retries``) when it failed at its
        instance before any byte reached the client. ``exclude``: instances not to use.
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
            else:
                tried, retries = set(exclude), self.settings.decode_retries
                while True:
                    try:
                        # The local path forwards the client's bytes unchanged.
                        upstream = await self.upstream.open(
                            f"{decode.url}{ROUTES[kind]}",
                            call.raw,
                            request_id,
                            self.settings.request_timeout_s,
                        )
                        first = await first_chunk(upstream)
                        self.router.leg_ok("decode", pool, decode.url)
                        break
                    except LegError as error:
                        log.warning(
                            "gateway.local_leg_failed",
                            extra={"url": decode.url, "cause": error.cause, "status": error.status},
                        )
                        if not _instance_fault(error):
                            self.router.leg_ok("decode", pool, decode.url)
                            if _rejects_request(error):
                                outcome = "client_error"
                            return _leg_error_response(error, path, request_id)
                        self.router.leg_failed("decode", pool, decode.url, error.cause)
                        tried.add(decode.url)
                        again = None
                        if retries > 0 and _retryable(error):
                            again = self.router.pick_decode(config, frozenset(tried))
                        if again is None:
                            return _leg_error_response(error, path, request_id)
                        retries -= 1
                        self.metrics.retry("decode", error.cause)
                        log.info(
                            "gateway.decode_retry",
                            extra={"from": decode.url, "to": again.url, "cause": error.cause},
                        )
                        self.router.end(decode.url)
                        decode = again
                        self.router.begin(decode.url)
            headers = {"x-request-id": request_id, "x-pdbridge-path": path}
            result = await relay(call.client, upstream, first, headers)
            outcome = "ok" if result.ok else "upstream_error"
            ttft = result.first_at - call.arrived
            if result.events > 1:
                tpot = (result.last_at - result.first_at) / (result.events - 1)
            return call.client.response
        except Rejected as rejected:
            outcome = "client_error"
            return _leg_error_response(rejected.error, path, request_id)
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
            log.debug(
                "gateway.request_done", extra={"path": path, "outcome": outcome or "fallback"}
            )

    async def _remote_legs(self, call: _Call, decode: Instance) -> tuple[LegResponse, bytes]:
        """Send the prefill and decode legs concurrently; return the decode leg and its first
        bytes, or raise :class:`Fallback`. Both legs are cancelled on any exit but success.

        Breaker verdict (once per request, for the site and the prefill instance): failure
        when the prefill leg fails or the KV does not reach decode (decode error naming the
        KV, or no first byte in time); success when decode produced its first byte or failed
        for a reason of its own after a good prefill; none when the client went away."""
        kind, body, config, request_id = call.kind, call.body, call.config, call.request_id
        decision = call.decision
        site = decision.site or ""
        prefill = self.router.acquire_prefill(config, site)
        if prefill is None:
            raise Fallback("breaker_open")
        pull = config.kv_mode == "pull"
        decode_url = f"{decode.url}{ROUTES[kind]}"
        if pull:
            # vLLM's convention: the prefill engine answers with where its KV waits, and the
            # decode leg (sent after that answer) carries it to the decode engine unchanged.
            prefill_kv: dict[str, Any] = dict(PULL_PREFILL_KV)
        else:
            # The decode engine's KV error after kv_timeout_ms makes the gateway fall back.
            prefill_kv, decode_kv = push_kv_params(
                uuid.uuid4().hex, decode.kv_address, config.kv_timeout_ms / 1000
            )
        # Counted against the link now (requests routed meanwhile see it); given back unless
        # the prefill leg went through (a refused or failed leg sent no KV).
        link_entry = self.router.note_remote_tokens(site, decision.incremental_tokens)
        self.router.begin(prefill.url, site)
        started = time.monotonic()
        prefill_task = asyncio.create_task(
            self.upstream.call(
                f"{prefill.url}{ROUTES[kind]}", leg_body(body, prefill_kv, prefill=True),
                request_id, self.settings.prefill_timeout_s,
            )
        )  # fmt: skip
        decode_task: asyncio.Task[tuple[LegResponse, bytes]] | None = None
        if not pull:
            decode_task = asyncio.create_task(
                self._open_decode(decode_url, leg_body(body, decode_kv, prefill=False), request_id)
            )
        prefill_s: float | None = None
        verdict: bool | None = None
        success = False
        instance_fault = False
        try:
            done, _ = await asyncio.wait(
                {t for t in (prefill_task, decode_task) if t is not None},
                return_when=asyncio.FIRST_COMPLETED,
            )
            if prefill_task in done:
                prefill_s = time.monotonic() - started
                prefill_error = prefill_task.exception()
                if isinstance(prefill_error, LegError) and _rejects_request(prefill_error):
                    # The engine refused the request itself (too long, bad parameter): the
                    # client's error, not the site's; local would refuse it too.
                    raise Rejected(prefill_error)
                if prefill_error is not None:
                    verdict = False
                    cause = prefill_cause(prefill_error)
                    instance_fault = _instance_fault(prefill_error) and cause != KV_PEER_REFUSED
                    if instance_fault:
                        assert isinstance(prefill_error, LegError)  # noqa: S101 - implied
                        self.router.leg_failed("prefill", site, prefill.url, prefill_error.cause)
                    log.warning(
                        "gateway.prefill_failed",
                        extra={
                            "site": site,
                            "url": prefill.url,
                            "cause": cause,
                            "error": str(prefill_error)[:500],
                        },
                    )
                    raise Fallback(cause)
                self.router.leg_ok("prefill", site, prefill.url)
            if decode_task is None:
                pulled = pulled_kv_params(_json_or_none(prefill_task.result()))
                if pulled is None:
                    verdict = False
                    log.warning(
                        "gateway.prefill_without_kv_params",
                        extra={"site": site, "url": prefill.url},
                    )
                    raise Fallback("prefill_error")
                decode_task = asyncio.create_task(
                    self._open_decode(decode_url, leg_body(body, pulled, prefill=False), request_id)
                )
            if not decode_task.done():
                # For streams the first event follows the KV, so the KV timeout bounds the
                # wait; a non-streamed body arrives only when generation ends.
                wait_s = (
                    config.kv_timeout_ms / 1000 + self.settings.first_byte_grace_s
                    if call.parsed.stream
                    else self.settings.request_timeout_s
                )
                done, _ = await asyncio.wait({decode_task}, timeout=wait_s)
                if not done:
                    verdict = False
                    log.warning("gateway.kv_timeout", extra={"site": site, "wait_s": wait_s})
                    raise Fallback("kv_timeout")
            decode_error = decode_task.exception()
            if isinstance(decode_error, LegError) and _rejects_request(decode_error):
                verdict = True if prefill_s is not None else None
                raise Rejected(decode_error)
            if decode_error is not None:
                kv_failure = kv_cause(decode_error)
                verdict = False if kv_failure else (True if prefill_s is not None else None)
                log.warning(
                    "gateway.decode_leg_failed",
                    extra={"url": decode.url, "error": str(decode_error)[:500]},
                )
                exclude: frozenset[str] = frozenset()
                if _instance_fault(decode_error):
                    assert isinstance(decode_error, LegError)  # noqa: S101 - implied
                    self.router.leg_failed(
                        "decode", config.decode.name, decode.url, decode_error.cause
                    )
                    exclude = frozenset({decode.url})
                raise Fallback(kv_failure or "decode_error", exclude)
            self.router.leg_ok("decode", config.decode.name, decode.url)
            verdict = True
            success = True
            return decode_task.result()
        finally:
            self.router.end(prefill.url, site)
            if not success and decode_task is not None:
                decode_task.cancel()
                if (
                    decode_task.done()
                    and not decode_task.cancelled()
                    and not decode_task.exception()
                ):
                    # The decode leg had answered but the request falls back (or was refused):
                    # close that answer, which aborts the engine's work and its deadline.
                    decode_task.result()[0].close()
            kv_sent = success or (
                prefill_task.done()
                and not prefill_task.cancelled()
                and not prefill_task.exception()
            )
            if not kv_sent:
                self.router.release_remote_tokens(site, link_entry)
            if not prefill_task.done():
                prefill_task.cancel()
            latency = prefill_s if prefill_s is not None else time.monotonic() - started
            self.router.record_prefill(
                site, prefill, verdict, latency, "remote_leg", instance_fault=instance_fault
            )

    async def _open_decode(
        self, url: str, body: bytes, request_id: str
    ) -> tuple[LegResponse, bytes]:
        response = await self.upstream.open(url, body, request_id, self.settings.request_timeout_s)
        return response, await first_chunk(response)

    async def _fallback(
        self, call: _Call, cause: str, exclude: frozenset[str] = frozenset()
    ) -> web.StreamResponse | None:
        """Serve by local prefill within the budget (503 with retry-after beyond it)."""
        headers = {"x-request-id": call.request_id, "x-pdbridge-path": "fallback"}
        if not call.config.fallback_to_local_prefill:
            self.metrics.request("fallback", "rejected")
            doc = error_body(
                f"the remote path is unavailable ({cause}) and fallback is disabled",
                "service_unavailable",
                None,
                cause,
            )
            return _json(503, doc, headers)
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
            return _json(503, doc, {**headers, "retry-after": str(retry_after)})
        self.metrics.fallback(cause)
        log.info("gateway.fallback", extra={"cause": cause, "site": call.decision.site})
        return await self._serve(call, "fallback", exclude)


@web.middleware
async def _errors(request: web.Request, handler: Any) -> web.StreamResponse:
    """Last line of defence: an unexpected exception becomes an OpenAI-style 500, logged."""
    try:
        return await handler(request)
    except web.HTTPException as error:
        if error.status >= 400:
            return _json(error.status, error_body(error.reason, "invalid_request_error"))
        raise
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:
        log.exception("gateway.unhandled_error", extra={"path": request.path})
        return _json(500, error_body("internal gateway error", "server_error"))


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

    async def close_upstream(app: web.Application) -> None:
        await gateway.upstream.close()

    app.on_cleanup.append(close_upstream)
    app[GATEWAY_KEY] = gateway
    return app

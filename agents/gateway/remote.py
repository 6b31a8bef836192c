"""The remote path: the prefill and decode legs of one attempt at a remote site
(:meth:`RemotePath._remote_legs`) and the request around them (:meth:`RemotePath._remote`):
a prefill leg failing before any KV reached the decode engine (``FAILOVER_CAUSES``) is sent
again, once, to the next-best site with a fresh transfer id before local fallback. The same
two legs serve the local path through the deployment's local prefill pool
(:meth:`RemotePath._local_legs`, docs/gateway.md "The local prefill pool").

A mixin of :class:`agents.gateway.app.Gateway`, called from its request handling on the
event loop; failures surface as :class:`~agents.gateway.outcomes.Fallback` (served by local
prefill by :meth:`Gateway._fallback`) or :class:`~agents.gateway.outcomes.Rejected`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from agents.gateway.causes import kv_cause, prefill_cause
from agents.gateway.config import DeploymentConfig, GatewaySettings, Instance
from agents.gateway.decision import Decision
from agents.gateway.metrics import LOCAL_PREFILL_UNAVAILABLE, GatewayMetrics
from agents.gateway.openai import Kind, ParsedRequest
from agents.gateway.outcomes import (
    Fallback,
    Rejected,
    instance_fault,
    json_or_none,
    rejects_request,
)
from agents.gateway.proxy import Client, leg_body
from agents.gateway.state import Router
from agents.gateway.trace import Trace
from agents.gateway.upstream import LegError, LegResponse, Upstream, first_chunk
from pdproto.causes import FAILOVER_CAUSES
from pdproto.http import FAILOVER_CAUSE_HEADER, FAILOVER_FROM_HEADER, SITE_HEADER
from pdproto.kv import (
    KV_PEER_REFUSED,
    KV_TRANSFER_PARAMS,
    PULL_PREFILL_KV,
    TRANSFER_ID,
    pulled_kv_params,
    push_kv_params,
)

if TYPE_CHECKING:
    from aiohttp import web

log = logging.getLogger("pdbridge.gateway")

ROUTES = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


@dataclass(frozen=True, slots=True)
class Call:
    """One request as the serving methods need it. ``prefill_timeout_s``: the wait of the
    current attempt's prefill leg; ``failover``: (site, cause) of the first site that failed
    it, once the request was sent on to another; ``trace``: the request's record (None when
    traces are off)."""

    client: Client
    kind: Kind
    arrived: float
    request_id: str
    raw: bytes
    body: dict[str, Any]
    parsed: ParsedRequest
    config: DeploymentConfig
    decision: Decision
    trace: Trace | None = None
    prefill_timeout_s: float = 0.0
    failover: tuple[str, str] | None = None


def route_headers(call: Call, path: str) -> dict[str, str]:
    """The answer's routing headers: the path, the prefill site of a remote answer, and the
    site failed over from (with its cause) when there was one."""
    headers = {"x-request-id": call.request_id, "x-pdbridge-path": path}
    if path == "remote" and call.decision.site:
        headers[SITE_HEADER] = call.decision.site
    if call.failover is not None:
        headers[FAILOVER_FROM_HEADER], headers[FAILOVER_CAUSE_HEADER] = call.failover
    return headers


def ttft_budget_s(settings: GatewaySettings, config: DeploymentConfig) -> float:
    """A remote request's TTFT budget: in push mode the decode engine gives up on the KV
    after ``kv_transfer.timeout_ms``, so the lesser of that and ``prefill_timeout_s``; in
    pull mode ``prefill_timeout_s`` (the decode leg is sent after the prefill answered)."""
    if config.kv_mode == "pull":
        return settings.prefill_timeout_s
    return min(settings.prefill_timeout_s, config.kv_timeout_ms / 1000)


class RemotePath:
    """The remote path over the gateway's state (set by :class:`Gateway`)."""

    settings: GatewaySettings
    router: Router
    metrics: GatewayMetrics
    upstream: Upstream

    async def _serve(
        self, call: Call, path: str, exclude: frozenset[str] = frozenset()
    ) -> web.StreamResponse | None:
        """Serve ``call`` on ``path`` (:meth:`Gateway._serve`)."""
        raise NotImplementedError

    async def _fallback(
        self, call: Call, cause: str, exclude: frozenset[str] = frozenset()
    ) -> web.StreamResponse | None:
        """Serve ``call`` by local prefill (:meth:`Gateway._fallback`)."""
        raise NotImplementedError

    async def _remote(self, call: Call) -> web.StreamResponse | None:
        """Serve a request routed remote: at its site, then -- when that site's prefill leg
        failed before any KV reached decode (``FAILOVER_CAUSES``) and another site can take
        it -- at the next-best site (``prefill_failovers`` times), else by local fallback.
        A leg that may still fail over waits ``prefill_site_timeout_fraction`` of the TTFT
        budget; the last one what is left of ``prefill_timeout_s``."""
        settings, config = self.settings, call.config
        fraction_s = ttft_budget_s(settings, config) * settings.prefill_site_timeout_fraction
        left = settings.prefill_failovers if len(config.prefill) > 1 else 0
        started = time.monotonic()
        tried: frozenset[str] = frozenset()
        while True:
            site = call.decision.site or ""
            tried |= {site}
            if left > 0 and self.router.next_site(config, tried) is not None:
                timeout = fraction_s
            else:
                timeout = max(settings.prefill_timeout_s - (time.monotonic() - started), fraction_s)
            call = dataclasses.replace(call, prefill_timeout_s=timeout)
            try:
                return await self._serve(call, "remote")
            except Fallback as fallback:
                cause, exclude = fallback.cause, fallback.exclude
            target = None
            if left > 0 and cause in FAILOVER_CAUSES:
                target = self.router.next_site(config, tried)
            if call.trace is not None and "prefill_sent" in call.trace.marks:
                call.trace.attempt_failed(cause)
            if target is None:
                return await self._fallback(call, cause, exclude)
            left -= 1
            self.metrics.failover(site, target, cause)
            log.warning(
                "gateway.prefill_failover",
                extra={"from_site": site, "to_site": target, "cause": cause},
            )
            call = dataclasses.replace(
                call,
                decision=dataclasses.replace(call.decision, site=target),
                failover=call.failover or (site, cause),
            )
            if call.trace is not None:
                call.trace.failover = call.failover

    async def _local_legs(self, call: Call, decode: Instance) -> tuple[LegResponse, bytes]:
        """Serve a local request through the local prefill pool: its prefill leg to the
        least-loaded available instance of the pool, the decode leg to ``decode`` (the same two
        legs as remote, at the decode site: no site breaker, no link accounting). The prefill
        leg waits ``prefill_site_timeout_fraction`` of the TTFT budget, as a remote leg that
        can still fail over: the decode engine can always prefill the request itself.

        Raises :class:`Fallback` when the decode engine is to prefill it itself --
        ``local_prefill_unavailable`` (no instance available) or the failed legs' cause --,
        counted in ``pdbridge_gateway_local_prefill_skipped_total`` and the trace's
        ``local_prefill``; never against the fallback budget (the request was local anyway).
        Raises :class:`Rejected` when an engine refused the request itself."""
        settings, config, trace = self.settings, call.config, call.trace
        prefill = self.router.acquire_local_prefill(config)
        if prefill is None:
            self.metrics.local_prefill_skipped(LOCAL_PREFILL_UNAVAILABLE)
            if trace is not None:
                trace.local_prefill = LOCAL_PREFILL_UNAVAILABLE
            raise Fallback(LOCAL_PREFILL_UNAVAILABLE)
        timeout = ttft_budget_s(settings, config) * settings.prefill_site_timeout_fraction
        call = dataclasses.replace(call, prefill_timeout_s=timeout)
        try:
            served = await self._remote_legs(call, decode, prefill)
        except Fallback as skipped:
            self.metrics.local_prefill_skipped(skipped.cause)
            if trace is not None:
                if "prefill_sent" in trace.marks:
                    trace.attempt_failed(skipped.cause)
                trace.local_prefill = skipped.cause
            raise
        self.metrics.local_prefill_served.inc()
        if trace is not None:
            trace.local_prefill = "served"
        return served

    async def _remote_legs(
        self, call: Call, decode: Instance, local_prefill: Instance | None = None
    ) -> tuple[LegResponse, bytes]:
        """Send the prefill and decode legs concurrently to ``call.decision.site`` -- or, with
        ``local_prefill`` (an instance of the local prefill pool the caller reserved), to that
        instance at the decode site, without site breaker, link accounting or site latency;
        return the decode leg and its first bytes, or raise :class:`Fallback`. Both legs are cancelled on
        any exit but success (a leg failed over is abandoned with its transfer id: the next
        attempt gets a fresh one, so KV of this one that still reaches the decode engine
        matches no request there). The prefill leg waits ``call.prefill_timeout_s``.

        Breaker verdict (once per request, for the site and the prefill instance): failure
        when the prefill leg fails or the KV does not reach decode (decode error naming the
        KV, or no first byte in time); success when decode produced its first byte or failed
        for a reason of its own after a good prefill; none when the client went away."""
        kind, body, config, request_id = call.kind, call.body, call.config, call.request_id
        decision = call.decision
        if local_prefill is not None:
            site, prefill = config.decode.name, local_prefill
        else:
            site = decision.site or ""
            acquired = self.router.acquire_prefill(config, site)
            if acquired is None:
                raise Fallback("breaker_open")
            prefill = acquired
        pull = config.kv_mode == "pull"
        decode_url = f"{decode.url}{ROUTES[kind]}"
        trace = call.trace
        transfer_id = ""
        if pull:
            # vLLM's convention: the prefill engine answers with where its KV waits, and the
            # decode leg (sent after that answer) carries it to the decode engine unchanged.
            prefill_kv: dict[str, Any] = dict(PULL_PREFILL_KV)
        else:
            # The decode engine's KV error after kv_timeout_ms makes the gateway fall back.
            transfer_id = uuid.uuid4().hex
            prefill_kv, decode_kv = push_kv_params(
                transfer_id,
                decode.kv_address_for(site),
                config.kv_timeout_ms / 1000,
                call.request_id,
            )
        # Counted against the link now (requests routed meanwhile see it); given back unless
        # the prefill leg went through (a refused or failed leg sent no KV).
        link_entry = (
            None
            if local_prefill is not None
            else self.router.note_remote_tokens(site, decision.incremental_tokens)
        )
        self.router.begin(prefill.url, site)
        started = time.monotonic()
        if trace is not None:
            trace.site, trace.prefill_instance = site, prefill.name
            trace.decode_instance, trace.transfer_id = decode.name, transfer_id or None
            trace.mark("prefill_sent", started)
        prefill_task = asyncio.create_task(
            self.upstream.call(
                f"{prefill.url}{ROUTES[kind]}", leg_body(body, prefill_kv, prefill=True),
                request_id, call.prefill_timeout_s,
            )
        )  # fmt: skip
        decode_task: asyncio.Task[tuple[LegResponse, bytes]] | None = None
        if not pull:
            decode_task = asyncio.create_task(
                self._open_decode(
                    decode_url, leg_body(body, decode_kv, prefill=False), request_id, trace
                )
            )
        prefill_s: float | None = None
        verdict: bool | None = None
        success = False
        at_instance = False
        try:
            done, _ = await asyncio.wait(
                {t for t in (prefill_task, decode_task) if t is not None},
                return_when=asyncio.FIRST_COMPLETED,
            )
            if prefill_task in done:
                prefill_s = time.monotonic() - started
                if trace is not None:
                    trace.mark("prefill_done", started + prefill_s)
                prefill_error = prefill_task.exception()
                if isinstance(prefill_error, LegError) and rejects_request(prefill_error):
                    # The engine refused the request itself (too long, bad parameter): the
                    # client's error, not the site's; local would refuse it too.
                    raise Rejected(prefill_error)
                if prefill_error is not None:
                    verdict = False
                    cause = prefill_cause(prefill_error)
                    at_instance = instance_fault(prefill_error) and cause != KV_PEER_REFUSED
                    if at_instance:
                        assert isinstance(prefill_error, LegError)  # noqa: S101 - implied
                        self.router.leg_failed("prefill", site, prefill.url, prefill_error.cause)
                    log.warning(
                        "gateway.prefill_failed",
                        extra={
                            "site": site,
                            "url": prefill.url,
                            "transfer_id": transfer_id,
                            "cause": cause,
                            "error": str(prefill_error)[:500],
                        },
                    )
                    raise Fallback(cause)
                self.router.leg_ok("prefill", site, prefill.url)
                if trace is not None and not pull:
                    trace.prefill_answer(_kv_params(prefill_task.result()))
            if decode_task is None:
                pulled = pulled_kv_params(json_or_none(prefill_task.result()))
                if trace is not None and pulled is not None:
                    trace.prefill_answer(pulled)
                    trace.transfer_id = str(pulled.get(TRANSFER_ID) or "") or None
                if pulled is None:
                    verdict = False
                    log.warning(
                        "gateway.prefill_without_kv_params",
                        extra={"site": site, "url": prefill.url},
                    )
                    raise Fallback("prefill_error")
                decode_task = asyncio.create_task(
                    self._open_decode(
                        decode_url, leg_body(body, pulled, prefill=False), request_id, trace
                    )
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
                    log.warning(
                        "gateway.kv_timeout",
                        extra={"site": site, "wait_s": wait_s, "transfer_id": transfer_id},
                    )
                    raise Fallback("kv_timeout")
            decode_error = decode_task.exception()
            if isinstance(decode_error, LegError) and rejects_request(decode_error):
                verdict = True if prefill_s is not None else None
                raise Rejected(decode_error)
            if decode_error is not None:
                kv_failure = kv_cause(decode_error)
                verdict = False if kv_failure else (True if prefill_s is not None else None)
                log.warning(
                    "gateway.decode_leg_failed",
                    extra={
                        "url": decode.url,
                        "transfer_id": transfer_id,
                        "error": str(decode_error)[:500],
                    },
                )
                exclude: frozenset[str] = frozenset()
                if instance_fault(decode_error):
                    assert isinstance(decode_error, LegError)  # noqa: S101 - implied
                    self.router.leg_failed(
                        "decode", config.decode.name, decode.url, decode_error.cause
                    )
                    exclude = frozenset({decode.url})
                raise Fallback(kv_failure or "decode_error", exclude)
            self.router.leg_ok("decode", config.decode.name, decode.url)
            verdict = True
            success = True
            # The success line that joins this request to its transfer on both engines' and
            # the KV link's logs (the request id is added by the log formatter); a local one
            # at DEBUG (the hot path's requests; their trace has the same).
            served_as = (
                (logging.DEBUG, "gateway.local_prefill_served")
                if local_prefill is not None
                else (logging.INFO, "gateway.remote_served")
            )
            log.log(
                *served_as,
                extra={
                    "site": site,
                    "prefill": prefill.name,
                    "decode": decode.name,
                    "transfer_id": transfer_id,
                    "prefill_s": None if prefill_s is None else round(prefill_s, 4),
                },
            )
            return decode_task.result()
        finally:
            self.router.end(prefill.url, site)
            if trace is not None and not success:
                trace.mark("attempt_end")
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
                if success and trace is not None and not pull:
                    # The KV reached decode before the prefill engine's answer reached us: let
                    # that answer (milliseconds away) land for the trace's transfer figures,
                    # within first_byte_grace_s, instead of aborting the finished leg.
                    _late_prefill(prefill_task, trace, started, self.settings.first_byte_grace_s)
                else:
                    prefill_task.cancel()
            latency = prefill_s if prefill_s is not None else time.monotonic() - started
            self.router.record_prefill(
                site, prefill, verdict, latency, "remote_leg", instance_fault=at_instance
            )
            if verdict is not None and local_prefill is None:
                # The site score's latency: a success its TTFT, a failure at least the
                # site timeout (the site gave no first token within it).
                site_timeout = min(
                    call.prefill_timeout_s,
                    ttft_budget_s(self.settings, config)
                    * self.settings.prefill_site_timeout_fraction,
                )
                sample = latency if verdict else max(latency, site_timeout)
                self.router.record_latency(site, sample)

    async def _open_decode(
        self, url: str, body: bytes, request_id: str, trace: Trace | None = None
    ) -> tuple[LegResponse, bytes]:
        if trace is not None:
            trace.mark("decode_sent")
        settings = self.settings
        # The first byte's wait is the caller's (the KV deadline plus grace); the body's
        # silences are bounded here.
        response = await self.upstream.open(
            url, body, request_id, settings.request_timeout_s, idle_s=settings.idle_timeout_s
        )
        first = await first_chunk(response)
        if trace is not None:
            trace.mark("decode_first_byte")
        return response, first


def _late_prefill(task: asyncio.Task[bytes], trace: Trace, started: float, grace_s: float) -> None:
    """Record a successful remote request's prefill answer when it lands after the decode
    leg's first byte (push mode: both legs end within milliseconds); cancelled after
    ``grace_s`` if it has not."""
    timer = asyncio.get_running_loop().call_later(grace_s, task.cancel)

    def done(task: asyncio.Task[bytes]) -> None:
        timer.cancel()
        if task.cancelled() or task.exception() is not None:
            return
        trace.mark("prefill_done")
        trace.prefill_answer(_kv_params(task.result()))

    task.add_done_callback(done)


def _kv_params(answer: bytes) -> Any:
    """A prefill answer's ``kv_transfer_params`` (None when the body is not that JSON)."""
    doc = json_or_none(answer)
    return doc.get(KV_TRANSFER_PARAMS) if isinstance(doc, dict) else None

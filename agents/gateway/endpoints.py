"""The gateway's plain endpoints: ``/health``, ``/v1/models``, ``/metrics``,
``/debug/routing`` and ``/debug/traces`` (a bearer token: request ids and client key names
are not for every caller), and the gauges computed on scrape. A mixin of
:class:`agents.gateway.app.Gateway` (which registers them in :func:`~agents.gateway.app.build_app`);
none of them reaches an engine.
"""

from __future__ import annotations

import hmac

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from agents.gateway.access import ClientKeys, admit
from agents.gateway.admission import Admission
from agents.gateway.budget import FallbackBudget
from agents.gateway.decision import site_score
from agents.gateway.metrics import GatewayMetrics
from agents.gateway.state import Router
from agents.gateway.trace import TraceRing

#: Most traces one ``GET /debug/traces`` answers (``?limit=``, default 50).
MAX_TRACES_LISTED = 500


class Endpoints:
    """The plain endpoints over the gateway's state (set by :class:`Gateway`)."""

    router: Router
    metrics: GatewayMetrics
    keys: ClientKeys
    budget: FallbackBudget
    admission: Admission
    traces: TraceRing
    debug_token: str | None

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
        # A drained instance is out by plan, not by fault: it does not degrade the gateway.
        if any(p["healthy"] < p["total"] - p["drained"] for p in pools):
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

    def _trace_refusal(self, request: web.Request) -> web.Response | None:
        """403 without a configured token, 401 without the right one; None: let it through."""
        if not self.debug_token:
            return web.json_response(
                {"detail": "request traces need PDBRIDGE_GATEWAY_DEBUG_TOKEN set on the gateway"},
                status=403,
            )
        sent = request.headers.get("Authorization", "")
        expected = f"Bearer {self.debug_token}"
        if not hmac.compare_digest(sent.encode(), expected.encode()):
            return web.json_response(
                {"detail": "a valid debug token is required (Authorization: Bearer ...)"},
                status=401,
                headers={"WWW-Authenticate": "Bearer"},
            )
        return None

    async def debug_traces(self, request: web.Request) -> web.Response:
        """``GET /debug/traces?limit=N&path=P``: the newest traces first."""
        refused = self._trace_refusal(request)
        if refused is not None:
            return refused
        try:
            limit = int(request.query.get("limit", "50"))
        except ValueError:
            return web.json_response({"detail": "limit: must be an integer"}, status=400)
        if not 1 <= limit <= MAX_TRACES_LISTED:
            return web.json_response(
                {"detail": f"limit: must be within 1..{MAX_TRACES_LISTED}"}, status=400
            )
        path = request.query.get("path") or None
        traces = [t.to_json() for t in self.traces.recent(limit, path)]
        return web.json_response(
            {"size": self.traces.size, "held": self.traces.held, "traces": traces}
        )

    async def debug_trace(self, request: web.Request) -> web.Response:
        """``GET /debug/traces/{request_id}``: one request's trace (404 once it left the ring)."""
        refused = self._trace_refusal(request)
        if refused is not None:
            return refused
        trace = self.traces.get(request.match_info["request_id"])
        if trace is None:
            return web.json_response(
                {"detail": "no trace of that request id (never seen, or left the ring)"},
                status=404,
            )
        return web.json_response(trace.to_json())

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
            m.site_score.labels(view.name).set(site_score(view) if view.available else 0.0)
            stats = router.stats.get(view.name)
            if stats is not None and stats.latency is not None and stats.latency.value is not None:
                m.site_latency.labels(view.name).set(stats.latency.value)
        ratio = router.ttft.ratio()
        if ratio is not None:
            m.ttft_ratio.set(ratio)
        m.pools(router.pools.values(), router.instance_inflight)

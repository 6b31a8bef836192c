"""Prometheus metrics of the agent and the relay of its children's endpoints.

``GET /metrics`` serves the agent's own registry; ``GET /children/<name>/metrics`` fetches
that child's metrics endpoint and passes the body through, so a scraper needs to reach only
the agent. Served by aiohttp on the agent's loop (``metrics_listen``).
"""

from __future__ import annotations

from collections.abc import Callable

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST


class AgentMetrics:
    """The agent's metric families (one registry per agent, so tests can run several)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.children_up = Gauge(
            "pdbridge_agent_children_up",
            "Children running and healthy, by kind",
            ["kind"],
            registry=self.registry,
        )
        self.children = Gauge(
            "pdbridge_agent_children", "Children by state", ["state"], registry=self.registry
        )
        self.restarts = Counter(
            "pdbridge_agent_child_restarts",
            "Child restarts (crash, health loss or request)",
            ["child"],
            registry=self.registry,
        )
        self.faults_active = Gauge(
            "pdbridge_agent_faults_active",
            "Injected faults not yet restored",
            ["kind"],
            registry=self.registry,
        )
        self.faults_restored = Counter(
            "pdbridge_agent_faults_restored",
            "Faults restored (expiry, clear, shutdown, restart)",
            registry=self.registry,
        )
        self.heartbeat_failures = Counter(
            "pdbridge_agent_heartbeat_failures",
            "Heartbeats the console did not accept",
            registry=self.registry,
        )
        self.requests = Counter(
            "pdbridge_agent_requests",
            "Control API calls by method and status code",
            ["method", "code"],
            registry=self.registry,
        )

    def text(self) -> str:
        return generate_latest(self.registry).decode()


def metrics_app(
    metrics: AgentMetrics,
    refresh: Callable[[], None],
    child_url: Callable[[str], tuple[str, str] | None],
    http: aiohttp.ClientSession,
) -> web.Application:
    """The aiohttp app of ``metrics_listen``; ``refresh`` updates gauges before a scrape;
    ``child_url``: a child's metrics URL and the TLS server name to expect there (empty: the
    URL's host; :attr:`agents.launch.LaunchPlan.tls_server_name`), None without one."""

    async def own(request: web.Request) -> web.Response:
        refresh()
        return web.Response(
            body=generate_latest(metrics.registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )

    async def relay(request: web.Request) -> web.Response:
        name = request.match_info["name"]
        found = child_url(name)
        if found is None:
            return web.json_response(
                {"detail": f"no child {name!r} with a metrics endpoint"}, status=404
            )
        url, server_name = found
        try:
            async with http.get(
                url, timeout=aiohttp.ClientTimeout(total=5), server_hostname=server_name or None
            ) as upstream:
                body = await upstream.read()
                return web.Response(
                    body=body,
                    status=upstream.status,
                    headers={"Content-Type": upstream.headers.get("Content-Type", "text/plain")},
                )
        except (aiohttp.ClientError, TimeoutError) as exc:
            return web.json_response(
                {"detail": f"child {name!r} metrics unreachable: {exc!r}"}, status=502
            )

    app = web.Application()
    app.router.add_get("/metrics", own)
    app.router.add_get("/children/{name}/metrics", relay)
    return app

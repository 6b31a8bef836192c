"""Gateway telemetry collection against a real HTTP gateway metrics page (rendered by the
gateway's own metrics registry, served on loopback) and Postgres: rates and quantiles of the
traffic between two scrapes, link utilisation, the overview's path mix, the readiness item
"monitoring receiving data", and an unreachable gateway."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from aiohttp import web
from django.utils import timezone
from prometheus_client import generate_latest

from agents.gateway.metrics import GatewayMetrics
from console.deployments.readiness import readiness
from console.telemetry import names
from console.telemetry.models import MetricSample
from orchestrator import telemetryops
from tests.agents.conftest import free_port
from tests.console.conftest import world  # noqa: F401 - fixture (params below: noqa F811)
from tests.console.pages.conftest import client_as  # noqa: F401 - fixture

pytestmark = pytest.mark.django_db


class GatewayPage:
    """An aiohttp server on loopback answering ``/metrics`` from a GatewayMetrics registry."""

    def __init__(self, metrics: GatewayMetrics, port: int) -> None:
        self.metrics, self.port = metrics, port
        self.loop = asyncio.new_event_loop()
        self.runner: web.AppRunner | None = None
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    async def _metrics(self, _request: web.Request) -> web.Response:
        return web.Response(body=generate_latest(self.metrics.registry), content_type="text/plain")

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()

    def start(self) -> None:
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)

    def stop(self) -> None:
        if self.runner is None:
            return
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.runner = None
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


@pytest.fixture
def gateway(
    world: Any,  # noqa: F811
    settings: Any,
) -> Iterator[tuple[GatewayMetrics, GatewayPage]]:
    settings.PDBRIDGE_CONTROLLER_INSECURE = True  # plain HTTP on loopback
    port = free_port()
    # The controller reaches a node's gateway by the node's hostname.
    world.decode_node.hostname = "localhost"
    world.decode_node.save()
    world.model.engine_settings = {"model": "tiny=qwen3-next", "gateway_port": port}
    world.model.save()
    world.deployment.state = "active"
    world.deployment.save()
    metrics = GatewayMetrics()
    server = GatewayPage(metrics, port)
    server.start()
    yield metrics, server
    server.stop()


def _serve(metrics: GatewayMetrics, path: str, n: int, ttft_s: float, outcome: str = "ok") -> None:
    for _ in range(n):
        metrics.requests.labels(path, outcome).inc()
        metrics.ttft.labels(path).observe(ttft_s)
        metrics.tpot.labels(path).observe(ttft_s / 2)


def _latest(w: Any, name: str, path: str | None = None) -> float:
    rows = MetricSample.objects.filter(subject_id=str(w.deployment.pk), name=name)
    if path is not None:
        rows = rows.filter(labels__path=path)
    return rows.order_by("-at", "-id").values_list("value", flat=True)[0]


def test_rates_and_quantiles_are_those_of_the_traffic_between_two_scrapes(
    world: Any,  # noqa: F811
    gateway: tuple[GatewayMetrics, GatewayPage],
    client_as: Any,  # noqa: F811
) -> None:
    metrics, _ = gateway
    _serve(metrics, "remote", 500, 5.0)  # before the first scrape: not in any window
    metrics.share.set(1.0)
    metrics.site_utilization.labels("remote").set(0.35)
    metrics.threshold.set(512)
    t0 = timezone.now() - timedelta(seconds=10)
    # The scrape itself, the two gauges (share, threshold) and the link's utilisation.
    assert telemetryops.collect_deployment(world.deployment, now=t0) == 4

    _serve(metrics, "remote", 30, 0.04)
    _serve(metrics, "local", 10, 0.01)
    _serve(metrics, "fallback", 2, 0.3, outcome="error")
    written = telemetryops.collect_deployment(world.deployment, now=t0 + timedelta(seconds=10))

    assert written > 3
    assert _latest(world, names.REQUESTS, "remote") == pytest.approx(3.0)
    assert _latest(world, names.REQUESTS, "local") == pytest.approx(1.0)
    assert _latest(world, names.REQUESTS, "fallback") == pytest.approx(0.2)
    assert _latest(world, names.SUCCESS) == pytest.approx(40 / 42)
    assert 0.025 < _latest(world, names.TTFT_P50, "remote") <= 0.05
    assert 0.01 < _latest(world, names.TPOT, "remote") <= 0.02  # observed 0.02 each
    assert _latest(world, names.EFFECTIVE_THRESHOLD) == 512
    assert _latest(world, names.REMOTE_SHARE) == 1.0
    link_util = MetricSample.objects.filter(
        subject_id=str(world.link.pk), name=names.LINK_UTILIZATION
    ).values_list("value", flat=True)
    assert list(link_util) == [0.35, 0.35]  # one per scrape

    # The overview shows the path mix and the link's utilisation; monitoring is receiving data.
    html = client_as("viewer").get("/").content.decode()
    assert "remote 71 % · local 24 % · fallback 5 %" in html
    # Traffic pauses: the next window's rates are zero, the hour's mix stays on the overview.
    telemetryops.collect_deployment(world.deployment, now=t0 + timedelta(seconds=20))
    assert _latest(world, names.REQUESTS, "remote") == 0.0
    html = client_as("viewer").get("/").content.decode()
    assert "remote 71 % · local 24 % · fallback 5 %" in html
    pools = list(world.deployment.pools.select_related("site").prefetch_related("nodes"))
    monitoring = {i.key: i for i in readiness(world.deployment, pools)}["monitoring"]
    assert monitoring.state == "pass"


def test_a_gateway_that_does_not_answer_writes_nothing(
    world: Any,  # noqa: F811
    gateway: tuple[GatewayMetrics, GatewayPage],
) -> None:
    _, server = gateway
    server.stop()

    assert telemetryops.collect() == {str(world.deployment.pk): 0}
    assert not MetricSample.objects.filter(subject_id=str(world.deployment.pk)).exists()

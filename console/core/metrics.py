"""Prometheus metrics of the console itself: request counts and latency by view (a
middleware), and workflow runs by state / nodes by status (read from the database at scrape
time, so they are right after a restart and across several console processes).

``GET /metrics`` serves them in the text format, without login, like every Prometheus
target: they carry counts only, never names or data. Put the console behind the proxy's
allowlist if even counts are sensitive."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

from django.http import HttpRequest, HttpResponse
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

REGISTRY = CollectorRegistry(auto_describe=True)

REQUESTS = Counter(
    "pdbridge_console_requests_total",
    "HTTP requests served by the console, by view name, method and status code.",
    ["view", "method", "status"],
    registry=REGISTRY,
)
LATENCY = Histogram(
    "pdbridge_console_request_seconds",
    "Time to serve a console request, by view name.",
    ["view"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
    registry=REGISTRY,
)


class StateCollector(Collector):
    """Runs by state and nodes by status, counted in the database at each scrape."""

    def describe(self) -> list[GaugeMetricFamily]:
        # Registration must not query the database (it happens at import time).
        return []

    @staticmethod
    def _by_field(
        name: str, doc: str, queryset: Any, field: str, values: list[str]
    ) -> GaugeMetricFamily:
        """One gauge per value of ``field`` (zero for values with no rows), one query."""
        from django.db.models import Count

        family = GaugeMetricFamily(name, doc, labels=[field])
        counted = dict(queryset.order_by().values_list(field).annotate(n=Count("id")))
        for value in values:
            family.add_metric([value], counted.get(value, 0))
        return family

    def collect(self) -> Iterator[GaugeMetricFamily]:
        from console.inventory.choices import NodeStatus
        from console.inventory.models import Node
        from console.runs.choices import RunState
        from console.runs.models import WorkflowRun

        yield self._by_field(
            "pdbridge_console_runs",
            "Workflow runs by state.",
            WorkflowRun.objects.all(),
            "state",
            list(RunState.values),
        )
        yield self._by_field(
            "pdbridge_console_nodes",
            "Registered nodes by heartbeat status.",
            Node.objects.all(),
            "status",
            list(NodeStatus.values),
        )


REGISTRY.register(StateCollector())


class MetricsMiddleware:
    """Counts every request by the resolved view's name (``unresolved`` for 404s before
    routing), so cardinality stays bounded by the URL map."""

    def __init__(self, get_response: Callable[[HttpRequest], HttpResponse]) -> None:
        self.get_response = get_response

    def __call__(self, request: HttpRequest) -> HttpResponse:
        started = time.perf_counter()
        response = self.get_response(request)
        match = getattr(request, "resolver_match", None)
        view = (match.view_name or "unnamed") if match is not None else "unresolved"
        method = request.method if request.method in _METHODS else "other"
        REQUESTS.labels(view=view, method=method, status=str(response.status_code)).inc()
        LATENCY.labels(view=view).observe(time.perf_counter() - started)
        return response


_METHODS = {"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"}


def metrics_view(request: HttpRequest) -> HttpResponse:
    """The Prometheus scrape endpoint."""
    return HttpResponse(generate_latest(REGISTRY), content_type=CONTENT_TYPE_LATEST)

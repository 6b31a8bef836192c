"""Canary gate arithmetic on real gateway metric pages (rendered by the gateway's own
metrics registry): windows between two scrapes, histogram quantiles, gate verdicts."""

from __future__ import annotations

import math

import pytest
from prometheus_client import generate_latest

from agents.gateway.metrics import GatewayMetrics
from orchestrator.workflows import gateway_metrics as gm
from orchestrator.workflows.canary import evaluate_gates, figures

GATES = {
    "ttft_p50_ratio": 1.5,
    "ttft_p99_ratio": 3.0,
    "success_rate_min": 0.9,
    "link_utilization_max": 0.7,
}


def page(metrics: GatewayMetrics) -> dict:
    return gm.parse(generate_latest(metrics.registry).decode())


def serve(metrics: GatewayMetrics, path: str, ttft_s: float, n: int, outcome: str = "ok") -> None:
    for _ in range(n):
        metrics.requests.labels(path, outcome).inc()
        metrics.ttft.labels(path).observe(ttft_s)


def test_quantile_interpolates_inside_the_bucket():
    buckets = {"0.1": 0.0, "0.25": 10.0, "0.5": 20.0, str(math.inf): 20.0}

    assert gm.quantile(buckets, 0.5) == pytest.approx(0.25)
    assert gm.quantile(buckets, 0.75) == pytest.approx(0.375)
    assert gm.quantile({}, 0.5) is None


def test_window_counts_only_traffic_after_the_start():
    metrics = GatewayMetrics()
    serve(metrics, "remote", 2.0, 50)
    start = {"gw": page(metrics)}
    serve(metrics, "remote", 0.04, 10)
    serve(metrics, "local", 0.04, 10)

    fig = figures(start, {"gw": page(metrics)})

    assert fig["remote_requests"] == 10
    assert fig["local_requests"] == 10
    assert fig["success_rate"] == 1.0
    assert 0.025 < fig["ttft_p50_remote_s"] <= 0.05
    assert fig["local_baseline"] == "step"
    assert all(g["passed"] for g in evaluate_gates(fig, GATES))


def test_slow_remote_path_fails_the_ttft_gate():
    metrics = GatewayMetrics()
    start = {"gw": page(metrics)}
    serve(metrics, "local", 0.04, 20)
    serve(metrics, "remote", 1.8, 20)

    gates = evaluate_gates(figures(start, {"gw": page(metrics)}), GATES)

    assert [g["gate"] for g in gates if not g["passed"]] == ["ttft_p50_ratio", "ttft_p99_ratio"]


def test_fallbacks_count_against_the_success_rate():
    metrics = GatewayMetrics()
    start = {"gw": page(metrics)}
    serve(metrics, "remote", 0.04, 8)
    serve(metrics, "fallback", 0.04, 2)

    fig = figures(start, {"gw": page(metrics)})
    gates = {g["gate"]: g for g in evaluate_gates(fig, GATES)}

    assert fig["success_rate"] == 0.8
    assert gates["success_rate"]["passed"] is False


def test_link_utilization_gate_and_unreachable_gateways():
    metrics = GatewayMetrics()
    metrics.site_utilization.labels("remote").set(0.9)
    start = {"gw": page(metrics), "gw2": {"error": "ClientConnectorError"}}
    serve(metrics, "remote", 0.04, 5)

    fig = figures(start, {"gw": page(metrics), "gw2": {"error": "ClientConnectorError"}})
    gates = {g["gate"]: g for g in evaluate_gates(fig, GATES)}

    assert fig["gateways_unreachable"] == ["gw2"]
    assert gates["link_utilization"] == {
        "gate": "link_utilization",
        "value": 0.9,
        "limit": 0.7,
        "passed": False,
    }

"""The alert rules pdbridge ships, as data. The same definitions become the database rows
(migration ``0002_default_rules``, ``alert_rules_sync_defaults``) and the Prometheus alerting
rules in ``deploy/prometheus/alerts.yaml`` (``manage.py alerts_export``), so the console and
Alertmanager sites alert on the same conditions.

Metric names follow Prometheus conventions (the names the console pages chart and the
recorders write: heartbeats, probes, the gateway scrape); the subject is what the sample is
about (``telemetry.MetricSample.subject_type``). Thresholds are starting points an operator
tunes per site (in the console; the exported file is regenerated from these defaults).
Pure data: no Django imports.
"""

from __future__ import annotations

from typing import Any

NODE = "inventory.node"
LINK = "inventory.link"
DEPLOYMENT = "deployments.deployment"

DEFAULT_RULES: list[dict[str, Any]] = [
    # resource
    {
        "name": "accelerator-saturated",
        "layer": "resource",
        "level": "warning",
        "metric": "node_accelerator_utilization_ratio",
        "subject_type": NODE,
        "aggregate": "avg",
        "comparison": "gt",
        "threshold": 0.95,
        "window_s": 600,
        "summary": "Accelerators above 95 % busy for 10 minutes: queueing and TTFT will grow.",
    },
    {
        "name": "accelerator-memory-full",
        "layer": "resource",
        "level": "critical",
        "metric": "node_accelerator_memory_used_ratio",
        "subject_type": NODE,
        "aggregate": "max",
        "comparison": "gt",
        "threshold": 0.97,
        "window_s": 300,
        "summary": "Accelerator memory above 97 %: KV cache evictions and OOM restarts ahead.",
    },
    # link
    {
        "name": "link-utilization-high",
        "layer": "link",
        "level": "warning",
        "metric": "link_utilization_ratio",
        "subject_type": LINK,
        "aggregate": "avg",
        "comparison": "gt",
        "threshold": 0.7,
        "window_s": 300,
        "summary": "WAN link above its 70 % ceiling: the gateway is sending more prefill local.",
    },
    {
        "name": "link-retransmits",
        "layer": "link",
        "level": "warning",
        "metric": "link_retransmits_per_second",
        "subject_type": LINK,
        "aggregate": "avg",
        "comparison": "gt",
        "threshold": 1.0,
        "window_s": 300,
        "summary": "KV chunks re-sent more than once a second: loss or corruption on the path.",
    },
    {
        "name": "link-rtt-high",
        "layer": "link",
        "level": "warning",
        "metric": "link_rtt_ms",
        "subject_type": LINK,
        "aggregate": "avg",
        "comparison": "gt",
        "threshold": 100.0,
        "window_s": 300,
        "summary": "WAN round trip above 100 ms: remote TTFT grows by the difference.",
    },
    {
        "name": "link-rate-low",
        "layer": "link",
        "level": "critical",
        # A ratio, not Mbit/s: one threshold holds for a 1 Gbit/s and a 100 Gbit/s link.
        "metric": "link_measured_ratio",
        "subject_type": LINK,
        "aggregate": "last",
        "comparison": "lt",
        "threshold": 0.5,
        "window_s": 900,
        "summary": "Measured WAN rate under half the provisioned rate: long prompts may not "
        "ship their KV in time.",
    },
    # service
    {
        "name": "engines-missing",
        "layer": "service",
        "level": "critical",
        # Recorded by the reconcile loop every 10 s: children the deployment needs that its
        # nodes do not report (an agent restart, a node down); it relaunches what it can.
        "metric": "deployment_engines_missing",
        "subject_type": DEPLOYMENT,
        "aggregate": "max",
        "comparison": "gt",
        "threshold": 0.0,
        "window_s": 60,
        "summary": "Engines the deployment needs are not running on their nodes (agent "
        "restarted, node down): traffic falls back or a site serves short.",
    },
    {
        "name": "ttft-p99-high",
        "layer": "service",
        "level": "warning",
        "metric": "gateway_ttft_p99_seconds",
        "subject_type": DEPLOYMENT,
        "aggregate": "avg",
        "comparison": "gt",
        "threshold": 5.0,
        "window_s": 300,
        "summary": "TTFT p99 above 5 s for 5 minutes.",
    },
    {
        "name": "ttft-p99-critical",
        "layer": "service",
        "level": "critical",
        "metric": "gateway_ttft_p99_seconds",
        "subject_type": DEPLOYMENT,
        "aggregate": "avg",
        "comparison": "gt",
        "threshold": 15.0,
        "window_s": 300,
        "summary": "TTFT p99 above 15 s for 5 minutes: consider the kill switch.",
    },
    {
        "name": "success-rate-low",
        "layer": "service",
        "level": "critical",
        "metric": "gateway_success_ratio",
        "subject_type": DEPLOYMENT,
        "aggregate": "avg",
        "comparison": "lt",
        "threshold": 0.99,
        "window_s": 300,
        "summary": "Fewer than 99 % of requests succeed.",
    },
    {
        "name": "queue-long",
        "layer": "service",
        "level": "warning",
        "metric": "engine_queue_length",
        "subject_type": NODE,
        "aggregate": "avg",
        "comparison": "gt",
        "threshold": 64.0,
        "window_s": 300,
        "summary": "More than 64 requests waiting on an engine for 5 minutes.",
    },
    # business
    {
        "name": "traffic-stopped",
        "layer": "business",
        "level": "info",
        "metric": "gateway_requests_per_second",
        "subject_type": DEPLOYMENT,
        "aggregate": "avg",
        "comparison": "lt",
        "threshold": 0.01,
        "window_s": 900,
        "summary": "No traffic for 15 minutes (quiet hours, or clients cannot reach the gateway).",
    },
    {
        "name": "throughput-low",
        "layer": "business",
        "level": "info",
        "metric": "gateway_output_tokens_per_second",
        "subject_type": DEPLOYMENT,
        "aggregate": "avg",
        "comparison": "lt",
        "threshold": 1.0,
        "window_s": 900,
        "summary": "Output tokens below 1/s for 15 minutes.",
    },
]

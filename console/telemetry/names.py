"""The metric names console pages chart, in one place. Whoever records samples (heartbeats,
probes, the gateway's scrape, workflows) uses these names so the pages find them; they follow
Prometheus conventions and base units. ``path`` labels are ``remote`` / ``local`` / ``fallback``."""

from __future__ import annotations

# inventory.node (recorded by every heartbeat)
NODE_CLOCK_SKEW_MS = "node_clock_skew_ms"
NODE_CHILDREN_HEALTHY = "node_children_healthy"
NODE_CHILDREN_TOTAL = "node_children_total"

# deployments.deployment (the reconcile loop, orchestrator.reconcile): children it needs that
# its nodes do not report (absent, or the node not online)
DEPLOYMENT_ENGINES_MISSING = "deployment_engines_missing"

# inventory.link (bandwidth probes, the kv-link's own counters)
LINK_MEASURED_MBIT_S = "link_measured_mbit_s"
LINK_RTT_MS = "link_rtt_ms"
#: measured / provisioned rate (the link alert compares this, so it holds for any link size)
LINK_RATE_RATIO = "link_measured_ratio"
LINK_UTILIZATION = "link_utilization_ratio"
#: TCP segments retransmitted / sent at the probing node while the probe ran (its loss)
LINK_RETRANSMIT_RATIO = "link_tcp_retransmit_ratio"

# deployments.deployment (the gateway's metrics, scraped)
TTFT_P50 = "gateway_ttft_p50_seconds"
TTFT_P99 = "gateway_ttft_p99_seconds"
TPOT = "gateway_tpot_seconds"
REQUESTS = "gateway_requests_per_second"  # labelled by path: the path mix
SUCCESS = "gateway_success_ratio"
EFFECTIVE_THRESHOLD = "gateway_effective_threshold_tokens"
REMOTE_SHARE = "gateway_remote_share_ratio"

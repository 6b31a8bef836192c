"""Prometheus metrics of the gateway (``pdbridge_gateway_`` prefix, base units).

One :class:`GatewayMetrics` per gateway process, on its own registry (served at ``/metrics``).
Labelled children used on the hot path are cached in dicts so that a request costs a few
dictionary lookups and increments, not label resolution.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from agents.gateway.decision import REASONS
from pdproto.causes import FAILOVER_CAUSES, FALLBACK_CAUSES
from pdproto.http import ATTEMPTS, PATHS

if TYPE_CHECKING:
    from agents.gateway.health import InstanceHealth, PoolHealth

OUTCOMES = ("ok", "client_error", "upstream_error", "rejected", "canceled")

#: A local request the decode engine prefilled itself because the local prefill pool had no
#: instance available (docs/gateway.md, "The local prefill pool").
LOCAL_PREFILL_UNAVAILABLE = "local_prefill_unavailable"
#: Why a local request was not served through the local prefill pool: no instance, or the
#: cause of its failed legs (a failed leg's cause outside these counts as ``prefill_error``).
LOCAL_PREFILL_SKIPS = (
    LOCAL_PREFILL_UNAVAILABLE,
    "prefill_error",
    "prefill_timeout",
    "kv_transfer",
    "kv_import_refused",
    "kv_peer_refused",
    "kv_unreachable",
    "kv_timeout",
    "decode_error",
)

_LATENCY_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
)  # fmt: skip
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0)


class GatewayMetrics:
    """The gateway's metric families and cached children."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "pdbridge_gateway_requests", "Requests answered, by path and outcome.",
            ["path", "outcome"], registry=r,
        )  # fmt: skip
        self.decisions = Counter(
            "pdbridge_gateway_decisions", "Routing decisions, by path and reason.",
            ["path", "reason"], registry=r,
        )  # fmt: skip
        self.fallbacks = Counter(
            "pdbridge_gateway_fallbacks", "Requests served by local prefill instead of the "
            "remote path, by cause.", ["cause"], registry=r,
        )  # fmt: skip
        self.budget_rejections = Counter(
            "pdbridge_gateway_fallback_budget_rejections",
            "Requests refused with 503 because the fallback budget was spent.",
            registry=r,
        )
        self.ttft = Histogram(
            "pdbridge_gateway_time_to_first_token_seconds",
            "Arrival to the first response byte sent to the client.", ["path"],
            buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.tpot = Histogram(
            "pdbridge_gateway_time_per_output_token_seconds",
            "Mean gap between streamed events of one request.", ["path"],
            buckets=_TPOT_BUCKETS, registry=r,
        )  # fmt: skip
        self.e2e = Histogram(
            "pdbridge_gateway_request_duration_seconds", "Arrival to the last byte sent.",
            ["path"], buckets=_LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.inflight = Gauge(
            "pdbridge_gateway_requests_in_flight", "Requests being served.", ["path"], registry=r
        )
        self.breaker_state = Gauge(
            "pdbridge_gateway_breaker_state", "Breaker state: 0 closed, 1 half-open, 2 open.",
            ["scope", "name"], registry=r,
        )  # fmt: skip
        self.breaker_ejections = Gauge(
            "pdbridge_gateway_breaker_ejections", "Times a breaker has opened since start.",
            ["scope", "name"], registry=r,
        )  # fmt: skip
        self.threshold = Gauge(
            "pdbridge_gateway_effective_threshold_tokens",
            "Incremental prompt length from which requests go remote, after re-tuning.",
            registry=r,
        )
        self.threshold_changes = Counter(
            "pdbridge_gateway_threshold_changes", "Re-tuning steps of the threshold.",
            ["direction"], registry=r,
        )  # fmt: skip
        self.share = Gauge(
            "pdbridge_gateway_remote_share_ratio", "Configured remote (canary) share, 0-1.",
            registry=r,
        )  # fmt: skip
        self.kill_switch = Gauge(
            "pdbridge_gateway_kill_switch", "1 when the kill switch sends everything local.",
            registry=r,
        )  # fmt: skip
        self.config_version = Gauge(
            "pdbridge_gateway_config_version", "Version of the applied config snapshot.",
            registry=r,
        )  # fmt: skip
        self.config_polls = Counter(
            "pdbridge_gateway_config_polls", "Config polls by result.", ["result"], registry=r
        )
        self.site_queue = Gauge(
            "pdbridge_gateway_site_queue_depth", "Requests queued at a remote site.", ["site"],
            registry=r,
        )  # fmt: skip
        self.site_utilization = Gauge(
            "pdbridge_gateway_site_link_utilization_ratio",
            "Estimated fraction of the site's link bandwidth in use.", ["site"], registry=r,
        )  # fmt: skip
        self.client_requests = Counter(
            "pdbridge_gateway_client_requests", "Requests admitted, by client key name "
            "('anonymous': keys optional and none valid sent).", ["key"], registry=r,
        )  # fmt: skip
        self.client_key_refusals = Counter(
            "pdbridge_gateway_client_key_refusals", "Requests refused with 401, by reason "
            "(missing: no key sent; invalid: not a key the gateway knows).", ["reason"],
            registry=r,
        )  # fmt: skip
        self.instance_available = Gauge(
            "pdbridge_gateway_instance_available", "1 when the instance takes traffic "
            "(healthy by its probes and not ejected), else 0.", ["role", "site", "instance"],
            registry=r,
        )  # fmt: skip
        self.instance_drained = Gauge(
            "pdbridge_gateway_instance_drained", "1 when the applied config drains the "
            "instance (no new legs go to it), else 0.", ["role", "site", "instance"],
            registry=r,
        )  # fmt: skip
        self.instance_in_flight = Gauge(
            "pdbridge_gateway_instance_in_flight", "Legs in flight to the instance.",
            ["role", "site", "instance"], registry=r,
        )  # fmt: skip
        self.instance_ejections = Counter(
            "pdbridge_gateway_instance_ejections", "Times outlier detection ejected the "
            "instance, by the cause of its last failed leg.",
            ["role", "site", "instance", "cause"], registry=r,
        )  # fmt: skip
        self.instance_failures = Counter(
            "pdbridge_gateway_instance_leg_failures", "Legs that failed at the instance, by "
            "cause (connect, timeout, stream_error, status: a 5xx).",
            ["role", "site", "instance", "cause"], registry=r,
        )  # fmt: skip
        self.health_probes = Counter(
            "pdbridge_gateway_health_probes", "Active GET /health probes of the instance, by "
            "result (ok, failed).", ["role", "site", "instance", "result"], registry=r,
        )  # fmt: skip
        self.pool_available = Gauge(
            "pdbridge_gateway_pool_available_instances", "Instances of the pool taking "
            "traffic.", ["role", "site"], registry=r,
        )  # fmt: skip
        self.retries = Counter(
            "pdbridge_gateway_retries", "Legs sent again to another instance after failing "
            "before any byte reached the client, by pool role and the failure's cause.",
            ["role", "cause"], registry=r,
        )  # fmt: skip
        self.admission_rejections = Counter(
            "pdbridge_gateway_admission_rejections", "Requests refused with 429 by admission "
            "control, by reason (queue_full: the in-flight limit and the queue were full; "
            "queue_timeout: queued past admission_queue_timeout_s; client_limit: one client "
            "address at max_in_flight_per_client).", ["reason"], registry=r,
        )  # fmt: skip
        self.admission_in_flight = Gauge(
            "pdbridge_gateway_admission_in_flight", "Completions requests admitted and not "
            "ended.", registry=r,
        )  # fmt: skip
        self.failovers = Counter(
            "pdbridge_gateway_prefill_failovers", "Remote requests sent on to another prefill "
            "site after their site's prefill leg failed before any KV reached decode, by the "
            "site failed over from and to and the cause.", ["from_site", "to_site", "cause"],
            registry=r,
        )  # fmt: skip
        self.served = Counter(
            "pdbridge_gateway_remote_served", "Remote requests whose decode leg got its KV "
            "from the site, by attempt (first: the site chosen; failover: the site failed "
            "over to).", ["site", "attempt"], registry=r,
        )  # fmt: skip
        self.site_latency = Gauge(
            "pdbridge_gateway_site_prefill_latency_seconds", "EWMA of the site's prefill "
            "legs' TTFT (a failed leg counts as its site timeout).", ["site"], registry=r,
        )  # fmt: skip
        self.site_score = Gauge(
            "pdbridge_gateway_site_score", "The site's routing score now (highest wins; 0: "
            "unavailable or saturated).", ["site"], registry=r,
        )  # fmt: skip
        self.ttft_ratio = Gauge(
            "pdbridge_gateway_remote_local_ttft_ratio", "Remote / local TTFT per 1,000 "
            "prompt tokens of streamed requests near the threshold (the re-tuner's input; "
            "absent until both are measured).", registry=r,
        )  # fmt: skip
        self.local_prefill_served = Counter(
            "pdbridge_gateway_local_prefill_served", "Local requests whose decode leg got its "
            "KV from an instance of the local prefill pool.", registry=r,
        )  # fmt: skip
        self.local_prefill_skips = Counter(
            "pdbridge_gateway_local_prefill_skipped", "Local requests the decode engine "
            "prefilled itself although the deployment has a local prefill pool, by cause "
            "(local_prefill_unavailable: no instance available; else the failed legs' cause).",
            ["cause"], registry=r,
        )  # fmt: skip
        self.admission_queued = Gauge(
            "pdbridge_gateway_admission_queued", "Requests waiting for admission.", registry=r
        )
        self._client_requests: dict[str, Any] = {}
        self._refusals = {c: self.client_key_refusals.labels(c) for c in ("missing", "invalid")}
        self._requests = {(p, o): self.requests.labels(p, o) for p in PATHS for o in OUTCOMES}
        self._decisions = {
            (p, reason): self.decisions.labels(p, reason)
            for p in ("remote", "local")
            for reason in REASONS
        }
        self._fallbacks = {c: self.fallbacks.labels(c) for c in FALLBACK_CAUSES}
        self._ttft = {p: self.ttft.labels(p) for p in PATHS}
        self._tpot = {p: self.tpot.labels(p) for p in PATHS}
        self._e2e = {p: self.e2e.labels(p) for p in PATHS}
        self._inflight = {p: self.inflight.labels(p) for p in PATHS}
        self._failovers: dict[tuple[str, str, str], Any] = {}
        self._local_skips = {c: self.local_prefill_skips.labels(c) for c in LOCAL_PREFILL_SKIPS}
        self._served: dict[tuple[str, str], Any] = {}

    def failover(self, from_site: str, to_site: str, cause: str) -> None:
        """A remote request failed at ``from_site`` (``cause``, one of FAILOVER_CAUSES) and
        was sent on to ``to_site``."""
        key = (from_site, to_site, cause if cause in FAILOVER_CAUSES else "prefill_error")
        child = self._failovers.get(key)
        if child is None:
            child = self._failovers[key] = self.failovers.labels(*key)
        child.inc()

    def local_prefill_skipped(self, cause: str) -> None:
        """A local request is served by the decode engine's own prefill (``cause``)."""
        self._local_skips.get(cause, self._local_skips["prefill_error"]).inc()

    def remote_served(self, site: str, attempt: str) -> None:
        """A remote request got its KV from ``site`` (``attempt``: one of ATTEMPTS)."""
        key = (site, attempt if attempt in ATTEMPTS else "first")
        child = self._served.get(key)
        if child is None:
            child = self._served[key] = self.served.labels(*key)
        child.inc()

    def ejected(self, pool: PoolHealth, inst: InstanceHealth, cause: str) -> None:
        """Outlier detection ejected ``inst`` from ``pool``."""
        self.instance_ejections.labels(pool.role, pool.site, inst.url, cause).inc()

    def leg_failed(self, role: str, site: str, url: str, cause: str) -> None:
        self.instance_failures.labels(role, site, url, cause).inc()

    def probed(self, role: str, site: str, url: str, ok: bool) -> None:
        self.health_probes.labels(role, site, url, "ok" if ok else "failed").inc()

    def retry(self, role: str, cause: str) -> None:
        self.retries.labels(role, cause).inc()

    def pools(self, pools: Iterable[PoolHealth], inflight: Mapping[str, int]) -> None:
        """Per-pool and per-instance gauges (on scrape)."""
        for pool in pools:
            self.pool_available.labels(pool.role, pool.site).set(pool.healthy_count())
            for url in pool.instances:
                labels = (pool.role, pool.site, url)
                self.instance_available.labels(*labels).set(1 if pool.available(url) else 0)
                self.instance_drained.labels(*labels).set(1 if url in pool.drained else 0)
                self.instance_in_flight.labels(*labels).set(inflight.get(url, 0))

    def client_request(self, key: str) -> None:
        """A request admitted under client key ``key`` (a name: bounded by the operators)."""
        child = self._client_requests.get(key)
        if child is None:
            child = self._client_requests[key] = self.client_requests.labels(key)
        child.inc()

    def client_key_refused(self, reason: str) -> None:
        self._refusals[reason].inc()

    def decision(self, path: str, reason: str) -> None:
        self._decisions[(path, reason)].inc()

    def fallback(self, cause: str) -> None:
        self._fallbacks[cause].inc()

    def begin(self, path: str) -> None:
        self._inflight[path].inc()

    def finish(
        self, path: str, outcome: str, ttft_s: float | None, e2e_s: float, tpot_s: float | None
    ) -> None:
        """One request ended (called exactly once per request that got a path)."""
        self._inflight[path].dec()
        self._requests[(path, outcome)].inc()
        if ttft_s is not None:
            self._ttft[path].observe(ttft_s)
        if tpot_s is not None:
            self._tpot[path].observe(tpot_s)
        self._e2e[path].observe(e2e_s)

    def abandon(self, path: str) -> None:
        """A path was begun and given up without an outcome (the remote path fell back)."""
        self._inflight[path].dec()

    def request(self, path: str, outcome: str) -> None:
        """A request answered without upstream (4xx, 503 from the budget)."""
        self._requests[(path, outcome)].inc()

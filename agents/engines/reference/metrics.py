"""Prometheus metrics of the reference engine, named like vLLM's where they mean the same, so
one scraper and one dashboard serve both engines. pdbridge-only series use ``pdbridge:``.

Called by the server's handlers (event loop thread); prometheus_client is thread-safe.
"""

from __future__ import annotations

from prometheus_client import (
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

_LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    40.0,
    80.0,
)


class EngineMetrics:
    """One registry per engine process (label ``model_name``)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        labels = ["model_name"]
        self.running = Gauge(
            "vllm:num_requests_running", "Requests being computed.", labels, registry=r
        )
        self.waiting = Gauge(
            "vllm:num_requests_waiting", "Requests queued for compute.", labels, registry=r
        )
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Time to first token.",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds",
            "Time between output tokens.",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "Request latency.",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.queue = Histogram(
            "vllm:request_queue_time_seconds",
            "Time spent waiting.",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.prefill_time = Histogram(
            "vllm:request_prefill_time_seconds",
            "Prefill (or KV load) time.",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.decode_time = Histogram(
            "vllm:request_decode_time_seconds",
            "Decode time.",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Prompt tokens processed.", labels, registry=r
        )
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Tokens generated.", labels, registry=r
        )
        self.prompt_by_source = Counter(
            "vllm:prompt_tokens_by_source",
            "Prompt tokens by where their KV came from.",
            [*labels, "source"],
            registry=r,
        )
        self.success = Counter(
            "vllm:request_success", "Finished requests.", [*labels, "finished_reason"], registry=r
        )
        self.cancelled = Counter(
            "pdbridge:requests_cancelled", "Requests whose client went away.", labels, registry=r
        )
        self.by_path = Counter(
            "pdbridge:requests_by_path", "Requests by serving path.", [*labels, "path"], registry=r
        )
        self.kv_transfers = Counter(
            "pdbridge:kv_transfers",
            "KV transfers by direction and outcome.",
            [*labels, "direction", "outcome"],
            registry=r,
        )
        self.kv_bytes = Counter(
            "pdbridge:kv_bytes", "KV bytes sent or received.", [*labels, "direction"], registry=r
        )
        # Seconds the compute thread spent on each phase: with the completed prefills / decodes
        # (the histograms' counts) this is what a side of the deployment can sustain -- the
        # rebalancer's producer and consumer capacity (docs/orchestrator.md, "Rebalancing").
        self.busy = Counter(
            "pdbridge:engine_busy_seconds",
            "Compute-thread seconds by phase (prefill: prompt chunks; decode: output tokens).",
            [*labels, "phase"],
            registry=r,
        )

    def add_model(self, name: str) -> None:
        """Create a model's series at zero, so scrapers see them before the first request."""
        for metric in (
            self.running,
            self.waiting,
            self.ttft,
            self.itl,
            self.e2e,
            self.queue,
            self.prefill_time,
            self.decode_time,
            self.prompt_tokens,
            self.generation_tokens,
            self.cancelled,
        ):
            metric.labels(model_name=name)
        for phase in ("prefill", "decode"):
            self.busy.labels(model_name=name, phase=phase)

    def render(self) -> bytes:
        """The engine's families, then the process's KV link (``pdbridge_kv_*`` of its
        senders and its embedded receiver, which share grpc_kv's process-wide metrics:
        transfers, checksum failures, refused peers) and the process collectors."""
        return generate_latest(self.registry) + generate_latest(REGISTRY)

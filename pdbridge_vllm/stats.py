"""The connector's metrics in vLLM's own ``/metrics`` (vLLM aggregates what each worker's
``get_kv_connector_stats`` returns and hands it to ``observe``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

_COUNTS = (
    "transfers",
    "transfers_failed",
    "bytes_raw",
    "bytes_wire",
    "retransmits",
    "resumes",
    "checksum_failures",
    "loads",
    "loads_failed",
)
_SERIES = ("transfer_seconds", "load_wait_seconds")


def _empty() -> dict[str, Any]:
    data: dict[str, Any] = dict.fromkeys(_COUNTS, 0)
    data.update({name: [] for name in _SERIES})
    data["failures"] = {}
    return data


@dataclass
class PdbridgeStats(KVConnectorStats):
    data: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        base = _empty()
        base.update(self.data or {})
        self.data = base

    def reset(self) -> None:
        self.data = _empty()

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        theirs = other.data
        for name in _COUNTS:
            self.data[name] += int(theirs.get(name, 0))
        for name in _SERIES:
            self.data[name] = list(self.data[name]) + list(theirs.get(name, ()))
        failures = dict(self.data["failures"])
        for cause, n in dict(theirs.get("failures", {})).items():
            failures[cause] = failures.get(cause, 0) + int(n)
        self.data["failures"] = failures
        return self

    def reduce(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {name: self.data[name] for name in _COUNTS}
        for name in _SERIES:
            values = self.data[name]
            out[f"avg_{name}"] = round(sum(values) / len(values), 4) if values else 0.0
        return out

    def is_empty(self) -> bool:
        return not any(
            self.data[name] for name in ("transfers", "transfers_failed", "loads", "loads_failed")
        )


class PdbridgePromMetrics(KVConnectorPromMetrics):
    """``vllm:pdbridge_kv_*``: transfers and loads (by outcome), bytes raw and on the wire,
    transfer seconds and load wait seconds (histograms), failures by cause."""

    def __init__(
        self, vllm_config: Any, metric_types: Any, labelnames: Any, per_engine_labelvalues: Any
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        c, h = self._counter_cls, self._histogram_cls
        labels = list(labelnames)
        self.counters = {
            name: self._per_engine(
                c(name=f"vllm:pdbridge_kv_{name}", documentation=doc, labelnames=labels)
            )
            for name, doc in (
                ("transfers", "KV transfers sent and acknowledged (prefill role)."),
                ("transfers_failed", "KV transfers that failed (prefill role)."),
                ("bytes_raw", "Raw KV bytes of acknowledged transfers."),
                ("bytes_wire", "Bytes on the wire of acknowledged transfers (after compression)."),
                ("retransmits", "Chunks sent again (corrupt in flight, lost in a cut)."),
                ("resumes", "Transfers resumed after a reconnect."),
                ("checksum_failures", "Chunks the receiver found damaged (each was re-sent)."),
                ("loads", "KV loads completed into paged blocks (decode role)."),
                ("loads_failed", "KV loads that failed, timed out or were refused (decode role)."),
            )
        }
        buckets = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 15, 30, 60]
        self.histograms = {
            name: self._per_engine(
                h(
                    name=f"vllm:pdbridge_kv_{name}",
                    documentation=doc,
                    labelnames=labels,
                    buckets=buckets,
                )
            )
            for name, doc in (
                ("transfer_seconds", "Seconds from a transfer's open to its acknowledged finish."),
                ("load_wait_seconds", "Seconds a decode request waited for its KV."),
            )
        }
        self.failures = c(
            name="vllm:pdbridge_kv_failures",
            documentation="Failed transfers and loads by cause (kv_timeout, kv_peer_refused, ...).",
            labelnames=[*labels, "cause"],
        )

    def _per_engine(self, metric: Any) -> dict[int, Any]:
        return {idx: metric.labels(*values) for idx, values in self.per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, counter in self.counters.items():
            value = transfer_stats_data.get(name, 0)
            if value:
                counter[engine_idx].inc(value)
        for name, histogram in self.histograms.items():
            for value in transfer_stats_data.get(name, ()):
                histogram[engine_idx].observe(value)
        values = self.per_engine_labelvalues.get(engine_idx, [])
        for cause, n in dict(transfer_stats_data.get("failures", {})).items():
            self.failures.labels(*values, cause).inc(n)

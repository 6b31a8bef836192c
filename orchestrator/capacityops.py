"""What each side of a deployment can sustain, measured from its engines: the producer
(prefill pools, remote and local) and consumer (decode pool) capacities the rebalancer
compares (``console.schedules.rebalance``).

Observed request rates cannot say which side is short -- in steady state every request is
prefilled once and decoded once, so they are equal. What differs is how busy each side was to
serve them. Every engine reports, cumulatively, its completed prefills and decodes (the counts
of ``vllm:request_prefill_time_seconds`` / ``vllm:request_decode_time_seconds``) and the
seconds its compute spent on each phase (``pdbridge:engine_busy_seconds_total{phase}``, the
reference engine's compute thread). An engine's capacity for its pool's phase is completions
per busy second over the window between two scrapes (its lifetime figure when it was idle in
the window; none when it never worked). A side's capacity is the sum over its engines:

* ``prefill_requests_per_second`` (labels ``path``: ``remote`` / ``local`` by whether the pool
  is at the decode site, and ``site``), one sample per prefill pool;
* ``decode_requests_per_second``, the decode pool's.

Called by ``orchestrator.telemetryops.collect_deployment`` on every gateway scrape (the beat's
``GATEWAY_SCRAPE_S``). Blocking: one HTTP GET per engine with a deadline; an engine that does
not answer, or reports no busy time (an engine without the counter, e.g. vLLM's own), is left
out of its side's sum and named in the ``engine_scrape`` sample's labels.
"""

from __future__ import annotations

import logging
from datetime import datetime
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from console.deployments.models import Deployment
from console.schedules.rebalance import CONSUMER_METRIC, PRODUCER_METRIC
from console.telemetry.models import MetricSample
from console.telemetry.services import samples_record_many, subject_key
from orchestrator import agentops
from orchestrator.agentops import Target

log = logging.getLogger("pdbridge.orchestrator.capacity")

#: Name of the sample whose labels hold every engine's cumulative counters of the last scrape.
ENGINE_SCRAPE = "engine_scrape"
SCRAPE_TIMEOUT_S = 5.0

_COUNTS = {
    "vllm:request_prefill_time_seconds_count": "prefill",
    "vllm:request_decode_time_seconds_count": "decode",
}


def parse_engine(text: str) -> dict[str, Any]:
    """``{"done": {phase: completions}, "busy": {phase: seconds}}`` of one engine's page
    (summed over models)."""
    out: dict[str, Any] = {"done": {}, "busy": {}}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            phase = _COUNTS.get(sample.name)
            if phase is not None:
                out["done"][phase] = out["done"].get(phase, 0.0) + float(sample.value)
            elif sample.name == "pdbridge:engine_busy_seconds_total":
                key = sample.labels.get("phase", "")
                out["busy"][key] = out["busy"].get(key, 0.0) + float(sample.value)
    return out


def engine_capacity(before: dict[str, Any] | None, now: dict[str, Any], phase: str) -> float | None:
    """Completions of ``phase`` per busy second between two scrapes of one engine; its lifetime
    figure when it did no work in between (or restarted: a counter went down); None when it
    has no busy time at all."""
    done, busy = now["done"].get(phase, 0.0), now["busy"].get(phase, 0.0)
    if before is not None:
        d_done = done - before["done"].get(phase, 0.0)
        d_busy = busy - before["busy"].get(phase, 0.0)
        if d_busy > 0 and d_done >= 0:
            return d_done / d_busy
    return done / busy if busy > 0 else None


async def _scrape(url: str) -> dict[str, Any]:
    timeout = aiohttp.ClientTimeout(total=SCRAPE_TIMEOUT_S)
    async with (
        aiohttp.ClientSession(timeout=timeout) as session,
        session.get(f"{url}/metrics") as response,
    ):
        response.raise_for_status()
        return parse_engine(await response.text())


def _engines(config: dict[str, Any]) -> list[tuple[str, Target]]:
    """(pool key, target) of every engine: ``prefill:<site>`` and ``decode``."""
    out: list[tuple[str, Target]] = []
    for role in ("prefill", "decode"):
        try:
            found = agentops.targets(config, role)
        except agentops.AgentOpsError:  # a pool without nodes has nothing to measure
            continue
        out += [(f"prefill:{t.site}" if role == "prefill" else "decode", t) for t in found]
    return out


def _previous(deployment: Deployment) -> dict[str, Any]:
    subject_type, subject_id = subject_key(deployment)
    row = (
        MetricSample.objects.filter(
            subject_type=subject_type, subject_id=subject_id, name=ENGINE_SCRAPE
        )
        .order_by("-at", "-id")
        .first()
    )
    return dict(row.labels.get("engines", {})) if row is not None else {}


def collect_capacity(deployment: Deployment, config: dict[str, Any], at: datetime) -> int:
    """Scrape the deployment's engines and record each pool's capacity; returns how many
    samples were written."""
    decode_site = (config["pools"].get("decode") or {}).get("site")
    before = _previous(deployment)
    pages: dict[str, dict[str, Any]] = {}
    missing: dict[str, str] = {}
    by_pool: dict[str, float] = {}
    for pool, target in _engines(config):
        key = f"{target.role}:{target.hostname}"
        try:
            page = agentops.run_async(_scrape(target.engine_url))
        except Exception as exc:  # a down engine is a gap in its side's sum, not a crash
            missing[key] = f"{type(exc).__name__}: {exc}"[:200]
            continue
        pages[key] = page
        value = engine_capacity(before.get(key), page, target.role)
        if value is None:
            missing[key] = "no busy time reported"
            continue
        by_pool[pool] = by_pool.get(pool, 0.0) + value
    if missing:
        log.info(
            "capacity_engines_missing", extra={"deployment": deployment.pk, "missing": missing}
        )
    if not pages:
        return 0
    written = samples_record_many(
        subject=deployment,
        values={ENGINE_SCRAPE: float(len(pages))},
        labels={"engines": pages, "missing": missing},
        at=at,
    )
    for pool, value in by_pool.items():
        if pool == "decode":
            written += samples_record_many(
                subject=deployment, values={CONSUMER_METRIC: value}, at=at
            )
            continue
        site = pool.split(":", 1)[1]
        labels = {"path": "local" if site == decode_site else "remote", "site": site}
        written += samples_record_many(
            subject=deployment, values={PRODUCER_METRIC: value}, labels=labels, at=at
        )
    return written

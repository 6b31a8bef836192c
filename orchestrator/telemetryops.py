"""Turning gateways' Prometheus pages into the console's telemetry samples.

Until this ran, only canary re-checks read gateways, so the overview's path mix, the deployment
charts and the readiness item "monitoring receiving data" stayed empty on a system serving
traffic. The beat task ``orchestrator.telemetry.collect_gateways`` calls :func:`collect` every
``GATEWAY_SCRAPE_S`` seconds.

How: every decode gateway of each deployment that is not draft or retired is scraped (with the
controller's client certificate); the pages are summed; the sum is stored as one
``gateway_scrape`` sample whose labels hold the cumulative counters. The charted rates and
quantiles are the traffic *between* that scrape and the previous one (``gateway_metrics.window``,
which treats a counter that went down as a restart): requests per second by path, TTFT p50 / p99
and median TPOT by path, success ratio, plus the gauges (configured remote share, effective
threshold) and each prefill link's utilisation.
Blocking (one HTTP round trip per gateway, each with a deadline); an unreachable gateway is
logged and left out, never raised.
"""

from __future__ import annotations

import logging
from datetime import datetime
from typing import Any

from django.utils import timezone

from console.deployments.choices import DeploymentState
from console.deployments.config import build_config
from console.deployments.models import Deployment
from console.inventory.models import Link
from console.telemetry import names
from console.telemetry.models import MetricSample
from console.telemetry.services import samples_record_many, subject_key
from orchestrator import agentops, capacityops
from orchestrator.workflows import gateway_metrics as gm

log = logging.getLogger("pdbridge.orchestrator.telemetry")

#: Name of the sample holding the summed cumulative counters of the last scrape.
SCRAPE = "gateway_scrape"
PATHS = ("remote", "local", "fallback")
SCRAPE_TIMEOUT_S = 5.0


def _scrape(deployment: Deployment) -> tuple[dict[str, Any] | None, dict[str, float]]:
    """Summed ``{requests, ttft_buckets}`` of the deployment's gateways (None when none
    answered), the last remote share seen, and link utilisation by prefill site."""
    try:
        targets = agentops.targets(build_config(deployment), "decode")
    except agentops.AgentOpsError:
        return None, {}
    ssl_ctx = agentops.http_ssl_context()
    total: dict[str, Any] = {"requests": {}, "ttft_buckets": {}, "tpot_buckets": {}}
    extra: dict[str, float] = {}
    answered = 0
    for target in targets:
        url = agentops.gateway_url(target)
        try:
            page = agentops.run_async(gm.scrape(url, ssl_ctx, SCRAPE_TIMEOUT_S))
        except Exception as exc:  # a gateway that is down is a gap in the chart, not a crash
            log.warning("gateway_scrape_failed", extra={"url": url, "error": repr(exc)})
            continue
        answered += 1
        for key, value in page["requests"].items():
            total["requests"][key] = total["requests"].get(key, 0.0) + value
        for kind in ("ttft_buckets", "tpot_buckets"):
            for path, buckets in page[kind].items():
                into = total[kind].setdefault(path, {})
                for le, count in buckets.items():
                    into[le] = into.get(le, 0.0) + count
        if page["remote_share"] is not None:
            extra["remote_share"] = page["remote_share"]
        if page["effective_threshold"] is not None:
            extra["effective_threshold"] = page["effective_threshold"]
        for site, ratio in page["link_utilization"].items():
            extra[f"util:{site}"] = max(extra.get(f"util:{site}", 0.0), ratio)
    return (total if answered else None), extra


def _previous(deployment: Deployment) -> MetricSample | None:
    subject_type, subject_id = subject_key(deployment)
    return (
        MetricSample.objects.filter(subject_type=subject_type, subject_id=subject_id, name=SCRAPE)
        .order_by("-at", "-id")
        .first()
    )


def record_window(
    deployment: Deployment,
    now_figures: dict[str, Any],
    previous: dict[str, Any],
    seconds: float,
    at: datetime,
) -> int:
    """Record the rates and quantiles of the traffic between two summed scrapes ``seconds``
    apart; returns how many samples were written."""
    win = gm.window(previous, now_figures)
    written = 0
    all_total = all_ok = 0.0
    for path in PATHS:
        total, ok = gm.requests_on(win, path)
        all_total, all_ok = all_total + total, all_ok + ok
        values = {names.REQUESTS: total / seconds}
        for name, kind, q in (
            (names.TTFT_P50, "ttft_buckets", 0.5),
            (names.TTFT_P99, "ttft_buckets", 0.99),
            (names.TPOT, "tpot_buckets", 0.5),  # the median request's time per output token
        ):
            value = gm.quantile(win[kind].get(path, {}), q)
            if value is not None:
                values[name] = value
        written += samples_record_many(
            subject=deployment, values=values, labels={"path": path}, at=at
        )
    if all_total > 0:
        written += samples_record_many(
            subject=deployment, values={names.SUCCESS: all_ok / all_total}, at=at
        )
    return written


def _capacity(deployment: Deployment, now: datetime) -> int:
    """The engines' capacity samples (:mod:`orchestrator.capacityops`); a deployment whose
    config cannot be built is logged and skipped."""
    try:
        return capacityops.collect_capacity(deployment, build_config(deployment), now)
    except Exception as exc:  # the gateway half must still run
        log.warning(
            "capacity_collect_failed", extra={"deployment": deployment.pk, "error": repr(exc)}
        )
        return 0


def collect_deployment(deployment: Deployment, now: datetime | None = None) -> int:
    """Scrape one deployment's gateways and record its samples; returns how many were written
    (0 when no gateway answered)."""
    now = now or timezone.now()
    written = _capacity(deployment, now)
    figures, extra = _scrape(deployment)
    if figures is None:
        return written
    previous = _previous(deployment)
    written += samples_record_many(
        subject=deployment,
        values={SCRAPE: sum(figures["requests"].values())},
        labels=figures,
        at=now,
    )
    gauges = {
        names.REMOTE_SHARE: extra.get("remote_share"),
        names.EFFECTIVE_THRESHOLD: extra.get("effective_threshold"),
    }
    written += samples_record_many(
        subject=deployment,
        values={k: v for k, v in gauges.items() if v is not None},
        at=now,
    )
    decode_sites = list(deployment.pools.filter(role="decode").values_list("site_id", flat=True))
    for key, ratio in extra.items():
        if key.startswith("util:"):
            link = Link.objects.filter(from_site__name=key[5:], to_site_id__in=decode_sites).first()
            if link is not None:
                written += samples_record_many(
                    subject=link, values={names.LINK_UTILIZATION: ratio}, at=now
                )
    seconds = (now - previous.at).total_seconds() if previous is not None else 0.0
    if previous is not None and seconds > 0:
        written += record_window(deployment, figures, previous.labels, seconds, now)
    return written


def collect() -> dict[str, int]:
    """Every serving deployment: scrape and record. Returns samples written by deployment id."""
    live = Deployment.objects.exclude(state__in=[DeploymentState.DRAFT, DeploymentState.RETIRED])
    return {str(d.pk): collect_deployment(d) for d in live}

"""Reading a gateway's Prometheus page into the figures canary gates compare: requests by path
and outcome, TTFT histograms by path, link utilisation, applied config version and share, and
the legs in flight per instance (what a tidal drain waits for).

Called by the deployment (step 6), canary and tidal workflows. ``scrape`` is a coroutine with a
deadline; it raises ``aiohttp.ClientError`` / ``TimeoutError`` when the gateway is unreachable.
The pure functions (``window``, ``quantile``) work on two scrapes: gates judge the traffic
*between* the start of a canary step and now, never the gateway's whole lifetime.
"""

from __future__ import annotations

import math
from typing import Any

import aiohttp

SUCCESS_OUTCOMES = ("ok",)


def parse(text: str) -> dict[str, Any]:
    """The figures of one Prometheus page (see the module docstring)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, Any] = {
        "requests": {},  # "path/outcome" -> count
        "ttft_buckets": {},  # path -> {le: cumulative count}
        "ttft_count": {},
        "ttft_sum": {},
        "tpot_buckets": {},  # path -> {le: cumulative count}
        "effective_threshold": None,
        "link_utilization": {},  # site -> ratio
        "config_version": None,
        "remote_share": None,
        "kill_switch": None,
        # role -> site -> instance url -> legs in flight (the tidal drain waits for 0)
        "instance_in_flight": {},
        # role -> site -> instance url -> 1 when in the pool and available (a tidal scale-up
        # publishes its share once the new instance is)
        "instance_available": {},
        # The gateway's own signs of a fault (a drill waits for them to move).
        "breaker_ejections": 0.0,
        "fallbacks": {},  # cause -> count
        "failovers_from": {},  # site failed over from -> count
    }
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            name, labels, value = sample.name, sample.labels, float(sample.value)
            if name == "pdbridge_gateway_requests_total":
                key = f"{labels.get('path', '')}/{labels.get('outcome', '')}"
                out["requests"][key] = out["requests"].get(key, 0.0) + value
            elif name == "pdbridge_gateway_time_to_first_token_seconds_bucket":
                le = labels["le"]
                bound = math.inf if le in ("+Inf", "inf") else float(le)
                out["ttft_buckets"].setdefault(labels["path"], {})[str(bound)] = value
            elif name == "pdbridge_gateway_time_per_output_token_seconds_bucket":
                le = labels["le"]
                bound = math.inf if le in ("+Inf", "inf") else float(le)
                out["tpot_buckets"].setdefault(labels["path"], {})[str(bound)] = value
            elif name == "pdbridge_gateway_effective_threshold_tokens":
                out["effective_threshold"] = value
            elif name == "pdbridge_gateway_time_to_first_token_seconds_count":
                out["ttft_count"][labels["path"]] = value
            elif name == "pdbridge_gateway_time_to_first_token_seconds_sum":
                out["ttft_sum"][labels["path"]] = value
            elif name == "pdbridge_gateway_site_link_utilization_ratio":
                out["link_utilization"][labels.get("site", "")] = value
            elif name == "pdbridge_gateway_config_version":
                out["config_version"] = int(value)
            elif name == "pdbridge_gateway_remote_share_ratio":
                out["remote_share"] = value
            elif name == "pdbridge_gateway_kill_switch":
                out["kill_switch"] = value
            elif name in (
                "pdbridge_gateway_instance_in_flight",
                "pdbridge_gateway_instance_available",
            ):
                key = "instance_in_flight" if name.endswith("in_flight") else "instance_available"
                by_site = out[key].setdefault(labels.get("role", ""), {})
                by_site.setdefault(labels.get("site", ""), {})[labels.get("instance", "")] = value
            elif name == "pdbridge_gateway_breaker_ejections":
                out["breaker_ejections"] += value
            elif name == "pdbridge_gateway_fallbacks_total":
                cause = labels.get("cause", "")
                out["fallbacks"][cause] = out["fallbacks"].get(cause, 0.0) + value
            elif name == "pdbridge_gateway_prefill_failovers_total":
                site = labels.get("from_site", "")
                out["failovers_from"][site] = out["failovers_from"].get(site, 0.0) + value
    return out


async def scrape(url: str, ssl_ctx: Any = None, timeout_s: float = 10.0) -> dict[str, Any]:
    """GET ``url``/metrics and parse it."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with (
        aiohttp.ClientSession(timeout=timeout) as session,
        session.get(f"{url}/metrics", ssl=ssl_ctx) as response,
    ):
        response.raise_for_status()
        return parse(await response.text())


def _delta(now: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in now.items()}


def window(start: dict[str, Any], now: dict[str, Any]) -> dict[str, Any]:
    """Traffic between two scrapes of the same gateway (a restarted gateway — counters lower
    than at the start — counts from zero)."""
    if sum(now["requests"].values()) < sum(start["requests"].values()):
        start = parse("")
    requests = _delta(now["requests"], start["requests"])
    buckets = {
        path: _delta(b, start["ttft_buckets"].get(path, {}))
        for path, b in now["ttft_buckets"].items()
    }
    tpot = {
        path: _delta(b, start.get("tpot_buckets", {}).get(path, {}))
        for path, b in now.get("tpot_buckets", {}).items()
    }
    return {"requests": requests, "ttft_buckets": buckets, "tpot_buckets": tpot}


def requests_on(win: dict[str, Any], path: str) -> tuple[float, float]:
    """(all, successful) requests on ``path`` in a window."""
    total = ok = 0.0
    for key, count in win["requests"].items():
        p, _, outcome = key.partition("/")
        if p == path:
            total += count
            if outcome in SUCCESS_OUTCOMES:
                ok += count
    return total, ok


def quantile(buckets: dict[str, float], q: float) -> float | None:
    """The ``q`` quantile of a cumulative histogram (linear inside the bucket, Prometheus'
    histogram_quantile); None when it holds no observation."""
    points = sorted((float(le), count) for le, count in buckets.items())
    if not points or points[-1][1] <= 0:
        return None
    rank = q * points[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in points:
        if count >= rank:
            if math.isinf(bound):
                return lower_bound
            if count == lower_count:
                return bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (
                count - lower_count
            )
        lower_bound, lower_count = bound, count
    return points[-1][0]

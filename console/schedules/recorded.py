"""What recorded traffic cost with the tidal schedule and what it would have cost without it.
Pure Python (no Django): ``console.schedules.selectors.tidal_recorded_cost`` reads the rows
and calls :func:`compare`; the API, the tidal page and the planner page show its answer.

Per hour of the window (the schedule's zone, the same hours the beat applies):

* **traffic** = the hour's mean of each path's recorded ``gateway_requests_per_second`` x
  3600 s (the gateway scrape's rate between two scrapes; ``remote``, ``local`` and
  ``fallback`` are all served requests), tokens = requests x ``tokens_per_request``. The
  gateways count requests, not tokens, so ``tokens_per_request`` is the schedule scenario's
  mean prompt plus output tokens; the same tokens go into both costs, so the saving does not
  depend on it. An hour without a single sample is a **gap**: no traffic, no cost per million
  tokens, left out of both totals (never filled in);
* **as scheduled**: GPUs per instance x (remote instances held x the remote site's price of
  that hour + local instances x the local site's price of that hour). Remote instances held =
  the nodes the hour's ``applied`` / ``unchanged`` application row ran (``scale.run``); an
  hour whose row was skipped or failed, or that has no row (schedule disabled, beat down),
  held what the last applied hour left (``held``); before any applied hour, the static count
  (``static``);
* **without the schedule**: the same formula with ``static_remote_instances`` every hour (the
  deployment's remote prefill pool, all of it, all day).

Totals cover the hours with traffic only, so both sides price the same tokens; ``saving`` is
the cost difference and ``1 - scheduled / static`` (the same ratio as the two costs per million
tokens). An hour with traffic recorded as 0 requests costs money but has no cost per million
tokens of its own (``idle``); it counts in the totals' cost.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

HOURS = 24
SECONDS_PER_HOUR = 3600.0
# Where an hour's remote instance count came from (see the module docstring).
SOURCE_APPLIED = "applied"
SOURCE_HELD = "held"
SOURCE_STATIC = "static"


@dataclass(frozen=True)
class RecordedHour:
    """One hour of the window as recorded."""

    hour_start: datetime  # aware, start of the schedule-local hour
    rates_by_path: dict[str, float] | None  # mean requests/s per path; None: no sample
    samples: int  # request-rate samples found in the hour (all paths)
    remote_instances: int  # what the schedule held this hour
    source: str  # applied | held | static
    outcome: str | None = None  # the hour's own application outcome, if it has a row
    remote_share_percent: int | None = None  # the share the schedule left, if known


@dataclass(frozen=True)
class CostInputs:
    """Everything :func:`compare` needs. Prices are per GPU-hour, index = schedule-local hour."""

    hours: list[RecordedHour]
    remote_prices: list[float]
    local_prices: list[float]
    gpus_per_instance: int
    local_instances: int
    static_remote_instances: int
    tokens_per_request: float
    window: dict[str, Any] = field(default_factory=dict)  # echoed into the answer


def _cost(inputs: CostInputs, hour: int, remote_instances: int) -> float:
    return inputs.gpus_per_instance * (
        remote_instances * inputs.remote_prices[hour]
        + inputs.local_instances * inputs.local_prices[hour]
    )


def _per_million(cost: float, tokens: float | None) -> float | None:
    return cost / tokens * 1e6 if tokens else None


def _total(cost: float, tokens: float) -> dict[str, Any]:
    return {"cost": cost, "tokens": tokens, "cost_per_million_tokens": _per_million(cost, tokens)}


def check_inputs(inputs: CostInputs) -> None:
    """``ValueError`` naming the table when prices are not 24 values, or a count is negative."""
    for name, values in (
        ("remote_prices", inputs.remote_prices),
        ("local_prices", inputs.local_prices),
    ):
        if len(values) != HOURS:
            raise ValueError(f"{name}: must hold {HOURS} hourly values, got {len(values)}")
    for name, value in (
        ("gpus_per_instance", inputs.gpus_per_instance),
        ("local_instances", inputs.local_instances),
        ("static_remote_instances", inputs.static_remote_instances),
    ):
        if value < 0:
            raise ValueError(f"{name}: must be >= 0")
    if not inputs.tokens_per_request > 0:
        raise ValueError("tokens_per_request: must be > 0")


def compare(inputs: CostInputs) -> dict[str, Any]:
    """Hour by hour and in total: the recorded traffic's cost as scheduled and without the
    schedule (module docstring). JSON-ready (``hour_start`` as ISO 8601)."""
    check_inputs(inputs)
    rows: list[dict[str, Any]] = []
    scheduled_cost = static_cost = tokens_total = 0.0
    with_data = idle = 0
    for h in inputs.hours:
        hour = h.hour_start.hour
        scheduled = _cost(inputs, hour, h.remote_instances)
        static = _cost(inputs, hour, inputs.static_remote_instances)
        requests: float | None = None
        tokens: float | None = None
        by_path: dict[str, float] | None = None
        if h.rates_by_path is not None:
            by_path = {path: rate * SECONDS_PER_HOUR for path, rate in h.rates_by_path.items()}
            requests = sum(by_path.values())
            tokens = requests * inputs.tokens_per_request
            with_data += 1
            idle += 1 if requests == 0 else 0
            scheduled_cost += scheduled
            static_cost += static
            tokens_total += tokens
        rows.append(
            {
                "hour_start": h.hour_start.isoformat(),
                "hour": hour,
                "gap": h.rates_by_path is None,
                "samples": h.samples,
                "requests": requests,
                "requests_by_path": by_path,
                "remote_request_share": (
                    by_path.get("remote", 0.0) / requests if by_path and requests else None
                ),
                "tokens": tokens,
                "remote_price": inputs.remote_prices[hour],
                "local_price": inputs.local_prices[hour],
                "scheduled": {
                    "remote_instances": h.remote_instances,
                    "source": h.source,
                    "outcome": h.outcome,
                    "remote_share_percent": h.remote_share_percent,
                    "cost": scheduled,
                    "cost_per_million_tokens": _per_million(scheduled, tokens),
                },
                "static": {
                    "remote_instances": inputs.static_remote_instances,
                    "cost": static,
                    "cost_per_million_tokens": _per_million(static, tokens),
                },
            }
        )
    return {
        "window": inputs.window,
        "hours": rows,
        "hours_with_data": with_data,
        "hours_without_data": len(inputs.hours) - with_data,
        "hours_idle": idle,
        "hours_by_source": {
            source: sum(1 for h in inputs.hours if h.source == source)
            for source in (SOURCE_APPLIED, SOURCE_HELD, SOURCE_STATIC)
        },
        "empty": tokens_total == 0,
        "tokens_per_request": inputs.tokens_per_request,
        "gpus_per_instance": inputs.gpus_per_instance,
        "local_instances": inputs.local_instances,
        "static_remote_instances": inputs.static_remote_instances,
        "totals": {
            "scheduled": _total(scheduled_cost, tokens_total),
            "static": _total(static_cost, tokens_total),
        },
        "saving": {
            "cost": static_cost - scheduled_cost,
            "share": 1 - scheduled_cost / static_cost if static_cost > 0 else None,
        },
    }

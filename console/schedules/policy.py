"""The tidal policy: per hour of the day, the remote instance count and remote share that
minimise cost per million tokens subject to a TTFT limit. Pure Python + numpy (no Django).

For every remote instance count ``n`` the capacity planner's model (``console.planner.model``,
not a second model) gives the best operating point: threshold, local prefill / decode split,
``Lambda_max`` and the offloaded share. That point does not depend on the hour; only prices and
the capacity window do. So the planner runs once per count and each hour then picks, among the
counts its capacity window allows, the cheapest one whose TTFT estimate is within the limit:

* cost per hour = GPUs per instance x (n x remote price(h) + N_local x local price(h))
  (the local pool is paid whether it prefills or decodes; remote instances only when held);
* tokens per hour = served x 3600 x (E[L] + output tokens), where served is ``Lambda_max``,
  or ``min(Lambda_max, demand)`` when an hourly demand curve is given;
* TTFT estimate, worst path: remote = T_remote(l_long) + S_kv(l_long) / (B x ceiling) + RTT
  (no overlap of prefill and transfer assumed: conservative); local = T_local(l_short).

With a demand curve a plan must also carry the hour's demand (``meets_demand``); when no
count within the TTFT limit does, the hour takes the one that serves most. When no count
meets the TTFT limit, the hour takes the lowest TTFT estimate and is flagged
``ttft_within_limit: false`` (the operator sees both flags in the what-if answer).

Callers: ``console.schedules.services`` (what-if, the beat's hourly apply). Pure, blocking; one
planner search per candidate count (milliseconds each).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from console.planner.model import GBIT, Plan, Scenario, json_safe, optimise

HOURS = 24


@dataclass(frozen=True)
class TidalInputs:
    """Everything the policy needs. Prices are per GPU-hour (energy already folded in)."""

    scenario: Scenario  # remote_instances is replaced per candidate count
    remote_prices: list[float]  # 24 values, index = local hour of the schedule
    local_prices: list[float]  # 24 values
    capacity: list[int]  # remote instances available per hour (capacity window), 24 values
    gpus_per_instance: int
    ttft_limit_s: float
    rtt_s: float = 0.0
    demand_rps: list[float] | None = None  # 24 values (requests/s), None: full load


@dataclass(frozen=True)
class Candidate:
    """The planner's best point with ``remote_instances`` remote instances."""

    remote_instances: int
    plan: Plan
    ttft_s: float
    tokens_per_hour: float


@dataclass(frozen=True)
class HourPlan:
    """What one hour should run."""

    hour: int
    remote_instances: int
    remote_share_percent: int  # the deployment's dial: 100 when anything goes remote, else 0
    threshold_tokens: int
    offload_share: float  # P(L > t): share of all requests prefilled remotely
    lambda_max_rps: float
    n_prefill: int
    n_decode: int
    ttft_s: float
    ttft_within_limit: bool
    served_rps: float  # Lambda_max, or the demand when it is lower
    meets_demand: bool
    cost_per_hour: float
    cost_per_million_tokens: float | None

    def as_dict(self) -> dict[str, Any]:
        return json_safe(dict(self.__dict__))


def _ttft(s: Scenario, plan: Plan, rtt_s: float) -> float:
    """Worst-path mean TTFT estimate of a plan (see the module docstring)."""
    worst = 0.0
    if plan.offload_share > 0 and plan.l_long is not None:
        link_bytes_s = s.link_gbps * GBIT / 8.0 * s.utilisation_ceiling
        transfer = float(s.kv(plan.l_long)) / link_bytes_s if math.isfinite(link_bytes_s) else 0.0
        worst = max(worst, float(s.remote_prefill(plan.l_long)) + transfer + rtt_s)
    if plan.offload_share < 1 and plan.l_short is not None:
        worst = max(worst, float(s.local_prefill(plan.l_short)))
    return worst


def candidates(inputs: TidalInputs) -> dict[int, Candidate]:
    """The planner's best point for every count from 0 to the largest capacity window."""
    s = inputs.scenario
    tokens_per_request = s.lengths.mean + s.decode.output_tokens
    out: dict[int, Candidate] = {}
    for n in range(max(inputs.capacity) + 1):
        scenario = replace(s, remote_instances=n)
        plan, *_ = optimise(scenario)
        out[n] = Candidate(
            remote_instances=n,
            plan=plan,
            ttft_s=_ttft(scenario, plan, inputs.rtt_s),
            tokens_per_hour=plan.lambda_max * 3600.0 * tokens_per_request,
        )
    return out


def _hour_plan(inputs: TidalInputs, hour: int, c: Candidate) -> HourPlan:
    gpus = inputs.gpus_per_instance
    cost = gpus * (
        c.remote_instances * inputs.remote_prices[hour]
        + inputs.scenario.local_instances * inputs.local_prices[hour]
    )
    remote = c.plan.offload_share > 0 and c.remote_instances > 0
    served = c.plan.lambda_max
    if inputs.demand_rps is not None:
        served = min(served, inputs.demand_rps[hour])
    tokens = served * c.tokens_per_hour / c.plan.lambda_max if c.plan.lambda_max > 0 else 0.0
    return HourPlan(
        hour=hour,
        remote_instances=c.remote_instances if remote else 0,
        remote_share_percent=100 if remote else 0,
        threshold_tokens=math.ceil(c.plan.threshold),
        offload_share=c.plan.offload_share if remote else 0.0,
        lambda_max_rps=c.plan.lambda_max,
        n_prefill=c.plan.n_prefill,
        n_decode=c.plan.n_decode,
        ttft_s=c.ttft_s,
        ttft_within_limit=c.ttft_s <= inputs.ttft_limit_s,
        served_rps=served,
        meets_demand=inputs.demand_rps is None or served >= inputs.demand_rps[hour],
        cost_per_hour=cost,
        cost_per_million_tokens=cost / tokens * 1e6 if tokens > 0 else None,
    )


def _cost_key(p: HourPlan) -> tuple[float, int]:
    # Unservable plans last; among equal costs the fewer remote instances (less to scale).
    cpm = p.cost_per_million_tokens
    return (cpm if cpm is not None else math.inf, p.remote_instances)


def choose(inputs: TidalInputs, hour: int, options: dict[int, Candidate]) -> HourPlan:
    """The hour's plan: cheapest within the TTFT limit that carries the demand; else, within
    the limit, the one serving most; else the lowest TTFT."""
    plans = [_hour_plan(inputs, hour, options[n]) for n in range(inputs.capacity[hour] + 1)]
    within = [p for p in plans if p.ttft_within_limit]
    feasible = [p for p in within if p.meets_demand]
    if feasible:
        return min(feasible, key=_cost_key)
    if within:
        return max(within, key=lambda p: (p.served_rps, -p.cost_per_hour))
    return min(plans, key=lambda p: (p.ttft_s, _cost_key(p)))


def _totals(plans: list[HourPlan]) -> dict[str, Any]:
    cost = sum(p.cost_per_hour for p in plans)
    tokens = sum(
        p.cost_per_hour / p.cost_per_million_tokens * 1e6
        for p in plans
        if p.cost_per_million_tokens
    )
    return {
        "cost_per_day": cost,
        "tokens_per_day": tokens,
        "cost_per_million_tokens": cost / tokens * 1e6 if tokens > 0 else None,
        "hours_over_ttft_limit": sum(1 for p in plans if not p.ttft_within_limit),
        "hours_short_of_demand": sum(1 for p in plans if not p.meets_demand),
    }


def check_inputs(inputs: TidalInputs) -> None:
    """Raise ``ValueError`` naming the field when a table does not have 24 sane values."""
    tables: list[tuple[str, list[Any]]] = [
        ("remote_prices", list(inputs.remote_prices)),
        ("local_prices", list(inputs.local_prices)),
        ("capacity", list(inputs.capacity)),
    ]
    if inputs.demand_rps is not None:
        tables.append(("demand_rps", list(inputs.demand_rps)))
    for name, values in tables:
        if len(values) != HOURS:
            raise ValueError(f"{name}: must hold {HOURS} hourly values, got {len(values)}")
        if any(not math.isfinite(v) or v < 0 for v in values):
            raise ValueError(f"{name}: every hourly value must be a finite number >= 0")


def day_plan(inputs: TidalInputs) -> dict[str, Any]:
    """The 24-hour tidal plan and its cost against all-local (no remote instance, every
    hour) and always-remote (the whole capacity window, every hour). JSON-ready, for charts:
    ``hours`` is the chosen plan, ``all_local`` / ``always_remote`` the two baselines."""
    check_inputs(inputs)
    options = candidates(inputs)
    tidal = [choose(inputs, h, options) for h in range(HOURS)]
    local = [_hour_plan(inputs, h, options[0]) for h in range(HOURS)]
    always = [_hour_plan(inputs, h, options[inputs.capacity[h]]) for h in range(HOURS)]
    totals = {
        "tidal": _totals(tidal),
        "all_local": _totals(local),
        "always_remote": _totals(always),
    }
    base_local = totals["all_local"]["cost_per_million_tokens"]
    base_remote = totals["always_remote"]["cost_per_million_tokens"]
    mine = totals["tidal"]["cost_per_million_tokens"]
    return json_safe(
        {
            "hours": [p.as_dict() for p in tidal],
            "all_local": [p.as_dict() for p in local],
            "always_remote": [p.as_dict() for p in always],
            "totals": totals,
            "saving": {
                "vs_all_local": 1 - mine / base_local if mine and base_local else None,
                "vs_always_remote": 1 - mine / base_remote if mine and base_remote else None,
            },
            "ttft_limit_s": inputs.ttft_limit_s,
        }
    )


def hour_plan(inputs: TidalInputs, hour: int) -> HourPlan:
    """Only one hour's plan (what the beat applies)."""
    check_inputs(inputs)
    limited = replace(inputs, capacity=[min(c, inputs.capacity[hour]) for c in inputs.capacity])
    return choose(inputs, hour, candidates(limited))

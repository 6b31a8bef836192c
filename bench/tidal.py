"""Tidal policy benchmark: how long a 24-hour what-if takes as the capacity window grows, what
sharing the planner searches across hours buys, and what the plan saves on the PrfaaS case
study under a day / night price tide. ``python -m bench.tidal``.

Side by side in one process:

* ``day_plan`` (one planner search per remote count, shared by the 24 hours) for capacity
  windows of 4, 16 and 64 remote instances, median of several runs;
* the naive loop (one search per hour and count, 24 x as many) at capacity 4: same plan,
  and the time ratio;
* the case study's cost per million tokens: tidal vs all-local vs always-remote.

Writes ``var/bench/tidal.json`` and prints a summary. CPU timing on a shared machine is
noisy: read the ratios and the order of magnitude.
"""

from __future__ import annotations

import argparse
import platform
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench import write_json
from bench.planner import timed
from console.planner.inputs import parse_scenario
from console.planner.presets import preset_scenario
from console.schedules.policy import HOURS, TidalInputs, candidates, choose, day_plan

OUTPUT = Path("var/bench/tidal.json")
# Remote GPU-hour price: cheap at night, normal by day, a peak in the evening.
REMOTE_PRICES = [1.0] * 8 + [2.0] * 10 + [6.0] * 4 + [2.0] * 2
LOCAL_PRICE = 1.5


def inputs(capacity: int) -> TidalInputs:
    return TidalInputs(
        scenario=parse_scenario(preset_scenario("prfaas-case-study")),
        remote_prices=list(REMOTE_PRICES),
        local_prices=[LOCAL_PRICE] * HOURS,
        capacity=[capacity] * HOURS,
        gpus_per_instance=8,
        ttft_limit_s=10.0,
    )


def naive(inp: TidalInputs) -> list[dict[str, Any]]:
    """One planner search per hour and count (what sharing the searches avoids)."""
    return [
        choose(inp, h, candidates(replace(inp, capacity=[inp.capacity[h]]))).as_dict()
        for h in range(HOURS)
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--output", type=Path, default=OUTPUT)
    args = parser.parse_args(argv)

    timings = {
        f"capacity_{c}": timed(lambda c=c: day_plan(inputs(c)), args.repeats) for c in (4, 16, 64)
    }
    small = inputs(4)
    shared_plan = day_plan(small)["hours"]
    naive_plan = naive(small)
    same = [h["remote_instances"] for h in shared_plan] == [
        h["remote_instances"] for h in naive_plan
    ]
    naive_time = timed(lambda: naive(small), max(1, args.repeats // 2))
    totals = day_plan(small)["totals"]
    result = {
        "python": sys.version.split()[0],
        "machine": platform.machine(),
        "day_plan": timings,
        "naive_capacity_4": naive_time,
        "naive_over_shared": naive_time["median_s"] / timings["capacity_4"]["median_s"],
        "naive_plan_identical": same,
        "case_study": {
            "remote_instances_by_hour": [h["remote_instances"] for h in shared_plan],
            "cost_per_million_tokens": {k: v["cost_per_million_tokens"] for k, v in totals.items()},
        },
    }
    write_json(args.output, result)
    cpm = result["case_study"]["cost_per_million_tokens"]
    for name, t in timings.items():
        print(f"day_plan {name}: median {t['median_s'] * 1000:.1f} ms")
    print(
        f"naive (per hour) / shared searches: {result['naive_over_shared']:.1f}x, same plan: {same}"
    )
    print(
        "case study cost per million tokens: "
        f"tidal {cpm['tidal']:.4f}, all-local {cpm['all_local']:.4f}, always-remote {cpm['always_remote']:.4f}"
    )
    print(f"wrote {args.output}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())

"""Planner benchmark: how long a full grid search takes, and whether it agrees with a scalar
re-implementation of the formulas. ``make bench-planner`` (``python -m bench.planner``).

Runs, side by side in one process:

* the case study (1,000 thresholds x every split of 8 local instances), the complete answer
  (grid, zoom, baselines, the verdict's two extra searches, sweeps), median of several runs;
* the same grid without zoom and sweeps (the bare search);
* larger fleets (1,000 thresholds x every split of 64 and 512 local instances);
* a plain-Python loop over the same case-study grid, evaluating the issue's formulas one cell
  at a time with ``math`` only: its best cell must equal the vectorised grid's best cell, and
  the time ratio shows what vectorising buys.

Writes ``var/bench/planner.json`` and prints a summary. Target: the full grid under 1 s.
CPU timing on a shared machine is noisy: read the ratios and the order of magnitude.
"""

from __future__ import annotations

import argparse
import math
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench import write_json
from console.planner.inputs import parse_scenario
from console.planner.model import Scenario, evaluate, optimise
from console.planner.presets import PRESETS, preset_scenario

TARGET_S = 1.0
OUTPUT = Path("var/bench/planner.json")


def timed(fn: Callable[[], Any], repeats: int) -> dict[str, float]:
    """Median and min wall time of ``repeats`` calls (after one warm-up call)."""
    fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return {"median_s": statistics.median(samples), "min_s": min(samples), "runs": repeats}


def scaled(local_instances: int, remote_instances: int) -> Scenario:
    """The case study with a bigger fleet (more splits to search)."""
    body = preset_scenario("prfaas-case-study")
    body["local"]["instances"] = local_instances
    body["remote"]["instances"] = remote_instances
    body["baseline"] = {}
    return parse_scenario(body)


def scalar_grid(s: Scenario) -> tuple[float, float, int]:
    """The issue's formulas, one (threshold, split) cell at a time, plain Python floats.
    Independent of the vectorised code except for the distribution's CDF/partial mean."""
    dist = s.lengths
    mean = dist.mean
    decode_per = s.decode.batch_size / (s.decode.step_time_s * s.decode.output_tokens)
    best = (-1.0, 0.0, 0)
    for t in s.thresholds.tolist():
        p = 1.0 - float(dist.cdf(t))
        part = float(dist.partial_mean(t))
        l_long = (mean - part) / p if p > 0 else math.nan
        l_short = part / (1.0 - p) if p < 1 else math.nan
        if p > 0:
            rp = s.remote_prefill
            t_remote = rp.a + rp.b * l_long + rp.c * l_long * l_long
            s_kv = float(s.kv(l_long))
            remote = min(s.remote_instances / t_remote, s.link_gbps * 1e9 / 8 / s_kv)
        for n_p in range(s.local_instances + 1):
            n_d = s.local_instances - n_p
            terms = [n_d * decode_per]
            if p > 0:
                terms.append(remote / p)
            if p < 1:
                lp = s.local_prefill
                t_local = lp.a + lp.b * l_short + lp.c * l_short * l_short
                terms.append(n_p / t_local / (1.0 - p))
            lam = min(terms)
            if lam > best[0] * (1 + 1e-12):
                best = (lam, t, n_p)
    return best


def run(repeats: int) -> dict[str, Any]:
    case = parse_scenario(preset_scenario("prfaas-case-study"))
    bare = replace(case, zoom=False)
    results: dict[str, Any] = {"target_s": TARGET_S, "cases": {}}

    answer = evaluate(case)
    paper = PRESETS["prfaas-case-study"]["paper"]
    results["case_study"] = {
        "model": {
            "threshold_tokens": answer["optimum"]["threshold_tokens"],
            "split": [answer["optimum"]["n_prefill"], answer["optimum"]["n_decode"]],
            "lambda_max_rps": answer["optimum"]["lambda_max_rps"],
            "homogeneous_rps": answer["baselines"]["homogeneous"]["lambda_max_rps"],
            "naive_heterogeneous_rps": answer["baselines"]["naive_heterogeneous"]["lambda_max_rps"],
            "gain_vs_homogeneous": answer["gain"]["vs_homogeneous"],
            "gain_vs_naive_heterogeneous": answer["gain"]["vs_naive_heterogeneous"],
            "verdict": answer["verdict"]["decision"],
        },
        "paper": paper,
    }

    cases: dict[str, tuple[Scenario, Callable[[Scenario], Any]]] = {
        "case_study_full_answer": (case, lambda s: evaluate(s, with_sweeps=True)),
        "case_study_bare_grid": (bare, optimise),
        "fleet_64_local_full_answer": (scaled(64, 32), lambda s: evaluate(s, with_sweeps=True)),
        "fleet_512_local_full_answer": (
            scaled(512, 256),
            lambda s: evaluate(s, with_sweeps=True),
        ),
    }
    for name, (scenario, fn) in cases.items():
        timing = timed(lambda fn=fn, scenario=scenario: fn(scenario), repeats)
        timing["thresholds"] = len(scenario.thresholds)
        timing["splits"] = scenario.local_instances + 1
        timing["cells"] = timing["thresholds"] * timing["splits"]
        timing["under_target"] = timing["median_s"] < TARGET_S
        results["cases"][name] = timing

    scalar_timing = timed(lambda: scalar_grid(bare), max(1, repeats // 5))
    scalar_best = scalar_grid(bare)
    vector_plan, *_ = optimise(bare)
    results["scalar_reference"] = {
        **scalar_timing,
        "best_lambda_rps": scalar_best[0],
        "best_threshold_tokens": scalar_best[1],
        "best_n_prefill": scalar_best[2],
        "vectorised_lambda_rps": vector_plan.lambda_max,
        "agrees": math.isclose(scalar_best[0], vector_plan.lambda_max, rel_tol=1e-9)
        and scalar_best[2] == vector_plan.n_prefill,
        "speedup_vs_bare_grid": scalar_timing["median_s"]
        / results["cases"]["case_study_bare_grid"]["median_s"],
    }
    results["environment"] = {
        "python": platform.python_version(),
        "machine": platform.machine(),
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--output", type=Path, default=OUTPUT)
    args = parser.parse_args(argv)
    results = run(args.repeats)
    write_json(args.output, results)
    model = results["case_study"]["model"]
    print(
        "case study: t={:.0f} split={}/{} lambda={:.3f} req/s homogeneous={:.3f} naive={:.3f} "
        "gains {:.2f}x {:.2f}x verdict={}".format(
            model["threshold_tokens"],
            *model["split"],
            model["lambda_max_rps"],
            model["homogeneous_rps"],
            model["naive_heterogeneous_rps"],
            model["gain_vs_homogeneous"],
            model["gain_vs_naive_heterogeneous"],
            model["verdict"],
        )
    )
    for name, t in results["cases"].items():
        print(
            f"{name:32s} {t['thresholds']} thresholds x {t['splits']} splits: "
            f"median {t['median_s'] * 1000:.1f} ms (min {t['min_s'] * 1000:.1f} ms)"
        )
    ref = results["scalar_reference"]
    print(
        f"scalar reference loop: median {ref['median_s'] * 1000:.1f} ms, agrees={ref['agrees']}, "
        f"vectorised bare grid is {ref['speedup_vs_bare_grid']:.0f}x faster"
    )
    print(f"wrote {args.output}")
    ok = all(t["under_target"] for t in results["cases"].values()) and ref["agrees"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

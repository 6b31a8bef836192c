"""The PrfaaS throughput model and its grid search. Pure Python + numpy (no Django).

From the paper "Prefill-as-a-Service: KVCache of Next-Generation Models Could Go
Cross-Datacenter" (2026). A threshold ``t`` sends ``p = P(L > t)`` of the requests to the
remote prefill pool; with ``l_long = E[L | L > t]`` and ``l_short = E[L | L <= t]``:

* ``remote        = min(N_remote / T_remote(l_long), B_out / S_kv(l_long))``
* ``local_prefill = N_p / T_local(l_short)``
* ``decode        = N_d x BS_max / (T_decode x L_out)``
* ``Lambda_max    = min(remote / p, local_prefill / (1 - p), decode)``

``evaluate`` grid-searches ``t`` and the split ``N_p + N_d = N_local`` (every split), zooms in
around the best grid cell (the optimum sits where two stage capacities cross, so a zoom finds
the crossing instead of the nearest grid line), and reports the baselines (homogeneous PD:
everything on local hardware with the best split; naive heterogeneous: ``p = 1``,
``N_d = N_local``), the egress at the optimum, the share offloaded, the binding stage and the
sweeps over ``t`` and over ``N_p`` for charts. ``p = 0`` (nothing offloaded) makes the remote
term infinite and ``p = 1`` the local one, so both ends of the grid are valid plans.

Callers: the planner API, ``bench.planner`` and the deployment workflow's capacity step.
Pure and blocking: a 1,000-threshold grid over a few dozen splits takes milliseconds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
from numpy.typing import NDArray

from console.planner.distributions import LengthDistribution
from console.planner.errors import PlannerInputError
from console.planner.profiles import DecodeProfile, KvProfile, PrefillProfile

FloatArray = NDArray[np.float64]

GBIT = 1e9  # link rates are decimal: 100 Gbit/s = 1e11 bit/s
PREFILL_TIME_MODES = ("at_mean_length", "expected")
# Stages whose capacity is within this of Lambda_max count as binding together.
BALANCE_TOLERANCE = 0.01
MAX_THRESHOLDS = 100_000
# thresholds x splits: bounds the memory of one search (a few float arrays of this size).
MAX_GRID_CELLS = 2_000_000
MAX_INSTANCES = 1_000  # per pool; the grid holds (N_local + 1) x thresholds cells
ZOOM_POINTS = 257
ZOOM_ROUNDS = 3
ZOOM_CANDIDATES = 4  # distinct grid columns zoomed: the best cells of the best splits


@dataclass(frozen=True)
class Scenario:
    """Everything the model needs. Built by ``console.planner.inputs.parse_scenario`` (which
    validates and names fields) or directly by Python callers (``check()`` then validates)."""

    remote_instances: int
    remote_prefill: PrefillProfile
    local_instances: int
    local_prefill: PrefillProfile
    kv: KvProfile
    decode: DecodeProfile
    link_gbps: float  # B_out in Gbit/s; math.inf for "no link limit"
    lengths: LengthDistribution
    thresholds: FloatArray  # the threshold grid, tokens
    utilisation_ceiling: float = 0.7  # share of the link the gateway may use (verdict only)
    homogeneous_instances: int | None = None  # baseline size; None = remote + local
    min_gain: float = 1.1  # the verdict's bar over the homogeneous baseline
    dense: bool | None = None  # every layer full attention (known only from an architecture)
    zoom: bool = True  # refine the optimum around the best grid cell
    # "at_mean_length": T(E[L | ...]) as the paper's model states it; "expected": E[T(L) | ...],
    # the mean prefill time (larger: T is convex), from the distribution's second moment.
    prefill_time: str = "at_mean_length"

    def check(self) -> None:
        """Validate cross-field constraints; raises ``PlannerInputError`` naming the field."""
        for name, value, minimum in (
            ("remote.instances", self.remote_instances, 0),
            ("local.instances", self.local_instances, 1),
        ):
            if isinstance(value, bool) or not isinstance(value, int):
                raise PlannerInputError(name, "must be an integer")
            if not minimum <= value <= MAX_INSTANCES:
                raise PlannerInputError(name, f"must be between {minimum} and {MAX_INSTANCES}")
        if self.homogeneous_instances is not None and not (
            1 <= self.homogeneous_instances <= MAX_INSTANCES
        ):
            raise PlannerInputError(
                "baseline.homogeneous_instances", f"must be between 1 and {MAX_INSTANCES}"
            )
        if not (self.link_gbps > 0):  # also rejects NaN
            raise PlannerInputError("link.bandwidth_gbps", "must be > 0")
        if not (0 < self.utilisation_ceiling <= 1):
            raise PlannerInputError("link.utilisation_ceiling", "must be in (0, 1]")
        if self.prefill_time not in PREFILL_TIME_MODES:
            raise PlannerInputError(
                "method.prefill_time", f"must be one of {', '.join(PREFILL_TIME_MODES)}"
            )
        if not (math.isfinite(self.min_gain) and self.min_gain > 0):
            raise PlannerInputError("verdict.min_gain", "must be a finite number > 0")
        grid = np.asarray(self.thresholds, dtype=np.float64)
        if grid.ndim != 1 or grid.size == 0:
            raise PlannerInputError("grid.thresholds", "must hold at least one threshold")
        if grid.size > MAX_THRESHOLDS:
            raise PlannerInputError("grid.thresholds", f"must hold at most {MAX_THRESHOLDS}")
        if not np.all(np.isfinite(grid)) or np.any(grid < 0):
            raise PlannerInputError("grid.thresholds", "must be finite token counts >= 0")
        if grid.size * (self.local_instances + 1) > MAX_GRID_CELLS:
            raise PlannerInputError(
                "grid.thresholds",
                f"thresholds x (local.instances + 1) must be at most {MAX_GRID_CELLS:,}",
            )
        lo, hi = self.lengths.lower, self.lengths.upper
        self.remote_prefill.check_positive(lo, hi, "remote.prefill")
        self.local_prefill.check_positive(lo, hi, "local.prefill")
        self.kv.check_positive(lo, hi, "kv")

    @property
    def homogeneous_size(self) -> int:
        return self.homogeneous_instances or (self.remote_instances + self.local_instances)


def threshold_grid(lower: float, upper: float, count: int, spacing: str = "linear") -> FloatArray:
    """``count`` thresholds from ``lower`` to ``upper`` inclusive (both ends are valid plans:
    everything remote, nothing remote), evenly spaced in tokens or in log(tokens)."""
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise PlannerInputError("grid.thresholds", "must be a positive integer count")
    if count > MAX_THRESHOLDS:
        raise PlannerInputError("grid.thresholds", f"must be at most {MAX_THRESHOLDS}")
    if spacing == "linear":
        return np.linspace(lower, upper, count)
    if spacing == "log":
        return np.geomspace(max(lower, 1.0), upper, count)
    raise PlannerInputError("grid.spacing", "must be linear or log")


@dataclass(frozen=True)
class StageRates:
    """Per threshold: offload share, conditional lengths and stage rates (requests/s)."""

    thresholds: FloatArray
    p: FloatArray  # P(L > t)
    l_long: FloatArray  # E[L | L > t] (nan where p == 0)
    l_short: FloatArray  # E[L | L <= t] (nan where p == 1)
    remote_compute: FloatArray  # N_remote / T_remote(l_long)
    remote_link: FloatArray  # B_out / S_kv(l_long)
    local_per_instance: FloatArray  # 1 / T_local(l_short)
    kv_long_bytes: FloatArray  # S_kv(l_long)

    @property
    def remote(self) -> FloatArray:
        return np.minimum(self.remote_compute, self.remote_link)


def stage_rates(s: Scenario, thresholds: FloatArray) -> StageRates:
    """The per-threshold quantities of the model, vectorised over ``thresholds``."""
    dist = s.lengths
    # Thresholds outside [lower, upper] are fine: below every prompt p = 1, above every one
    # p = 0 (a histogram's point mass at its lower edge stays local at t = lower).
    t = np.asarray(thresholds, dtype=np.float64)
    below = dist.cdf(t)
    p = np.clip(1.0 - below, 0.0, 1.0)
    part = dist.partial_mean(t)
    mean = dist.mean
    with np.errstate(divide="ignore", invalid="ignore"):
        l_long = np.where(p > 0, (mean - part) / p, np.nan)
        l_short = np.where(p < 1, part / (1.0 - p), np.nan)
    # Cancellation at the far tails can push a conditional mean outside its interval.
    l_long = np.where(p > 0, np.clip(l_long, t, dist.upper), np.nan)
    l_short = np.where(p < 1, np.clip(l_short, dist.lower, t), np.nan)
    long_eval = np.nan_to_num(l_long, nan=dist.upper)
    short_eval = np.nan_to_num(l_short, nan=dist.lower)
    kv_long = s.kv(long_eval)
    if s.prefill_time == "expected":
        part2 = dist.partial_moment2(t)
        with np.errstate(divide="ignore", invalid="ignore"):
            long_m2 = np.where(p > 0, (dist.moment2 - part2) / p, np.nan)
            short_m2 = np.where(p < 1, part2 / (1.0 - p), np.nan)
        # E[L^2 | .] >= E[L | .]^2 always; cancellation at the far tails can break it.
        t_remote = s.remote_prefill.expected(long_eval, np.maximum(long_m2, long_eval**2))
        t_local = s.local_prefill.expected(short_eval, np.maximum(short_m2, short_eval**2))
    else:
        t_remote, t_local = s.remote_prefill(long_eval), s.local_prefill(short_eval)
    with np.errstate(divide="ignore"):  # 0 KV bytes (all mass at 0 tokens): no link limit
        remote_compute = s.remote_instances / t_remote
        remote_link = s.link_gbps * GBIT / 8.0 / kv_long
        local_per_instance = 1.0 / t_local
    return StageRates(
        thresholds=t,
        p=p,
        l_long=l_long,
        l_short=l_short,
        remote_compute=remote_compute,
        remote_link=remote_link,
        local_per_instance=local_per_instance,
        kv_long_bytes=kv_long,
    )


def _capacities(
    r: StageRates, n_prefill: NDArray[np.int64], n_local: int, decode_rps: float
) -> tuple[FloatArray, FloatArray, FloatArray]:
    """Stage capacities in requests/s of total traffic, shape ``(splits, thresholds)``."""
    with np.errstate(divide="ignore", invalid="ignore"):
        remote_cap = np.where(r.p > 0, r.remote / r.p, np.inf)
        local_cap = np.where(
            r.p < 1, n_prefill[:, None] * r.local_per_instance / (1.0 - r.p), np.inf
        )
    decode_cap = (n_local - n_prefill)[:, None] * decode_rps
    as_float = np.float64
    return (
        np.asarray(remote_cap[None, :], dtype=as_float),
        np.asarray(local_cap, dtype=as_float),
        np.asarray(decode_cap, dtype=as_float),
    )


def lambda_grid(s: Scenario, r: StageRates) -> tuple[NDArray[np.int64], FloatArray]:
    """``Lambda_max`` for every split ``N_p = 0..N_local`` (rows) and threshold (columns)."""
    n_prefill = np.arange(s.local_instances + 1, dtype=np.int64)
    remote_cap, local_cap, decode_cap = _capacities(
        r, n_prefill, s.local_instances, s.decode.requests_per_s
    )
    lam = np.minimum(np.minimum(remote_cap, local_cap), decode_cap)
    return n_prefill, np.asarray(lam, dtype=np.float64)


def _best_cell(lam: FloatArray, thresholds: FloatArray) -> tuple[int, int]:
    """The (split, threshold) cell of the maximum. Ties (flat regions where decode binds) go to
    the highest threshold, which offloads least and so uses the least link, then to the
    fewest local prefill instances."""
    top = float(lam.max())
    near = lam >= top * (1 - 1e-12) if top > 0 else lam >= top
    rows, cols = np.nonzero(near)
    order = np.lexsort((rows, -thresholds[cols]))
    k = int(order[0])
    return int(rows[k]), int(cols[k])


@dataclass(frozen=True)
class Plan:
    """One operating point: threshold, split and the resulting throughput."""

    threshold: float
    n_prefill: int
    n_decode: int
    lambda_max: float  # requests/s
    offload_share: float  # p
    l_long: float | None
    l_short: float | None
    egress_gbps: float  # KV leaving the remote pool at lambda_max
    capacities: dict[str, float]  # per stage, requests/s of total traffic (inf: not used)
    binding: list[str]  # stages within BALANCE_TOLERANCE of lambda_max, tightest first

    def as_dict(self) -> dict[str, Any]:
        return {
            "threshold_tokens": self.threshold,
            "n_prefill": self.n_prefill,
            "n_decode": self.n_decode,
            "lambda_max_rps": self.lambda_max,
            "offload_share": self.offload_share,
            "l_long_tokens": self.l_long,
            "l_short_tokens": self.l_short,
            "egress_gbps": self.egress_gbps,
            "stage_capacity_rps": dict(self.capacities),  # inf (stage unused) -> null in JSON
            "binding_stage": self.binding[0] if self.binding else None,
            "binding_stages": self.binding,
        }


def plan_at(s: Scenario, threshold: float, n_prefill: int) -> Plan:
    """Evaluate one (threshold, split) point in full detail."""
    r = stage_rates(s, np.array([threshold], dtype=np.float64))
    p = float(r.p[0])
    n_local = s.local_instances
    with np.errstate(divide="ignore", invalid="ignore"):
        caps = {
            "remote_compute": float(r.remote_compute[0] / p) if p > 0 else math.inf,
            "remote_link": float(r.remote_link[0] / p) if p > 0 else math.inf,
            "local_prefill": (
                float(n_prefill * r.local_per_instance[0] / (1 - p)) if p < 1 else math.inf
            ),
            "decode": (n_local - n_prefill) * s.decode.requests_per_s,
        }
    lam = min(caps.values())
    binding = sorted(
        (k for k, v in caps.items() if v <= lam * (1 + BALANCE_TOLERANCE)),
        key=lambda k: caps[k],
    )
    egress = lam * p * float(r.kv_long_bytes[0]) * 8.0 / GBIT if p > 0 else 0.0
    return Plan(
        threshold=float(r.thresholds[0]),
        n_prefill=n_prefill,
        n_decode=n_local - n_prefill,
        lambda_max=lam,
        offload_share=p,
        l_long=None if p == 0 else float(r.l_long[0]),
        l_short=None if p == 1 else float(r.l_short[0]),
        egress_gbps=egress,
        capacities=caps,
        binding=binding,
    )


def _zoom(s: Scenario, grid: FloatArray, col: int) -> tuple[float, int, float]:
    """Refine around grid column ``col`` (between its neighbours), all splits, a few rounds."""
    lo = float(grid[max(col - 1, 0)])
    hi = float(grid[min(col + 1, len(grid) - 1)])
    best_t, best_n, best_lam = float(grid[col]), -1, -math.inf
    for _ in range(ZOOM_ROUNDS):
        if hi <= lo:
            break
        ts = np.linspace(lo, hi, ZOOM_POINTS)
        n_prefill, lam = lambda_grid(s, stage_rates(s, ts))
        row, c = _best_cell(lam, ts)
        if lam[row, c] > best_lam:
            best_t, best_n, best_lam = float(ts[c]), int(n_prefill[row]), float(lam[row, c])
        step = (hi - lo) / (ZOOM_POINTS - 1)
        lo, hi = max(lo, best_t - step), min(hi, best_t + step)
    return best_t, best_n, best_lam


def _zoom_columns(lam: FloatArray) -> list[int]:
    """Where to zoom: each split's best grid column, for the splits with the best grid values.
    A coarse grid can miss a narrow peak of one split while another split's plateau wins on
    the grid; zooming only the overall best cell would then stay on the plateau."""
    per_split = np.argmax(lam, axis=1)
    values = lam[np.arange(lam.shape[0]), per_split]
    columns: list[int] = []
    for row in np.argsort(-values, kind="stable"):
        col = int(per_split[row])
        if col not in columns:
            columns.append(col)
        if len(columns) == ZOOM_CANDIDATES:
            break
    return columns


def optimise(s: Scenario) -> tuple[Plan, StageRates, NDArray[np.int64], FloatArray]:
    """Grid search (plus zoom): the best plan, and the grid it came from (for sweeps)."""
    grid = np.asarray(s.thresholds, dtype=np.float64)
    rates = stage_rates(s, grid)
    n_prefill, lam = lambda_grid(s, rates)
    row, col = _best_cell(lam, rates.thresholds)
    plan = plan_at(s, float(rates.thresholds[col]), int(n_prefill[row]))
    if s.zoom and len(grid) > 1:
        for candidate in _zoom_columns(lam):
            t, n, value = _zoom(s, rates.thresholds, candidate)
            if value > plan.lambda_max * (1 + 1e-12):
                plan = plan_at(s, t, n)
    return plan, rates, n_prefill, lam


def _whole_distribution_time(s: Scenario, profile: PrefillProfile) -> float:
    """Prefill seconds of a request drawn from the whole distribution, per ``prefill_time``."""
    mean = s.lengths.mean
    if s.prefill_time == "expected":
        return float(profile.expected(mean, max(s.lengths.moment2, mean * mean)))
    return float(profile(mean))


def homogeneous_baseline(s: Scenario, instances: int) -> dict[str, Any]:
    """Same-datacenter PD on local hardware: every prompt prefilled locally (``p = 0``,
    ``l_short = E[L]``), ``instances`` split between prefill and decode at the best split."""
    per_instance = 1.0 / _whole_distribution_time(s, s.local_prefill)
    n_prefill = np.arange(instances + 1)
    lam = np.minimum(n_prefill * per_instance, (instances - n_prefill) * s.decode.requests_per_s)
    best = int(np.argmax(lam))
    return {
        "instances": instances,
        "n_prefill": best,
        "n_decode": instances - best,
        "lambda_max_rps": float(lam[best]),
    }


def naive_baseline(s: Scenario) -> dict[str, Any]:
    """Every prompt prefilled remotely (``p = 1``, ``l_long = E[L]``), all local instances
    decode."""
    mean = s.lengths.mean
    compute = s.remote_instances / _whole_distribution_time(s, s.remote_prefill)
    link = s.link_gbps * GBIT / 8.0 / float(s.kv(mean))
    decode = s.local_instances * s.decode.requests_per_s
    lam = min(compute, link, decode)
    return {
        "n_prefill": 0,
        "n_decode": s.local_instances,
        "lambda_max_rps": lam,
        "egress_gbps": lam * float(s.kv(mean)) * 8.0 / GBIT,
        "binding_stage": min(
            (("remote_compute", compute), ("remote_link", link), ("decode", decode)),
            key=lambda kv: kv[1],
        )[0],
    }


def _ratio(a: float, b: float) -> float | None:
    return a / b if b > 0 else None


def _rounded(values: FloatArray, digits: int = 6) -> list[float | None]:
    return [
        float(f"{v:.{digits}g}") if math.isfinite(v) else None for v in np.asarray(values).tolist()
    ]


def sweeps(
    s: Scenario, rates: StageRates, n_prefill: NDArray[np.int64], lam: FloatArray
) -> dict[str, Any]:
    """Chart data: best Lambda per threshold (with its split, share, egress and the two
    prefill capacities at that split), and best Lambda per split (with its threshold)."""
    rows = np.argmax(lam, axis=0)
    cols = np.arange(lam.shape[1])
    best = lam[rows, cols]
    remote_cap, local_cap, _ = _capacities(
        rates, n_prefill, s.local_instances, s.decode.requests_per_s
    )
    egress = best * rates.p * rates.kv_long_bytes * 8.0 / GBIT
    by_split_cols = np.argmax(lam, axis=1)
    return {
        "threshold": {
            "threshold_tokens": _rounded(rates.thresholds),
            "lambda_max_rps": _rounded(best),
            "n_prefill": n_prefill[rows].tolist(),
            "offload_share": _rounded(rates.p),
            "egress_gbps": _rounded(egress),
            "remote_capacity_rps": _rounded(np.broadcast_to(remote_cap[0], best.shape)),
            "local_capacity_rps": _rounded(local_cap[rows, cols]),
        },
        "split": {
            "n_prefill": n_prefill.tolist(),
            "n_decode": (s.local_instances - n_prefill).tolist(),
            "lambda_max_rps": _rounded(lam[n_prefill, by_split_cols]),
            "threshold_tokens": _rounded(rates.thresholds[by_split_cols]),
        },
    }


def evaluate(s: Scenario, *, with_sweeps: bool = True) -> dict[str, Any]:
    """The full answer for a scenario: optimum, baselines, gains, verdict, sweeps. JSON-ready.

    Raises ``PlannerInputError`` on an invalid scenario."""
    from console.planner.verdict import verdict  # verdict re-runs the model: avoid a cycle

    s.check()
    plan, rates, n_prefill, lam = optimise(s)
    homogeneous = homogeneous_baseline(s, s.homogeneous_size)
    local_only = homogeneous_baseline(s, s.local_instances)
    naive = naive_baseline(s)
    out: dict[str, Any] = {
        "optimum": plan.as_dict(),
        "baselines": {
            "homogeneous": homogeneous,
            "local_only": local_only,
            "naive_heterogeneous": naive,
        },
        "gain": {
            "vs_homogeneous": _ratio(plan.lambda_max, homogeneous["lambda_max_rps"]),
            "vs_local_only": _ratio(plan.lambda_max, local_only["lambda_max_rps"]),
            "vs_naive_heterogeneous": _ratio(plan.lambda_max, naive["lambda_max_rps"]),
        },
        "link": {
            "bandwidth_gbps": s.link_gbps,
            "utilisation_ceiling": s.utilisation_ceiling,
            "egress_share": plan.egress_gbps / s.link_gbps if math.isfinite(s.link_gbps) else 0.0,
        },
        "lengths": s.lengths.describe(),
        "profiles": {
            "remote_prefill": s.remote_prefill.describe(),
            "local_prefill": s.local_prefill.describe(),
            "kv": s.kv.describe(),
            "decode_rps_per_instance": s.decode.requests_per_s,
        },
        "grid": {
            "thresholds": len(rates.thresholds),
            "splits": len(n_prefill),
            "zoomed": s.zoom,
        },
        "method": {"prefill_time": s.prefill_time},
        "verdict": verdict(s, plan, homogeneous),
    }
    if with_sweeps:
        out["sweeps"] = sweeps(s, rates, n_prefill, lam)
    return json_safe(out)


def json_safe(value: Any) -> Any:
    """Replace non-finite floats (an unused stage's infinite capacity, an overflow on absurd
    but valid inputs) by ``None`` so that the answer is always valid JSON."""
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_safe(v) for v in value]
    if isinstance(value, float | np.floating):
        return float(value) if math.isfinite(value) else None
    if isinstance(value, np.integer):
        return int(value)
    return value


def unlimited_link(s: Scenario) -> Scenario:
    """The same scenario with no link limit (what compute alone would offload)."""
    return replace(s, link_gbps=math.inf)


def capped_link(s: Scenario) -> Scenario:
    """The same scenario with the link cut to its utilisation ceiling."""
    return replace(s, link_gbps=s.link_gbps * s.utilisation_ceiling)

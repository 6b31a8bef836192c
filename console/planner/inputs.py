"""Planner inputs as JSON -> a validated ``Scenario``. Pure Python (no Django).

The request body of ``POST /api/planner/evaluate/`` and the shape of the presets::

    {
      "remote":  {"instances": 4, "prefill": {"coefficients": [0.389, 4.21e-5, 9.94e-11]}},
      "local":   {"instances": 8, "prefill": {"points": [[1024, 0.61], [8192, 1.6], ...]}},
      "kv":      {"fixed_bytes": 180355072, "per_token_bytes": 17100.8}
                 | {"points": [[1024, 200068300], ...]} | {"architecture": {...}},
      "decode":  {"batch_size": 20, "step_time_ms": 25, "output_tokens": 1024},
      "link":    {"bandwidth_gbps": 100, "utilisation_ceiling": 0.7},
      "lengths": {"kind": "lognormal", "mu": 9.9, "sigma": 1.0, "lower": 128, "upper": 131072}
                 | {"kind": "histogram", "csv": "lo,hi,count\\n..."}
                 | {"kind": "histogram", "bins": [[lo, hi, count], ...]},
      "grid":    {"thresholds": 1000, "spacing": "linear", "zoom": true}
                 | {"threshold_values": [4096, 8192, ...]},
      "baseline": {"homogeneous_instances": 12},
      "verdict":  {"min_gain": 1.1},
      "method":   {"prefill_time": "at_mean_length"}      # or "expected": E[T(L)]
    }

``grid``, ``baseline``, ``verdict``, ``method`` and ``link.utilisation_ceiling`` are optional. Unknown keys
are errors (a typo must not silently fall back to a default). Every error is a
``PlannerInputError`` whose ``field`` is the dotted path of the offending value.
Callers: the planner API serializers, ``presets``, ``bench.planner``. Pure, blocking.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from console.planner.distributions import Histogram, TruncatedLogNormal, parse_histogram_csv
from console.planner.errors import PlannerInputError
from console.planner.kvsize import is_dense
from console.planner.model import (
    MAX_INSTANCES,
    MAX_THRESHOLDS,
    Scenario,
    threshold_grid,
)
from console.planner.profiles import DecodeProfile, KvProfile, PrefillProfile

DEFAULT_THRESHOLDS = 1000
DEFAULT_CEILING = 0.7
DEFAULT_MIN_GAIN = 1.1
MAX_CSV_CHARS = 2_000_000

_TOP = {
    "remote",
    "local",
    "kv",
    "decode",
    "link",
    "lengths",
    "grid",
    "baseline",
    "verdict",
    "method",
}


def _object(value: Any, field: str, allowed: set[str]) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise PlannerInputError(field, "must be an object")
    unknown = sorted(set(value) - allowed)
    if unknown:
        prefix = f"{field}." if field else ""
        raise PlannerInputError(f"{prefix}{unknown[0]}", "is not a known field")
    return value


def _required(obj: dict[str, Any], key: str, field: str) -> Any:
    if key not in obj or obj[key] is None:
        raise PlannerInputError(f"{field}.{key}" if field else key, "is required")
    return obj[key]


def _number(value: Any, field: str, *, minimum: float | None = None, strict: bool = False) -> float:
    """A finite JSON number (not a bool, not a numeric string), optionally bounded below."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise PlannerInputError(field, "must be a finite number")
    if minimum is not None and (value <= minimum if strict else value < minimum):
        raise PlannerInputError(field, f"must be {'>' if strict else '>='} {minimum:g}")
    return float(value)


def _integer(value: Any, field: str, *, minimum: int, maximum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise PlannerInputError(field, "must be an integer")
    if value < minimum or (maximum is not None and value > maximum):
        bound = f"between {minimum} and {maximum}" if maximum is not None else f">= {minimum}"
        raise PlannerInputError(field, f"must be {bound}")
    return value


def _prefill(value: Any, field: str) -> PrefillProfile:
    obj = _object(value, field, {"coefficients", "points"})
    if ("coefficients" in obj) == ("points" in obj):
        raise PlannerInputError(field, "give exactly one of coefficients or points")
    if "coefficients" in obj:
        return PrefillProfile.from_coefficients(obj["coefficients"], f"{field}.coefficients")
    return PrefillProfile.fit(obj["points"], f"{field}.points")


def _pool(value: Any, field: str, minimum: int) -> tuple[int, PrefillProfile]:
    obj = _object(value, field, {"instances", "prefill"})
    instances = _integer(
        _required(obj, "instances", field),
        f"{field}.instances",
        minimum=minimum,
        maximum=MAX_INSTANCES,
    )
    return instances, _prefill(_required(obj, "prefill", field), f"{field}.prefill")


def _kv(value: Any, upper: float) -> tuple[KvProfile, bool | None]:
    """The KV profile and whether the model is dense (None when not known)."""
    obj = _object(value, "kv", {"fixed_bytes", "per_token_bytes", "points", "architecture"})
    forms: list[str] = [k for k in ("points", "architecture") if k in obj]
    if "fixed_bytes" in obj or "per_token_bytes" in obj:
        forms.append("fixed_bytes/per_token_bytes")
    if len(forms) != 1:
        raise PlannerInputError(
            "kv", "give exactly one of fixed_bytes + per_token_bytes, points, architecture"
        )
    if "architecture" in obj:
        profile = KvProfile.from_architecture(obj["architecture"], upper, "kv.architecture")
        return profile, is_dense(obj["architecture"])
    if "points" in obj:
        return KvProfile.from_points(obj["points"], "kv.points"), None
    fixed = _number(obj.get("fixed_bytes", 0), "kv.fixed_bytes", minimum=0)
    per_token = _number(obj.get("per_token_bytes", 0), "kv.per_token_bytes", minimum=0)
    return KvProfile.linear(fixed, per_token, "kv"), None


def _decode(value: Any) -> DecodeProfile:
    obj = _object(value, "decode", {"batch_size", "step_time_ms", "output_tokens"})
    return DecodeProfile(
        batch_size=_number(
            _required(obj, "batch_size", "decode"), "decode.batch_size", minimum=0, strict=True
        ),
        step_time_s=_number(
            _required(obj, "step_time_ms", "decode"), "decode.step_time_ms", minimum=0, strict=True
        )
        / 1000.0,
        output_tokens=_number(
            _required(obj, "output_tokens", "decode"),
            "decode.output_tokens",
            minimum=0,
            strict=True,
        ),
    )


def parse_lengths(value: Any, field: str = "lengths") -> TruncatedLogNormal | Histogram:
    """A length distribution from its JSON form (see the module docstring)."""
    if not isinstance(value, dict):
        raise PlannerInputError(field, "must be an object")
    kind = value.get("kind")
    if kind == "lognormal":
        obj = _object(value, field, {"kind", "mu", "sigma", "lower", "upper"})
        try:
            return TruncatedLogNormal(
                mu=_number(_required(obj, "mu", field), f"{field}.mu"),
                sigma=_number(_required(obj, "sigma", field), f"{field}.sigma"),
                lower=_number(_required(obj, "lower", field), f"{field}.lower"),
                upper=_number(_required(obj, "upper", field), f"{field}.upper"),
            )
        except PlannerInputError as exc:
            if exc.field.startswith(f"{field}."):
                raise
            raise exc.under(field) from None
    if kind == "histogram":
        obj = _object(value, field, {"kind", "csv", "bins"})
        if ("csv" in obj) == ("bins" in obj):
            raise PlannerInputError(field, "give exactly one of csv or bins")
        if "csv" in obj:
            text = obj["csv"]
            if not isinstance(text, str):
                raise PlannerInputError(f"{field}.csv", "must be a string")
            if len(text) > MAX_CSV_CHARS:
                raise PlannerInputError(f"{field}.csv", f"must be at most {MAX_CSV_CHARS} chars")
            return parse_histogram_csv(text, f"{field}.csv")
        bins = obj["bins"]
        if not isinstance(bins, list):
            raise PlannerInputError(f"{field}.bins", "must be a list of [lo, hi, count]")
        rows = []
        for i, row in enumerate(bins):
            where = f"{field}.bins[{i}]"
            if not isinstance(row, list | tuple) or len(row) != 3:
                raise PlannerInputError(where, "must be [lo, hi, count]")
            rows.append(tuple(_number(v, where) for v in row))
        return Histogram.from_bins(rows, f"{field}.bins")  # type: ignore[arg-type]
    raise PlannerInputError(f"{field}.kind", "must be lognormal or histogram")


def _grid(value: Any, lower: float, upper: float) -> tuple[np.ndarray, bool]:
    obj = _object(value, "grid", {"thresholds", "spacing", "zoom", "threshold_values"})
    zoom = obj.get("zoom", True)
    if not isinstance(zoom, bool):
        raise PlannerInputError("grid.zoom", "must be true or false")
    if "threshold_values" in obj:
        if "thresholds" in obj or "spacing" in obj:
            raise PlannerInputError(
                "grid", "give threshold_values, or thresholds (a count) with spacing, not both"
            )
        values = obj["threshold_values"]
        if not isinstance(values, list) or not values:
            raise PlannerInputError("grid.threshold_values", "must be a non-empty list")
        if len(values) > MAX_THRESHOLDS:
            raise PlannerInputError("grid.threshold_values", f"must hold at most {MAX_THRESHOLDS}")
        grid = [_number(v, f"grid.threshold_values[{i}]", minimum=0) for i, v in enumerate(values)]
        return np.unique(np.array(grid, dtype=np.float64)), zoom
    count = obj.get("thresholds", DEFAULT_THRESHOLDS)
    spacing = obj.get("spacing", "linear")
    return threshold_grid(lower, upper, count, spacing), zoom


def parse_scenario(data: Any) -> Scenario:
    """Validate a planner request body and build its ``Scenario`` (checked)."""
    obj = _object(data, "", _TOP)
    lengths = parse_lengths(_required(obj, "lengths", ""))
    n_remote, remote = _pool(_required(obj, "remote", ""), "remote", 0)
    n_local, local = _pool(_required(obj, "local", ""), "local", 1)
    kv, dense = _kv(_required(obj, "kv", ""), lengths.upper)
    decode = _decode(_required(obj, "decode", ""))
    link = _object(_required(obj, "link", ""), "link", {"bandwidth_gbps", "utilisation_ceiling"})
    bandwidth = _number(
        _required(link, "bandwidth_gbps", "link"), "link.bandwidth_gbps", minimum=0, strict=True
    )
    ceiling = _number(
        link.get("utilisation_ceiling", DEFAULT_CEILING),
        "link.utilisation_ceiling",
        minimum=0,
        strict=True,
    )
    thresholds, zoom = _grid(obj.get("grid", {}), lengths.lower, lengths.upper)
    baseline = _object(obj.get("baseline", {}), "baseline", {"homogeneous_instances"})
    homogeneous = baseline.get("homogeneous_instances")
    if homogeneous is not None:
        homogeneous = _integer(homogeneous, "baseline.homogeneous_instances", minimum=1)
    verdict = _object(obj.get("verdict", {}), "verdict", {"min_gain"})
    min_gain = _number(
        verdict.get("min_gain", DEFAULT_MIN_GAIN), "verdict.min_gain", minimum=0, strict=True
    )
    method = _object(obj.get("method", {}), "method", {"prefill_time"})
    prefill_time = method.get("prefill_time", "at_mean_length")  # checked by Scenario.check
    scenario = Scenario(
        remote_instances=n_remote,
        remote_prefill=remote,
        local_instances=n_local,
        local_prefill=local,
        kv=kv,
        decode=decode,
        link_gbps=bandwidth,
        lengths=lengths,
        thresholds=thresholds,
        utilisation_ceiling=ceiling,
        homogeneous_instances=homogeneous,
        min_gain=min_gain,
        dense=dense,
        zoom=zoom,
        prefill_time=prefill_time,
    )
    scenario.check()
    return scenario

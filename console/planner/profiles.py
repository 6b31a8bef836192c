"""Hardware and model profiles the throughput model consumes. Pure Python + numpy (no Django).

* ``PrefillProfile``: prefill time of one instance, ``T(l) = a + b l + c l^2`` seconds, given
  as coefficients or least-squares fitted to measured ``(tokens, seconds)`` points.
* ``KvProfile``: KV bytes of one request, ``S_kv(l)``, piecewise linear in ``l``: from a fixed
  + per-token size, from measured ``(tokens, bytes)`` points (interpolated, extrapolated along
  the end segments), or from an architecture (``console.planner.kvsize``; sliding windows make
  it piecewise linear with a knee at each window, so it is sampled exactly at those knees).
* ``DecodeProfile``: batch size, step time and output length of one decode instance.

Callers: ``console.planner.model`` and the API input parser. Construction validates and raises
``PlannerInputError`` naming the field; evaluation is vectorised, pure and blocking.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import ArrayLike, NDArray

from console.planner.errors import PlannerInputError
from console.planner.kvsize import ArchitectureError, kv_size, validate_architecture

FloatArray = NDArray[np.float64]

MIB = 2**20
KIB = 2**10


def _finite(value: float, field: str, *, positive: bool = False, nonneg: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise PlannerInputError(field, "must be a finite number")
    if positive and value <= 0:
        raise PlannerInputError(field, "must be > 0")
    if nonneg and value < 0:
        raise PlannerInputError(field, "must be >= 0")
    return float(value)


def _points(points: Any, field: str, minimum: int) -> FloatArray:
    """Validate ``[[x, y], ...]`` with distinct finite x >= 0 and finite y > 0; sorted by x."""
    if not isinstance(points, list | tuple) or len(points) < minimum:
        raise PlannerInputError(
            field, f"must be a list of at least {minimum} [tokens, value] pairs"
        )
    rows = []
    for i, point in enumerate(points):
        where = f"{field}[{i}]"
        if not isinstance(point, list | tuple) or len(point) != 2:
            raise PlannerInputError(where, "must be a [tokens, value] pair")
        x = _finite(point[0], where, nonneg=True)
        y = _finite(point[1], where, positive=True)
        rows.append((x, y))
    data = np.array(sorted(rows), dtype=np.float64)
    if len(np.unique(data[:, 0])) != len(data):
        raise PlannerInputError(field, "token counts must be distinct")
    return data


@dataclass(frozen=True)
class PrefillProfile:
    """Prefill seconds of one instance for an uncached prompt of ``l`` tokens."""

    a: float  # seconds, fixed per request
    b: float  # seconds per token (linear part: MLP, projections)
    c: float  # seconds per token^2 (attention)
    fitted_from: int = 0  # number of measured points behind a fit (0: explicit coefficients)
    fit_rms_s: float = 0.0  # root-mean-square residual of the fit, seconds

    @classmethod
    def from_coefficients(cls, coefficients: Any, field: str = "coefficients") -> PrefillProfile:
        if not isinstance(coefficients, list | tuple) or len(coefficients) != 3:
            raise PlannerInputError(field, "must be [a, b, c] for T(l) = a + b l + c l^2 seconds")
        a, b, c = (_finite(v, f"{field}[{i}]") for i, v in enumerate(coefficients))
        return cls(a=a, b=b, c=c)

    @classmethod
    def fit(cls, points: Any, field: str = "points") -> PrefillProfile:
        """Least-squares quadratic through measured ``[tokens, seconds]`` points (>= 3)."""
        data = _points(points, field, minimum=3)
        x, y = data[:, 0], data[:, 1]
        # Scale x so the normal equations stay well conditioned at 1e5-token lengths.
        scale = float(x.max()) or 1.0
        c2, c1, c0 = np.polyfit(x / scale, y, 2)
        a, b, c = float(c0), float(c1 / scale), float(c2 / scale**2)
        residual = y - (a + b * x + c * x * x)
        return cls(
            a=a,
            b=b,
            c=c,
            fitted_from=len(x),
            fit_rms_s=float(np.sqrt(np.mean(residual**2))),
        )

    def __call__(self, tokens: ArrayLike) -> FloatArray:
        t = np.asarray(tokens, dtype=np.float64)
        with np.errstate(over="ignore"):  # absurd coefficients: an infinite time, 0 req/s
            return np.asarray(self.a + self.b * t + self.c * t * t)

    def expected(self, mean: ArrayLike, moment2: ArrayLike) -> FloatArray:
        """``E[T(L)] = a + b E[L] + c E[L^2]``: the mean prefill time over a set of requests."""
        m1 = np.asarray(mean, dtype=np.float64)
        m2 = np.asarray(moment2, dtype=np.float64)
        with np.errstate(over="ignore"):
            return np.asarray(self.a + self.b * m1 + self.c * m2)

    def check_positive(self, lower: float, upper: float, field: str) -> None:
        """Raise unless ``T(l) > 0`` over ``[lower, upper]`` (a fit can dip below zero)."""
        xs = np.linspace(lower, upper, 257)
        if self.c != 0:
            vertex = -self.b / (2 * self.c)
            if lower < vertex < upper:
                xs = np.append(xs, vertex)
        if float(self(xs).min()) <= 0:
            raise PlannerInputError(
                field, f"prefill time must be > 0 s for every length in [{lower:g}, {upper:g}]"
            )

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {"coefficients": [self.a, self.b, self.c]}
        if self.fitted_from:
            out["fitted_from_points"] = self.fitted_from
            out["fit_rms_s"] = self.fit_rms_s
        return out


@dataclass(frozen=True)
class KvProfile:
    """KV bytes of one request as a piecewise-linear function of its length."""

    xs: FloatArray  # knots, tokens, increasing
    ys: FloatArray  # bytes at each knot
    source: str  # "linear" | "points" | "architecture"

    @classmethod
    def linear(cls, fixed_bytes: float, per_token_bytes: float, field: str = "kv") -> KvProfile:
        fixed = _finite(fixed_bytes, f"{field}.fixed_bytes", nonneg=True)
        per_token = _finite(per_token_bytes, f"{field}.per_token_bytes", nonneg=True)
        if fixed == 0 and per_token == 0:
            raise PlannerInputError(field, "fixed_bytes and per_token_bytes cannot both be 0")
        return cls(
            xs=np.array([0.0, 1.0]), ys=np.array([fixed, fixed + per_token]), source="linear"
        )

    @classmethod
    def from_points(cls, points: Any, field: str = "kv.points") -> KvProfile:
        data = _points(points, field, minimum=2)
        return cls(xs=data[:, 0], ys=data[:, 1], source="points")

    @classmethod
    def from_architecture(
        cls, arch: Any, upper: float, field: str = "kv.architecture"
    ) -> KvProfile:
        """Sample ``kvsize.kv_bytes`` at 0, at every sliding window and at ``upper``: between
        those knots the size is exactly linear in the length."""
        try:
            normalised = validate_architecture(arch)
        except ArchitectureError as exc:
            raise PlannerInputError(f"{field}.{exc.field}", exc.message) from None
        windows = {g["window"] for g in normalised["layers"] if g["kind"] == "sliding"}
        top = max(math.ceil(upper), 1, *windows) if windows else max(math.ceil(upper), 1)
        knots = sorted({0, *windows, top})
        if len(knots) < 2:
            knots = [0, 1]
        ys = [float(kv_size(normalised, k).total_bytes) for k in knots]
        return cls(xs=np.array(knots, dtype=np.float64), ys=np.array(ys), source="architecture")

    def __call__(self, tokens: ArrayLike) -> FloatArray:
        t = np.asarray(tokens, dtype=np.float64)
        inside = np.interp(t, self.xs, self.ys)
        # np.interp clamps outside the knots; extend along the end segments instead.
        lo_slope = (self.ys[1] - self.ys[0]) / (self.xs[1] - self.xs[0])
        hi_slope = (self.ys[-1] - self.ys[-2]) / (self.xs[-1] - self.xs[-2])
        below = self.ys[0] + lo_slope * (t - self.xs[0])
        above = self.ys[-1] + hi_slope * (t - self.xs[-1])
        out = np.where(t < self.xs[0], below, np.where(t > self.xs[-1], above, inside))
        return np.asarray(np.maximum(out, 0.0))

    def check_positive(self, lower: float, upper: float, field: str) -> None:
        """Raise unless ``S_kv(l) > 0`` over ``[max(lower, 1), upper]`` (extrapolating measured
        points can reach 0; a dense model's 0 bytes at 0 tokens is fine)."""
        lower = max(lower, 1.0)
        xs = np.concatenate([[lower, upper], self.xs[(self.xs > lower) & (self.xs < upper)]])
        if float(self(xs).min()) <= 0:
            raise PlannerInputError(
                field, f"KV size must be > 0 bytes for every length in [{lower:g}, {upper:g}]"
            )

    def describe(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "points": [[float(x), float(y)] for x, y in zip(self.xs, self.ys, strict=True)],
        }


@dataclass(frozen=True)
class DecodeProfile:
    """One decode instance: ``batch_size`` concurrent requests, ``step_time_s`` per token step,
    ``output_tokens`` per request, so it completes ``batch_size / (step_time_s x output_tokens)``
    requests per second."""

    batch_size: float
    step_time_s: float
    output_tokens: float

    def __post_init__(self) -> None:
        _finite(self.batch_size, "batch_size", positive=True)
        _finite(self.step_time_s, "step_time_s", positive=True)
        _finite(self.output_tokens, "output_tokens", positive=True)

    @property
    def requests_per_s(self) -> float:
        return self.batch_size / (self.step_time_s * self.output_tokens)

"""Prompt-length distributions for the capacity planner. Pure Python + numpy (no Django).

The throughput model needs, for a threshold ``t``, three exact quantities of the uncached
prompt length ``L``:

* ``p = P(L > t)`` (the share offloaded to the remote prefill pool),
* ``E[L | L > t]`` (``l_long``) and ``E[L | L <= t]`` (``l_short``).

Both distributions here give them in closed form, vectorised over an array of thresholds:

* ``TruncatedLogNormal``: ``ln L ~ N(mu, sigma)`` truncated to ``[lower, upper]``. With ``Phi``
  the standard normal CDF, ``P(L <= x) = (Phi(z(x)) - Phi(z(lower))) / Z`` and the partial
  expectation ``E[L; a < L <= b] = exp(mu + sigma^2/2) (Phi(z(b) - sigma) - Phi(z(a) - sigma)) / Z``
  where ``z(x) = (ln x - mu) / sigma`` and ``Z = Phi(z(upper)) - Phi(z(lower))``; the second
  moment likewise with ``exp(2 mu + 2 sigma^2)`` and a shift of ``2 sigma``.
* ``Histogram``: bins ``[lo, hi)`` with counts, the density uniform inside each bin (a bin with
  ``lo == hi`` is a point mass), so CDF and partial expectations are exact piecewise formulas.

Callers: ``console.planner.model`` (grid search) and the API input parser. Every function is
pure and blocking (microseconds to a millisecond); bad input raises ``PlannerInputError`` naming
the field.
"""

from __future__ import annotations

import csv
import io
import math
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
from numpy.typing import ArrayLike, NDArray

from console.planner.errors import PlannerInputError

FloatArray = NDArray[np.float64]

_erf = np.vectorize(math.erf, otypes=[np.float64])

# No prompt is longer than this; a larger bound is a unit mistake (bytes for tokens).
MAX_TOKENS = 1e9
# A CSV histogram larger than this is almost certainly a raw log, not a histogram.
MAX_HISTOGRAM_ROWS = 100_000


def _phi(z: FloatArray) -> FloatArray:
    """Standard normal CDF, exact to double precision (numpy has no erf; math.erf is exact)."""
    return np.asarray(0.5 * (1.0 + _erf(np.asarray(z, dtype=np.float64) / math.sqrt(2.0))))


class LengthDistribution(Protocol):
    """What the throughput model needs from a length distribution (all vectorised)."""

    @property
    def lower(self) -> float: ...

    @property
    def upper(self) -> float: ...

    def cdf(self, x: ArrayLike) -> FloatArray:
        """``P(L <= x)``."""
        ...

    def partial_mean(self, x: ArrayLike) -> FloatArray:
        """``E[L; L <= x]`` (the expectation restricted to ``L <= x``, not conditioned)."""
        ...

    def partial_moment2(self, x: ArrayLike) -> FloatArray:
        """``E[L^2; L <= x]`` (for the expected prefill time of a quadratic ``T``)."""
        ...

    @property
    def mean(self) -> float: ...

    @property
    def moment2(self) -> float:
        """``E[L^2]``."""
        ...

    def describe(self) -> dict[str, object]: ...


@dataclass(frozen=True)
class TruncatedLogNormal:
    """``ln L ~ N(mu, sigma^2)`` restricted to ``lower <= L <= upper`` (tokens)."""

    mu: float
    sigma: float
    lower: float
    upper: float
    _z: float = field(init=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("mu", "sigma", "lower", "upper"):
            value = getattr(self, name)
            if not math.isfinite(value):
                raise PlannerInputError(name, "must be a finite number")
        if self.sigma <= 0:
            raise PlannerInputError("sigma", "must be > 0")
        if self.lower <= 0:
            raise PlannerInputError("lower", "must be > 0 (a log-normal has no mass at 0)")
        if self.upper <= self.lower:
            raise PlannerInputError("upper", "must be greater than lower")
        if self.upper > MAX_TOKENS:
            raise PlannerInputError("upper", f"must be at most {MAX_TOKENS:g} tokens")
        mass = float(self._phi_at(self.upper) - self._phi_at(self.lower))
        if not mass > 1e-12:
            raise PlannerInputError(
                "mu", "leaves (almost) no probability inside [lower, upper]; check mu and sigma"
            )
        object.__setattr__(self, "_z", mass)

    def _phi_at(self, x: ArrayLike, shift: float = 0.0) -> FloatArray:
        x = np.clip(np.asarray(x, dtype=np.float64), self.lower, self.upper)
        return _phi((np.log(x) - self.mu) / self.sigma - shift)

    def cdf(self, x: ArrayLike) -> FloatArray:
        return np.clip((self._phi_at(x) - self._phi_at(self.lower)) / self._z, 0.0, 1.0)

    def partial_mean(self, x: ArrayLike) -> FloatArray:
        scale = math.exp(self.mu + self.sigma**2 / 2.0)
        s = self.sigma
        return np.asarray(scale * (self._phi_at(x, s) - self._phi_at(self.lower, s)) / self._z)

    def partial_moment2(self, x: ArrayLike) -> FloatArray:
        # E[L^2; L <= x] = exp(2 mu + 2 sigma^2) (Phi(z(x) - 2 sigma) - Phi(z(lower) - 2 sigma)) / Z
        scale = math.exp(2 * self.mu + 2 * self.sigma**2)
        s2 = 2 * self.sigma
        return np.asarray(scale * (self._phi_at(x, s2) - self._phi_at(self.lower, s2)) / self._z)

    @property
    def mean(self) -> float:
        return float(self.partial_mean(self.upper))

    @property
    def moment2(self) -> float:
        return float(self.partial_moment2(self.upper))

    def describe(self) -> dict[str, object]:
        return {
            "kind": "lognormal",
            "mu": self.mu,
            "sigma": self.sigma,
            "lower": self.lower,
            "upper": self.upper,
            "mean": self.mean,
        }


@dataclass(frozen=True)
class Histogram:
    """Counts over length bins ``[lo, hi)``, uniform inside a bin; ``lo == hi`` is a point mass.

    Bins may arrive in any order but must not overlap (after sorting by ``lo``)."""

    lo: FloatArray
    hi: FloatArray
    weight: FloatArray  # probabilities, summing to 1
    lower: float = field(init=False)
    upper: float = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "lower", float(self.lo[0]))
        object.__setattr__(self, "upper", float(self.hi[-1]))

    @classmethod
    def from_bins(cls, bins: list[tuple[float, float, float]], where: str = "bins") -> Histogram:
        """Build from ``(lo, hi, count)`` rows; raises ``PlannerInputError`` naming the row."""
        if not bins:
            raise PlannerInputError(where, "must hold at least one bin")
        if len(bins) > MAX_HISTOGRAM_ROWS:
            raise PlannerInputError(where, f"has more than {MAX_HISTOGRAM_ROWS} rows")
        order = sorted(range(len(bins)), key=lambda i: (bins[i][0], bins[i][1]))
        previous_hi = -math.inf
        for i in order:
            lo, hi, count = bins[i]
            row = f"{where}[{i}]"
            if not all(math.isfinite(v) for v in (lo, hi, count)):
                raise PlannerInputError(row, "must hold finite numbers")
            if lo < 0:
                raise PlannerInputError(row, "lengths must be >= 0")
            if hi > MAX_TOKENS:
                raise PlannerInputError(row, f"lengths must be at most {MAX_TOKENS:g} tokens")
            if hi < lo:
                raise PlannerInputError(row, "upper edge must be >= lower edge")
            if count < 0:
                raise PlannerInputError(row, "count must be >= 0")
            if lo < previous_hi:
                raise PlannerInputError(row, "overlaps the previous bin")
            previous_hi = hi
        data = np.array([bins[i] for i in order], dtype=np.float64)
        total = float(data[:, 2].sum())
        if not total > 0:
            raise PlannerInputError(where, "counts must not all be zero")
        keep = data[:, 2] > 0
        data = data[keep]
        return cls(lo=data[:, 0], hi=data[:, 1], weight=data[:, 2] / total)

    def _locate(self, x: ArrayLike) -> tuple[FloatArray, FloatArray, FloatArray]:
        """For each ``x``: ``P(L <= x)``, ``E[L; L <= x]`` and ``E[L^2; L <= x]``: the bins
        wholly below ``x`` (cumulative sums) plus the part of the bin holding ``x`` that lies
        at ``<= x``. Binary search over the sorted bins: O(len(x) log bins)."""
        xs = np.asarray(x, dtype=np.float64)
        lo_all, hi_all = self.lo, self.hi
        cum_w = np.concatenate([[0.0], np.cumsum(self.weight)])
        cum_m = np.concatenate([[0.0], np.cumsum(self.weight * (lo_all + hi_all) / 2.0)])
        m2_all = self.weight * (lo_all * lo_all + lo_all * hi_all + hi_all * hi_all) / 3.0
        cum_m2 = np.concatenate([[0.0], np.cumsum(m2_all)])
        k = np.searchsorted(self.lo, xs, side="right") - 1  # last bin starting at <= x
        inside = k >= 0
        kk = np.where(inside, k, 0)
        lo, hi, w = self.lo[kk], self.hi[kk], self.weight[kk]
        width = hi - lo
        frac = np.where(width > 0, np.clip((xs - lo) / np.where(width > 0, width, 1.0), 0, 1), 1.0)
        top = np.minimum(xs, hi)
        part_w = np.where(inside, cum_w[kk] + w * frac, 0.0)
        # The part of the bin below x sits uniformly on [lo, min(x, hi)]: its mean is the midpoint.
        part_m = np.where(inside, cum_m[kk] + w * frac * (lo + top) / 2.0, 0.0)
        # ... and its second moment is that of a uniform on [lo, top].
        part_m2 = np.where(
            inside, cum_m2[kk] + w * frac * (lo * lo + lo * top + top * top) / 3.0, 0.0
        )
        return part_w, part_m, part_m2

    def cdf(self, x: ArrayLike) -> FloatArray:
        part_w, _, _ = self._locate(x)
        return np.asarray(np.clip(part_w, 0.0, 1.0))

    def partial_mean(self, x: ArrayLike) -> FloatArray:
        _, part_m, _ = self._locate(x)
        return np.asarray(part_m)

    def partial_moment2(self, x: ArrayLike) -> FloatArray:
        _, _, part_m2 = self._locate(x)
        return np.asarray(part_m2)

    @property
    def moment2(self) -> float:
        lo, hi = self.lo, self.hi
        return float(self.weight @ ((lo * lo + lo * hi + hi * hi) / 3.0))

    @property
    def mean(self) -> float:
        return float(self.weight @ ((self.lo + self.hi) / 2.0))

    def describe(self) -> dict[str, object]:
        return {
            "kind": "histogram",
            "bins": len(self.weight),
            "lower": self.lower,
            "upper": self.upper,
            "mean": self.mean,
        }


def parse_histogram_csv(text: str, where: str = "csv") -> Histogram:
    """Parse a CSV histogram: rows ``lo,hi,count`` (bins) or ``length,count`` (point masses).

    A first row that is not numeric is taken as a header and skipped; blank lines and lines
    starting with ``#`` are ignored. Errors name the line (``csv line 4``)."""
    rows: list[tuple[float, float, float]] = []
    width: int | None = None
    for number, raw in enumerate(csv.reader(io.StringIO(text)), start=1):
        cells = [c.strip() for c in raw]
        if not cells or not any(cells) or cells[0].startswith("#"):
            continue
        try:
            values = [float(c) for c in cells]
        except ValueError:
            if not rows and width is None:
                width = -1  # header seen; the next numeric row fixes the width
                continue
            raise PlannerInputError(f"{where} line {number}", "must hold numbers only") from None
        if len(values) not in (2, 3):
            raise PlannerInputError(
                f"{where} line {number}", "must have 2 columns (length,count) or 3 (lo,hi,count)"
            )
        if width not in (None, -1) and len(values) != width:
            raise PlannerInputError(f"{where} line {number}", "has a different number of columns")
        width = len(values)
        rows.append((values[0], values[0], values[1]) if len(values) == 2 else tuple(values))  # type: ignore[arg-type]
        if len(rows) > MAX_HISTOGRAM_ROWS:
            raise PlannerInputError(where, f"has more than {MAX_HISTOGRAM_ROWS} rows")
    if not rows:
        raise PlannerInputError(where, "holds no data rows")
    return Histogram.from_bins(rows, where=where)

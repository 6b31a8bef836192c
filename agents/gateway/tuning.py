"""Short-term threshold re-tuning (PrfaaS): when the remote side is under pressure, or its
measured TTFT is worse than local prefill's, send only longer requests (their KV bytes per
second of prefill are lower, and the remote path's fixed costs weigh less on them); come back
down when the pressure falls, and below the configured threshold (to the operator's bound)
when the remote path is measurably faster.

Pure: the gateway's tuning loop calls :meth:`ThresholdTuner.update` every
``retune_interval_s`` with the *pressure* of the best remote site and the remote/local
*TTFT ratio* (:class:`TtftRatio`), and logs/exports each change it returns. Pressure of a
site = max(link utilisation / ceiling, queue depth / queue high water); 1.0 means at the
limit. TTFT ratio = remote TTFT per 1,000 incremental tokens / local TTFT per 1,000 tokens,
from streamed requests near the threshold; above 1 the remote path is the slower one.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TuningSettings:
    """``raise_at``/``lower_at``: pressure above/below which the threshold moves;
    ``step``: multiplicative step; the factor stays within [``min_factor``, ``max_factor``]
    (``min_factor`` < 1 only reached on TTFT evidence); ``ttft_raise_at``/``ttft_lower_at``:
    the remote/local TTFT ratio at or above which the threshold rises, at or below which it
    may fall under the configured one."""

    raise_at: float = 0.9
    lower_at: float = 0.6
    step: float = 1.25
    max_factor: float = 4.0
    queue_high_water: float = 8.0
    min_factor: float = 1.0
    ttft_raise_at: float = 1.0
    ttft_lower_at: float = 0.8


def site_pressure(
    utilization: float, ceiling: float, queue_depth: float, queue_high: float
) -> float:
    """Pressure of one site (see the module docstring)."""
    link = utilization / ceiling if ceiling > 0 else 1.0
    queue = queue_depth / queue_high if queue_high > 0 else 0.0
    return max(link, queue)


class Ewma:
    """An exponentially weighted moving average with its sample count (None until the first
    sample)."""

    __slots__ = ("alpha", "samples", "value")

    def __init__(self, alpha: float) -> None:
        self.alpha = alpha
        self.value: float | None = None
        self.samples = 0

    def add(self, sample: float) -> float:
        self.value = sample if self.value is None else (
            self.alpha * sample + (1 - self.alpha) * self.value
        )  # fmt: skip
        self.samples += 1
        return self.value


class TtftRatio:
    """Measured TTFT of streamed requests per 1,000 incremental prompt tokens, remote and
    local, for the re-tuner. Only requests within a factor of two of the effective threshold
    count (the lengths the threshold decides between: per-token figures of very short or very
    long prompts say little about the threshold's neighbourhood); failed-over remote and
    fallback requests do not (their TTFT includes the failed attempt)."""

    def __init__(self, alpha: float, min_samples: int) -> None:
        self.min_samples = max(min_samples, 1)
        self.remote = Ewma(alpha)
        self.local = Ewma(alpha)

    def add(self, path: str, tokens: int, threshold: int, ttft_s: float) -> bool:
        """One request's TTFT; returns whether it counted."""
        if tokens <= 0 or ttft_s < 0 or not threshold / 2 <= tokens <= threshold * 2:
            return False
        ewma = self.remote if path == "remote" else self.local if path == "local" else None
        if ewma is None:
            return False
        ewma.add(ttft_s * 1000 / tokens)
        return True

    def ratio(self) -> float | None:
        """remote / local, once each has ``min_samples`` samples (None before)."""
        r, loc = self.remote, self.local
        if r.value is None or loc.value is None or loc.value <= 0:
            return None
        if min(r.samples, loc.samples) < self.min_samples:
            return None
        return r.value / loc.value

    def snapshot(self) -> dict[str, float | int | None]:
        """The inputs as ``/debug/routing`` shows them."""
        ratio = self.ratio()
        return {
            "remote_s_per_ktok": _round(self.remote.value),
            "local_s_per_ktok": _round(self.local.value),
            "remote_samples": self.remote.samples,
            "local_samples": self.local.samples,
            "ratio": _round(ratio),
        }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


class ThresholdTuner:
    """Holds the multiplicative factor applied to the configured threshold."""

    def __init__(self, settings: TuningSettings) -> None:
        self.settings = settings
        self.factor = 1.0
        #: Why the last change happened: ``pressure``, ``ttft`` (the remote path measured
        #: slower: up; faster: down below 1.0) or ``relax`` (back towards 1.0).
        self.last_reason = ""

    def effective(self, base_tokens: int) -> int:
        """The threshold to route with, given the snapshot's configured one."""
        return round(base_tokens * self.factor)

    def update(
        self, pressure: float | None, ttft_ratio: float | None = None
    ) -> tuple[float, float] | None:
        """Feed the current pressure (None: no remote site in play, relax towards 1.0) and
        the remote/local TTFT ratio (None: not measured enough). Returns ``(old_factor,
        new_factor)`` when the factor changed (its reason in :attr:`last_reason`), else
        None. Up: pressure at ``raise_at`` or the ratio at ``ttft_raise_at``. Down: pressure
        at ``lower_at`` or none, to ``min_factor`` when the ratio is at ``ttft_lower_at``,
        else to 1.0 (from either side)."""
        s = self.settings
        old = self.factor
        slow = pressure is not None and ttft_ratio is not None and ttft_ratio >= s.ttft_raise_at
        if pressure is not None and pressure >= s.raise_at:
            new, reason = min(old * s.step, s.max_factor), "pressure"
        elif slow:
            new, reason = min(old * s.step, s.max_factor), "ttft"
        elif pressure is None or pressure <= s.lower_at:
            fast = pressure is not None and ttft_ratio is not None and ttft_ratio <= s.ttft_lower_at
            if fast:
                floor, reason = min(s.min_factor, 1.0), "ttft"
            else:
                floor, reason = 1.0, "relax"
            new = max(old / s.step, floor) if old > floor else min(old * s.step, floor)
        else:
            new, reason = old, ""
        # Snap to the bounds so that repeated steps land exactly on 1.0.
        if abs(new - 1.0) < 1e-9:
            new = 1.0
        if new == old:
            return None
        self.factor = new
        self.last_reason = reason
        return old, new

"""Short-term threshold re-tuning (PrfaaS): when the remote side is under pressure, send only
longer requests (their KV bytes per second of prefill are lower), and come back down when the
pressure falls.

Pure: the gateway's tuning loop calls :meth:`ThresholdTuner.update` every
``retune_interval_s`` with the *pressure* of the best remote site and logs/exports each change
it returns. Pressure of a site = max(link utilisation / ceiling, queue depth / queue high
water); 1.0 means at the limit.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TuningSettings:
    """``raise_at``/``lower_at``: pressure above/below which the threshold moves;
    ``step``: multiplicative step; ``max_factor``: the effective threshold stays within
    [base, base * max_factor]."""

    raise_at: float = 0.9
    lower_at: float = 0.6
    step: float = 1.25
    max_factor: float = 4.0
    queue_high_water: float = 8.0


def site_pressure(
    utilization: float, ceiling: float, queue_depth: float, queue_high: float
) -> float:
    """Pressure of one site (see the module docstring)."""
    link = utilization / ceiling if ceiling > 0 else 1.0
    queue = queue_depth / queue_high if queue_high > 0 else 0.0
    return max(link, queue)


class ThresholdTuner:
    """Holds the multiplicative factor applied to the configured threshold."""

    def __init__(self, settings: TuningSettings) -> None:
        self.settings = settings
        self.factor = 1.0

    def effective(self, base_tokens: int) -> int:
        """The threshold to route with, given the snapshot's configured one."""
        return round(base_tokens * self.factor)

    def update(self, pressure: float | None) -> tuple[float, float] | None:
        """Feed the current pressure (None: no remote site in play, relax towards 1.0).
        Returns ``(old_factor, new_factor)`` when the factor changed, else None."""
        s = self.settings
        old = self.factor
        if pressure is not None and pressure >= s.raise_at:
            new = min(old * s.step, s.max_factor)
        elif pressure is None or pressure <= s.lower_at:
            new = max(old / s.step, 1.0)
        else:
            new = old
        # Snap to the bounds so that repeated division lands exactly on 1.0.
        if abs(new - 1.0) < 1e-9:
            new = 1.0
        if new == old:
            return None
        self.factor = new
        return old, new

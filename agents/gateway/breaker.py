"""Circuit breakers, one per remote site and one per remote instance (per gateway process).

Pure state machine with an injected clock (a ``() -> float`` of monotonic seconds), so tests
drive time by hand. The request handler calls :meth:`CircuitBreaker.try_acquire` before it
sends a prefill leg and :meth:`CircuitBreaker.record` (or :meth:`CircuitBreaker.release`)
when the leg ends. Nothing blocks; nothing raises.

States: ``closed`` (traffic flows; outcomes go into a sliding time window) -> ``open`` when,
over the window with at least ``min_requests`` outcomes, the error rate exceeds
``error_rate_limit`` or the p99 latency exceeds ``latency_p99_limit_s``, or at once after
``consecutive_failures`` failures in a row. ``open`` ejects the target for
``ejection_base_s * 2**(ejections-1)`` capped at ``ejection_cap_s``; then ``half_open`` lets
``half_open_probes`` requests through at a time; ``close_after_successes`` successes close it,
one failure re-opens it with a longer ejection. The ejection count decays back to zero after
the breaker has stayed closed for ``ejection_decay_s``. The cap is short (10 s) on purpose:
it bounds how long traffic stays away after the fault cleared (the next half-open probe
comes at most a cap later), while the decay (120 s) keeps a flapping target's ejections long
for that while.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

State = Literal["closed", "open", "half_open"]

#: Numeric state for the ``pdbridge_gateway_breaker_state`` gauge.
STATE_VALUE: dict[str, int] = {"closed": 0, "half_open": 1, "open": 2}


@dataclass(frozen=True, slots=True)
class BreakerSettings:
    """Breaker knobs. The two limits come from the deployment snapshot's ``circuit_breaker``
    section; the rest are gateway settings (see :class:`agents.gateway.config.GatewaySettings`)."""

    error_rate_limit: float = 0.05
    latency_p99_limit_s: float = 2.5
    window_s: float = 30.0
    min_requests: int = 20
    consecutive_failures: int = 5
    ejection_base_s: float = 5.0
    ejection_cap_s: float = 8.0
    ejection_decay_s: float = 120.0
    half_open_probes: int = 1
    close_after_successes: int = 3
    max_samples: int = 2_000


class CircuitBreaker:
    """One breaker. Not thread-safe: it lives on the gateway's event loop."""

    def __init__(self, name: str, settings: BreakerSettings, clock: Callable[[], float]) -> None:
        self.name = name
        self.settings = settings
        self._clock = clock
        self._state: State = "closed"
        # (time, ok, latency_s) of recent outcomes while closed.
        self._window: deque[tuple[float, bool, float]] = deque()
        self._failures_in_window = 0
        self._consecutive_failures = 0
        self._open_until = 0.0
        self._ejections = 0
        self._closed_since = clock()
        self._probes_in_flight = 0
        self._probe_successes = 0
        self.last_reason = ""
        self.total_ejections = 0

    # -- reading -------------------------------------------------------------------------
    @property
    def state(self) -> State:
        """Current state; an ``open`` breaker whose ejection has run out reads ``half_open``."""
        if self._state == "open" and self._clock() >= self._open_until:
            self._state = "half_open"
            self._probes_in_flight = 0
            self._probe_successes = 0
        return self._state

    def allows(self) -> bool:
        """Whether a request could go through now (does not reserve a probe slot)."""
        state = self.state
        if state == "closed":
            return True
        if state == "half_open":
            return self._probes_in_flight < self.settings.half_open_probes
        return False

    def snapshot(self) -> dict[str, Any]:
        """State for ``/debug/routing``."""
        now = self._clock()
        self._expire(now)
        n = len(self._window)
        return {
            "name": self.name,
            "state": self.state,
            "window_requests": n,
            "window_error_rate": round(self._failures_in_window / n, 4) if n else 0.0,
            "window_p99_s": round(self._p99(), 4) if n else None,
            "consecutive_failures": self._consecutive_failures,
            "ejections": self._ejections,
            "open_for_s": round(max(self._open_until - now, 0.0), 3),
            "last_reason": self.last_reason,
        }

    # -- writing -------------------------------------------------------------------------
    def try_acquire(self) -> bool:
        """Reserve the right to send one request; False when the breaker refuses."""
        state = self.state
        if state == "closed":
            return True
        if state == "half_open" and self._probes_in_flight < self.settings.half_open_probes:
            self._probes_in_flight += 1
            return True
        return False

    def release(self) -> None:
        """The acquired request ended without a verdict (client went away): free its slot."""
        if self._state == "half_open" and self._probes_in_flight > 0:
            self._probes_in_flight -= 1

    def record(self, ok: bool, latency_s: float) -> None:
        """The outcome of an acquired request."""
        now = self._clock()
        state = self.state
        if state == "half_open":
            self._probes_in_flight = max(self._probes_in_flight - 1, 0)
            if not ok:
                self._trip(now, "probe_failed")
                return
            self._probe_successes += 1
            if self._probe_successes >= self.settings.close_after_successes:
                self._close(now)
            return
        if state == "open":
            # A request sent before the breaker opened; it no longer changes anything.
            return
        if now - self._closed_since >= self.settings.ejection_decay_s:
            self._ejections = 0
        self._window.append((now, ok, latency_s))
        if not ok:
            self._failures_in_window += 1
            self._consecutive_failures += 1
        else:
            self._consecutive_failures = 0
        self._expire(now)
        self._evaluate(now)

    def trip(self, reason: str) -> None:
        """Open now (``reason``: who decided, e.g. ``ejected`` by the instance's pool health),
        with the ejection an error-rate trip would give."""
        self._trip(self._clock(), reason)

    # -- internals -----------------------------------------------------------------------
    def _expire(self, now: float) -> None:
        horizon = now - self.settings.window_s
        window = self._window
        while window and (window[0][0] < horizon or len(window) > self.settings.max_samples):
            _, ok, _ = window.popleft()
            if not ok:
                self._failures_in_window -= 1

    def _p99(self) -> float:
        latencies = sorted(sample[2] for sample in self._window)
        index = max(math.ceil(0.99 * len(latencies)) - 1, 0)
        return latencies[index]

    def _evaluate(self, now: float) -> None:
        s = self.settings
        if self._consecutive_failures >= s.consecutive_failures:
            self._trip(now, "consecutive_failures")
            return
        n = len(self._window)
        if n < s.min_requests:
            return
        if self._failures_in_window / n > s.error_rate_limit:
            self._trip(now, "error_rate")
        elif self._window[-1][2] > s.latency_p99_limit_s and self._p99() > s.latency_p99_limit_s:
            # Sorting the window only when the newest sample is itself slow keeps the common
            # path O(1); p99 can only have crossed the limit if a slow sample just arrived.
            self._trip(now, "latency_p99")

    def _trip(self, now: float, reason: str) -> None:
        s = self.settings
        self._ejections += 1
        self.total_ejections += 1
        ejection = min(s.ejection_base_s * 2 ** (self._ejections - 1), s.ejection_cap_s)
        self._state = "open"
        self._open_until = now + ejection
        self._probes_in_flight = 0
        self._probe_successes = 0
        self._window.clear()
        self._failures_in_window = 0
        self._consecutive_failures = 0
        self.last_reason = reason

    def _close(self, now: float) -> None:
        self._state = "closed"
        self._closed_since = now
        self._window.clear()
        self._failures_in_window = 0
        self._consecutive_failures = 0
        self.last_reason = "recovered"

"""Pool health: every instance the gateway sends legs to (the local decode pool, each remote
site's prefill pool) is judged by active probes and by outlier ejection, in Envoy's manner.

* **Outlier ejection (passive)**: ``consecutive_failures`` legs in a row that failed at the
  instance (connect error, timeout, a 5xx that is not a KV verdict, a connection that broke
  before the first byte) eject it for ``base_ejection_s x times ejected`` (capped at
  ``max_ejection_s``). The count of ejections decays back to zero once the instance has stayed
  in service for ``max_ejection_s``. An ejection that would leave fewer than
  ``100 - max_ejection_percent`` % of the pool available is skipped (logged): a pool of one
  is never ejected passively, and the last available instance of any pool never is.
* **Active probes**: every ``check_interval_s`` each instance's ``GET /health`` (bounded by
  ``check_timeout_s``); ``unhealthy_threshold`` failures in a row mark it unhealthy,
  ``healthy_threshold`` successes in a row healthy again -- and clear an ejection, since the
  instance has just been seen serving. A probe is evidence, not a guess, so it is not bound
  by the ejection percentage.

An instance is *available* when it is healthy and not ejected. Who calls it: the router
(:mod:`agents.gateway.state`) records each leg's outcome and asks for available instances;
the probe loop (:mod:`agents.gateway.server`) records probes. Pure state with an injected
clock; event-loop only; never raises on the request path.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("pdbridge.gateway")


@dataclass(frozen=True, slots=True)
class HealthSettings:
    """Outlier-ejection and probe knobs (``GatewaySettings.outlier_*`` / ``health_check_*``)."""

    consecutive_failures: int = 3
    base_ejection_s: float = 5.0
    max_ejection_s: float = 60.0
    max_ejection_percent: float = 50.0
    check_interval_s: float = 2.0
    check_timeout_s: float = 1.0
    unhealthy_threshold: int = 2
    healthy_threshold: int = 2


class InstanceHealth:
    """One instance's health within one pool."""

    __slots__ = (
        "consecutive_failures",
        "ejected_until",
        "ejections",
        "healthy",
        "in_service_since",
        "last_failure",
        "probe_failures",
        "probe_successes",
        "total_ejections",
        "url",
    )

    def __init__(self, url: str, now: float) -> None:
        self.url = url
        self.healthy = True  # until probes say otherwise
        self.consecutive_failures = 0
        self.ejected_until = 0.0
        self.ejections = 0
        self.total_ejections = 0
        self.in_service_since = now
        self.probe_failures = 0
        self.probe_successes = 0
        self.last_failure = ""

    def ejected(self, now: float) -> bool:
        return now < self.ejected_until

    def available(self, now: float) -> bool:
        return self.healthy and now >= self.ejected_until


class PoolHealth:
    """The instances of one pool (``role`` decode or prefill, at ``site``)."""

    def __init__(
        self,
        role: str,
        site: str,
        urls: Iterable[str],
        settings: HealthSettings,
        clock: Callable[[], float],
        on_eject: Callable[[PoolHealth, InstanceHealth, str], None] | None = None,
        drained: Iterable[str] = (),
    ) -> None:
        self.role = role
        self.site = site
        self.settings = settings
        self.clock = clock
        self.on_eject = on_eject
        now = clock()
        self.instances: dict[str, InstanceHealth] = {u: InstanceHealth(u, now) for u in urls}
        #: Instances the console drained (``drained: true`` in the snapshot): never available,
        #: not probed, not counted by the ejection limit (they are out by plan, not fault).
        self.drained: frozenset[str] = frozenset(drained)

    def reuse(self, old: PoolHealth | None) -> list[str]:
        """Keep the state of the instances that remain from ``old`` (a new config), except
        those that rejoin after a drain: their engine was (re)started and found healthy
        before the console put them back, so they start afresh. Returns the rejoined."""
        if old is None:
            return []
        rejoined = []
        for url in self.instances:
            if url in old.drained and url not in self.drained:
                rejoined.append(url)
                self._log("gateway.instance_rejoined", url)
            elif url in old.instances:
                self.instances[url] = old.instances[url]
        for url in sorted(self.drained - old.drained):
            self._log("gateway.instance_drained", url)
        return rejoined

    # -- reading -------------------------------------------------------------------------
    def available(self, url: str) -> bool:
        if url in self.drained:
            return False
        inst = self.instances.get(url)
        return inst is None or inst.available(self.clock())

    def in_rotation(self) -> list[str]:
        """The instances not drained (available or not)."""
        return [u for u in self.instances if u not in self.drained]

    def healthy_count(self) -> int:
        now = self.clock()
        return sum(
            1 for u, i in self.instances.items() if u not in self.drained and i.available(now)
        )

    def snapshot(self) -> dict[str, Any]:
        """The pool's entry in ``/health`` and ``/debug/routing``."""
        now = self.clock()
        healthy = self.healthy_count()
        return {
            "role": self.role,
            "site": self.site,
            "healthy": healthy,
            "total": len(self.instances),
            "drained": len(self.drained & set(self.instances)),
            "status": "unhealthy" if healthy == 0 else "ok",
            "instances": [
                {
                    "url": i.url,
                    "available": i.url not in self.drained and i.available(now),
                    "drained": i.url in self.drained,
                    "healthy": i.healthy,
                    "ejected_for_s": round(max(i.ejected_until - now, 0.0), 3),
                    "consecutive_failures": i.consecutive_failures,
                    "ejections": i.total_ejections,
                    "last_failure": i.last_failure,
                }
                for i in self.instances.values()
            ],
        }

    # -- legs ----------------------------------------------------------------------------
    def success(self, url: str) -> None:
        """A leg to ``url`` produced output (or an answer of the engine's own)."""
        inst = self.instances.get(url)
        if inst is None:
            return
        inst.consecutive_failures = 0
        now = self.clock()
        if inst.ejections and now - inst.in_service_since >= self.settings.max_ejection_s:
            inst.ejections = 0

    def failure(self, url: str, cause: str) -> bool:
        """A leg to ``url`` failed at the instance; returns whether it was ejected now."""
        inst = self.instances.get(url)
        if inst is None:
            return False
        inst.last_failure = cause
        inst.consecutive_failures += 1
        now = self.clock()
        if inst.ejected(now) or inst.consecutive_failures < self.settings.consecutive_failures:
            return False
        return self._eject(inst, now, cause)

    def _eject(self, inst: InstanceHealth, now: float, cause: str) -> bool:
        s = self.settings
        serving = [i for u, i in self.instances.items() if u not in self.drained]
        total = len(serving)
        unavailable = sum(1 for i in serving if not i.available(now))
        allowed = math.floor(total * s.max_ejection_percent / 100)
        if unavailable + 1 > allowed or unavailable + 1 >= total:
            # Ejecting it would leave the pool with too few (or none) to serve: keep it,
            # its next failures are still retried elsewhere where possible.
            inst.consecutive_failures = 0
            self._log("gateway.ejection_skipped", inst.url, cause=cause, unavailable=unavailable)
            return False
        if inst.ejections and now - inst.in_service_since >= s.max_ejection_s:
            inst.ejections = 0
        inst.ejections += 1
        inst.total_ejections += 1
        duration = min(s.base_ejection_s * inst.ejections, s.max_ejection_s)
        inst.ejected_until = now + duration
        inst.in_service_since = inst.ejected_until
        inst.consecutive_failures = 0
        self._log(
            "gateway.instance_ejected",
            inst.url,
            cause=cause,
            ejection_s=duration,
            ejections=inst.ejections,
        )
        if self.on_eject is not None:
            self.on_eject(self, inst, cause)
        return True

    def _log(self, event: str, url: str, **fields: Any) -> None:
        """A pool event, with the pool, the instance and the pool's size."""
        extra = {"role": self.role, "site": self.site, "url": url, "total": len(self.instances)}
        log.warning(event, extra={**extra, **fields})

    # -- probes --------------------------------------------------------------------------
    def probe(self, url: str, ok: bool) -> bool:
        """The outcome of one active probe of ``url``; returns whether it marked the instance
        unhealthy now."""
        inst = self.instances.get(url)
        if inst is None:
            return False
        s = self.settings
        if ok:
            inst.probe_failures = 0
            inst.probe_successes += 1
            if not inst.healthy and inst.probe_successes >= s.healthy_threshold:
                inst.healthy = True
                # Seen serving again: whatever ejected it has passed.
                inst.ejected_until = 0.0
                inst.consecutive_failures = 0
                inst.in_service_since = self.clock()
                self._log("gateway.instance_healthy", url)
            return False
        inst.probe_successes = 0
        inst.probe_failures += 1
        if inst.healthy and inst.probe_failures >= s.unhealthy_threshold:
            inst.healthy = False
            inst.last_failure = "health_check"
            self._log("gateway.instance_unhealthy", url)
            return True
        return False


def pick(
    pool: PoolHealth,
    urls: list[str],
    inflight: dict[str, int],
    exclude: frozenset[str] = frozenset(),
) -> str | None:
    """The available url of ``urls`` (in the caller's order: ties keep it) with the fewest
    legs in flight, skipping ``exclude``; when none is available, the least loaded of the
    rest not excluded (panic routing: a pool whose every instance looks down is still tried,
    never refused outright); None when every url is excluded."""
    candidates = [u for u in urls if u not in exclude]
    if not candidates:
        return None
    live = [u for u in candidates if pool.available(u)] or candidates
    return min(live, key=lambda u: inflight.get(u, 0))

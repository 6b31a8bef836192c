"""The router: live per-site state around the pure decision core.

Holds the current snapshot, the breakers (one per remote site, one per remote instance), the
threshold tuner, the per-site load signals (queue depth scraped from engine metrics plus the
gateway's own in-flight legs) and the link-utilisation estimate (prompt tokens routed to a
site in the last ``utilization_window_s`` x KV bytes per token, against the link's
bandwidth). Event-loop only, never blocks, never raises on the request path.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from agents.gateway.breaker import CircuitBreaker
from agents.gateway.config import DeploymentConfig, GatewaySettings, Instance, Site
from agents.gateway.decision import Decision, RoutingPolicy, SiteView, decide
from agents.gateway.tuning import ThresholdTuner, site_pressure

log = logging.getLogger("pdbridge.gateway")


@dataclass(slots=True)
class SiteStats:
    """Load signals for one remote site."""

    scraped_queue: float = 0.0
    inflight: int = 0
    tokens: deque[tuple[float, int]] = field(default_factory=deque)
    token_sum: int = 0


class Router:
    """Routing state of one gateway process (breakers are per instance of the gateway)."""

    def __init__(self, settings: GatewaySettings, clock: Callable[[], float] = time.monotonic):
        self.settings = settings
        self.clock = clock
        self.config: DeploymentConfig | None = None
        self.tuner = ThresholdTuner(settings.tuning())
        self.site_breakers: dict[str, CircuitBreaker] = {}
        self.instance_breakers: dict[str, CircuitBreaker] = {}
        self.stats: dict[str, SiteStats] = {}
        self.instance_inflight: dict[str, int] = {}
        self._decode_turn = 0

    # -- configuration -------------------------------------------------------------------
    def apply(self, config: DeploymentConfig) -> None:
        """Swap in a new snapshot atomically. Breakers and load signals of sites and
        instances that remain are kept; new limits apply to them from now on."""
        breaker_settings = self.settings.breaker(
            config.error_rate_limit, config.latency_p99_limit_ms
        )
        sites: dict[str, CircuitBreaker] = {}
        instances: dict[str, CircuitBreaker] = {}
        for site in config.prefill:
            breaker = self.site_breakers.get(site.name) or CircuitBreaker(
                site.name, breaker_settings, self.clock
            )
            breaker.settings = breaker_settings
            sites[site.name] = breaker
            self.stats.setdefault(site.name, SiteStats())
            for inst in site.instances:
                ib = self.instance_breakers.get(inst.url) or CircuitBreaker(
                    inst.url, breaker_settings, self.clock
                )
                ib.settings = breaker_settings
                instances[inst.url] = ib
        self.site_breakers, self.instance_breakers = sites, instances
        self.config = config

    # -- decisions -----------------------------------------------------------------------
    def _link(self, config: DeploymentConfig, site: str) -> tuple[float, float]:
        link = config.links.get(site)
        if link is None:
            return 0.0, config.link_utilization_ceiling
        return link.bandwidth_mbit_s, link.utilization_ceiling

    def utilization(self, site: str, bandwidth_mbit_s: float) -> float:
        """Estimated fraction of the link's bandwidth the KV of recent remote requests uses."""
        stats = self.stats.get(site)
        if stats is None or bandwidth_mbit_s <= 0:
            return 0.0
        horizon = self.clock() - self.settings.utilization_window_s
        tokens = stats.tokens
        while tokens and tokens[0][0] < horizon:
            stats.token_sum -= tokens.popleft()[1]
        config = self.config
        per_token = (config and config.kv_bytes_per_token) or self.settings.kv_bytes_per_token
        bits_per_s = stats.token_sum * per_token * 8 / self.settings.utilization_window_s
        return bits_per_s / (bandwidth_mbit_s * 1e6)

    def site_views(self, config: DeploymentConfig) -> list[SiteView]:
        """The decision core's view of every remote site now."""
        views = []
        for site in config.prefill:
            bandwidth, ceiling = self._link(config, site.name)
            stats = self.stats[site.name]
            available = self.site_breakers[site.name].allows() and any(
                self.instance_breakers[i.url].allows() for i in site.instances
            )
            views.append(
                SiteView(
                    name=site.name,
                    available=available,
                    queue_depth=stats.scraped_queue + stats.inflight,
                    utilization=self.utilization(site.name, bandwidth),
                    ceiling=ceiling,
                    # An unknown link is treated as 1 Gbit/s for scoring only.
                    bandwidth_mbit_s=bandwidth or 1000.0,
                )
            )
        return views

    def decide(
        self, config: DeploymentConfig, key: str, prompt_tokens: int, cached_tokens: int = 0
    ) -> Decision:
        """Route one request under ``config`` (the snapshot the request started with)."""
        policy = RoutingPolicy(
            kill_switch=config.kill_switch,
            remote_share_percent=config.remote_share_percent,
            threshold_tokens=self.tuner.effective(config.threshold_tokens),
        )
        return decide(policy, key, prompt_tokens, cached_tokens, lambda: self.site_views(config))

    # -- instance choice -----------------------------------------------------------------
    def acquire_prefill(self, config: DeploymentConfig, site_name: str) -> Instance | None:
        """Reserve the site's breaker and its least-loaded instance whose breaker allows a
        request; None when none does (the caller falls back)."""
        site = next((s for s in config.prefill if s.name == site_name), None)
        if site is None or not self.site_breakers[site_name].try_acquire():
            return None
        candidates = sorted(
            (i for i in site.instances if self.instance_breakers[i.url].allows()),
            key=lambda i: self.instance_inflight.get(i.url, 0),
        )
        for inst in candidates:
            if self.instance_breakers[inst.url].try_acquire():
                return inst
        self.site_breakers[site_name].release()
        return None

    def record_prefill(
        self, site: str, inst: Instance, ok: bool | None, latency_s: float, cause: str = ""
    ) -> None:
        """Outcome of a prefill leg (``ok=None``: abandoned without verdict)."""
        for breaker in (self.site_breakers.get(site), self.instance_breakers.get(inst.url)):
            if breaker is None:
                continue
            before = breaker.state
            if ok is None:
                breaker.release()
                continue
            breaker.record(ok, latency_s)
            after = breaker.state
            if after != before:
                log.warning(
                    "gateway.breaker_state",
                    extra={"breaker": breaker.name, "from": before, "to": after, "cause": cause},
                )

    def pick_decode(self, config: DeploymentConfig) -> Instance:
        """The local decode instance with the fewest in-flight requests (round-robin among
        equals, so an idle pool spreads load)."""
        instances = config.decode.instances
        self._decode_turn = (self._decode_turn + 1) % len(instances)
        rotated = instances[self._decode_turn :] + instances[: self._decode_turn]
        return min(rotated, key=lambda i: self.instance_inflight.get(i.url, 0))

    def begin(self, url: str, site: str | None = None) -> None:
        """An upstream leg to ``url`` started (load signal)."""
        self.instance_inflight[url] = self.instance_inflight.get(url, 0) + 1
        if site is not None and site in self.stats:
            self.stats[site].inflight += 1

    def end(self, url: str, site: str | None = None) -> None:
        """An upstream leg to ``url`` ended."""
        self.instance_inflight[url] = max(self.instance_inflight.get(url, 1) - 1, 0)
        if site is not None and site in self.stats:
            self.stats[site].inflight = max(self.stats[site].inflight - 1, 0)

    def note_remote_tokens(self, site: str, tokens: int) -> None:
        """A request with ``tokens`` incremental prompt tokens was sent to ``site``."""
        stats = self.stats.get(site)
        if stats is not None:
            stats.tokens.append((self.clock(), tokens))
            stats.token_sum += tokens

    # -- re-tuning -----------------------------------------------------------------------
    def retune(self) -> tuple[float, float] | None:
        """One re-tuning step from the best available site's pressure; logs a change."""
        config = self.config
        if config is None:
            return None
        pressures = [
            site_pressure(v.utilization, v.ceiling, v.queue_depth, self.settings.queue_high_water)
            for v in self.site_views(config)
            if v.available
        ]
        change = self.tuner.update(min(pressures) if pressures else None)
        if change is not None:
            log.info(
                "gateway.threshold_retuned",
                extra={
                    "factor_from": round(change[0], 4),
                    "factor_to": round(change[1], 4),
                    "threshold_tokens": self.tuner.effective(config.threshold_tokens),
                    "pressure": round(min(pressures), 4) if pressures else None,
                },
            )
        return change

    def debug(self) -> dict[str, Any]:
        """The ``/debug/routing`` document."""
        config = self.config
        if config is None:
            return {"config": None}
        views = {v.name: v for v in self.site_views(config)}
        return {
            "config": {
                "deployment": config.deployment_id,
                "version": config.version,
                "model": config.model_name,
                "kill_switch": config.kill_switch,
                "remote_share_percent": config.remote_share_percent,
                "threshold_tokens": config.threshold_tokens,
                "fallback_to_local_prefill": config.fallback_to_local_prefill,
            },
            "effective_threshold_tokens": self.tuner.effective(config.threshold_tokens),
            "threshold_factor": round(self.tuner.factor, 4),
            "sites": [
                {
                    "site": site.name,
                    "available": views[site.name].available,
                    "queue_depth": views[site.name].queue_depth,
                    "link_utilization": round(views[site.name].utilization, 4),
                    "link_ceiling": views[site.name].ceiling,
                    "bandwidth_mbit_s": views[site.name].bandwidth_mbit_s,
                    "breaker": self.site_breakers[site.name].snapshot(),
                    "instances": [
                        {
                            "name": inst.name,
                            "url": inst.url,
                            "inflight": self.instance_inflight.get(inst.url, 0),
                            "breaker": self.instance_breakers[inst.url].snapshot(),
                        }
                        for inst in site.instances
                    ],
                }
                for site in config.prefill
            ],
            "decode": _site_doc(config.decode, self.instance_inflight),
        }


def _site_doc(site: Site, inflight: dict[str, int]) -> dict[str, Any]:
    return {
        "site": site.name,
        "instances": [
            {
                "name": i.name,
                "url": i.url,
                "kv_address": i.kv_address,
                "inflight": inflight.get(i.url, 0),
            }
            for i in site.instances
        ],
    }

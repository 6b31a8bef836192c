"""The router: live per-site state around the pure decision core.

Holds the current snapshot, the breakers (one per remote site, one per prefill instance --
remote or of the local prefill pool, which is never a remote site), the
threshold tuner, the per-site load signals (queue depth scraped from engine metrics plus the
gateway's own in-flight legs), the link-utilisation estimate (prompt tokens routed to a
site in the last ``utilization_window_s`` x KV bytes per token, against the link's
bandwidth), each site's prefill latency (EWMA of its prefill legs' TTFT, in the site score)
and the remote/local TTFT the re-tuner compares. Event-loop only, never blocks, never raises
on the request path.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from agents.gateway.breaker import CircuitBreaker
from agents.gateway.config import DeploymentConfig, GatewaySettings, Instance, Site
from agents.gateway.decision import (
    Decision,
    RoutingPolicy,
    SiteView,
    choose_site,
    decide,
    site_score,
)
from agents.gateway.health import InstanceHealth, PoolHealth, pick
from agents.gateway.tuning import Ewma, ThresholdTuner, TtftRatio, site_pressure

log = logging.getLogger("pdbridge.gateway")


@dataclass(slots=True)
class SiteStats:
    """Load signals for one remote site."""

    scraped_queue: float = 0.0
    inflight: int = 0
    #: [time, tokens] of each request sent to the site, oldest first (a list, so that a
    #: request whose prefill leg did not go through can give its tokens back in place).
    tokens: deque[list[float]] = field(default_factory=deque)
    token_sum: float = 0
    #: EWMA of the site's prefill legs' TTFT (seconds) and when its last sample came.
    latency: Ewma | None = None
    latency_at: float = 0.0


class Router:
    """Routing state of one gateway process (breakers are per instance of the gateway)."""

    def __init__(self, settings: GatewaySettings, clock: Callable[[], float] = time.monotonic):
        self.settings = settings
        self.clock = clock
        self.config: DeploymentConfig | None = None
        self.tuner = ThresholdTuner(settings.tuning())
        self.ttft = TtftRatio(settings.latency_ewma_alpha, settings.retune_ttft_min_samples)
        #: The re-tuner's last changes, newest last (``/debug/routing``).
        self.threshold_changes: deque[dict[str, Any]] = deque(maxlen=20)
        self.last_pressure: float | None = None
        self.site_breakers: dict[str, CircuitBreaker] = {}
        self.instance_breakers: dict[str, CircuitBreaker] = {}
        self.stats: dict[str, SiteStats] = {}
        self.instance_inflight: dict[str, int] = {}
        #: Health of every pool: ("decode", site) and ("prefill", site).
        self.pools: dict[tuple[str, str], PoolHealth] = {}
        #: Called when a pool ejects an instance (the gateway counts it in its metrics).
        self.on_eject: Callable[[PoolHealth, InstanceHealth, str], None] | None = None
        #: Called with (role, site, url, cause) for each leg failing at an instance, and
        #: with (role, site, url, ok) for each active probe.
        self.on_failure: Callable[[str, str, str, str], None] | None = None
        self.on_probe: Callable[[str, str, str, bool], None] | None = None
        #: Called with (role, site, url, why) when an instance stops being available by
        #: evidence (probes marked it unhealthy, or it was ejected): the gateway abandons
        #: the legs waiting on it.
        self.on_unavailable: Callable[[str, str, str, str], None] | None = None
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
        # The local prefill pool: instance breakers and pool health as a remote site's, but no
        # site breaker, load signals or link (it is not a remote site).
        local = () if config.local_prefill is None else (config.local_prefill,)
        for inst in (i for site in local for i in site.instances):
            ib = self.instance_breakers.get(inst.url) or CircuitBreaker(
                inst.url, breaker_settings, self.clock
            )
            ib.settings = breaker_settings
            instances[inst.url] = ib
        pools: dict[tuple[str, str], PoolHealth] = {}
        health = self.settings.health()
        prefill_pools = [("prefill", s) for s in (*config.prefill, *local)]
        for role, site in [("decode", config.decode), *prefill_pools]:
            pool = PoolHealth(
                role,
                site.name,
                [i.url for i in site.instances],
                health,
                self.clock,
                self._ejected,
                drained=[i.url for i in site.instances if i.drained],
            )
            for url in pool.reuse(self.pools.get((role, site.name))):
                # Rejoined after a drain (its engine restarted and found healthy): its old
                # breaker verdicts were about the engine that was stopped.
                if url in instances:
                    instances[url] = CircuitBreaker(url, breaker_settings, self.clock)
            pools[(role, site.name)] = pool
        self.site_breakers, self.instance_breakers = sites, instances
        self.pools = pools
        self.config = config

    def _ejected(self, pool: PoolHealth, inst: InstanceHealth, cause: str) -> None:
        # The instance's breaker agrees with its pool: an ejected prefill instance's breaker
        # opens too (it half-opens and closes on successes, as after its own trip), so
        # /debug/routing and the breaker gauges name the instance, not the site.
        breaker = self.instance_breakers.get(inst.url) if pool.role == "prefill" else None
        if breaker is not None and breaker.state != "open":
            before = breaker.state
            breaker.trip("ejected")
            log.warning(
                "gateway.breaker_state",
                extra={"breaker": breaker.name, "from": before, "to": "open", "cause": cause},
            )
        if self.on_eject is not None:
            self.on_eject(pool, inst, cause)
        if self.on_unavailable is not None:
            self.on_unavailable(pool.role, pool.site, inst.url, "ejected")

    # -- pool health ---------------------------------------------------------------------
    def pool(self, role: str, site: str) -> PoolHealth | None:
        return self.pools.get((role, site))

    def leg_ok(self, role: str, site: str, url: str) -> None:
        """A leg to ``url`` (of pool ``role``/``site``) produced output."""
        pool = self.pools.get((role, site))
        if pool is not None:
            pool.success(url)

    def leg_failed(self, role: str, site: str, url: str, cause: str) -> None:
        """A leg to ``url`` failed at the instance (connect, timeout, 5xx, broken)."""
        pool = self.pools.get((role, site))
        if pool is not None:
            if self.on_failure is not None:
                self.on_failure(role, site, url, cause)
            pool.failure(url, cause)

    def probed(self, role: str, site: str, url: str, ok: bool) -> None:
        """The outcome of an active health probe of ``url``."""
        pool = self.pools.get((role, site))
        if pool is not None:
            if self.on_probe is not None:
                self.on_probe(role, site, url, ok)
            if pool.probe(url, ok) and self.on_unavailable is not None:
                self.on_unavailable(role, site, url, "health_check")

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

    def record_latency(self, site: str, seconds: float) -> None:
        """One prefill leg's TTFT at ``site`` (a failed leg: its whole site timeout)."""
        stats = self.stats.get(site)
        if stats is None:
            return
        if stats.latency is None:
            stats.latency = Ewma(self.settings.latency_ewma_alpha)
        stats.latency.add(max(seconds, 0.0))
        stats.latency_at = self.clock()

    def latency_factors(self, config: DeploymentConfig) -> dict[str, float]:
        """Each measured site's latency factor (0-1] for the score, ``floor / (floor +
        EWMA)`` (``prefill_latency_floor_s``: latencies well below it barely matter; sites
        compare by the ratio of their factors, so a site ten times slower scores about a
        tenth). Unmeasured sites are left out (1.0: tried, and so measured). A site's penalty
        halves every ``prefill_latency_halflife_s`` without a sample, so a site avoided for
        being slow is tried again once its penalty faded."""
        floor = max(self.settings.prefill_latency_floor_s, 1e-3)
        halflife = self.settings.prefill_latency_halflife_s
        now = self.clock()
        factors = {}
        for site in config.prefill:
            stats = self.stats.get(site.name)
            latency = None if stats is None or stats.latency is None else stats.latency.value
            if stats is None or latency is None:
                continue
            raw = floor / (floor + latency)
            age = max(now - stats.latency_at, 0.0)
            fade = 0.5 ** (age / halflife) if halflife > 0 else 1.0
            factors[site.name] = 1.0 - (1.0 - raw) * fade
        return factors

    def next_site(self, config: DeploymentConfig, tried: frozenset[str]) -> str | None:
        """The best site that can take a request now, leaving out ``tried`` (the sites this
        request already failed at); None when there is none."""
        views = [v for v in self.site_views(config) if v.name not in tried]
        site, _ = choose_site(views)
        return None if site is None else site.name

    def site_views(self, config: DeploymentConfig) -> list[SiteView]:
        """The decision core's view of every remote site now."""
        views = []
        # One site has nobody to be compared with (and the lookups cost the hot path).
        factors = self.latency_factors(config) if len(config.prefill) > 1 else {}
        for site in config.prefill:
            pool = self.pools[("prefill", site.name)]
            if site.instances and not pool.in_rotation():
                # Every instance drained (scaled to zero by plan): not a remote site now.
                continue
            bandwidth, ceiling = self._link(config, site.name)
            stats = self.stats[site.name]
            available = self.site_breakers[site.name].allows() and any(
                self.instance_breakers[i.url].allows() and pool.available(i.url)
                for i in site.instances
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
                    latency_factor=factors.get(site.name, 1.0),
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
        """Reserve the site's breaker and its least-loaded available instance whose breaker
        allows a request; None when none does (the caller falls back)."""
        site = next((s for s in config.prefill if s.name == site_name), None)
        if site is None or not self.site_breakers[site_name].try_acquire():
            return None
        inst = self._reserve_instance(site, self.pools[("prefill", site_name)])
        if inst is None:
            self.site_breakers[site_name].release()
        return inst

    def _reserve_instance(self, site: Site, pool: PoolHealth) -> Instance | None:
        """The least-loaded available instance of ``site`` whose breaker lets a request in,
        reserved; None when there is none."""
        candidates = sorted(
            (
                i
                for i in site.instances
                if self.instance_breakers[i.url].allows() and pool.available(i.url)
            ),
            key=lambda i: self.instance_inflight.get(i.url, 0),
        )
        for inst in candidates:
            if self.instance_breakers[inst.url].try_acquire():
                return inst
        return None

    def local_prefill_in_rotation(self, config: DeploymentConfig) -> bool:
        """Whether ``config`` has a local prefill pool with an instance not drained (a pool
        that is empty or drained by plan is as if there were none)."""
        site = config.local_prefill
        pool = None if site is None else self.pools.get(("prefill", site.name))
        return pool is not None and bool(pool.in_rotation())

    def acquire_local_prefill(self, config: DeploymentConfig) -> Instance | None:
        """Reserve the local prefill pool's least-loaded available instance whose breaker
        allows a request; None when there is none (the decode engine prefills itself)."""
        site = config.local_prefill
        pool = None if site is None else self.pools.get(("prefill", site.name))
        if site is None or pool is None:
            return None
        return self._reserve_instance(site, pool)

    def record_prefill(
        self,
        site: str,
        inst: Instance,
        ok: bool | None,
        latency_s: float,
        cause: str = "",
        instance_fault: bool = False,
    ) -> None:
        """Outcome of a prefill leg (``ok=None``: abandoned without verdict).
        ``instance_fault``: the failure was the instance's own (its leg could not connect,
        timed out, answered 5xx): the site's breaker gets no verdict while another instance
        of the site is available -- one dead instance is ejected, the site stays open."""
        site_verdict = ok
        if ok is False and instance_fault and self._others_available(site, inst.url):
            site_verdict = None
        for breaker, verdict in (
            (self.site_breakers.get(site), site_verdict),
            (self.instance_breakers.get(inst.url), ok),
        ):
            if breaker is None:
                continue
            before = breaker.state
            if verdict is None:
                breaker.release()
                continue
            breaker.record(verdict, latency_s)
            after = breaker.state
            if after != before:
                log.warning(
                    "gateway.breaker_state",
                    extra={"breaker": breaker.name, "from": before, "to": after, "cause": cause},
                )

    def _others_available(self, site: str, url: str) -> bool:
        pool = self.pools.get(("prefill", site))
        config = self.config
        if pool is None or config is None:
            return False
        return any(
            i.url != url and pool.available(i.url) and self.instance_breakers[i.url].allows()
            for s in config.prefill
            if s.name == site
            for i in s.instances
        )

    def pick_decode(
        self, config: DeploymentConfig, exclude: frozenset[str] = frozenset()
    ) -> Instance | None:
        """The available local decode instance with the fewest in-flight requests
        (round-robin among equals, so an idle pool spreads load), skipping ``exclude``
        (instances this request already failed on); when none is available, the least
        loaded of the others (see :func:`agents.gateway.health.pick`); None when all are
        excluded."""
        instances = config.decode.instances
        self._decode_turn = (self._decode_turn + 1) % len(instances)
        rotated = instances[self._decode_turn :] + instances[: self._decode_turn]
        pool = self.pools.get(("decode", config.decode.name))
        if pool is None:  # a config applied without its pools (never through apply)
            pool = PoolHealth("decode", config.decode.name, [], self.settings.health(), self.clock)
        url = pick(pool, [i.url for i in rotated], self.instance_inflight, exclude)
        return next((i for i in rotated if i.url == url), None)

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

    def note_remote_tokens(self, site: str, tokens: int) -> list[float] | None:
        """A request with ``tokens`` incremental prompt tokens is being sent to ``site``;
        returns its entry, for :meth:`release_remote_tokens` when its KV never crossed."""
        stats = self.stats.get(site)
        if stats is None:
            return None
        entry = [self.clock(), float(tokens)]
        stats.tokens.append(entry)
        stats.token_sum += tokens
        return entry

    def release_remote_tokens(self, site: str, entry: list[float] | None) -> None:
        """The request of ``entry`` sent no KV over the link (its prefill leg was refused
        or failed): its tokens no longer count against the link's utilisation."""
        stats = self.stats.get(site)
        if stats is None or entry is None or not entry[1]:
            return
        stats.token_sum = max(stats.token_sum - entry[1], 0)
        entry[1] = 0

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
        pressure = min(pressures) if pressures else None
        ratio = self.ttft.ratio()
        self.last_pressure = pressure
        change = self.tuner.update(pressure, ratio)
        if change is not None:
            record = {
                "at": datetime.now(UTC).isoformat(timespec="milliseconds"),
                "factor_from": round(change[0], 4),
                "factor_to": round(change[1], 4),
                "threshold_tokens": self.tuner.effective(config.threshold_tokens),
                "reason": self.tuner.last_reason,
                "pressure": None if pressure is None else round(pressure, 4),
                "ttft_ratio": None if ratio is None else round(ratio, 4),
            }
            self.threshold_changes.append(record)
            log.info("gateway.threshold_retuned", extra=record)
        return change

    def ttft_sample(self, config: DeploymentConfig, path: str, tokens: int, ttft_s: float) -> None:
        """A streamed request's TTFT on ``path`` (``remote``: served by its first site;
        ``local``), for the re-tuner's remote/local comparison."""
        self.ttft.add(path, tokens, self.tuner.effective(config.threshold_tokens), ttft_s)

    def _latency(self, site: str) -> float | None:
        stats = self.stats.get(site)
        value = None if stats is None or stats.latency is None else stats.latency.value
        return None if value is None else round(value, 4)

    def debug(self) -> dict[str, Any]:
        """The ``/debug/routing`` document."""
        config = self.config
        if config is None:
            return {"config": None}
        views = {v.name: v for v in self.site_views(config)}
        for site in config.prefill:  # a site drained out has no view: show it unavailable
            if site.name not in views:
                bandwidth, ceiling = self._link(config, site.name)
                views[site.name] = SiteView(site.name, False, 0.0, 0.0, ceiling, bandwidth)
        s = self.settings
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
            "tuning": {
                "min_factor": s.retune_min_factor,
                "max_factor": s.retune_max_factor,
                "pressure": None if self.last_pressure is None else round(self.last_pressure, 4),
                "ttft": self.ttft.snapshot(),
                "changes": list(self.threshold_changes),
            },
            "sites": [
                {
                    "site": site.name,
                    "available": views[site.name].available,
                    "queue_depth": views[site.name].queue_depth,
                    "link_utilization": round(views[site.name].utilization, 4),
                    "link_ceiling": views[site.name].ceiling,
                    "bandwidth_mbit_s": views[site.name].bandwidth_mbit_s,
                    "prefill_latency_s": self._latency(site.name),
                    "latency_factor": round(views[site.name].latency_factor, 4),
                    "score": round(site_score(views[site.name]), 3)
                    if views[site.name].available
                    else 0.0,
                    "breaker": self.site_breakers[site.name].snapshot(),
                    "instances": [
                        {
                            "name": inst.name,
                            "url": inst.url,
                            "drained": inst.drained,
                            "inflight": self.instance_inflight.get(inst.url, 0),
                            "breaker": self.instance_breakers[inst.url].snapshot(),
                        }
                        for inst in site.instances
                    ],
                }
                for site in config.prefill
            ],
            "local_prefill": self._local_prefill_doc(config),
            "decode": _site_doc(config.decode, self.instance_inflight),
            "pools": [pool.snapshot() for pool in self.pools.values()],
        }

    def _local_prefill_doc(self, config: DeploymentConfig) -> dict[str, Any] | None:
        """The local prefill pool in ``/debug/routing`` (None without one)."""
        site = config.local_prefill
        if site is None:
            return None
        pool = self.pools[("prefill", site.name)]
        return {
            "site": site.name,
            "available": any(
                self.instance_breakers[i.url].allows() and pool.available(i.url)
                for i in site.instances
            ),
            "instances": [
                {
                    "name": inst.name,
                    "url": inst.url,
                    "drained": inst.drained,
                    "available": pool.available(inst.url),
                    "inflight": self.instance_inflight.get(inst.url, 0),
                    "breaker": self.instance_breakers[inst.url].snapshot(),
                }
                for inst in site.instances
            ],
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

"""Configuration: the deployment snapshot the console serves (parsed and validated into
:class:`DeploymentConfig`) and the gateway's own knobs (:class:`GatewaySettings`).

Who calls it: the poller (each new snapshot), the CLI (settings file, static snapshot file).
Failures surface as :class:`ConfigError` whose message names the offending field; a snapshot
that fails validation is never applied (the gateway keeps its last good one).

Engine addresses. The console contract lists each node's ``hostname`` and ``agent_address``;
the gateway additionally reads, when present, ``engine_url`` (the engine's HTTP base URL) and
``kv_address`` (``host:port`` of a decode node's KV receiver) on each node. Without them it
uses ``http://<hostname>:<engine_settings.port or 8000>`` and
``<engine_settings.kv_host or hostname>:<engine_settings.kv_port or 7100>`` from the pool's
``engine_settings``; ``engine_settings.kv_site_addresses`` (prefill site -> ``host:port``)
gives a prefill site its own address of the receiver (its own WAN path).

Local prefill pool. ``pools.prefill`` lists every prefill pool, including one at the decode
site (the local PD cluster that long-timescale rebalancing grows and shrinks). That one is not
a remote site: it is :attr:`DeploymentConfig.local_prefill`, and :attr:`DeploymentConfig.prefill`
holds the remote sites only (see docs/gateway.md, "The local prefill pool").
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from agents.gateway.breaker import BreakerSettings
from agents.gateway.health import HealthSettings
from agents.gateway.tuning import TuningSettings
from pdproto.kv import KV_MODES


class ConfigError(ValueError):
    """A snapshot or settings file is invalid; the message names the field."""


# -- deployment snapshot -------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Instance:
    """One engine: ``name`` (hostname), ``url`` (HTTP base), ``kv_address`` (decode only),
    ``drained`` (the console took it out of rotation: no new leg goes to it, see
    docs/gateway.md "Draining")."""

    name: str
    url: str
    kv_address: str
    drained: bool = False
    #: (prefill site, address) pairs where that site's engines reach this decode node's KV
    #: receiver instead of ``kv_address``: the pool's ``engine_settings.kv_site_addresses``
    #: (each site's own WAN path, proxy or NAT in front of the receiver).
    site_kv_addresses: tuple[tuple[str, str], ...] = ()

    def kv_address_for(self, site: str) -> str:
        """Where ``site``'s prefill engines send this node the KV."""
        return dict(self.site_kv_addresses).get(site, self.kv_address)


@dataclass(frozen=True, slots=True)
class Site:
    """A pool of engines at one site."""

    name: str
    instances: tuple[Instance, ...]


@dataclass(frozen=True, slots=True)
class Link:
    """The WAN link from a prefill site to the decode site."""

    from_site: str
    bandwidth_mbit_s: float
    rtt_ms: float | None
    utilization_ceiling: float


@dataclass(frozen=True, slots=True)
class DeploymentConfig:
    """One validated config snapshot. Immutable: the gateway swaps whole snapshots, so a
    request keeps the snapshot it started with (in-flight requests are never disturbed)."""

    deployment_id: int
    deployment_name: str
    state: str
    version: int
    model_name: str
    max_model_len: int | None
    kv_bytes_per_token: float | None
    threshold_tokens: int
    remote_share_percent: float
    kill_switch: bool
    fallback_to_local_prefill: bool
    link_utilization_ceiling: float
    error_rate_limit: float
    latency_p99_limit_ms: float
    kv_timeout_ms: float
    decode: Site
    #: The remote prefill sites: every ``pools.prefill`` entry at a site other than the
    #: decode pool's (the candidates of the site choice and of failover).
    prefill: tuple[Site, ...]
    links: Mapping[str, Link]
    raw: Mapping[str, Any] = field(repr=False, compare=False)
    #: How the remote legs hand the KV over (``kv_transfer.mode``; see
    #: ``pdproto.kv.KV_MODES``).
    kv_mode: str = "push"
    #: Characters per token of this model's tokenizer (``model.engine_settings.
    #: chars_per_token``: 1 for a byte-level tokenizer); None: the gateway's setting.
    chars_per_token: float | None = None
    #: The prefill pool at the decode site (``pools.prefill`` entry whose ``site`` is the
    #: decode pool's), None without one: never a remote site; the local path sends a prefill
    #: leg to it (docs/gateway.md, "The local prefill pool").
    local_prefill: Site | None = None


def _get(data: Mapping[str, Any], key: str, where: str) -> Any:
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where}: must be an object")
    if key not in data:
        raise ConfigError(f"{where}.{key}: missing")
    return data[key]


def _section(value: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where}: must be an object")
    return value


def _number(value: Any, where: str, low: float | None = None, high: float | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(f"{where}: must be a number, got {value!r}")
    if (low is not None and value < low) or (high is not None and value > high):
        raise ConfigError(f"{where}: must be within [{low}, {high}], got {value!r}")
    return float(value)


def _positive(value: Any, where: str) -> float:
    number = _number(value, where)
    if number <= 0:
        raise ConfigError(f"{where}: must be > 0, got {value!r}")
    return number


def _bool(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"{where}: must be true or false, got {value!r}")
    return value


def _one_of(value: Any, allowed: tuple[str, ...], where: str) -> str:
    if value not in allowed:
        raise ConfigError(f"{where}: must be one of {', '.join(allowed)}, got {value!r}")
    return str(value)


def _str(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{where}: must be a non-empty string, got {value!r}")
    return value


def _site(pool: Any, where: str, decode: bool) -> Site:
    name = _str(_get(pool, "site", where), f"{where}.site")
    settings = pool.get("engine_settings") or {}
    if not isinstance(settings, Mapping):
        raise ConfigError(f"{where}.engine_settings: must be an object")
    nodes = _get(pool, "nodes", where)
    if not isinstance(nodes, list):
        raise ConfigError(f"{where}.nodes: must be a list")
    by_site = settings.get("kv_site_addresses") or {}
    if not isinstance(by_site, Mapping):
        raise ConfigError(f"{where}.engine_settings.kv_site_addresses: must be an object")
    site_kv = tuple(
        (site, _str(address, f"{where}.engine_settings.kv_site_addresses.{site}"))
        for site, address in sorted(by_site.items())
    )
    instances = []
    for i, node in enumerate(nodes):
        at = f"{where}.nodes[{i}]"
        host = _str(_get(node, "hostname", at), f"{at}.hostname")
        url = node.get("engine_url") or f"http://{host}:{int(settings.get('port', 8000))}"
        url = _str(url, f"{at}.engine_url").rstrip("/")
        if not url.startswith(("http://", "https://")):
            raise ConfigError(f"{at}.engine_url: must start with http:// or https://")
        kv_host = settings.get("kv_host") or host  # a WAN proxy / NAT in front of the receiver
        kv = node.get("kv_address") or f"{kv_host}:{int(settings.get('kv_port', 7100))}"
        drained = _bool(node.get("drained", False), f"{at}.drained")
        instances.append(Instance(host, url, _str(kv, f"{at}.kv_address"), drained, site_kv))
    if decode and not instances:
        raise ConfigError(f"{where}.nodes: the decode pool needs at least one node")
    return Site(name, tuple(instances))


def parse_snapshot(data: Any) -> DeploymentConfig:
    """Validate a snapshot (the console's JSON body, decoded) into a config."""
    if not isinstance(data, Mapping):
        raise ConfigError("snapshot: must be a JSON object")
    deployment = _section(_get(data, "deployment", "snapshot"), "deployment")
    model = _section(_get(data, "model", "snapshot"), "model")
    routing = _section(_get(data, "routing", "snapshot"), "routing")
    breaker = _section(data.get("circuit_breaker") or {}, "circuit_breaker")
    kv = _section(data.get("kv_transfer") or {}, "kv_transfer")
    pools = _section(_get(data, "pools", "snapshot"), "pools")
    model_settings = _section(model.get("engine_settings") or {}, "model.engine_settings")
    ceiling = _number(
        routing.get("link_utilization_ceiling", 0.7), "routing.link_utilization_ceiling", 0, 1
    )
    decode = _site(_get(pools, "decode", "pools"), "pools.decode", decode=True)
    links: dict[str, Link] = {}
    raw_links = data.get("links") or []
    if not isinstance(raw_links, list):
        raise ConfigError("links: must be a list")
    for i, link in enumerate(raw_links):
        at = f"links[{i}]"
        _section(link, at)
        # The console lists every link among the deployment's sites; only the ones into the
        # decode site carry KV.
        if link.get("to_site", decode.name) != decode.name:
            continue
        measured = link.get("measured_mbit_s")
        bandwidth = measured if measured else _get(link, "provisioned_mbit_s", at)
        rtt = link.get("rtt_ms")
        links[_str(_get(link, "from_site", at), f"{at}.from_site")] = Link(
            from_site=link["from_site"],
            bandwidth_mbit_s=_number(bandwidth, f"{at}.provisioned_mbit_s", 0),
            rtt_ms=None if rtt is None else _number(rtt, f"{at}.rtt_ms", 0),
            utilization_ceiling=_number(
                link.get("utilization_ceiling", ceiling), f"{at}.utilization_ceiling", 0, 1
            ),
        )
    prefill = _get(pools, "prefill", "pools")
    if not isinstance(prefill, list):
        raise ConfigError("pools.prefill: must be a list")
    pools_prefill = [_site(p, f"pools.prefill[{i}]", decode=False) for i, p in enumerate(prefill)]
    seen: set[str] = set()
    for i, pool in enumerate(pools_prefill):
        if pool.name in seen:  # the console allows one pool per role and site
            raise ConfigError(f"pools.prefill[{i}].site: {pool.name!r} has a prefill pool already")
        seen.add(pool.name)
    local = [s for s in pools_prefill if s.name == decode.name]
    max_len = model_settings.get("max_model_len")
    kv_bpt = model_settings.get("kv_bytes_per_token")
    cpt = model_settings.get("chars_per_token")
    return DeploymentConfig(
        deployment_id=int(_number(_get(deployment, "id", "deployment"), "deployment.id", 1)),
        deployment_name=str(deployment.get("name", "")),
        state=str(deployment.get("state", "")),
        version=int(_number(_get(data, "version", "snapshot"), "version", 0)),
        model_name=_str(_get(model, "name", "model"), "model.name"),
        max_model_len=None
        if max_len is None
        else int(_number(max_len, "model.engine_settings.max_model_len", 1)),
        kv_bytes_per_token=None
        if kv_bpt is None
        else _number(kv_bpt, "model.engine_settings.kv_bytes_per_token", 0),
        chars_per_token=None
        if cpt is None
        else _positive(cpt, "model.engine_settings.chars_per_token"),
        threshold_tokens=int(
            _number(
                _get(routing, "remote_prefill_threshold_tokens", "routing"),
                "routing.remote_prefill_threshold_tokens",
                0,
            )
        ),
        remote_share_percent=_number(
            _get(routing, "remote_share_percent", "routing"), "routing.remote_share_percent", 0, 100
        ),
        kill_switch=_bool(routing.get("kill_switch", False), "routing.kill_switch"),
        fallback_to_local_prefill=_bool(
            routing.get("fallback_to_local_prefill", True), "routing.fallback_to_local_prefill"
        ),
        link_utilization_ceiling=ceiling,
        error_rate_limit=_number(
            breaker.get("error_rate_limit", 0.05), "circuit_breaker.error_rate_limit", 0, 1
        ),
        latency_p99_limit_ms=_number(
            breaker.get("latency_p99_limit_ms", 2500), "circuit_breaker.latency_p99_limit_ms", 0
        ),
        kv_timeout_ms=_number(kv.get("timeout_ms", 4000), "kv_transfer.timeout_ms", 0),
        kv_mode=_one_of(kv.get("mode", "push"), KV_MODES, "kv_transfer.mode"),
        decode=decode,
        prefill=tuple(s for s in pools_prefill if s.name != decode.name),
        local_prefill=local[0] if local else None,
        links=links,
        raw=data,
    )


# -- gateway settings ----------------------------------------------------------------------
EVENT_LOOPS = ("auto", "uvloop", "asyncio")


@dataclass(frozen=True, slots=True)
class GatewaySettings:
    """The gateway process's own knobs (YAML file given with ``--settings``; each key below is
    documented once here and listed in docs/gateway.md)."""

    #: Listen address and port (0: an ephemeral port, printed at start).
    host: str = "127.0.0.1"
    port: int = 8080
    #: Seconds between config polls (ETag: an unchanged snapshot costs a 304).
    poll_interval_s: float = 2.0
    #: Where the last good snapshot is kept (used when the console is unreachable at start).
    state_dir: str = "var/gateway"
    #: Upstream TCP connect timeout; a prefill leg's whole timeout; how long the client may
    #: wait for the first byte of a remote decode leg beyond ``kv_transfer.timeout_ms``.
    connect_timeout_s: float = 2.0
    prefill_timeout_s: float = 30.0
    first_byte_grace_s: float = 5.0
    #: Longest a whole upstream request may take (local or decode leg).
    request_timeout_s: float = 600.0
    #: Per-leg deadlines (0: none). ``first_byte_timeout_s``: a streamed local leg that
    #: produced no first token by then failed at its instance (sent once more to another
    #: decode instance within ``decode_retries``, the request's ``request_timeout_s`` still
    #: its whole budget); a remote decode leg's first byte is bounded by
    #: ``kv_transfer.timeout_ms + first_byte_grace_s`` instead, and a non-streamed leg's first
    #: byte is its last (no first-byte deadline: health probes abandon it, see
    #: docs/gateway.md "Hung engines"). ``idle_timeout_s``: a leg's body (stream or not)
    #: that stops for this long while the client keeps up ends with an error event.
    first_byte_timeout_s: float = 30.0
    idle_timeout_s: float = 30.0
    #: Fallback budget: local-prefill replacements of the remote path per second, burst, and
    #: the bounded wait (seconds, waiters) before a 503 with retry-after.
    fallback_rate_per_s: float = 20.0
    fallback_burst: int = 40
    fallback_max_wait_s: float = 2.0
    fallback_max_waiters: int = 64
    #: Breaker knobs besides the two limits from the snapshot (see BreakerSettings).
    breaker_window_s: float = 30.0
    breaker_min_requests: int = 20
    breaker_consecutive_failures: int = 5
    breaker_ejection_base_s: float = 5.0
    #: The longest ejection: after a fault clears, traffic returns within about this (the
    #: next half-open probe; 8 s keeps it inside the 10 s recovery target with the trial
    #: request's own time to spare: at 10 s the soak measured 10.18 s); each probe during a
    #: long outage costs one request a failover or fallback. The ejection count decays after
    #: ``breaker_ejection_decay_s`` closed.
    breaker_ejection_cap_s: float = 8.0
    breaker_ejection_decay_s: float = 120.0
    breaker_half_open_probes: int = 1
    breaker_close_after_successes: int = 3
    #: Pool health (every decode and prefill instance; see agents.gateway.health): legs in
    #: a row failing at an instance (connect, timeout, 5xx) that eject it, the ejection time
    #: (x times ejected, capped), the most of a pool that may be ejected at once (percent;
    #: a pool's last available instance never is); active ``GET /health`` probes (interval,
    #: 0: none; timeout; failures / successes in a row that mark it unhealthy / healthy).
    outlier_consecutive_failures: int = 3
    outlier_base_ejection_s: float = 5.0
    outlier_max_ejection_s: float = 60.0
    outlier_max_ejection_percent: float = 50.0
    health_check_interval_s: float = 2.0
    health_check_timeout_s: float = 1.0
    health_check_unhealthy_threshold: int = 2
    health_check_healthy_threshold: int = 2
    #: A request whose decode leg failed before any byte reached the client is sent again
    #: to another decode instance this many times (0: never).
    decode_retries: int = 1
    #: Failover across prefill sites (docs/gateway.md, "Failover across prefill sites"): a
    #: remote request whose prefill leg failed before any KV reached the decode engine (its
    #: cause one of ``pdproto.causes.FAILOVER_CAUSES``) is sent again, with a fresh transfer
    #: id, to the next-best site this many times before local fallback (0: never).
    prefill_failovers: int = 1
    #: The site timeout of a prefill leg that can still fail over, as a fraction (0-1] of
    #: the request's TTFT budget: ``min(prefill_timeout_s, kv_transfer.timeout_ms)`` in push
    #: mode (the decode engine gives up on the KV after the latter anyway), ``prefill_timeout_s``
    #: in pull mode. A leg with no site left to fail over to waits what is left of
    #: ``prefill_timeout_s``, as a single site's leg always did.
    prefill_site_timeout_fraction: float = 0.5
    #: Prefill latency in the site score: each site's EWMA of its prefill legs' TTFT (a
    #: failed leg counts as its whole site timeout; ``latency_ewma_alpha``: weight of a new
    #: sample, also of the re-tuner's TTFT averages) scales its score by ``floor / (floor +
    #: EWMA)`` (``prefill_latency_floor_s``: latencies well below it barely matter); the
    #: penalty halves every ``prefill_latency_halflife_s`` without a sample, so a site avoided
    #: for being slow is tried again.
    latency_ewma_alpha: float = 0.3
    prefill_latency_floor_s: float = 0.1
    prefill_latency_halflife_s: float = 30.0
    #: Admission control (agents.gateway.admission): completions requests served at once
    #: (0: no limit), how many more may wait for one to end and for how long, and the
    #: ``Retry-After`` (seconds) of the 429 that any other request gets.
    max_in_flight_requests: int = 1024
    max_queued_requests: int = 1024
    admission_queue_timeout_s: float = 10.0
    admission_retry_after_s: int = 1
    #: Slots and queue places one client address may hold together (0: no cap). Behind a
    #: proxy or load balancer every request has its address: raise it or set 0 there.
    max_in_flight_per_client: int = 256
    #: A request's head and body must arrive within this (seconds from its first byte;
    #: admission is taken only after): a slower client gets 408 and its connection closes.
    request_read_timeout_s: float = 30.0
    #: Threshold re-tuning (see TuningSettings) and how often it runs.
    retune_interval_s: float = 5.0
    retune_raise_at: float = 0.9
    retune_lower_at: float = 0.6
    retune_step: float = 1.25
    retune_max_factor: float = 4.0
    queue_high_water: float = 8.0
    #: Re-tuning from measured TTFT (streamed requests near the threshold, per 1,000
    #: incremental tokens, EWMA with ``latency_ewma_alpha``): remote / local at or above
    #: ``retune_ttft_raise_at`` raises the threshold; at or below ``retune_ttft_lower_at``
    #: (and no pressure) lowers it, down to ``retune_min_factor`` (the operator's lower bound;
    #: 1.0: never below the configured threshold). Each path needs
    #: ``retune_ttft_min_samples`` samples before the ratio counts.
    retune_min_factor: float = 1.0
    retune_ttft_raise_at: float = 1.0
    retune_ttft_lower_at: float = 0.8
    retune_ttft_min_samples: int = 5
    #: How often engine ``/metrics`` are scraped for queue depth (0: never).
    scrape_interval_s: float = 2.0
    #: Window over which routed prompt tokens estimate each link's utilisation, and the KV
    #: bytes per prompt token when the snapshot's model does not say.
    utilization_window_s: float = 5.0
    kv_bytes_per_token: float = 140.0
    #: Prompt length: characters per token for the estimate, and whether to ask the decode
    #: engine's ``/tokenize`` for an exact count when the estimate is within a factor of two of
    #: the threshold.
    chars_per_token: float = 4.0
    tokenize: bool = False
    #: Prefix-cache awareness: estimate the decode pool's cached prefix of each prompt from
    #: the prompts recently sent there (blocks of ``prefix_block_tokens``, at most
    #: ``prefix_index_blocks`` remembered) and route on the uncached remainder only. Off by
    #: default: right only when the decode engines cache prefixes (vLLM's prefix caching).
    prefix_cache_estimate: bool = False
    prefix_block_tokens: int = 64
    prefix_index_blocks: int = 200_000
    #: Largest request body accepted (bytes); longer prompts than the model allows get 400.
    max_body_bytes: int = 16 * 1024 * 1024
    #: Header whose value is the sticky key (else the body's ``user``, else the request id).
    sticky_key_header: str = "x-pdbridge-key"
    #: Event loop: ``auto`` (uvloop when installed, else asyncio's), ``uvloop`` (required) or
    #: ``asyncio``. uvloop's cheaper loop iterations shorten the queueing every request and
    #: chunk meets under load (the added TTFT of paced load, see docs/gateway.md).
    event_loop: str = "auto"
    #: Serve the completions endpoints' plain requests on the gateway's own lean HTTP/1.1
    #: server (``agents.gateway.fastpath``); everything else, and every request when off,
    #: on aiohttp's. Same behaviour both ways; the fast path costs about half the CPU per
    #: request (docs/gateway.md, "The relay's hot path").
    fast_server: bool = True
    #: Refuse requests without a valid client API key (401), whatever the console says; the
    #: console's per-deployment ``require_client_keys`` turns it on too. Off: keys are
    #: optional (docs/gateway.md, "Client keys").
    require_client_keys: bool = False
    #: Request traces (docs/gateway.md, "Request traces"): the last ``trace_ring_size``
    #: requests' path and timeline kept in memory for ``/debug/traces`` (0: none kept, none
    #: shipped); with a console, every ``trace_ship_interval_s`` the traces queued since are
    #: POSTed to it: a ``trace_ship_sample_rate`` share of requests served normally, and every
    #: fallback, failover and error -- at most ``trace_ship_queue`` waiting (more are dropped
    #: and counted).
    trace_ring_size: int = 2048
    trace_ship_sample_rate: float = 0.01
    trace_ship_interval_s: float = 5.0
    trace_ship_queue: int = 1000

    def breaker(self, error_rate_limit: float, latency_p99_limit_ms: float) -> BreakerSettings:
        """Breaker settings combining the snapshot's limits with these knobs."""
        return BreakerSettings(
            error_rate_limit=error_rate_limit,
            latency_p99_limit_s=latency_p99_limit_ms / 1000.0,
            window_s=self.breaker_window_s,
            min_requests=self.breaker_min_requests,
            consecutive_failures=self.breaker_consecutive_failures,
            ejection_base_s=self.breaker_ejection_base_s,
            ejection_cap_s=self.breaker_ejection_cap_s,
            ejection_decay_s=self.breaker_ejection_decay_s,
            half_open_probes=self.breaker_half_open_probes,
            close_after_successes=self.breaker_close_after_successes,
        )

    def health(self) -> HealthSettings:
        """Pool-health settings."""
        return HealthSettings(
            consecutive_failures=max(self.outlier_consecutive_failures, 1),
            base_ejection_s=self.outlier_base_ejection_s,
            max_ejection_s=self.outlier_max_ejection_s,
            max_ejection_percent=min(self.outlier_max_ejection_percent, 100.0),
            check_interval_s=self.health_check_interval_s,
            check_timeout_s=self.health_check_timeout_s,
            unhealthy_threshold=max(self.health_check_unhealthy_threshold, 1),
            healthy_threshold=max(self.health_check_healthy_threshold, 1),
        )

    def tuning(self) -> TuningSettings:
        """Re-tuning settings."""
        return TuningSettings(
            raise_at=self.retune_raise_at,
            lower_at=self.retune_lower_at,
            step=self.retune_step,
            max_factor=self.retune_max_factor,
            queue_high_water=self.queue_high_water,
            min_factor=self.retune_min_factor,
            ttft_raise_at=self.retune_ttft_raise_at,
            ttft_lower_at=self.retune_ttft_lower_at,
        )


def settings_from_mapping(data: Mapping[str, Any]) -> GatewaySettings:
    """Build settings from a mapping, refusing unknown keys and wrong types by name."""
    known = {f.name: f for f in dataclasses.fields(GatewaySettings)}
    values: dict[str, Any] = {}
    for key, value in data.items():
        if key not in known:
            raise ConfigError(f"settings.{key}: unknown setting")
        default = getattr(GatewaySettings(), key)
        if isinstance(default, bool):
            values[key] = _bool(value, f"settings.{key}")
        elif isinstance(default, int | float):
            number = _number(value, f"settings.{key}", 0)
            values[key] = int(number) if isinstance(default, int) else number
        else:
            values[key] = _str(value, f"settings.{key}")
    if not 0 <= values.get("trace_ship_sample_rate", 0.0) <= 1:
        raise ConfigError("settings.trace_ship_sample_rate: must be within [0, 1]")
    if values.get("trace_ship_interval_s", 5.0) <= 0:
        raise ConfigError("settings.trace_ship_interval_s: must be > 0")
    for key in ("prefill_site_timeout_fraction", "latency_ewma_alpha"):
        if key in values and not 0 < values[key] <= 1:
            raise ConfigError(f"settings.{key}: must be within (0, 1], got {values[key]!r}")
    low, high = values.get("retune_min_factor", 1.0), values.get("retune_max_factor", 4.0)
    if not 0 < low <= 1 or high < 1:
        raise ConfigError(
            "settings.retune_min_factor, settings.retune_max_factor: need "
            f"0 < min <= 1 <= max, got {low!r}, {high!r}"
        )
    if values.get("event_loop", "auto") not in EVENT_LOOPS:
        raise ConfigError(f"settings.event_loop: must be one of {', '.join(EVENT_LOOPS)}")
    return GatewaySettings(**values)


def load_settings(path: str | Path | None) -> GatewaySettings:
    """Settings from a YAML file (None: all defaults)."""
    if path is None:
        return GatewaySettings()
    data = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path}: must hold a mapping of settings")
    return settings_from_mapping(data)


def load_snapshot_file(path: str | Path) -> DeploymentConfig:
    """A static snapshot from a JSON (or YAML) file, as ``--config FILE`` takes it."""
    text = Path(path).read_text()
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        data = yaml.safe_load(text)
    return parse_snapshot(data)

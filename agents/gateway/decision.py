"""The routing decision: pure functions and values, no I/O, no clock.

The request handler calls :func:`decide` once per request with the policy of the config
snapshot it started with, the request's sticky key, its incremental prompt length and a view
of each remote site; the result says which path serves the request and why. Everything here
is deterministic so that several gateways side by side agree on the canary share, and cheap
(the benchmark asks for >= 20,000 decisions per second on one core).

Rules, in order (the first that fails keeps the request local and names itself as reason):

1. ``kill_switch`` off;
2. the sticky key's hash bucket is inside ``remote_share_percent``;
3. incremental length (prompt minus the decode site's cached prefix) >= effective threshold;
4. at least one remote site whose breaker allows traffic (``breaker_open`` otherwise);
5. ... and whose link utilisation is under its ceiling (``link_saturated`` otherwise).

Among the sites that pass 4 and 5 the one with the highest :func:`site_score` wins (a
request whose prefill leg fails there may be sent to the next one: ``choose_site`` with the
sites already tried left out).
A request that passed 1-3 but failed 4 or 5 *wanted* the remote path: the server serves it
by local prefill as a **fallback**, which the fallback budget bounds.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import xxhash

Path = Literal["remote", "local"]

#: Reasons a decision gives; they label the ``pdbridge_gateway_decisions_total`` metric.
REASONS = (
    "remote",
    "kill_switch",
    "share",
    "below_threshold",
    "breaker_open",
    "link_saturated",
    "no_remote_site",
)

# Share buckets are hundredths of a percent so that 0.01 % steps are expressible.
_BUCKETS = 10_000


def share_bucket(key: str) -> int:
    """The stable bucket (0..9,999) of a sticky key. Same key, same bucket, on every gateway
    and across restarts (xxh64 with a fixed seed, not Python's salted ``hash``)."""
    return xxhash.xxh64_intdigest(key.encode("utf-8", "surrogatepass")) % _BUCKETS


def in_share(key: str, percent: float) -> bool:
    """Whether ``key`` falls inside a remote share of ``percent`` (0-100). Shares nest: a key
    inside 10 % is inside 50 % too, so raising the canary share never moves a caller back."""
    if percent <= 0:
        return False
    if percent >= 100:
        return True
    return share_bucket(key) < round(percent * _BUCKETS / 100)


@dataclass(frozen=True, slots=True)
class RoutingPolicy:
    """The routing part of a config snapshot, with the threshold already re-tuned."""

    kill_switch: bool
    remote_share_percent: float
    threshold_tokens: int


@dataclass(frozen=True, slots=True)
class SiteView:
    """What the router knows about one remote prefill site at decision time.

    ``available``: its breaker allows traffic and it has at least one usable instance.
    ``utilization``: estimated fraction (0-1) of the link's capacity in use now.
    ``ceiling``: the link's utilisation ceiling (0-1). ``bandwidth_mbit_s``: measured link
    bandwidth if known, else provisioned. ``queue_depth``: requests waiting at the site.
    ``latency_factor``: (0-1], from the site's measured prefill latency (1: not measured;
    see ``Router.latency_factors``).
    """

    name: str
    available: bool
    queue_depth: float
    utilization: float
    ceiling: float
    bandwidth_mbit_s: float
    latency_factor: float = 1.0


@dataclass(frozen=True, slots=True)
class Decision:
    """The outcome: ``path`` and ``site`` (for remote), ``reason`` (one of :data:`REASONS`),
    ``wants_remote`` (True when only site health/capacity kept it local: a fallback)."""

    path: Path
    reason: str
    site: str | None
    incremental_tokens: int
    threshold_tokens: int
    wants_remote: bool = False


def site_score(site: SiteView) -> float:
    """Higher is better: bandwidth times the fraction of the ceiling still free, divided by
    the queue ahead, times the latency factor (a site whose prefill legs take ten times
    another's scores about a tenth of it, other things equal). A site at or over its ceiling scores 0 and is never
    chosen."""
    if site.ceiling <= 0:
        return 0.0
    headroom = (site.ceiling - site.utilization) / site.ceiling
    if headroom <= 0:
        return 0.0
    return (
        max(site.bandwidth_mbit_s, 1.0)
        * headroom
        / (1.0 + max(site.queue_depth, 0.0))
        * site.latency_factor
    )


def choose_site(sites: Sequence[SiteView]) -> tuple[SiteView | None, str]:
    """The best usable site and, when there is none, why (``no_remote_site``,
    ``breaker_open`` or ``link_saturated``). Ties go to the first name in sort order so that
    equal sites do not flap between gateways."""
    if not sites:
        return None, "no_remote_site"
    best: SiteView | None = None
    best_score = 0.0
    any_available = False
    for site in sites:
        if not site.available:
            continue
        any_available = True
        score = site_score(site)
        if score <= 0:
            continue
        if best is None or score > best_score or (score == best_score and site.name < best.name):
            best, best_score = site, score
    if best is not None:
        return best, "remote"
    return None, ("link_saturated" if any_available else "breaker_open")


def decide(
    policy: RoutingPolicy,
    key: str,
    prompt_tokens: int,
    cached_tokens: int,
    sites: Sequence[SiteView] | Callable[[], Sequence[SiteView]],
) -> Decision:
    """Route one request; see the module docstring for the rules. Never raises. ``sites`` may
    be a function, called only when rules 1-3 pass (most requests never need the site view)."""
    incremental = max(prompt_tokens - max(cached_tokens, 0), 0)
    threshold = policy.threshold_tokens
    if policy.kill_switch:
        return Decision("local", "kill_switch", None, incremental, threshold)
    if not in_share(key, policy.remote_share_percent):
        return Decision("local", "share", None, incremental, threshold)
    if incremental < threshold:
        return Decision("local", "below_threshold", None, incremental, threshold)
    site, reason = choose_site(sites() if callable(sites) else sites)
    if site is None:
        return Decision("local", reason, None, incremental, threshold, wants_remote=True)
    return Decision("remote", "remote", site.name, incremental, threshold)

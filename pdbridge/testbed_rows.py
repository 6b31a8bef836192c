"""The testbed's inventory, catalog and deployment rows, and its agents' configuration.

Called by ``pdbridge.testbed`` after Django is set up; blocking (database writes). Validation
errors of the services surface as Django ``ValidationError`` naming the field.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pdbridge.testbed_models import DemoModel

if TYPE_CHECKING:
    from pdbridge.netns import NamespaceSites

SITES = ("local", "remote")
#: The remote (prefill) sites' names, in order (``pdbridge run --remote-sites N``: the first N).
REMOTE_SITES = ("remote", "remote-b", "remote-c")


DEPLOYMENT = "demo"


@dataclass(frozen=True)
class SitePorts:
    """One remote site's ports: its prefill engine and its own WAN path (fault proxy ->
    shaper -> the decode engine's receiver; a probe shaper in front of the kv-link)."""

    prefill: int
    kv_shaped: int  # this site's WAN shaping proxy, in front of the receiver
    kv_wan: int  # this site's agent's fault proxy, in front of the shaper: prefill dials this
    kv_link_wan: int  # this site's probe shaper, in front of the kv-link


@dataclass
class Ports:
    """Ports written into the deployment's pools (below the ephemeral range, probed). The
    fields name the first remote site's; ``more`` holds each further remote site's."""

    decode: int
    prefill: int
    kv_receiver: int  # the decode engine's embedded KV receiver
    kv_shaped: int  # the WAN shaping proxy, in front of the receiver
    kv_wan: int  # the remote agent's fault proxy, in front of the shaper: prefill dials this
    kv_link: int
    # A second shaping proxy, in front of the kv-link: step 2's probe crosses the same
    # emulated WAN as the KV (prefill sites dial ``kv_host:kv_link_wan``).
    kv_link_wan: int
    gateway: int
    more: dict[str, SitePorts] = field(default_factory=dict)

    @classmethod
    def choose(
        cls, pick: Callable[[], int], gateway: int, remote_sites: tuple[str, ...] = ("remote",)
    ) -> Ports:
        from pdbridge.procgroup import port_is_free

        gateway_port = gateway if gateway and port_is_free(gateway) else pick()
        ports = cls(pick(), pick(), pick(), pick(), pick(), pick(), pick(), gateway_port)
        ports.more = {s: SitePorts(pick(), pick(), pick(), pick()) for s in remote_sites[1:]}
        return ports

    def site(self, name: str) -> SitePorts:
        """The ports of remote site ``name``."""
        if name == REMOTE_SITES[0]:
            return SitePorts(self.prefill, self.kv_shaped, self.kv_wan, self.kv_link_wan)
        return self.more[name]


@dataclass(frozen=True)
class Layout:
    """Where each site's processes listen and how the others reach them: all on loopback
    (``loopback``), or one address per site in two network namespaces (``namespaces``, see
    :mod:`pdbridge.netns`)."""

    hosts: dict[str, str]  # site -> node hostname: what the orchestrator, gateway and TLS use
    binds: dict[str, str]  # site -> the address the site's servers bind
    console_host: str  # how agents (and the gateways they launch) reach the console
    # What prefill engines dial for KV: the remote site's own fault proxy, in front of the
    # WAN (None: the decode node's hostname, i.e. ``localhost`` on loopback, which is the
    # remote agent's proxy too since both sites share the loopback).
    kv_host: str | None = None

    @property
    def remotes(self) -> tuple[str, ...]:
        """The remote (prefill) sites, the first one first."""
        return tuple(s for s in self.hosts if s != "local")

    @classmethod
    def loopback(cls, console_host: str, remote_sites: int = 1) -> Layout:
        sites = ("local", *REMOTE_SITES[:remote_sites])
        return cls({s: "localhost" for s in sites}, {s: "127.0.0.1" for s in sites}, console_host)

    @classmethod
    def namespaces(cls, sites: NamespaceSites) -> Layout:
        addresses = {s.name: s.address for s in sites.all}
        return cls(addresses, addresses, sites.console_address, sites.remote.address)

    def kv_wan_host(self, site: str) -> str:
        """Where ``site``'s prefill engines (and its probe) reach its own WAN path: its
        fault proxy and probe shaper (its own address in a namespace; loopback's name)."""
        return self.binds[site] if self.kv_host else self.hosts["local"]


@dataclass
class Rows:
    deployment_id: int
    node_ids: list[int]
    tokens: dict[str, str] = field(default_factory=dict)  # site -> node token (shown once)

    def set_agent_addresses(self, addresses: dict[str, str]) -> None:
        from console.inventory.models import Node
        from console.inventory.services import node_update

        for node in Node.objects.filter(pk__in=self.node_ids).select_related("site"):
            node_update(actor=None, node=node, agent_address=addresses[node.site.name])


def register(
    model: DemoModel,
    ports: Ports,
    pki: dict[str, Path],
    wan_mbit: float,
    layout: Layout,
    weights_sha256: str,
    gateway_settings_file: Path | None = None,
) -> Rows:
    """Sites ``local`` (decode) and each of ``layout.remotes`` (prefill: ``remote``, then
    ``remote-b`` ...), a link from each remote site, one node per site (named as
    ``layout.hosts`` says), the model (with its weights sha256), the ``demo`` deployment with
    its pools (a prefill pool per remote site; servers bound to ``layout.binds``) and a fast
    rollout plan, and a token per node; ``gateway_settings_file``: the gateway's settings on
    the local node (the testbed's ships every trace). With several remote sites the decode pool names each
    site's own WAN path (``kv_site_addresses``, ``kv_link_site_addresses``): its engines and
    its probe dial that site's fault proxy and shaper, so cutting one site's leaves the
    others'."""
    from console.catalog.services import model_create
    from console.deployments.services import deployment_create, pool_create
    from console.inventory.services import link_create, node_create, node_token_issue, site_create
    from console.rollouts.services import rollout_plan_create
    from grpc_kv.tls import certificate_identity

    local = site_create(actor=None, name="local", role="decode", region="testbed-local")
    remotes = {
        name: site_create(actor=None, name=name, role="prefill", region=f"testbed-{name}")
        for name in layout.remotes
    }
    for remote in remotes.values():
        link_create(actor=None, from_site=remote, to_site=local, provisioned_mbit_s=int(wan_mbit))
    nodes = {
        site.name: node_create(
            actor=None, site=site, hostname=layout.hosts[site.name], agent_address="127.0.0.1:1"
        )
        for site in (local, *remotes.values())
    }
    spec = model_create(actor=None, name=model.served, family="testbed",
                        architecture=model.architecture, parameter_count=model.parameter_count,
                        weights_sha256=weights_sha256,
                        engine_settings={"max_model_len": model.max_model_len,
                                         "chars_per_token": model.chars_per_token})  # fmt: skip
    several = len(layout.remotes) > 1
    # The KV receivers allow the prefill nodes by hostname, matched against the common name
    # of the certificate a sender presents. Every testbed node shares one certificate: on
    # loopback its name is their hostname (``localhost``); in namespaces the hostnames are
    # the sites' addresses and the shared certificate is ``sites``, allowed by name here.
    shared = certificate_identity(pki["node_cert"].read_bytes())
    extra_peers = [shared] if shared and shared not in layout.hosts.values() else []
    dep = deployment_create(
        actor=None,
        name=DEPLOYMENT,
        model=spec,
        remote_prefill_threshold_tokens=64,
        chunked_prefill_tokens=model.chunked_prefill_tokens,
        timeout_ms=model.timeout_ms,
        # The engines' sends now use the deployment's chunk size: grpc_kv's measured 4 MiB,
        # not the 32 MiB default that ran ~5x slower through grpcio (docs/kv-link.md).
        chunk_size_mb=4,
        extra_allowed_peers=extra_peers,
        # With several remote sites, the site that takes over a cut one's traffic shares this
        # machine's few cores with everything else: its prefill p99 passed the 2.5 s default
        # on two cores (--netns, all load on one site), tripped its breaker on latency and
        # sent the traffic to fallback -- contention of the testbed, not a slow WAN. A dead
        # path still trips it: its legs fail (site timeout, errors) whatever this limit.
        **({"latency_p99_limit_ms": 6000} if several else {}),
    )
    common: dict[str, Any] = {
        "model": model.spec,
        **model.pool_settings,
        "kv_tls": {
            "ca": str(pki["ca"]),
            "cert": str(pki["node_cert"]),
            "key": str(pki["node_key"]),
        },
    }
    # Prefill engines send KV to ``kv_host:kv_wan``: the remote agent's fault proxy, whose
    # upstream is the WAN shaper and then the decode engine's receiver (``kv_listen``).
    kv_host: dict[str, Any] = {"kv_host": layout.kv_host} if layout.kv_host else {}
    if layout.kv_host:  # namespace sites: engines bind the site address, HTTP on private veths
        common["http_insecure"] = True
    if len(layout.remotes) > 1:  # each remote site's own WAN path (docs/testbed.md)
        kv_host["kv_site_addresses"] = {
            s: f"{layout.kv_wan_host(s)}:{ports.site(s).kv_wan}" for s in layout.remotes
        }
        kv_host["kv_link_site_addresses"] = {
            s: f"{layout.kv_wan_host(s)}:{ports.site(s).kv_link_wan}" for s in layout.remotes
        }
    pool_create(
        actor=None, deployment=dep, role="decode", site=local, nodes=[nodes["local"]],
        engine_settings={**common, "host": layout.binds["local"], "port": ports.decode,
                         "kv_port": ports.kv_wan, **kv_host,
                         "kv_listen": f"{layout.binds['local']}:{ports.kv_receiver}",
                         "kv_link_port": ports.kv_link, "kv_link_wan_port": ports.kv_link_wan,
                         "gateway_port": ports.gateway,
                         **({"gateway_settings_file": str(gateway_settings_file)}
                            if gateway_settings_file else {})},
    )  # fmt: skip
    for name, remote in remotes.items():
        pool_create(
            actor=None, deployment=dep, role="prefill", site=remote, nodes=[nodes[name]],
            engine_settings={**common, "host": layout.binds[name], "port": ports.site(name).prefill},
        )  # fmt: skip
    rollout_plan_create(
        actor=None,
        name="demo-fast",
        deployment=dep,
        # Enough requests per step to mean something, 99 % success, the link under its
        # ceiling. The TTFT gates are wide for a reason of this testbed, not of production:
        # the tiny model prefills in milliseconds, so the WAN's round trips (10 ms each way)
        # dominate remote TTFT. On an idle machine the p50 ratio measured 1.0-1.2, in the
        # CI suite on two busy cores 2.2-3.1; a broken remote path (every request waiting
        # a timeout, then falling back) is 10x and more. Production gates: 1.5-2x.
        steps=[
            {"share_percent": 50, "min_duration_s": 5, "min_requests": 16},
            {"share_percent": 100, "min_duration_s": 3, "min_requests": 8},
        ],
        gate_ttft_p50_ratio=model.ttft_gates[0],
        gate_ttft_p99_ratio=model.ttft_gates[1],
        gate_success_rate_min=0.99,
        gate_link_utilization_max=0.7,
    )
    tokens = {site: node_token_issue(actor=None, node=node) for site, node in nodes.items()}
    return Rows(dep.pk, [n.pk for n in nodes.values()], tokens)


def agent_config(
    site: str,
    site_dir: Path,
    pki: dict[str, Path],
    console_url: str,
    token_file: Path,
    ports: Ports,
    layout: Layout,
) -> dict[str, Any]:
    """A site's agent: mTLS (only the controller may call it), heartbeats to the console; a
    remote site's agent runs that site's fault proxy in front of its WAN shaper on the KV path
    (the shaper listens on the site's loopback, in its namespace with ``--netns``)."""
    bind = layout.binds[site]
    proxies = {}
    if site != "local":
        own = ports.site(site)
        proxies["local"] = {
            "listen": f"{bind}:{own.kv_wan}",
            "upstream": f"127.0.0.1:{own.kv_shaped}",
        }
    return {
        "node": {"name": layout.hosts[site], "site": site},
        "listen": f"{bind}:0",
        "state_dir": str(site_dir / "state"),
        "metrics_listen": f"{bind}:0",
        "tls": {
            "ca": str(pki["ca"]),
            "cert": str(pki["node_cert"]),
            "key": str(pki["node_key"]),
            "allowed_identities": ["orchestrator"],
        },
        "console": {
            "url": console_url,
            "token_file": str(token_file),
            "ca": str(pki["ca"]),
            "heartbeat_interval_s": 2,
        },
        "supervision": {
            "readiness_timeout_s": 300,
            "health_interval_s": 1,
            "health_failures": 5,
            "stop_grace_s": 3,
        },
        "faults": {"mechanism": "proxy", "proxies": proxies},
    }

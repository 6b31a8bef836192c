"""Datacenters in real network namespaces: sites ``local`` and ``remote`` (and, with
``remote_sites`` > 1, ``remote-b``, ``remote-c``) each get a namespace and one address; the root
namespace (console, Celery, the operator's shell) reaches each site over its own management
veth; each remote site reaches the local site only over its own **WAN** veth, shaped with
``tc tbf`` (this kernel has no netem: latency and faults come from the userspace proxies on the
KV path). Remote sites do not reach each other.

::

    root ns  C ──mgmt veth── L (ns <prefix>-local-<id>) ══WAN veth (tbf)══ R (ns <prefix>-remote-<id>)
             C ──────────────mgmt veth──────────────────────────────────────── R

Every veth end carries its namespace's one address as a point-to-point /32 (``ip addr add
ADDR peer PEER``), so a process binds to and dials one address per site whatever namespace it
runs in: ``C`` (the console, in the root namespace), ``L`` and ``R`` (``R2``, ``R3`` for more
remote sites, each with its own WAN veth to ``L``). The root namespace never forwards
(``ip_forward`` is left alone), so traffic between the sites can only take a WAN veth: cutting
one cuts that remote site off while every site still reaches the console, as a real WAN outage
would.

Used by ``pdbridge run --netns`` (``pdbridge.testbed``) and by the deploy-flow e2e tests.
Blocking (``ip``/``tc`` subprocesses). Needs root and iproute2: :func:`check_available` raises
:class:`NetnsError` with a clear message otherwise. Names carry a random suffix so parallel
runs do not collide; :meth:`NamespaceSites.teardown` removes namespaces and veths (call it
after every process inside has been stopped). :func:`remove_recorded` cleans up after a run
that was killed before it could tear down.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import subprocess
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

SITES = ("local", "remote")
#: The remote (prefill) sites' names, in order: ``remote_site_names(n)`` takes the first n.
REMOTE_SITES = ("remote", "remote-b", "remote-c")
_PREFIX = re.compile(r"^[a-z][a-z0-9]{0,7}$")


class NetnsError(RuntimeError):
    """Namespaces cannot be used here, or an ``ip``/``tc`` command failed (message says which)."""


def _run(argv: Sequence[str]) -> str:
    try:
        done = subprocess.run(  # noqa: S603 - fixed iproute2 argv, no shell
            list(argv), capture_output=True, text=True, timeout=20, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise NetnsError(f"{' '.join(argv)}: {exc}") from exc
    if done.returncode != 0:
        raise NetnsError(f"{' '.join(argv)} failed: {done.stderr.strip()}")
    return done.stdout


def check_available() -> None:
    """Raise NetnsError unless this process may create namespaces (root, ``ip`` and ``tc``)."""
    if os.name != "posix" or os.geteuid() != 0:
        raise NetnsError("network namespaces need root (run as root, or drop --netns)")
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise NetnsError(
            f"{' and '.join(missing)} not found: install iproute2 (apt-get install iproute2)"
        )


def remote_site_names(count: int) -> tuple[str, ...]:
    """The names of ``count`` remote sites (1..3): ``remote``, then ``remote-b``, ``remote-c``."""
    if not 1 <= count <= len(REMOTE_SITES):
        raise ValueError(f"remote sites: 1 to {len(REMOTE_SITES)}, got {count}")
    return REMOTE_SITES[:count]


def default_prefix() -> str:
    """Namespace / interface name prefix: ``$PDBRIDGE_NETNS_PREFIX`` or ``pdb``."""
    return os.environ.get("PDBRIDGE_NETNS_PREFIX", "pdb")


@dataclass(frozen=True)
class Site:
    """One site's namespace, its address and its interfaces (``mgmt``/``wan`` inside it)."""

    name: str
    namespace: str
    address: str
    mgmt: str  # the site's end of the management veth (holds ``address``)
    mgmt_root: str  # the root namespace's end of it
    wan: str  # the site's end of the WAN veth
    # A remote site's: the local site's end of its WAN veth ("" for the first remote site,
    # whose peer end is the local site's ``wan``; unused on the local site).
    wan_peer: str = ""


@dataclass
class NamespaceSites:
    """The sites and the console address; see the module docstring. ``remote`` is the first
    remote site; ``others`` the further ones (``remote-b``, ``remote-c``)."""

    console_address: str
    local: Site
    remote: Site
    rate_mbit: float | None = None
    others: list[Site] = field(default_factory=list)

    @property
    def remotes(self) -> list[Site]:
        """Every remote site, the first one first."""
        return [self.remote, *self.others]

    @property
    def all(self) -> list[Site]:
        return [self.local, *self.remotes]

    def site(self, name: str) -> Site:
        for site in self.all:
            if site.name == name:
                return site
        names = ", ".join(s.name for s in self.all)
        raise KeyError(f"site: one of {names}, got {name!r}")

    def local_end(self, remote: Site) -> str:
        """The local site's end of ``remote``'s WAN veth."""
        return remote.wan_peer or self.local.wan

    @property
    def addresses(self) -> list[str]:
        return [self.console_address, *(s.address for s in self.all)]

    def wrap(self, site: str, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside ``site``'s namespace (``ip netns exec`` execs: same pid)."""
        return ["ip", "netns", "exec", self.site(site).namespace, *argv]

    def shape(self, rate_mbit: float) -> None:
        """(Re)shape both directions of the WAN to ``rate_mbit`` with tbf."""
        if not rate_mbit > 0:
            raise ValueError(f"rate_mbit: must be positive, got {rate_mbit!r}")
        # Burst must hold a GSO super-packet (64 KiB) and about 4 ms at the rate.
        burst = max(int(rate_mbit * 1e6 / 8 / 250), 256 * 1024)
        ends = [(self.local, self.local_end(r)) for r in self.remotes]
        for site, dev in [*ends, *((r, r.wan) for r in self.remotes)]:
            _run(["ip", "netns", "exec", site.namespace, "tc", "qdisc", "replace", "dev",
                  dev, "root", "tbf", "rate", f"{rate_mbit}mbit", "burst", str(burst),
                  "latency", "50ms"])  # fmt: skip
        self.rate_mbit = rate_mbit

    def set_wan(self, up: bool, site: str = "remote") -> None:
        """Cut (or restore) ``site``'s WAN: the local site's end of its veth goes down."""
        _run(["ip", "-n", self.local.namespace, "link", "set",
              self.local_end(self.site(site)), "up" if up else "down"])  # fmt: skip

    def wan_up(self, site: str = "remote") -> bool:
        dev = self.local_end(self.site(site))
        out = _run(["ip", "-n", self.local.namespace, "-j", "link", "show", dev])
        return "UP" in json.loads(out)[0]["flags"]

    def record(self, path: Path) -> None:
        """Write what :func:`remove_recorded` needs to clean up after a killed run."""
        path.write_text(json.dumps(asdict(self)))

    def teardown(self) -> None:
        """Remove the namespaces and veths; tolerates what is already gone. Processes left in
        a namespace keep it (and its WAN veth) alive until they exit: stop them first."""
        for site in self.all:
            for argv in (
                ["ip", "-n", site.namespace, "link", "del", site.wan],
                ["ip", "link", "del", site.mgmt_root],
                ["ip", "netns", "del", site.namespace],
            ):
                with contextlib.suppress(NetnsError):
                    _run(argv)

    def exists(self) -> list[str]:
        """Namespaces and root-side interfaces of these sites still present (for tests)."""
        names = set(_run(["ip", "netns", "list"]).split())
        links = _run(["ip", "-o", "link", "show"])
        left = [s.namespace for s in self.all if s.namespace in names]
        left += [s.mgmt_root for s in self.all if f" {s.mgmt_root}@" in links]
        return left


def _taken_addresses() -> str:
    return _run(["ip", "-o", "addr", "show"]) + _run(["ip", "route", "show", "table", "all"])


def _pick_addresses(count: int = 3) -> tuple[str, ...]:
    """``count`` (at most 7) consecutive /32s in 10.64.0.0/11, none of them in use in the root
    namespace (other test fixtures use 10.100+ and 10.213 ranges)."""
    taken = _taken_addresses()
    for _ in range(50):
        base = f"10.{64 + secrets.randbelow(32)}.{secrets.randbelow(256)}"
        last = 8 * (1 + secrets.randbelow(30))
        picked = tuple(f"{base}.{last + 1 + i}" for i in range(count))
        if not any(re.search(rf"\b{re.escape(a)}\b", taken) for a in picked):
            return picked
    raise NetnsError("no free addresses in 10.64.0.0/11 for the namespace sites")


def create(
    prefix: str | None = None, rate_mbit: float | None = None, remote_sites: int = 1
) -> NamespaceSites:
    """Create the local site and ``remote_sites`` (1..3) remote sites (see the module
    docstring); on failure, what was made is removed. ``prefix`` (default
    :func:`default_prefix`): lower-case letters and digits, 1-8 chars."""
    check_available()
    prefix = default_prefix() if prefix is None else prefix
    if not _PREFIX.match(prefix):
        raise NetnsError(f"prefix: 1-8 lower-case letters/digits, got {prefix!r}")
    try:
        names = remote_site_names(remote_sites)
    except ValueError as exc:
        raise NetnsError(str(exc)) from None
    short, suffix = prefix[:5], secrets.token_hex(3)
    console, local_ip, *remote_ips = _pick_addresses(2 + len(names))

    def site(name: str, address: str, first: bool = True) -> Site:
        # One letter per site in interface names (15 characters at most): l, r, b, c.
        tag = name[0] if "-" not in name else name[-1]
        return Site(name, f"{prefix}-{name}-{suffix}", address, mgmt=f"{short}m{tag}{suffix}",
                    mgmt_root=f"{short}c{tag}{suffix}", wan=f"{short}w{tag}{suffix}",
                    wan_peer="" if first else f"{short}x{tag}{suffix}")  # fmt: skip

    remotes = [site(n, ip, i == 0) for i, (n, ip) in enumerate(zip(names, remote_ips, strict=True))]
    sites = NamespaceSites(console, site("local", local_ip), remotes[0], others=remotes[1:])
    local = sites.local
    try:
        for s in sites.all:
            _run(["ip", "netns", "add", s.namespace])
            _run(["ip", "link", "add", s.mgmt_root, "type", "veth", "peer", "name", s.mgmt])
            _run(["ip", "link", "set", s.mgmt, "netns", s.namespace])
            ns = ["ip", "-n", s.namespace]
            # Point-to-point addresses (``ADDR peer PEER``): the kernel owns the host route to
            # the peer and puts it back when a link comes up again after a cut. The same
            # local address on several interfaces is fine: one address per site, whatever
            # the path.
            _run(["ip", "addr", "add", console, "peer", f"{s.address}/32", "dev", s.mgmt_root])
            _run(["ip", "link", "set", s.mgmt_root, "up"])
            _run([*ns, "link", "set", "lo", "up"])
            _run([*ns, "addr", "add", s.address, "peer", f"{console}/32", "dev", s.mgmt])
            _run([*ns, "link", "set", s.mgmt, "up"])
        for remote in sites.remotes:  # one WAN veth per remote site, to the local site
            end = sites.local_end(remote)
            _run(["ip", "link", "add", end, "type", "veth", "peer", "name", remote.wan])
            _run(["ip", "link", "set", end, "netns", local.namespace])
            _run(["ip", "link", "set", remote.wan, "netns", remote.namespace])
            for s, dev, peer in ((local, end, remote), (remote, remote.wan, local)):
                ns = ["ip", "-n", s.namespace]
                _run([*ns, "addr", "add", s.address, "peer", f"{peer.address}/32", "dev", dev])
                _run([*ns, "link", "set", dev, "up"])
        if rate_mbit:
            sites.shape(rate_mbit)
    except BaseException:
        sites.teardown()
        raise
    return sites


@contextlib.contextmanager
def namespace_sites(
    prefix: str | None = None, rate_mbit: float | None = None, remote_sites: int = 1
) -> Iterator[NamespaceSites]:
    """:func:`create`, torn down on exit (stop the processes inside before leaving)."""
    sites = create(prefix, rate_mbit, remote_sites)
    try:
        yield sites
    finally:
        sites.teardown()


def remove_recorded(path: Path) -> list[str]:
    """Tear down the sites recorded at ``path`` by a run that did not (killed); returns the
    namespaces that were still there. Missing or unreadable record: nothing to do."""
    try:
        data = json.loads(path.read_text())
        sites = NamespaceSites(
            data["console_address"],
            Site(**data["local"]),
            Site(**data["remote"]),
            others=[Site(**o) for o in data.get("others", [])],
        )
    except (OSError, ValueError, KeyError, TypeError):
        return []
    left = sites.exists()
    sites.teardown()
    path.unlink(missing_ok=True)
    return left

"""Two datacenters in real network namespaces: sites ``local`` and ``remote`` each get a
namespace and one address; the root namespace (console, Celery, the operator's shell) reaches
each site over its own management veth; the two sites reach each other only over the **WAN**
veth between them, shaped with ``tc tbf`` (this kernel has no netem: latency and faults come
from the userspace proxies on the KV path).

::

    root ns  C ──mgmt veth── L (ns <prefix>-local-<id>) ══WAN veth (tbf)══ R (ns <prefix>-remote-<id>)
             C ──────────────mgmt veth──────────────────────────────────────── R

Every veth end carries its namespace's one address as a point-to-point /32 (``ip addr add
ADDR peer PEER``), so a process binds to and dials one address per site whatever namespace it
runs in: ``C`` (the console, in the root namespace), ``L`` and ``R``. The root namespace never forwards (``ip_forward`` is left alone),
so traffic between the sites can only take the WAN veth: cutting it cuts the sites apart
while both still reach the console, as a real WAN outage would.

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
from dataclasses import asdict, dataclass
from pathlib import Path

SITES = ("local", "remote")
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


@dataclass
class NamespaceSites:
    """The two sites and the console address; see the module docstring."""

    console_address: str
    local: Site
    remote: Site
    rate_mbit: float | None = None

    def site(self, name: str) -> Site:
        if name not in SITES:
            raise KeyError(f"site: one of {', '.join(SITES)}, got {name!r}")
        return self.local if name == "local" else self.remote

    @property
    def addresses(self) -> list[str]:
        return [self.console_address, self.local.address, self.remote.address]

    def wrap(self, site: str, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside ``site``'s namespace (``ip netns exec`` execs: same pid)."""
        return ["ip", "netns", "exec", self.site(site).namespace, *argv]

    def shape(self, rate_mbit: float) -> None:
        """(Re)shape both directions of the WAN to ``rate_mbit`` with tbf."""
        if not rate_mbit > 0:
            raise ValueError(f"rate_mbit: must be positive, got {rate_mbit!r}")
        # Burst must hold a GSO super-packet (64 KiB) and about 4 ms at the rate.
        burst = max(int(rate_mbit * 1e6 / 8 / 250), 256 * 1024)
        for site in (self.local, self.remote):
            _run(["ip", "netns", "exec", site.namespace, "tc", "qdisc", "replace", "dev",
                  site.wan, "root", "tbf", "rate", f"{rate_mbit}mbit", "burst", str(burst),
                  "latency", "50ms"])  # fmt: skip
        self.rate_mbit = rate_mbit

    def set_wan(self, up: bool) -> None:
        """Cut (or restore) the WAN: the local site's end goes down."""
        _run(["ip", "-n", self.local.namespace, "link", "set", self.local.wan,
              "up" if up else "down"])  # fmt: skip

    def wan_up(self) -> bool:
        out = _run(["ip", "-n", self.local.namespace, "-j", "link", "show", self.local.wan])
        return "UP" in json.loads(out)[0]["flags"]

    def record(self, path: Path) -> None:
        """Write what :func:`remove_recorded` needs to clean up after a killed run."""
        path.write_text(json.dumps(asdict(self)))

    def teardown(self) -> None:
        """Remove the namespaces and veths; tolerates what is already gone. Processes left in
        a namespace keep it (and its WAN veth) alive until they exit: stop them first."""
        for site in (self.local, self.remote):
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
        left = [s.namespace for s in (self.local, self.remote) if s.namespace in names]
        left += [s.mgmt_root for s in (self.local, self.remote) if f" {s.mgmt_root}@" in links]
        return left


def _taken_addresses() -> str:
    return _run(["ip", "-o", "addr", "show"]) + _run(["ip", "route", "show", "table", "all"])


def _pick_addresses() -> tuple[str, str, str]:
    """Three /32s in 10.64.0.0/11, none of them in use in the root namespace (other test
    fixtures use 10.100+ and 10.213 ranges)."""
    taken = _taken_addresses()
    for _ in range(50):
        base = f"10.{64 + secrets.randbelow(32)}.{secrets.randbelow(256)}"
        last = 4 * (1 + secrets.randbelow(62))
        trio = (f"{base}.{last + 1}", f"{base}.{last + 2}", f"{base}.{last + 3}")
        if not any(re.search(rf"\b{re.escape(a)}\b", taken) for a in trio):
            return trio
    raise NetnsError("no free addresses in 10.64.0.0/11 for the namespace sites")


def create(prefix: str | None = None, rate_mbit: float | None = None) -> NamespaceSites:
    """Create both sites (see the module docstring); on failure, what was made is removed.
    ``prefix`` (default :func:`default_prefix`): lower-case letters and digits, 1-8 chars."""
    check_available()
    prefix = default_prefix() if prefix is None else prefix
    if not _PREFIX.match(prefix):
        raise NetnsError(f"prefix: 1-8 lower-case letters/digits, got {prefix!r}")
    short, suffix = prefix[:5], secrets.token_hex(3)
    console, local_ip, remote_ip = _pick_addresses()

    def site(name: str, address: str) -> Site:
        tag = name[0]
        return Site(name, f"{prefix}-{name}-{suffix}", address, mgmt=f"{short}m{tag}{suffix}",
                    mgmt_root=f"{short}c{tag}{suffix}", wan=f"{short}w{tag}{suffix}")  # fmt: skip

    sites = NamespaceSites(console, site("local", local_ip), site("remote", remote_ip))
    local, remote = sites.local, sites.remote
    try:
        for s in (local, remote):
            _run(["ip", "netns", "add", s.namespace])
            _run(["ip", "link", "add", s.mgmt_root, "type", "veth", "peer", "name", s.mgmt])
            _run(["ip", "link", "set", s.mgmt, "netns", s.namespace])
        _run(["ip", "link", "add", local.wan, "type", "veth", "peer", "name", remote.wan])
        _run(["ip", "link", "set", local.wan, "netns", local.namespace])
        _run(["ip", "link", "set", remote.wan, "netns", remote.namespace])
        # Point-to-point addresses (``ADDR peer PEER``): the kernel owns the host route to the
        # peer and puts it back when a link comes up again after a cut. The same local
        # address on several interfaces is fine: one address per site, whatever the path.
        for s, peer in ((local, remote), (remote, local)):
            ns = ["ip", "-n", s.namespace]
            _run(["ip", "addr", "add", console, "peer", f"{s.address}/32", "dev", s.mgmt_root])
            _run(["ip", "link", "set", s.mgmt_root, "up"])
            _run([*ns, "link", "set", "lo", "up"])
            _run([*ns, "addr", "add", s.address, "peer", f"{console}/32", "dev", s.mgmt])
            _run([*ns, "addr", "add", s.address, "peer", f"{peer.address}/32", "dev", s.wan])
            _run([*ns, "link", "set", s.mgmt, "up"])
            _run([*ns, "link", "set", s.wan, "up"])
        if rate_mbit:
            sites.shape(rate_mbit)
    except BaseException:
        sites.teardown()
        raise
    return sites


@contextlib.contextmanager
def namespace_sites(
    prefix: str | None = None, rate_mbit: float | None = None
) -> Iterator[NamespaceSites]:
    """:func:`create`, torn down on exit (stop the processes inside before leaving)."""
    sites = create(prefix, rate_mbit)
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
            data["console_address"], Site(**data["local"]), Site(**data["remote"])
        )
    except (OSError, ValueError, KeyError, TypeError):
        return []
    left = sites.exists()
    sites.teardown()
    path.unlink(missing_ok=True)
    return left

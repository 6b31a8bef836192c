"""Two "datacenters" on one machine: two network namespaces joined by a veth pair whose
egress is shaped with ``tc tbf`` (this kernel has no netem: latency, loss and corruption
come from :mod:`grpc_kv.faultproxy`).

    with two_sites(rate_mbit=200) as net:
        net.popen(net.site_b, [sys.executable, "-m", "pdbridge.cli", "kv", "serve", ...])
        net.run(net.site_a, [...])

Needs root and iproute2; without them :func:`require_netns` calls
``tests.support.unavailable`` (a skip, or a failure under CI=true). Names carry a random
suffix and everything is torn down on exit, also after a failure. Other suites (gateway,
drills) import this module.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import subprocess
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from tests.support import subprocess_env, unavailable


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=10)


def require_netns() -> None:
    """Skip (or fail under CI) unless namespaces and tc can be used here."""
    if os.geteuid() != 0:
        unavailable("network namespaces need root")
    if not shutil.which("ip") or not shutil.which("tc"):
        unavailable("iproute2 (ip, tc) is not installed")
    probe = f"pdbprobe{uuid.uuid4().hex[:6]}"
    try:
        _ip("netns", "add", probe)
    except (subprocess.CalledProcessError, OSError) as exc:
        unavailable(f"cannot create a network namespace: {exc}")
    finally:
        with contextlib.suppress(Exception):
            _ip("netns", "del", probe)


@dataclass
class TwoSites:
    """The namespaces, their veth ends and addresses; helpers to run commands inside."""

    site_a: str
    site_b: str
    veth_a: str
    veth_b: str
    ip_a: str
    ip_b: str
    rate_mbit: float | None
    procs: list[subprocess.Popen[str]] = field(default_factory=list)

    def cmd(self, ns: str, argv: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", ns, *argv]

    def run(
        self, ns: str, argv: Sequence[str], timeout: float = 120, **kw: Any
    ) -> subprocess.CompletedProcess[str]:
        """Run a command inside ``ns`` to completion (child Pythons import this checkout)."""
        return subprocess.run(
            self.cmd(ns, argv),
            env=subprocess_env(),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
            **kw,
        )

    def popen(self, ns: str, argv: Sequence[str]) -> subprocess.Popen[str]:
        """Start a long-running command inside ``ns``; stopped when the sites go down."""
        proc = subprocess.Popen(
            self.cmd(ns, argv),
            env=subprocess_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.procs.append(proc)
        return proc

    def shape(self, rate_mbit: float) -> None:
        """(Re)shape both directions of the link to ``rate_mbit`` with tbf."""
        # Burst must hold a GSO super-packet (64 KiB) and about 4 ms at the rate.
        burst = max(int(rate_mbit * 1e6 / 8 / 250), 256 * 1024)
        for ns, dev in ((self.site_a, self.veth_a), (self.site_b, self.veth_b)):
            subprocess.run(
                ["ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root", "tbf",
                 "rate", f"{rate_mbit}mbit", "burst", str(burst), "latency", "50ms"],
                check=True, capture_output=True, text=True, timeout=10,
            )  # fmt: skip
        self.rate_mbit = rate_mbit

    def set_link(self, up: bool) -> None:
        """Cut (or restore) the path: the veth end in site_a goes down."""
        subprocess.run(
            ["ip", "netns", "exec", self.site_a, "ip", "link", "set", self.veth_a,
             "up" if up else "down"],
            check=True, capture_output=True, timeout=10,
        )  # fmt: skip


@contextlib.contextmanager
def two_sites(rate_mbit: float | None = None) -> Iterator[TwoSites]:
    """Create the two sites (see module docstring); always torn down."""
    require_netns()
    suffix = uuid.uuid4().hex[:6]
    octet = random.randint(1, 250)
    net = TwoSites(
        site_a=f"pdba-{suffix}",
        site_b=f"pdbb-{suffix}",
        veth_a=f"pva{suffix}",
        veth_b=f"pvb{suffix}",
        ip_a=f"10.213.{octet}.1",
        ip_b=f"10.213.{octet}.2",
        rate_mbit=None,
    )
    try:
        _ip("netns", "add", net.site_a)
        _ip("netns", "add", net.site_b)
        _ip("link", "add", net.veth_a, "type", "veth", "peer", "name", net.veth_b)
        _ip("link", "set", net.veth_a, "netns", net.site_a)
        _ip("link", "set", net.veth_b, "netns", net.site_b)
        for ns, dev, addr in (
            (net.site_a, net.veth_a, net.ip_a),
            (net.site_b, net.veth_b, net.ip_b),
        ):
            _ip("-n", ns, "addr", "add", f"{addr}/30", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        if rate_mbit:
            net.shape(rate_mbit)
        yield net
    finally:
        for proc in net.procs:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=5)
        for ns in (net.site_a, net.site_b):
            with contextlib.suppress(Exception):
                _ip("netns", "del", ns)  # deletes the veth pair with it

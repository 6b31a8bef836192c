"""Kernel-level link faults (need root / CAP_NET_ADMIN).

* ``link_cut``: the WAN interface towards the peer goes down (``ip link set DEV down``), or,
  when the peer's addresses are configured (mechanism ``route``/``auto``), blackhole routes
  to them (``ip route add blackhole ADDR``) so only that peer's traffic stops.
* ``link_degrade``: a token-bucket rate limit on the WAN interface (``tc qdisc ... tbf``),
  params ``rate_mbit`` (required) and ``burst_kb`` (default 64). Latency and resets need a
  userspace fault proxy in the KV path; this kernel has no netem.

Restore undoes from the journalled record and tolerates "already undone".
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import shutil

from agents.faults import Fault, FaultContext, FaultError, FaultInjector

log = logging.getLogger("pdbridge.agent.faults")


async def run_ip(args: list[str], tolerate: tuple[str, ...] = ()) -> None:
    """Run an iproute2 command; FaultError (INTERNAL) with its stderr when it fails, unless
    the error text contains one of ``tolerate`` (an already-undone state)."""
    tool = shutil.which(args[0])
    if tool is None:
        raise FaultError("mechanism", f"{args[0]} is not installed", "FAILED_PRECONDITION")
    proc = await asyncio.create_subprocess_exec(
        tool, *args[1:], stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE
    )
    _, err = await proc.communicate()
    text = err.decode(errors="replace").strip()
    if proc.returncode != 0 and not any(t in text for t in tolerate):
        raise FaultError("mechanism", f"{' '.join(args)} failed: {text}", "INTERNAL")
    log.info("agent.fault_cmd", extra={"cmd": " ".join(args), "rc": proc.returncode})


def _netns(details: dict[str, object]) -> list[str]:
    ns = str(details.get("netns") or "")
    return ["-n", ns] if ns else []


def _require_root() -> None:
    if os.geteuid() != 0:
        raise FaultError(
            "mechanism", "kernel link faults need root (CAP_NET_ADMIN)", "FAILED_PRECONDITION"
        )


class _LinkFault(FaultInjector):
    def _interface(self, fault: Fault, ctx: FaultContext) -> str:
        peer = ctx.config.peers.get(fault.target)
        interface = (peer.interface if peer else "") or ctx.config.wan_interface
        if not interface:
            raise FaultError(
                "target",
                f"no WAN interface configured for peer site {fault.target!r}",
                "FAILED_PRECONDITION",
            )
        return interface


class LinkCut(_LinkFault):
    def prepare(self, fault: Fault, ctx: FaultContext) -> None:
        _require_root()
        if fault.params:
            raise FaultError("params", "link_cut takes no params")
        if not fault.target:
            raise FaultError("target", "peer site required")
        peer = ctx.config.peers.get(fault.target)
        mechanism = ctx.config.mechanism
        if mechanism == "auto":
            mechanism = "route" if peer and peer.addresses else "interface"
        details: dict[str, object] = {"netns": ctx.config.wan_netns}
        if mechanism == "route":
            if not peer or not peer.addresses:
                raise FaultError(
                    "target",
                    f"no addresses configured for peer site {fault.target!r}",
                    "FAILED_PRECONDITION",
                )
            for address in peer.addresses:
                ipaddress.ip_network(address, strict=False)
            details["addresses"] = list(peer.addresses)
        else:
            details["interface"] = self._interface(fault, ctx)
        fault.mechanism = mechanism
        fault.details = details

    async def apply(self, fault: Fault, ctx: FaultContext) -> None:
        ns = _netns(fault.details)
        if fault.mechanism == "route":
            for address in fault.details["addresses"]:
                await run_ip(["ip", *ns, "route", "replace", "blackhole", address])
        else:
            await run_ip(["ip", *ns, "link", "set", "dev", fault.details["interface"], "down"])

    async def restore(self, fault: Fault, ctx: FaultContext) -> None:
        ns = _netns(fault.details)
        if fault.mechanism == "route":
            for address in fault.details["addresses"]:
                await run_ip(
                    ["ip", *ns, "route", "del", "blackhole", address], tolerate=("No such process",)
                )
        else:
            await run_ip(
                ["ip", *ns, "link", "set", "dev", fault.details["interface"], "up"],
                tolerate=("Cannot find device",),
            )


class LinkDegrade(_LinkFault):
    def prepare(self, fault: Fault, ctx: FaultContext) -> None:
        _require_root()
        params = dict(fault.params)
        rate = params.pop("rate_mbit", None)
        burst = params.pop("burst_kb", 64)
        for unsupported in ("latency_ms", "loss", "reset_every"):
            if unsupported in params:
                raise FaultError(
                    f"params.{unsupported}",
                    "needs the userspace fault proxy; kernel mode supports rate_mbit only",
                    "FAILED_PRECONDITION",
                )
        if params:
            raise FaultError(f"params.{sorted(params)[0]}", "unknown parameter")
        if not isinstance(rate, int | float) or isinstance(rate, bool) or rate <= 0:
            raise FaultError("params.rate_mbit", "a positive number is required")
        if not isinstance(burst, int | float) or burst <= 0:
            raise FaultError("params.burst_kb", "must be a positive number")
        fault.mechanism = "tc"
        fault.details = {
            "netns": ctx.config.wan_netns,
            "interface": self._interface(fault, ctx),
            "rate_kbit": int(rate * 1000),
            "burst_kb": int(burst),
        }

    async def apply(self, fault: Fault, ctx: FaultContext) -> None:
        d = fault.details
        await run_ip(
            ["tc", *_netns(d), "qdisc", "replace", "dev", d["interface"], "root", "tbf",
             "rate", f"{d['rate_kbit']}kbit", "burst", f"{d['burst_kb']}kb", "latency", "100ms"]
        )  # fmt: skip

    async def restore(self, fault: Fault, ctx: FaultContext) -> None:
        d = fault.details
        await run_ip(
            ["tc", *_netns(d), "qdisc", "del", "dev", d["interface"], "root"],
            tolerate=(
                "No such file",
                "Cannot find device",
                "Cannot delete qdisc with handle of zero",
            ),
        )

"""Link faults towards a peer site: ``link_cut`` and ``link_degrade``.

Mechanisms (``faults.mechanism``; ``auto`` = kernel when the agent is root and the peer has
kernel config, otherwise the proxy):

* ``route`` (root): blackhole routes to the peer's addresses (``ip route replace blackhole``):
  only that peer's traffic stops. With ``faults.peers.<site>.ports`` (the peer's kv-link
  ports) a policy rule per address and port instead (``ip rule add to ADDR ipproto tcp dport
  PORT blackhole``): only the KV link stops; the control plane to that peer keeps working.
* ``interface`` (root): the WAN interface goes down (``ip link set DEV down``); for
  ``link_degrade`` a token-bucket limit on it (``tc qdisc replace ... tbf``). This kernel has
  no netem, so latency and resets need the proxy.
* ``proxy`` (no privilege): the agent's userspace fault proxy for that peer
  (``faults.proxies.<site>``, :class:`grpc_kv.faultproxy.FaultProxy`, through which the
  kv-link dials the peer): a cut (``reset`` or ``blackhole``), or toxics for bandwidth,
  latency and connection resets.

Restore undoes from the journalled record and tolerates "already undone"; a proxy lives in
the agent, so after an agent restart there is nothing left to undo there.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import os
import shutil
from typing import Any

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


def _netns(details: dict[str, Any]) -> list[str]:
    ns = str(details.get("netns") or "")
    return ["-n", ns] if ns else []


# What ``ip rule del`` says when the rule is already gone.
_NO_RULE = ("No such file or directory",)


def _port_rule(verb: str, address: str, port: int, details: dict[str, Any]) -> list[str]:
    """``ip rule add|del`` black-holing TCP to one kv-link port of a peer address."""
    family = "-6" if ipaddress.ip_network(address, strict=False).version == 6 else "-4"
    return ["ip", family, *_netns(details), "rule", verb, "to", address,
            "ipproto", "tcp", "dport", str(port), "blackhole"]  # fmt: skip


def _number(params: dict[str, Any], key: str, default: float | None = None) -> float | None:
    value = params.pop(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise FaultError(f"params.{key}", "must be a positive number")
    return float(value)


class _LinkFault(FaultInjector):
    kernel_mechanisms: tuple[str, ...] = ("route", "interface")

    def choose(self, fault: Fault, ctx: FaultContext) -> str:
        """The mechanism for this fault; FaultError when none is usable."""
        if not fault.target:
            raise FaultError("target", "peer site required")
        peer = ctx.config.peers.get(fault.target)
        has_route = bool(peer and peer.addresses) and "route" in self.kernel_mechanisms
        has_interface = bool((peer and peer.interface) or ctx.config.wan_interface)
        has_proxy = fault.target in ctx.config.proxies
        mechanism = ctx.config.mechanism
        if mechanism == "auto":
            if os.geteuid() == 0 and (has_route or has_interface):
                mechanism = "route" if has_route else "interface"
            elif has_proxy:
                mechanism = "proxy"
            elif has_route or has_interface:
                mechanism = "route" if has_route else "interface"
            else:
                raise FaultError(
                    "target",
                    f"nothing configured to act on peer site {fault.target!r} "
                    "(faults.peers, faults.wan_interface or faults.proxies)",
                    "FAILED_PRECONDITION",
                )
        if mechanism in ("route", "interface"):
            if mechanism not in self.kernel_mechanisms:
                mechanism = "interface"
            if os.geteuid() != 0:
                raise FaultError(
                    "mechanism",
                    "kernel link faults need root (CAP_NET_ADMIN)",
                    "FAILED_PRECONDITION",
                )
            if mechanism == "route" and not has_route:
                raise FaultError(
                    "target",
                    f"no addresses configured for peer site {fault.target!r}",
                    "FAILED_PRECONDITION",
                )
            if mechanism == "interface" and not has_interface:
                raise FaultError(
                    "target",
                    f"no WAN interface configured for peer site {fault.target!r}",
                    "FAILED_PRECONDITION",
                )
        if mechanism == "proxy" and fault.target not in ctx.proxies:
            raise FaultError(
                "target",
                f"no fault proxy running for peer site {fault.target!r}",
                "FAILED_PRECONDITION",
            )
        return mechanism

    @staticmethod
    def interface(fault: Fault, ctx: FaultContext) -> str:
        peer = ctx.config.peers.get(fault.target)
        return (peer.interface if peer else "") or ctx.config.wan_interface


class LinkCut(_LinkFault):
    def prepare(self, fault: Fault, ctx: FaultContext) -> None:
        params = dict(fault.params)
        mode = params.pop("mode", "reset")
        if params:
            raise FaultError(f"params.{sorted(params)[0]}", "unknown parameter of link_cut")
        mechanism = self.choose(fault, ctx)
        details: dict[str, Any] = {"netns": ctx.config.wan_netns}
        if mechanism == "proxy":
            if mode not in ("reset", "blackhole"):
                raise FaultError("params.mode", "reset or blackhole")
            details = {"mode": mode}
        elif "mode" in fault.params:
            raise FaultError("params.mode", "only the proxy mechanism has cut modes")
        elif mechanism == "route":
            peer = ctx.config.peers[fault.target]
            for address in peer.addresses:
                try:
                    ipaddress.ip_network(address, strict=False)
                except ValueError:
                    raise FaultError(
                        "target", f"faults.peers.{fault.target}: bad address {address!r}"
                    ) from None
            details["addresses"] = list(peer.addresses)
            details["ports"] = list(peer.ports)
        else:
            details["interface"] = self.interface(fault, ctx)
        fault.mechanism = mechanism
        fault.details = details

    async def apply(self, fault: Fault, ctx: FaultContext) -> None:
        ns = _netns(fault.details)
        if fault.mechanism == "proxy":
            ctx.proxies[fault.target].cut(fault.details["mode"])
        elif fault.mechanism == "route":
            for address in fault.details["addresses"]:
                for port in fault.details.get("ports") or []:
                    # ``ip rule add`` is not idempotent: drop a leftover twin first, so one
                    # delete at restore undoes it.
                    await run_ip(_port_rule("del", address, port, fault.details), _NO_RULE)
                    await run_ip(_port_rule("add", address, port, fault.details))
                if not fault.details.get("ports"):
                    await run_ip(["ip", *ns, "route", "replace", "blackhole", address])
        else:
            await run_ip(["ip", *ns, "link", "set", "dev", fault.details["interface"], "down"])

    async def restore(self, fault: Fault, ctx: FaultContext) -> None:
        ns = _netns(fault.details)
        if fault.mechanism == "proxy":
            proxy = ctx.proxies.get(fault.target)
            if proxy is not None:
                proxy.restore()
        elif fault.mechanism == "route":
            for address in fault.details["addresses"]:
                for port in fault.details.get("ports") or []:
                    await run_ip(_port_rule("del", address, port, fault.details), _NO_RULE)
                if not fault.details.get("ports"):  # .get: journalled before ports existed
                    await run_ip(
                        ["ip", *ns, "route", "del", "blackhole", address],
                        tolerate=("No such process",),
                    )
        else:
            await run_ip(
                ["ip", *ns, "link", "set", "dev", fault.details["interface"], "up"],
                tolerate=("Cannot find device",),
            )


class LinkDegrade(_LinkFault):
    """params: ``rate_mbit`` (kernel and proxy), ``burst_kb`` (kernel), ``latency_ms``,
    ``jitter_ms``, ``reset_after_kb`` (proxy: each connection is reset after that much
    data, a loss-like fault for long transfers) and ``corrupt_every_kb`` (proxy: one byte
    flipped every that many KiB of each connection's data towards the peer -- silent
    corruption, what the KV link's per-chunk checksums exist to catch)."""

    kernel_mechanisms = ("interface",)
    PROXY_ONLY = ("latency_ms", "jitter_ms", "reset_after_kb", "corrupt_every_kb")

    def choose(self, fault: Fault, ctx: FaultContext) -> str:
        # The kernel here shapes rate only (no netem): under ``auto`` a degrade that asks for
        # latency, resets or corruption goes to the peer's fault proxy when it has one.
        if (
            ctx.config.mechanism == "auto"
            and any(key in fault.params for key in self.PROXY_ONLY)
            and fault.target in ctx.config.proxies
            and fault.target in ctx.proxies
        ):
            return "proxy"
        return super().choose(fault, ctx)

    def prepare(self, fault: Fault, ctx: FaultContext) -> None:
        params = dict(fault.params)
        rate = _number(params, "rate_mbit")
        mechanism = self.choose(fault, ctx)
        if mechanism == "proxy":
            details: dict[str, Any] = {
                "rate_mbit": rate,
                "latency_ms": _number(params, "latency_ms"),
                "jitter_ms": _number(params, "jitter_ms"),
                "reset_after_kb": _number(params, "reset_after_kb"),
                "corrupt_every_kb": _number(params, "corrupt_every_kb"),
            }
            if params:
                raise FaultError(f"params.{sorted(params)[0]}", "unknown parameter of link_degrade")
            if not any(details.values()):
                raise FaultError(
                    "params",
                    "one of rate_mbit, latency_ms, reset_after_kb, corrupt_every_kb is required",
                )
        else:
            burst = _number(params, "burst_kb", 64)
            for proxy_only in self.PROXY_ONLY:
                if proxy_only in params:
                    raise FaultError(
                        f"params.{proxy_only}",
                        "needs the userspace fault proxy (faults.proxies); the kernel mechanism limits rate_mbit only",
                        "FAILED_PRECONDITION",
                    )
            if params:
                raise FaultError(f"params.{sorted(params)[0]}", "unknown parameter of link_degrade")
            if rate is None:
                raise FaultError("params.rate_mbit", "a positive number is required")
            details = {
                "netns": ctx.config.wan_netns,
                "interface": self.interface(fault, ctx),
                "rate_kbit": int(rate * 1000),
                "burst_kb": int(burst or 64),
            }
        fault.mechanism = "proxy" if mechanism == "proxy" else "tc"
        fault.details = details

    async def apply(self, fault: Fault, ctx: FaultContext) -> None:
        d = fault.details
        if fault.mechanism == "proxy":
            from grpc_kv.faultproxy import Bandwidth, CloseAfter, Flip, Latency, Toxic

            toxics: list[Toxic] = []
            if d["rate_mbit"]:
                toxics.append(Bandwidth(bytes_per_s=d["rate_mbit"] * 1e6 / 8))
            if d["latency_ms"]:
                toxics.append(Latency(ms=d["latency_ms"], jitter_ms=d["jitter_ms"] or 0.0))
            if d["reset_after_kb"]:
                toxics.append(CloseAfter(bytes=int(d["reset_after_kb"] * 1024), reset=True))
            if d.get("corrupt_every_kb"):  # .get: journalled before this parameter existed
                every = max(1, int(d["corrupt_every_kb"] * 1024))
                # The proxy's clients are this site's senders: upstream = towards the peer.
                toxics.append(Flip(direction="upstream", every=every))
            proxy = ctx.proxies[fault.target]
            ctx.toxics[fault.id] = [proxy.add(t) for t in toxics]
            return
        await run_ip(
            ["tc", *_netns(d), "qdisc", "replace", "dev", d["interface"], "root", "tbf",
             "rate", f"{d['rate_kbit']}kbit", "burst", f"{d['burst_kb']}kb", "latency", "100ms"]
        )  # fmt: skip

    async def restore(self, fault: Fault, ctx: FaultContext) -> None:
        d = fault.details
        if fault.mechanism == "proxy":
            proxy = ctx.proxies.get(fault.target)
            for toxic in ctx.toxics.pop(fault.id, []):
                if proxy is not None and toxic in proxy.toxics:
                    proxy.remove(toxic)
            return
        await run_ip(
            ["tc", *_netns(d), "qdisc", "del", "dev", d["interface"], "root"],
            tolerate=(
                "No such file",
                "Cannot find device",
                "Cannot delete qdisc with handle of zero",
            ),
        )

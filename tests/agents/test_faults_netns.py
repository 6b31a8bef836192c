"""Link faults between two network-namespace "sites" joined by a veth pair (root needed).

Site A (``local``, where the agent's WAN interface lives) and site B (``remote``) run a real
TCP listener; traffic is a real TCP connect from A to B.
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from agents.proto.api import pb
from tests.agents.conftest import AgentProc, agent_config, free_port, stub
from tests.agents.test_grpc_api import T, settings
from tests.support import unavailable, wait_for

pytestmark = [pytest.mark.netns, pytest.mark.slow]

LISTENER = """
import selectors, socket, time
sel = selectors.DefaultSelector()
for port in (9000, 9001):  # 9000 stands for the peer's kv-link port, 9001 for anything else
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("10.231.0.2", port)); s.listen(64); s.setblocking(False)
    sel.register(s, selectors.EVENT_READ)
end = time.time() + 180
while time.time() < end:
    for key, _ in sel.select(1):
        try:
            c, _ = key.fileobj.accept(); c.close()
        except OSError:
            pass
"""


@dataclass
class Sites:
    ns_a: str
    ns_b: str
    veth_a: str
    listener: subprocess.Popen[bytes]

    def reachable(self, port: int = 9000) -> bool:
        """One real TCP connect from site A to site B's listener (0.5 s timeout)."""
        code = subprocess.run(
            ["ip", "netns", "exec", self.ns_a, sys.executable, "-c",
             f"import socket; socket.create_connection(('10.231.0.2', {port}), timeout=0.5).close()"],
            capture_output=True, timeout=30, check=False,
        ).returncode  # fmt: skip
        return code == 0


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


@pytest.fixture
def sites() -> Iterator[Sites]:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        unavailable("network namespaces need root and iproute2")
    suffix = secrets.token_hex(3)
    ns_a, ns_b, veth_a, veth_b = f"pdba-{suffix}", f"pdbb-{suffix}", f"pva{suffix}", f"pvb{suffix}"
    try:
        _ip("netns", "add", ns_a)
        _ip("netns", "add", ns_b)
        _ip("link", "add", veth_a, "type", "veth", "peer", "name", veth_b)
        _ip("link", "set", veth_a, "netns", ns_a)
        _ip("link", "set", veth_b, "netns", ns_b)
        _ip("-n", ns_a, "addr", "add", "10.231.0.1/24", "dev", veth_a)
        _ip("-n", ns_b, "addr", "add", "10.231.0.2/24", "dev", veth_b)
        for ns, dev in ((ns_a, veth_a), (ns_b, veth_b)):
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
    except subprocess.CalledProcessError as exc:
        subprocess.run(["ip", "netns", "del", ns_a], capture_output=True, check=False)
        subprocess.run(["ip", "netns", "del", ns_b], capture_output=True, check=False)
        unavailable(f"cannot create network namespaces: {exc.stderr!r}")
    listener = subprocess.Popen(["ip", "netns", "exec", ns_b, sys.executable, "-c", LISTENER])
    result = Sites(ns_a, ns_b, veth_a, listener)
    try:
        wait_for(result.reachable, 15)
        yield result
    finally:
        listener.kill()
        listener.wait(10)
        subprocess.run(["ip", "netns", "del", ns_a], capture_output=True, check=False)
        subprocess.run(["ip", "netns", "del", ns_b], capture_output=True, check=False)


def _config(tmp: Path, sites: Sites, **faults: Any) -> dict[str, Any]:
    return agent_config(
        tmp, None, faults={"wan_interface": sites.veth_a, "wan_netns": sites.ns_a, **faults}
    )


def _inject(agent: AgentProc, kind: str, duration_s: float, **params: Any) -> Any:
    request = pb.InjectFaultRequest(
        request_id=os.urandom(8).hex(),
        kind=kind,
        target="remote",
        duration_s=duration_s,
        params=settings(**params),
    )
    return stub(agent, None).InjectFault(request, timeout=T).fault


def test_link_cut_expires_by_itself(
    agent_factory: Callable[..., AgentProc], tmp_path: Path, sites: Sites
) -> None:
    agent = agent_factory(_config(tmp_path, sites))
    injected_at = time.monotonic()
    fault = _inject(agent, "link_cut", 5)
    assert fault.mechanism == "interface"
    assert not sites.reachable()
    assert [f.id for f in stub(agent, None).Status(pb.StatusRequest(), timeout=T).faults] == [
        fault.id
    ]
    wait_for(sites.reachable, 15)  # no further call: the agent restores at expiry
    assert time.monotonic() - injected_at >= 4.5
    assert list(stub(agent, None).Status(pb.StatusRequest(), timeout=T).faults) == []


def test_restarted_agent_restores_journalled_fault_before_it_serves(
    agent_factory: Callable[..., AgentProc], tmp_path: Path, sites: Sites
) -> None:
    """Ordered, not timed (a loaded machine starts an agent in anything from 1 to 30 s): the
    restore is the start-up's first act, so the link is back as soon as the next agent serves."""
    config = _config(tmp_path, sites)
    agent = agent_factory(config)
    _inject(agent, "link_cut", 300)
    agent.kill9()
    assert not sites.reachable()  # the fault outlives the agent that injected it...
    agent_factory(config, subdir="second")  # returns once the agent serves
    # ...until the next agent restores it (a veth's carrier can take a moment to come back).
    wait_for(sites.reachable, 5, what="the link restored by the agent's start")
    assert '"faults": []' in (Path(config["state_dir"]) / "faults.json").read_text()


def _cut_then_kill9(
    agent_factory: Callable[..., AgentProc], config: dict[str, Any], sites: Sites
) -> None:
    agent = agent_factory(config)
    _inject(agent, "link_cut", 300)
    agent.kill9()
    assert not sites.reachable()


def test_journalled_fault_is_restored_before_a_slow_accelerator_probe(
    agent_factory: Callable[..., AgentProc],
    tmp_path: Path,
    sites: Sites,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """nvidia-smi can take seconds on a GPU node; the restore must not wait for it. A stand-in
    on PATH (this machine has no GPU) holds the probe until the test releases it, so the order
    is observed, not timed: the link is back while the probe has not answered, and the agent
    serves only once it has."""
    config = _config(tmp_path, sites)
    _cut_then_kill9(agent_factory, config, sites)
    tools = tmp_path / "bin"
    tools.mkdir()
    called, release = tmp_path / "probe-called-at", tmp_path / "go"
    (tools / "nvidia-smi").write_text(
        f"#!/bin/sh\ndate +%s.%N > {called}\n"
        f"while [ ! -e {release} ]; do sleep 0.05; done\n"
        "echo 'NVIDIA H200, 143771'\n"
    )
    (tools / "nvidia-smi").chmod(0o755)
    monkeypatch.setenv("PATH", f"{tools}:{os.environ['PATH']}")
    with ThreadPoolExecutor(1) as pool:
        second = pool.submit(agent_factory, config, "second")  # returns once it serves
        wait_for(sites.reachable, 120)  # a generous deadline: the agent's start under load
        # Restored while the probe had not started, or had not answered and was still within
        # the agent's 10 s budget for it (so the agent was still waiting, not serving).
        if called.exists():
            assert time.time() - float(called.read_text() or time.time()) < 10
            assert not second.done()
        release.touch()
        assert second.result(120).process.poll() is None
    assert called.exists()  # the probe did run, after the restore


def test_journalled_fault_is_restored_even_when_the_start_then_fails(
    agent_factory: Callable[..., AgentProc], tmp_path: Path, sites: Sites
) -> None:
    config = _config(tmp_path, sites)
    _cut_then_kill9(agent_factory, config, sites)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        proxies = {
            "remote": {"listen": f"127.0.0.1:{busy.getsockname()[1]}", "upstream": "127.0.0.1:9"}
        }
        broken = _config(tmp_path, sites, proxies=proxies)
        with pytest.raises(AssertionError, match="agent exited 1"):
            agent_factory(broken, subdir="second")
    assert sites.reachable()
    assert '"faults": []' in (Path(config["state_dir"]) / "faults.json").read_text()


def test_route_cut_and_clear(
    agent_factory: Callable[..., AgentProc], tmp_path: Path, sites: Sites
) -> None:
    agent = agent_factory(_config(tmp_path, sites, peers={"remote": {"addresses": ["10.231.0.2"]}}))
    fault = _inject(agent, "link_cut", 60)
    assert fault.mechanism == "route"
    assert not sites.reachable()
    cleared = stub(agent, None).ClearFault(
        pb.ClearFaultRequest(request_id="c-1", id=fault.id), timeout=T
    )
    assert [f.id for f in cleared.cleared] == [fault.id]
    assert sites.reachable()


def test_port_rule_cut_stops_only_the_kv_port_until_a_restarted_agent_restores_it(
    agent_factory: Callable[..., AgentProc], tmp_path: Path, sites: Sites
) -> None:
    config = _config(
        tmp_path, sites, peers={"remote": {"addresses": ["10.231.0.2"], "ports": [9000]}}
    )
    agent = agent_factory(config)
    fault = _inject(agent, "link_cut", 300)
    assert fault.mechanism == "route"
    assert not sites.reachable(9000)  # the KV port is cut...
    assert sites.reachable(9001)  # ...the rest of the peer is not

    def rules() -> str:
        return subprocess.run(
            ["ip", "-n", sites.ns_a, "rule", "show"], capture_output=True, text=True, check=True
        ).stdout

    assert rules().count("dport 9000 blackhole") == 1
    agent.kill9()
    assert not sites.reachable(9000)  # journalled, still in force without its agent
    started = time.monotonic()
    agent_factory(config, subdir="second")
    wait_for(sites.reachable, 5)
    assert time.monotonic() - started < 5
    assert "dport 9000" not in rules()


def test_link_degrade_shapes_and_shutdown_restores(
    agent_factory: Callable[..., AgentProc], tmp_path: Path, sites: Sites
) -> None:
    agent = agent_factory(_config(tmp_path, sites))
    fault = _inject(agent, "link_degrade", 60, rate_mbit=5)
    assert fault.mechanism == "tc"

    def qdisc() -> str:
        return subprocess.run(
            ["tc", "-n", sites.ns_a, "qdisc", "show", "dev", sites.veth_a],
            capture_output=True,
            text=True,
            check=True,
        ).stdout

    assert "tbf" in qdisc()
    assert "rate 5Mbit" in qdisc()
    assert agent.terminate() == 0  # graceful shutdown restores every fault
    assert "tbf" not in qdisc()


def test_auto_degrade_shapes_in_the_kernel_and_sends_latency_to_the_proxy(
    agent_factory: Callable[..., AgentProc], tmp_path: Path, sites: Sites
) -> None:
    proxies = {"remote": {"listen": f"127.0.0.1:{free_port()}", "upstream": "127.0.0.1:9"}}
    agent = agent_factory(_config(tmp_path, sites, proxies=proxies))
    shaped = _inject(agent, "link_degrade", 60, rate_mbit=5)
    assert shaped.mechanism == "tc"  # root and a WAN interface: the kernel
    stub(agent, None).ClearFault(pb.ClearFaultRequest(request_id="c-2", id=shaped.id), timeout=T)
    delayed = _inject(agent, "link_degrade", 60, latency_ms=50)
    assert delayed.mechanism == "proxy"  # no netem here: latency only through the proxy

"""The tidal beat job carries out each hour's scale intent on real agents: two remote prefill
nodes, each a real ``pdbridge agent`` process over mTLS (``pre-1`` on the host, ``pre-2`` in
its own network namespace joined by a veth pair, so both engines can listen on the pool's one
engine port as on two machines). The engine is the agents' test health server kind
(``plain``: a test double for a GPU engine; the agent launches, supervises and stops it like
any engine).

A simulated day is driven with an injected clock: the beat's two halves are called as the task
calls them (``tidal_apply_due`` then ``carry_out_all``)."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import yaml
from django.test import override_settings

from console.deployments.models import Deployment
from console.deployments.services import (
    deployment_set_kill_switch,
    pool_create,
)
from console.inventory.models import Node
from console.schedules.models import TidalApplication
from console.schedules.services import tidal_apply_due
from grpc_kv.certs import create_ca, create_node_cert
from orchestrator import agentops
from orchestrator.agentops import Target
from orchestrator.tidalops import carry_out_all
from tests.agents.conftest import agent_config
from tests.console.factories import (
    ModelSpecFactory,
    NodeFactory,
    SiteFactory,
    make_deployment,
    make_tidal_schedule,
)
from tests.console.schedules.conftest import REMOTE_PRICES, case_study
from tests.netns import _ip, require_netns
from tests.orchestrator.workflows.topology import pinned_port
from tests.support import deadline_in, subprocess_env

pytestmark = [pytest.mark.netns, pytest.mark.django_db, pytest.mark.timeout(300)]

DAY = datetime(2026, 11, 30, tzinfo=UTC)
# Two remote instances at night, one in the afternoon, none at the evening price peak.
CAPACITY = [2] * 12 + [1] * 6 + [2] * 6


@dataclass
class RemoteAgent:
    hostname: str
    address: str
    process: subprocess.Popen[bytes]
    log: Path


@dataclass
class Bed:
    agents: dict[str, RemoteAgent]
    tls: dict[str, str]


def _start(tmp: Path, config: dict[str, Any], prefix: list[str]) -> tuple[Any, int, Path]:
    tmp.mkdir(parents=True, exist_ok=True)
    path = tmp / "agent.yaml"
    path.write_text(yaml.safe_dump(config))
    info = Path(config["state_dir"]) / "agent.json"
    log = tmp / "agent.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [*prefix, sys.executable, "-m", "pdbridge.cli", "agent", "--config", str(path)],
            stdout=out, stderr=subprocess.STDOUT, env=subprocess_env(),
        )  # fmt: skip
    deadline = deadline_in(60)
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"agent exited: {log.read_text()[-3000:]}")
        if info.exists():
            return proc, int(json.loads(info.read_text())["port"]), log
        time.sleep(0.05)
    proc.kill()
    raise AssertionError(f"agent did not start: {log.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def bed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Bed]:
    require_netns()
    tmp = tmp_path_factory.mktemp("tidal")
    ca = create_ca(tmp / "ca")
    certs = {
        n: create_node_cert(ca, tmp / "nodes", n, loopback=True)
        for n in ("pre-1", "pre-2", "orchestrator")
    }
    suffix = uuid.uuid4().hex[:6]
    ns, veth_host, veth_ns = f"pdbt-{suffix}", f"pth{suffix}", f"ptn{suffix}"
    octet = int(suffix[:2], 16) % 250 + 1
    host_ip, ns_ip = f"10.214.{octet}.1", f"10.214.{octet}.2"
    agents: dict[str, RemoteAgent] = {}
    try:
        _ip("netns", "add", ns)
        _ip("link", "add", veth_host, "type", "veth", "peer", "name", veth_ns)
        _ip("link", "set", veth_ns, "netns", ns)
        _ip("addr", "add", f"{host_ip}/30", "dev", veth_host)
        _ip("link", "set", veth_host, "up")
        _ip("-n", ns, "addr", "add", f"{ns_ip}/30", "dev", veth_ns)
        _ip("-n", ns, "link", "set", veth_ns, "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        for name, listen, prefix in (
            ("pre-1", "127.0.0.1", []),
            ("pre-2", ns_ip, ["ip", "netns", "exec", ns]),
        ):
            config = agent_config(tmp / name, None, node={"name": name, "site": "remote"})
            config.pop("insecure")
            config["listen"] = f"{listen}:0"
            config["tls"] = {
                "ca": str(ca.ca_file),
                "cert": str(certs[name].cert_file),
                "key": str(certs[name].key_file),
                "allowed_identities": ["orchestrator"],
            }
            proc, port, log = _start(tmp / name, config, prefix)
            agents[name] = RemoteAgent(name, f"{listen}:{port}", proc, log)
        yield Bed(
            agents,
            {
                "PDBRIDGE_CONTROLLER_TLS_CA": str(ca.ca_file),
                "PDBRIDGE_CONTROLLER_TLS_CERT": str(certs["orchestrator"].cert_file),
                "PDBRIDGE_CONTROLLER_TLS_KEY": str(certs["orchestrator"].key_file),
            },
        )
    finally:
        for agent in agents.values():  # SIGTERM: the agent stops its children first
            agent.process.terminate()
            try:
                agent.process.wait(30)
            except subprocess.TimeoutExpired:
                agent.process.kill()
                agent.process.wait(10)
        with contextlib.suppress(Exception):
            _ip("link", "del", veth_host)
        with contextlib.suppress(Exception):
            _ip("netns", "del", ns)


@dataclass
class Tidal:
    bed: Bed
    deployment_id: int
    schedule_id: int

    @property
    def child(self) -> str:
        return agentops.child_name(self.deployment_id, "prefill")

    def target(self, host: str) -> Target:
        return Target("prefill", "remote", host, self.bed.agents[host].address)

    def state(self, host: str) -> dict[str, Any]:
        return agentops.child_status(self.target(host), self.child)

    def tick(self, hour: int, minute: int = 1) -> TidalApplication:
        now = DAY + timedelta(hours=hour, minutes=minute)
        ids = tidal_apply_due(now=now)
        carry_out_all(ids)
        return TidalApplication.objects.get(
            schedule_id=self.schedule_id, hour_start=DAY + timedelta(hours=hour)
        )


@pytest.fixture
def tidal(bed: Bed) -> Iterator[Tidal]:
    """An active deployment whose remote prefill pool is the two agents' nodes, with an
    enabled schedule; its engines are stopped again afterwards."""
    remote = SiteFactory(name="remote", role="prefill")
    local = SiteFactory(name="local", role="decode", gpu_hour_price=1.5)
    nodes = [
        NodeFactory(site=remote, hostname=name, agent_address=agent.address)
        for name, agent in bed.agents.items()
    ]
    decode = NodeFactory(site=local, hostname="dec-1", agent_address="127.0.0.1:1")
    deployment = make_deployment(name="tidal", model=ModelSpecFactory(name="tiny"))
    pool_create(actor=None, deployment=deployment, role="decode", site=local, nodes=[decode])
    pool_create(
        actor=None,
        deployment=deployment,
        role="prefill",
        site=remote,
        nodes=nodes,
        engine_settings={
            "engine": "plain",
            "model": "tiny",
            "kv_insecure": True,
            # A fresh port per test: the agent binds a pinned port without SO_REUSEADDR, so
            # the previous test's port may still be held by TIME_WAIT connections.
            "port": pinned_port(),
        },
    )
    schedule = make_tidal_schedule(
        deployment=deployment,
        remote_site=remote,
        local_site=local,
        capacity=CAPACITY,
        scenario=case_study(),
        remote_prices=REMOTE_PRICES,
    )
    world = Tidal(bed, deployment.pk, schedule.pk)
    # No gateway here (tests/orchestrator/test_tidal_gateway.py has them): a drain is not
    # waited for.
    with override_settings(PDBRIDGE_CONTROLLER_INSECURE=False, TIDAL_DRAIN_TIMEOUT_S=0, **bed.tls):
        yield world
        for host in bed.agents:
            if world.state(host)["state"] != "absent":

                async def stop(agent: Any) -> Any:
                    return await agent.stop(world.child)

                agentops.call(world.target(host), stop)


def test_scale_down_stops_one_scale_up_launches_it_again_and_a_repeated_tick_does_nothing(
    tidal: Tidal,
) -> None:
    night = tidal.tick(11)
    assert night.scale["run"] == ["pre-1", "pre-2"], night.scale
    assert night.scale["agents_state"] == "done", night.scale
    assert night.error == ""
    assert {r["action"] for r in night.scale["agents"]} == {"started"}
    running = {h: tidal.state(h) for h in ("pre-1", "pre-2")}
    assert all(s["state"] == "running" for s in running.values()), running

    again = tidal.tick(11, minute=30)  # the same hour: nothing new is sent
    assert again.scale["agent_attempts"] == 1
    assert {h: tidal.state(h)["pid"] for h in running} == {h: s["pid"] for h, s in running.items()}

    afternoon = tidal.tick(12)  # capacity 1: the second node's engine stops
    assert afternoon.scale["run"] == ["pre-1"]
    assert afternoon.scale["stop"] == ["pre-2"]
    assert afternoon.scale["agents_state"] == "done", afternoon.scale
    actions = {r["node"]: r["action"] for r in afternoon.scale["agents"]}
    assert actions == {"pre-1": "unchanged", "pre-2": "stopped"}
    assert tidal.state("pre-2")["state"] == "absent"
    assert tidal.state("pre-1")["pid"] == running["pre-1"]["pid"]  # left running

    late = tidal.tick(22)  # capacity 2 again: launched again on the second node
    assert late.scale["run"] == ["pre-1", "pre-2"], late.scale
    actions = {r["node"]: r["action"] for r in late.scale["agents"]}
    assert actions == {"pre-1": "unchanged", "pre-2": "started"}
    relaunched = tidal.state("pre-2")
    assert relaunched["state"] == "running"
    assert relaunched["pid"] != running["pre-2"]["pid"]


def test_agent_errors_are_recorded_and_retried_and_the_kill_switch_defers_the_calls(
    tidal: Tidal,
) -> None:
    tidal.tick(11)
    assert tidal.state("pre-2")["state"] == "running"
    pre2 = Node.objects.get(hostname="pre-2")
    real_address = pre2.agent_address

    # Kill switch turned on after the hour's row was written: no agent is touched.
    ids = tidal_apply_due(now=DAY + timedelta(hours=12, minutes=1))
    deployment = Deployment.objects.get(pk=tidal.deployment_id)
    deployment_set_kill_switch(actor=None, deployment=deployment, enabled=True)
    assert carry_out_all(ids) == {ids[0]: "deferred"}
    assert tidal.state("pre-2")["state"] == "running"

    # Switch off, but pre-2's agent unreachable: the error is on the row, the beat goes on.
    deployment.refresh_from_db()
    deployment_set_kill_switch(actor=None, deployment=deployment, enabled=False)
    pre2.agent_address = "127.0.0.1:1"
    pre2.save()
    assert carry_out_all(ids) == {ids[0]: "failed"}
    row = TidalApplication.objects.get(pk=ids[0])
    assert "stop pre-2" in row.error
    assert row.scale["agents_state"] == "failed"
    assert tidal.state("pre-2")["state"] == "running"

    # Reachable again: the next tick of the same hour retries and finishes the hour.
    pre2.agent_address = real_address
    pre2.save()
    row = tidal.tick(12, minute=2)
    assert row.scale["agents_state"] == "done", row.scale
    assert row.error == ""
    assert row.scale["agent_attempts"] == 2
    assert tidal.state("pre-2")["state"] == "absent"


def test_the_beat_task_applies_the_current_hour_and_carries_it_out(tidal: Tidal) -> None:
    from orchestrator.tasks.schedules import apply_tidal

    ids = apply_tidal()  # the real clock: whatever hour it is now, run synchronously

    row = TidalApplication.objects.get(pk=ids[0])
    assert row.scale["agents_state"] == "done", row.scale
    for host in row.scale["run"]:
        assert tidal.state(host)["state"] == "running"
    for host in row.scale["stop"]:
        assert tidal.state(host)["state"] == "absent"
    apply_tidal()  # a second tick: the row is done, nothing new is sent for it
    assert TidalApplication.objects.get(pk=ids[0]).scale["agent_attempts"] == 1

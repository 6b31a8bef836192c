"""A tidal hour change reaching a real gateway: the console (Django's live server on the test
database), two remote prefill nodes, each a real ``pdbridge agent`` process over mTLS in a
network namespace of its own (so each node is an address, as two machines are), a real
``pdbridge gateway`` process polling the console's config snapshot, and client load through
it. The engines are the gateway tests' engine double processes (``engine_proc``: a test
double for a GPU engine, which cannot run here); the agents launch, supervise and stop them
like any engine, the decode double runs on the host. The beat's two halves are called as the
task calls them (``tidal_apply_due`` with an injected hour, then ``carry_out`` re-checked
until the hour is done, as ``orchestrator.schedules.carry_out_tidal`` re-sends itself)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from django.test import override_settings

from console.deployments.models import Deployment
from console.deployments.services import pool_create
from console.inventory.services import node_token_issue
from console.schedules.models import TidalApplication
from console.schedules.services import tidal_apply_due
from grpc_kv.certs import create_ca, create_node_cert
from orchestrator import agentops
from orchestrator.agentops import Target
from orchestrator.tidalops import DONE, DRAINING, carry_out
from orchestrator.workflows import gateway_metrics as gm
from tests.agents.conftest import agent_config
from tests.agents.engines.client import free_port
from tests.agents.gateway.procs import Proc, _ready_line, metric, start_double
from tests.console.factories import (
    ModelSpecFactory,
    NodeFactory,
    SiteFactory,
    make_deployment,
    make_tidal_schedule,
)
from tests.console.schedules.conftest import REMOTE_PRICES, case_study
from tests.netns import _ip, require_netns
from tests.orchestrator.test_tidal_agents import _start
from tests.orchestrator.workflows.topology import pinned_port
from tests.support import deadline_in, subprocess_env

pytestmark = [
    pytest.mark.netns,
    pytest.mark.slow,
    pytest.mark.django_db(transaction=True),
    pytest.mark.timeout(600),
]

#: How long a test waits for an event: generous (a loaded machine is not a failure); a
#: passing run returns as soon as the event is seen.
EVENT_S = 120
DAY = datetime(2026, 11, 30, tzinfo=UTC)
#: No remote instance until 04:00 and at 23:00, two at 11:00, one at 12:00.
CAPACITY = [0] * 4 + [2] * 8 + [1] * 6 + [2] * 5 + [0]
POLL_S = 0.5
GATEWAY_SETTINGS = {
    "poll_interval_s": POLL_S,
    "health_check_interval_s": 0.5,
    "scrape_interval_s": 0.5,
    "connect_timeout_s": 1.0,
    "prefill_timeout_s": 10.0,
    "fallback_rate_per_s": 100.0,
}


@dataclass
class Node:
    hostname: str  # its address: what the gateway dials and its certificate names
    agent_address: str
    journal: Path


@dataclass
class Bed:
    nodes: dict[str, Node]
    tls: dict[str, str]
    certs: Any
    kv_dir: Path
    tmp: Path
    procs: list[Any] = field(default_factory=list)


@pytest.fixture(scope="module")
def bed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Bed]:
    with agent_bed(tmp_path_factory.mktemp("tidalgw"), site="remote") as made:
        yield made


@contextlib.contextmanager
def agent_bed(tmp: Path, site: str, double_args: tuple[str, ...] = ()) -> Iterator[Bed]:
    """Two nodes, each a real agent over mTLS in a namespace of its own, whose engine
    ``double`` is the engine double process (``double_args``: its delays and so on)."""
    require_netns()
    kv_dir = tmp / "kv"
    kv_dir.mkdir()
    suffix = uuid.uuid4().hex[:5]
    octet = int(suffix[:2], 16) % 250 + 1
    spaces = [(f"pdtg{i}-{suffix}", f"ptg{i}h{suffix}", f"ptg{i}n{suffix}", i) for i in (1, 2)]
    addresses = {i: (f"10.215.{octet}.{4 * i - 3}", f"10.215.{octet}.{4 * i - 2}") for i in (1, 2)}
    ca = create_ca(tmp / "ca")
    names = [addresses[i][1] for i in (1, 2)]
    certs = {
        n: create_node_cert(ca, tmp / "certs", n, loopback=True) for n in [*names, "orchestrator"]
    }
    certs["gateway"] = create_node_cert(ca, tmp / "certs", "gateway", loopback=True)
    procs: list[Any] = []
    nodes: dict[str, Node] = {}
    try:
        for ns, veth_host, veth_ns, i in spaces:
            host_ip, ns_ip = addresses[i]
            _ip("netns", "add", ns)
            _ip("link", "add", veth_host, "type", "veth", "peer", "name", veth_ns)
            _ip("link", "set", veth_ns, "netns", ns)
            _ip("addr", "add", f"{host_ip}/30", "dev", veth_host)
            _ip("link", "set", veth_host, "up")
            _ip("-n", ns, "addr", "add", f"{ns_ip}/30", "dev", veth_ns)
            _ip("-n", ns, "link", "set", veth_ns, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            journal = tmp / f"{ns_ip}.jsonl"
            config = agent_config(tmp / ns_ip, None, node={"name": ns_ip, "site": site})
            config.pop("insecure")
            config["listen"] = f"{ns_ip}:0"
            config["tls"] = {
                "ca": str(ca.ca_file),
                "cert": str(certs[ns_ip].cert_file),
                "key": str(certs[ns_ip].key_file),
                "allowed_identities": ["orchestrator"],
            }
            config["engines"]["double"] = {
                "argv": ["{python}", "-m", "tests.agents.gateway.engine_proc", "--name",
                         "{name}", "--kv-dir", str(kv_dir), "--port", "{port}", "--host",
                         "{settings.host}", "--journal", str(journal), "--max-prompt-chars",
                         "1000000", *double_args],
            }  # fmt: skip
            proc, port, _ = _start(tmp / ns_ip, config, ["ip", "netns", "exec", ns])
            procs.append(proc)
            nodes[ns_ip] = Node(ns_ip, f"{ns_ip}:{port}", journal)
        yield Bed(
            nodes,
            {
                "PDBRIDGE_CONTROLLER_TLS_CA": str(ca.ca_file),
                "PDBRIDGE_CONTROLLER_TLS_CERT": str(certs["orchestrator"].cert_file),
                "PDBRIDGE_CONTROLLER_TLS_KEY": str(certs["orchestrator"].key_file),
            },
            certs,
            kv_dir,
            tmp,
        )
    finally:
        for proc in procs:  # SIGTERM: the agent stops its children first
            proc.terminate()
            try:
                proc.wait(30)
            except Exception:
                proc.kill()
                proc.wait(10)
        for ns, veth_host, _, _ in spaces:
            with contextlib.suppress(Exception):
                _ip("link", "del", veth_host)
            with contextlib.suppress(Exception):
                _ip("netns", "del", ns)


def _gateway(deployment_id: int, console: str, token: str, port: int, bed: Bed) -> Proc:
    work = bed.tmp / f"gw-{deployment_id}"
    work.mkdir()
    (work / "gateway.yaml").write_text(yaml.safe_dump(GATEWAY_SETTINGS))
    log = work / "gateway.log"
    cert = bed.certs["gateway"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdbridge.cli", "gateway", "--deployment", str(deployment_id),
         "--console", console, "--token", token, "--insecure", "--tls-cert",
         str(cert.cert_file), "--tls-key", str(cert.key_file), "--host", "127.0.0.1",
         "--port", str(port), "--settings", str(work / "gateway.yaml"),
         "--state-dir", str(work / "state")],
        stdout=subprocess.PIPE, stderr=log.open("a"), text=True, env=subprocess_env(),
    )  # fmt: skip
    line = _ready_line(proc, log, 60)
    assert line.startswith("pdbridge gateway listening on"), line
    return Proc(proc, f"https://127.0.0.1:{port}", log)


@dataclass
class World:
    bed: Bed
    deployment_id: int
    schedule_id: int
    gateway: Proc
    ssl: Any

    @property
    def child(self) -> str:
        return agentops.child_name(self.deployment_id, "prefill")

    def target(self, host: str) -> Target:
        return Target("prefill", "remote", host, self.bed.nodes[host].agent_address)

    def state(self, host: str) -> dict[str, Any]:
        return agentops.child_status(self.target(host), self.child)

    def deployment(self) -> Deployment:
        return Deployment.objects.get(pk=self.deployment_id)

    def get(self, path: str) -> str:
        async def go() -> str:
            async with (
                aiohttp.ClientSession() as session,
                session.get(self.gateway.url + path, ssl=self.ssl) as response,
            ):
                return await response.text()

        return asyncio.run(go())

    def routing(self) -> dict[str, Any]:
        doc: dict[str, Any] = json.loads(self.get("/debug/routing"))
        return doc

    def wait_version(self, version: int) -> float:
        """Seconds until the gateway reports ``version`` applied; asserts it took at most one
        poll: its count of unchanged polls (304) did not grow meanwhile by more than the one
        that may have been in flight when the version was written."""
        started = time.monotonic()
        polls = metric(
            self.get("/metrics"), "pdbridge_gateway_config_polls_total", result="unchanged"
        )
        while True:
            page = self.get("/metrics")
            if (gm.parse(page)["config_version"] or 0) >= version:
                grew = (
                    metric(page, "pdbridge_gateway_config_polls_total", result="unchanged") - polls
                )
                assert grew <= 1, f"version {version} applied after {grew} unchanged polls"
                return time.monotonic() - started
            assert time.monotonic() - started < EVENT_S, f"gateway never applied v{version}"
            time.sleep(0.05)

    def hour(self, hour: int) -> TidalApplication:
        """The beat's tick at ``hour``:01 and the re-checks of its drain, until done."""
        ids = tidal_apply_due(now=DAY + timedelta(hours=hour, minutes=1))
        assert len(ids) == 1, ids
        deadline = deadline_in(EVENT_S)
        state = carry_out(ids[0])
        while state == DRAINING:
            assert time.monotonic() < deadline, TidalApplication.objects.get(pk=ids[0]).scale
            time.sleep(0.5)  # the re-check task's countdown (RECHECK_S), shortened
            state = carry_out(ids[0])
        row = TidalApplication.objects.get(pk=ids[0])
        assert state == DONE, row.scale
        return row


@pytest.fixture
def world(bed: Bed, live_server: Any) -> Iterator[World]:
    remote = SiteFactory(name="remote", role="prefill")
    local = SiteFactory(name="local", role="decode", gpu_hour_price=1.5)
    prefill_nodes = [
        NodeFactory(site=remote, hostname=n.hostname, agent_address=n.agent_address)
        for n in bed.nodes.values()
    ]
    decode_node = NodeFactory(site=local, hostname="127.0.0.1", agent_address="127.0.0.1:1")
    decode = start_double("decode", bed.kv_dir, bed.tmp, max_prompt_chars=1_000_000)
    gateway_port = free_port()
    deployment = make_deployment(
        name=f"tidal-{uuid.uuid4().hex[:4]}", model=ModelSpecFactory(name="tiny")
    )
    pool_create(
        actor=None,
        deployment=deployment,
        role="decode",
        site=local,
        nodes=[decode_node],
        engine_settings={"port": int(decode.url.rsplit(":", 1)[1]), "gateway_port": gateway_port},
    )
    pool_create(
        actor=None,
        deployment=deployment,
        role="prefill",
        site=remote,
        nodes=prefill_nodes,
        engine_settings={
            "engine": "double",
            "model": "tiny",
            "host": "0.0.0.0",  # inside the node's own namespace
            "kv_insecure": True,
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
    token = node_token_issue(actor=None, node=decode_node)
    gateway = _gateway(deployment.pk, live_server.url, token, gateway_port, bed)
    ssl_ctx = None
    with override_settings(PDBRIDGE_CONTROLLER_INSECURE=False, TIDAL_DRAIN_TIMEOUT_S=60, **bed.tls):
        ssl_ctx = agentops.http_ssl_context()
        w = World(bed, deployment.pk, schedule.pk, gateway, ssl_ctx)
        try:
            yield w
        finally:
            gateway.stop()
            decode.stop()
            for host in bed.nodes:
                if w.state(host)["state"] != "absent":

                    async def stop(agent: Any) -> Any:
                        return await agent.stop(w.child)

                    agentops.call(w.target(host), stop)
            for node in bed.nodes.values():
                node.journal.unlink(missing_ok=True)


class Load:
    """``concurrency`` clients sending completions in a loop until stopped: (status, path,
    time the answer ended) of each."""

    def __init__(self, url: str, ssl: Any, prompt: str, concurrency: int = 4) -> None:
        self.url, self.ssl, self.prompt, self.concurrency = url, ssl, prompt, concurrency
        self.results: list[tuple[int, str | None, float]] = []
        self.errors: list[str] = []  # the first answers that were not 200
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    async def _main(self) -> None:
        timeout = aiohttp.ClientTimeout(total=60)
        async with aiohttp.ClientSession(timeout=timeout) as session:

            async def client(c: int) -> None:
                i = 0
                while not self._stop.is_set():
                    i += 1
                    stream = i % 3 == 0
                    body = {"model": "tiny", "prompt": f"{self.prompt} {c}-{i}",
                            "max_tokens": 4, "stream": stream}  # fmt: skip
                    try:
                        async with session.post(
                            self.url + "/v1/completions", json=body, ssl=self.ssl
                        ) as r:
                            raw = await r.read()
                            status = r.status
                            if status == 200 and stream and not raw.endswith(b"data: [DONE]\n\n"):
                                status = 598
                            path = r.headers.get("x-pdbridge-path")
                            if status != 200 and len(self.errors) < 5:
                                self.errors.append(f"{status} {raw[:300]!r}")
                    except (aiohttp.ClientError, TimeoutError):
                        status, path = 599, None
                    self.results.append((status, path, time.time()))

            await asyncio.gather(*(client(c) for c in range(self.concurrency)))

    def __enter__(self) -> Load:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(90)

    def wait_for(self, count: int) -> None:
        deadline = deadline_in(EVENT_S)
        while len(self.results) < count:
            assert time.monotonic() < deadline, f"only {len(self.results)} answers"
            time.sleep(0.05)


#: A prompt over every hour's threshold (the plan's are about 40,000 and 56,000 tokens; 4
#: characters per token is the gateway's estimate), so each goes remote whatever the hour.
PROMPT_TOKENS = 80_000


def _prompt(threshold: int) -> str:
    assert threshold < PROMPT_TOKENS
    return "abc " * PROMPT_TOKENS


def _journal(node: Node) -> list[dict[str, Any]]:
    if not node.journal.exists():
        return []
    return [json.loads(line) for line in node.journal.read_text().splitlines() if line]


def _check_routing(world: World, deployment: Deployment) -> None:
    config = world.routing()["config"]
    assert config["version"] >= deployment.version
    assert config["remote_share_percent"] == deployment.remote_share_percent
    assert config["threshold_tokens"] == deployment.remote_prefill_threshold_tokens


def test_a_tidal_scale_down_drains_the_node_from_the_gateway_before_its_engine_stops(
    world: World,
) -> None:
    night = world.hour(11)  # two instances: both engines launched, both in the pool
    assert night.scale["run"] == sorted(world.bed.nodes), night.scale
    assert all(r["healthy"] for r in night.scale["agents"]), night.scale
    deployment = world.deployment()
    world.wait_version(deployment.version)
    _check_routing(world, deployment)
    assert deployment.remote_share_percent > 0, night.plan
    leaving = night.scale["run"][1]
    staying = night.scale["run"][0]
    prompt = _prompt(deployment.remote_prefill_threshold_tokens)

    with Load(world.gateway.url, world.ssl, prompt) as load:
        load.wait_for(40)
        before = len(load.results)
        afternoon = world.hour(12)  # one instance: the second node leaves
        stopped_at = time.time()
        load.wait_for(len(load.results) + 40)  # and the load goes on after the stop

    # The hour's share and threshold reached the gateway within one poll.
    deployment = world.deployment()
    world.wait_version(deployment.version)
    _check_routing(world, deployment)
    assert afternoon.scale["stop"] == [leaving], afternoon.scale
    drain = afternoon.scale["drain"]
    # Ordering, from the row's evidence: drained (a new version), every gateway applied it
    # with no leg in flight to the node, and only then the engine was stopped.
    assert drain["state"] == "applied", drain
    assert drain["nodes"] == [leaving]
    assert drain["started_at"] < drain["applied_at"]
    assert all(g["applied"] and g["config_version"] >= drain["version"] for g in drain["gateways"])
    stop = next(r for r in afternoon.scale["agents"] if r["node"] == leaving)
    assert stop["action"] == "stopped", afternoon.scale
    assert drain["applied_at"] <= stop["at"]
    assert world.state(leaving)["state"] == "absent"
    assert world.state(staying)["state"] == "running"
    # ... and from the engine's own journal: every leg it served had ended before its stop.
    applied = datetime.fromisoformat(drain["applied_at"]).timestamp()
    served = _journal(world.bed.nodes[leaving])
    assert served, "the node that left had served no prefill leg before the change"
    assert all(leg["ended_at"] <= applied + 0.5 for leg in served), served[-3:]
    assert all(leg["outcome"] == "completed" for leg in served), served[-3:]
    # 0 failed client requests across the change, and none fell back.
    statuses = [s for s, _, _ in load.results]
    assert statuses.count(200) == len(statuses), (
        {s: statuses.count(s) for s in set(statuses)},
        load.errors,
    )
    paths = [p for _, p, _ in load.results]
    assert paths.count("fallback") == 0, {p: paths.count(p) for p in set(paths)}
    after = [p for _, p, t in load.results[before:] if t > stopped_at]
    assert after, "no answer after the stop"
    assert set(after) == {"remote"}, after
    assert deployment.remote_prefill_threshold_tokens < PROMPT_TOKENS
    # The gateway: the node is drained, the site serves on the other, no breaker opened.
    site = world.routing()["sites"][0]
    assert site["breaker"]["state"] == "closed"
    assert {i["name"]: i["drained"] for i in site["instances"]} == {staying: False, leaving: True}

    late = world.hour(22)  # two again: relaunched, healthy, rejoins in a new version
    assert late.scale["joined"]["nodes"] == [leaving], late.scale
    world.wait_version(late.scale["joined"]["version"])
    site = world.routing()["sites"][0]
    assert {i["name"]: i["drained"] for i in site["instances"]} == {staying: False, leaving: False}


def test_tidal_zero_one_zero_remote_instances_under_load_costs_no_fallback(world: World) -> None:
    """0 -> 1 -> 0 remote instances with traffic flowing: the hour that starts an instance
    publishes its share only once the engine is up and in the gateway's pool (it once went
    out first: ~7 s of ``no_remote_site`` fallbacks); the hour that ends it sets the share
    to 0 first, then drains, then stops."""
    night = world.hour(3)
    assert (night.plan["remote_instances"], night.plan["remote_share_percent"]) == (0, 0)
    world.wait_version(world.deployment().version)
    prompt = _prompt(world.deployment().remote_prefill_threshold_tokens)

    with Load(world.gateway.url, world.ssl, prompt) as load:
        load.wait_for(20)
        morning = world.hour(12)
        load.wait_for(len(load.results) + 40)
        # The held share reaches the gateway with its version (one poll), then traffic goes
        # remote.
        world.wait_version(morning.scale["share"]["version"])
        published = time.time()
        deadline = deadline_in(EVENT_S)
        while not any(p == "remote" for _, p, t in load.results if t > published):
            assert time.monotonic() < deadline, "never served remote after the share"
            time.sleep(0.1)
        late = world.hour(23)
        load.wait_for(len(load.results) + 20)

    assert morning.plan["remote_instances"] == 1
    assert morning.plan["remote_share_percent"] > 0
    share, joined = morning.scale["share"], morning.scale["joined"]
    # Held back, then published in a later version, once the gateway served the engine.
    assert share["state"] == "published", share
    assert share["percent"] == morning.plan["remote_share_percent"]
    assert share["version"] > joined["version"]
    assert all(g["serving"] for g in share["gateways"]), share["gateways"]
    assert morning.config_version < share["version"]
    assert late.plan["remote_share_percent"] == 0
    assert late.scale["drain"]["state"] == "applied", late.scale
    statuses = [s for s, _, _ in load.results]
    assert statuses.count(200) == len(statuses), (
        {s: statuses.count(s) for s in set(statuses)},
        load.errors,
    )
    paths = [p for _, p, _ in load.results]
    assert paths.count("fallback") == 0, {p: paths.count(p) for p in set(paths)}


def test_a_dead_instance_is_ejected_and_the_site_keeps_serving_on_the_other(
    world: World,
) -> None:
    night = world.hour(11)
    deployment = world.deployment()
    world.wait_version(deployment.version)
    dead, alive = night.scale["run"][1], night.scale["run"][0]

    async def stop(agent: Any) -> Any:  # an operator's stop without a drain, or a crash
        return await agent.stop(world.child)

    agentops.call(world.target(dead), stop)
    before = len(_journal(world.bed.nodes[alive]))
    prompt = _prompt(deployment.remote_prefill_threshold_tokens)
    with Load(world.gateway.url, world.ssl, prompt) as load:
        load.wait_for(60)

    statuses = [s for s, _, _ in load.results]
    assert statuses.count(200) == len(statuses), (
        {s: statuses.count(s) for s in set(statuses)},
        load.errors,
    )
    paths = [p for _, p, _ in load.results]
    assert paths.count("remote") >= len(paths) - 5, {p: paths.count(p) for p in set(paths)}
    site = world.routing()["sites"][0]
    assert site["breaker"]["state"] == "closed", site
    assert site["breaker"]["ejections"] == 0, site
    by_name = {i["name"]: i for i in site["instances"]}
    pool = next(p for p in world.routing()["pools"] if p["role"] == "prefill")
    dead_url = by_name[dead]["url"]
    out = next(i for i in pool["instances"] if i["url"] == dead_url)
    assert not out["available"], pool
    assert by_name[alive]["breaker"]["state"] == "closed"
    served = [leg for leg in _journal(world.bed.nodes[alive])[before:] if leg["leg"] == "prefill"]
    assert len(served) >= paths.count("remote"), (len(served), paths.count("remote"))

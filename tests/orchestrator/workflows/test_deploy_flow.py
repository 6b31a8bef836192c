"""The deployment and canary workflows end to end on real processes: Celery workers, the
console, two mTLS node agents (sites ``local`` and ``remote``) that launch reference engines,
a kv-link and the gateway, and the remote agent's fault proxy on the KV (WAN) path. The two
sites are network namespaces joined by a tbf-shaped veth (``topology``); needs root.

The tests share one module-scoped testbed and run in order: the first deploys from nothing
(engines are launched by the workflow), the later ones re-use what it brought up. The canary
rollback comes last: the latency it injects opens the gateway's breaker on the remote site
for a while, as a real WAN incident would.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from django.core.management import call_command
from django.db import connection
from django.test import override_settings

from agents.client import AgentClient
from agents.engines.reference import checkpoints
from agents.weights import hash_files
from console.core import celery_client
from console.deployments import flows
from console.deployments.models import Deployment
from console.deployments.services import deployment_update, pool_create, pool_update
from console.inventory.models import Link, Node
from console.inventory.services import node_token_issue, node_update
from console.rollouts.services import rollout_plan_create
from console.runs import services as run_services
from console.runs.models import WorkflowRun
from console.telemetry.models import MetricSample
from grpc_kv.tls import TLSConfig
from tests.console.factories import LinkFactory, ModelSpecFactory, SiteFactory, make_deployment
from tests.orchestrator.conftest import _database_url
from tests.orchestrator.workflows import topology as topo
from tests.support import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


class World:
    """Handles on the testbed."""

    def __init__(self, tmp: Path, sites: Any) -> None:
        self.tmp = tmp
        self.sites = sites
        self.pki = topo.make_pki(tmp / "pki", sites.addresses)
        self.ports = topo.Ports()
        self.models_dir = tmp / "models"
        self.console: topo.Console | None = None
        self.agents: dict[str, Any] = {}
        self.deployment_id = 0
        # While this file exists, a reference engine the remote agent starts waits before it
        # runs (so a test can hold a Launch in progress); absent by default.
        self.engine_hold = tmp / "remote-engine.hold"

    @property
    def deployment(self) -> Deployment:
        return Deployment.objects.get(pk=self.deployment_id)

    def agent_call(self, site: str, fn: Any) -> Any:
        tls = TLSConfig(
            ca_file=self.pki.ca,
            cert_file=self.pki.controller_cert,
            key_file=self.pki.controller_key,
            server_name="localhost",
        )

        async def go() -> Any:
            async with AgentClient(self.agents[site].address, tls) as agent:
                return await fn(agent)

        return asyncio.run(go())

    def children(self, site: str) -> dict[str, Any]:
        status = self.agent_call(site, lambda a: a.status())
        return {c.name: c for c in status.children}

    def engine_ready(self, site: str, name: str) -> dict[str, Any]:
        """The last ``engine_ready`` line a child engine printed (its log, through the agent)."""
        answer = self.agent_call(site, lambda a: a.logs(name, offset=-(1 << 20), max_bytes=1 << 20))
        lines = answer.data.decode(errors="replace").splitlines()
        return [json.loads(x) for x in lines if x.startswith('{"event": "engine_ready"')][-1]

    def agent_events(self, site: str, event: str) -> list[dict[str, Any]]:
        """The site agent's structured log lines of one event."""
        lines = self.agents[site].log_path.read_text().splitlines()
        parsed = (json.loads(line) for line in lines if line.startswith("{"))
        return [e for e in parsed if e["event"] == event]

    @property
    def gateway_url(self) -> str:
        return f"https://{self.sites.local.address}:{self.ports.gateway}"


def _rows(world: World) -> None:
    local, remote = (
        SiteFactory(name="local", role="decode"),
        SiteFactory(name="remote", role="prefill"),
    )
    LinkFactory(from_site=remote, to_site=local, provisioned_mbit_s=int(topo.WAN_MBIT))
    # One address per site: node names, bind addresses and TLS names alike.
    ip = {site: world.sites.site(site).address for site in ("local", "remote")}
    nodes = {
        site: Node.objects.create(site=row, hostname=ip[site], agent_address="127.0.0.1:1")
        for site, row in (("local", local), ("remote", remote))
    }
    # The catalog's weights hash is the built checkpoint's, as the testbed registers it: the
    # readiness checklist compares every node's report against it.
    [checkpoint] = world.models_dir.glob(f"{topo.MODEL}*")
    sha = hash_files([checkpoints.weights_file(checkpoint)[0]])
    model = ModelSpecFactory(name=topo.SERVED, architecture=topo.ARCH, weights_sha256=sha)
    dep = make_deployment(
        name="flows",
        model=model,
        remote_prefill_threshold_tokens=64,
        chunked_prefill_tokens=64,
        timeout_ms=8000,
        # Both sites share one node certificate, whose identity (its common name) is
        # ``localhost``, not the prefill node's hostname (its address): allowed by name, as
        # the testbed's --netns does (KV receivers match the common name only).
        extra_allowed_peers=[topo.NODE_IDENTITY],
    )
    p, pki = world.ports, world.pki
    common = {
        "model": f"{topo.SERVED}={topo.MODEL}",
        "models_dir": str(world.models_dir),
        "threads": 1,
        "kv_tls": {"ca": str(pki.ca), "cert": str(pki.node_cert), "key": str(pki.node_key)},
        "http_insecure": True,  # engine HTTP on the sites' private veths
    }
    pool_create(
        actor=None, deployment=dep, role="decode", site=local, nodes=[nodes["local"]],
        engine_settings={
            **common,
            "host": ip["local"],
            "port": p.decode,
            # What prefill engines dial: the remote agent's fault proxy, in front of the WAN.
            "kv_host": ip["remote"],
            "kv_port": p.kv_wan,
            "kv_listen": f"{ip['local']}:{p.kv_receiver}",
            "kv_link_port": p.kv_link,
            "gateway_port": p.gateway,
        },
    )  # fmt: skip
    pool_create(
        actor=None, deployment=dep, role="prefill", site=remote, nodes=[nodes["remote"]],
        engine_settings={**common, "host": ip["remote"], "port": p.prefill},
    )  # fmt: skip
    rollout_plan_create(
        actor=None,
        name="flows-fast",
        deployment=dep,
        steps=[
            {"share_percent": 50, "min_duration_s": 2, "min_requests": 4},
            {"share_percent": 100, "min_duration_s": 1, "min_requests": 2},
        ],
        gate_ttft_p50_ratio=4.0,
        gate_ttft_p99_ratio=10.0,
        gate_success_rate_min=0.9,
        gate_link_utilization_max=0.95,
    )
    world.deployment_id = dep.pk
    for site, node in nodes.items():
        token_file = world.tmp / f"{site}.token"
        token_file.write_text(node_token_issue(actor=None, node=node))
        proxies = (
            {"local": {"listen": f"{ip['remote']}:{p.kv_wan}",
                       "upstream": f"{ip['local']}:{p.kv_receiver}"}}
            if site == "remote"
            else {}
        )  # fmt: skip
        assert world.console is not None
        config = topo.agent_config(
            world.tmp / site, pki, site, world.console.site_url, token_file, proxies, ip[site]
        )
        if site == "remote":
            held = 'while [ -e "$0" ]; do sleep 0.1; done; exec "$@"'
            config["engine_executables"] = {
                "reference": ["sh", "-c", held, str(world.engine_hold), *topo.PDBRIDGE_CLI]
            }
        agent = topo.start_site_agent(world.tmp / site, config, world.sites, site)
        world.agents[site] = agent
        node_update(actor=None, node=node, agent_address=agent.address)


@pytest.fixture(scope="module")
def world(
    django_db_setup: Any, django_db_blocker: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[World]:
    env = contextlib.contextmanager(topo.set_env)
    with contextlib.ExitStack() as stack:  # the namespaces go last, once empty
        world = World(tmp_path_factory.mktemp("flows"), stack.enter_context(topo.sites_up()))
        topo.build_models(world.models_dir)
        stack.enter_context(django_db_blocker.unblock())
        stack.enter_context(env(topo.controller_env(world.pki)))
        try:
            world.console = topo.Console(
                _database_url(), world.tmp / "console.log", world.pki, world.sites.console_address
            )
            _rows(world)
            yield world
        finally:
            for agent in world.agents.values():
                agent.terminate()
            if world.console is not None:
                world.console.stop()
            connection.close()
            call_command("flush", interactive=False, verbosity=0)


@pytest.fixture
def db_open(world: World, django_db_blocker: Any) -> Iterator[World]:
    """The tests read and write the committed testbed rows (no per-test transaction)."""
    with django_db_blocker.unblock():
        yield world


def run_of(run_id: int) -> WorkflowRun:
    return WorkflowRun.objects.get(pk=run_id)


def steps_of(run_id: int) -> dict[str, Any]:
    return {s.name: s for s in run_of(run_id).steps.all()}


def ended(run_id: int) -> bool:
    return run_of(run_id).state in {"succeeded", "failed", "rolled_back", "canceled"}


def describe(run_id: int) -> str:
    run = run_of(run_id)
    return f"run {run.pk} {run.state} {run.error} " + " ".join(
        f"{s.name}={s.state}" + (f" ({s.error})" if s.error else "")
        for s in run.steps.order_by("index")
    )


@pytest.mark.django_db
def test_pools_become_launch_settings_with_tls_and_kv_addresses():
    """(Also the reason the test database exists for this module: pytest-django creates it
    only for sessions with a ``django_db`` test; the testbed commits rows outside tests.)"""
    from console.deployments.config import build_config
    from orchestrator import agentops

    local, remote = SiteFactory(role="decode"), SiteFactory(role="prefill")
    dep = make_deployment(
        chunked_prefill_tokens=128,
        checksum=False,
        extra_allowed_peers=["kv-relay"],
        timeout_ms=15000,
        retry=5,
        chunk_size_mb=8,
    )
    tls = {"ca": "/etc/ca.pem", "cert": "/etc/n.pem", "key": "/etc/n-key.pem"}
    node = Node.objects.create(site=local, hostname="dec-1", agent_address="10.0.0.1:7070")
    pool_create(
        actor=None, deployment=dep, role="decode", site=local, nodes=[node],
        engine_settings={"model": "m", "port": 9000, "kv_port": 9100, "kv_tls": tls},
    )  # fmt: skip
    pool_create(actor=None, deployment=dep, role="prefill", site=remote, nodes=[])
    config = build_config(Deployment.objects.get(pk=dep.pk))

    [decode] = agentops.targets(config, "decode")
    engine, launch = agentops.engine_launch_settings(decode, config)

    assert (decode.engine_url, decode.kv_address) == ("http://dec-1:9000", "dec-1:9100")
    assert engine == "reference"
    assert launch["port"] == 9000
    assert launch["chunked_prefill_tokens"] == 128
    assert launch["extra_args"] == [
        "--kv-listen", "127.0.0.1:9100", "--kv-compression", "auto",
        # The deployment's link settings reach the engine's sends (#19: not grpc_kv's 4 s).
        "--kv-timeout-ms", "15000", "--kv-retry", "5", "--kv-chunk-size-mb", "8.0",
        "--no-verify-kv-digests",
        "--kv-tls-ca", "/etc/ca.pem", "--kv-tls-cert", "/etc/n.pem", "--kv-tls-key", "/etc/n-key.pem",
        "--kv-allowed-peer", "kv-relay",
    ]  # fmt: skip
    with pytest.raises(agentops.AgentOpsError, match=r"pools\.prefill"):
        agentops.targets(config, "prefill")
    # A WAN relay in front of the receiver (the remote site's fault proxy); plaintext engine
    # HTTP on a private non-loopback address.
    relayed = agentops.Target(
        "decode", "s", "dec-1", "a:1",
        {"model": "m", "port": 9000, "kv_port": 9100, "kv_host": "10.64.0.3",
         "kv_insecure": True, "http_insecure": True},
    )  # fmt: skip
    assert (relayed.engine_url, relayed.kv_address) == ("http://dec-1:9000", "10.64.0.3:9100")
    # Step 2 probes the kv-link where the KV goes: through the relay when it fronts the kv-link
    # too (``kv_link_wan_port``), else the kv-link itself.
    assert relayed.kv_link_wan_address == relayed.kv_link_address == "dec-1:7101"
    relayed.settings["kv_link_wan_port"] = 9101
    assert relayed.kv_link_wan_address == "10.64.0.3:9101"
    relayed.settings["kv_link_wan_port"] = "9101"
    with pytest.raises(agentops.AgentOpsError, match=r"engine_settings\.kv_link_wan_port"):
        _ = relayed.kv_link_wan_address
    del relayed.settings["kv_link_wan_port"]
    _, relayed_launch = agentops.engine_launch_settings(relayed, config)
    assert relayed_launch["extra_args"][-2:] == ["--kv-insecure", "--insecure"]
    assert "kv_host" not in relayed_launch["kv_connector_extra_config"]
    plain = agentops.Target("decode", "s", "h", "a:1", {"model": "m"})
    with pytest.raises(agentops.AgentOpsError, match=r"engine_settings\.kv_tls"):
        agentops.engine_launch_settings(plain, config)


PARAMS = {
    "probe_seconds": 1,
    "verify_lengths": [40, 200],
    "verify_deadline_s": 10,
    "recheck_s": 1,
    "canary": {"recheck_s": 1},
}


def test_deploy_from_nothing_to_full_share_with_evidence_and_a_worker_killed_mid_step(
    start_worker, db_open
):
    world = db_open
    prefill_name = f"dep{world.deployment_id}-prefill"
    world.engine_hold.touch()  # the prefill engine's start waits: step 3's Launch stays open
    try:
        first = start_worker(stale_s=3)
        run = flows.deployment_deploy(actor=None, deployment=world.deployment, params=PARAMS)
        wait_for(
            lambda: [
                e
                for e in world.agent_events("remote", "agent.child_spawned")
                if e["child"] == prefill_name
            ],
            timeout=300,
            what="the remote agent is inside step 3's Launch (engine spawned, not ready)",
        )
        assert steps_of(run.pk)["remote_prefill"].state == "running"

        first.kill9()
        start_worker(stale_s=3)
        time.sleep(3.5)  # the dead worker's heartbeat goes stale
        from orchestrator.tasks.runs import resume_stalled  # the beat job, sent as a task

        resume_stalled.delay()
        # The resumed step repeats its Launch while the first one is still starting.
        [repeated] = wait_for(
            lambda: [
                e
                for e in world.agent_events("remote", "agent.request_repeated")
                if e["method"] == "Launch"
            ],
            timeout=60,
            what="the resumed step's Launch reaches the remote agent while the first is open",
        )
    finally:
        world.engine_hold.unlink(missing_ok=True)
    with topo.Traffic(world.gateway_url, world.pki.ssl_context()) as traffic:
        wait_for(lambda: ended(run.pk), timeout=600, what="deploy run ends")
    assert run_of(run.pk).state == "succeeded", describe(run.pk)

    steps = steps_of(run.pk)
    assert all(s.state == "succeeded" and s.evidence for s in steps.values())
    baseline = steps["capacity_baseline"].evidence
    assert baseline["kv_bytes_per_request"]["64"] > 0
    assert world.deployment.baseline == baseline
    wan = steps["wan_baseline"].evidence
    assert wan["probes"][0]["mbit_s"] > 0
    assert Link.objects.get().measured_mbit_s == wan["probes"][0]["mbit_s"]
    assert steps["kv_link"].evidence["loopback"]["ok"] is True
    assert steps["kv_link"].evidence["loopback"]["checksum_failures"] == 0
    # Every KV receiver admits the prefill node (by its hostname) and the sites' shared
    # certificate (extra_allowed_peers); the kv-link the orchestrator as well (step 5's
    # loopback).
    prefill_node = world.sites.site("remote").address
    assert steps["kv_link"].evidence["kv_link"]["allowlist"] == {
        "applies": True,
        "peers": sorted(["orchestrator", topo.NODE_IDENTITY, prefill_node]),
    }
    [decode_engine] = steps["local_decode"].evidence["engines"]
    assert decode_engine["allowlist"] == {
        "applies": True,
        "peers": sorted([topo.NODE_IDENTITY, prefill_node]),
    }
    gateway = steps["gateway"].evidence["gateways"][0]
    assert gateway["remote_share"] == 0.0
    verify = steps["verification"].evidence
    assert verify["ok"] is True
    assert [p["prompt_tokens"] for p in verify["reports"][0]["prompts"]] == [40, 200]
    canary = run_of(steps["canary"].evidence["canary_run"])
    assert canary.state == "succeeded"
    assert [s.name for s in canary.steps.order_by("index")] == ["share_50", "share_100"]
    dep = world.deployment
    assert (dep.state, dep.remote_share_percent) == ("active", 100)
    # The killed step was resumed, and its side effect happened once: the prefill engine was
    # started once, and the resumed step got the first Launch's answer for the same request.
    prefill = steps["remote_prefill"]
    assert prefill.attempt == 2
    assert "resumed after its worker stopped" in prefill.log_excerpt
    [launched] = prefill.evidence["engines"]
    assert (repeated["request_id"], repeated["in_flight"]) == (launched["request_id"], True)
    assert launched["action"] == "started"
    spawned = [
        e["pid"]
        for e in world.agent_events("remote", "agent.child_spawned")
        if e["child"] == prefill_name
    ]
    assert spawned == [launched["pid"]]
    children = world.children("remote")
    assert [n for n in children if n.endswith("-prefill")] == [prefill_name]
    assert (children[prefill_name].pid, children[prefill_name].restarts) == (spawned[0], 0)
    assert traffic.count(200) > 0
    assert "remote" in {path for status, path in traffic.results if status == 200}
    # The console's readiness checklist finds the engines the workflow launched (their
    # heartbeat rows carry the deployment's id) and their weights: no false "weights fail".
    items = wait_for(lambda: _readiness_if(world, "weights", "pass"), timeout=120, what="weights")
    assert (items["weights"], items["instances"]) == ("pass", "pass"), items


def _readiness_if(world: World, key: str, state: str) -> dict[str, str] | None:
    from console.deployments.readiness import readiness

    dep = world.deployment
    pools = list(dep.pools.select_related("site").prefetch_related("nodes"))
    items = {i.key: i.state for i in readiness(dep, pools)}
    return items if items[key] == state else None


def _checksums_off_on_a_plaintext_kv_link(world: World) -> None:
    """Per-chunk checksums off (``checksum=false``: link checksum mode ``none``), raw chunks,
    and the KV link in plaintext: over TLS a flipped byte fails the record's MAC and the
    connection drops, so silent corruption -- what the checksums exist for -- needs a link
    that TLS does not cover. The engines are relaunched with these settings by steps 3-4."""
    dep = world.deployment
    deployment_update(
        actor=None, deployment=dep, checksum=False, compression="none", reason="test: no checksums"
    )
    for pool in dep.pools.all():
        engine_settings = {k: v for k, v in pool.engine_settings.items() if k != "kv_tls"}
        pool_update(actor=None, pool=pool, engine_settings={**engine_settings, "kv_insecure": True})


def test_verification_failure_leaves_share_zero_and_retry_from_that_step_succeeds(
    start_worker, db_open
):
    world = db_open
    start_worker(stale_s=3)
    _checksums_off_on_a_plaintext_kv_link(world)
    params = {**PARAMS, "verify_lengths": [120], "verify_deadline_s": 4}
    # The remote agent's fault proxy on the WAN path of the KV link flips one byte in every
    # 4 KiB the prefill engine sends: with checksums off the decode engine imports the
    # damaged KV, and its output diverges from the local-only run.
    fault = world.agent_call(
        "remote", lambda a: a.inject_fault("link_degrade", "local", 300, {"corrupt_every_kb": 4})
    ).fault
    try:
        run = flows.deployment_deploy(actor=None, deployment=world.deployment, params=params)
        wait_for(lambda: ended(run.pk), timeout=300, what="deploy run fails")
    finally:
        world.agent_call("remote", lambda a: a.clear_fault(fault.id))

    assert run_of(run.pk).state == "failed", describe(run.pk)
    steps = steps_of(run.pk)
    assert [s.state for s in sorted(steps.values(), key=lambda s: s.index)] == [
        *["succeeded"] * 6,
        "failed",
        "pending",
    ], describe(run.pk)
    verification = steps["verification"]
    prefill_host = world.sites.site("remote").address  # the prefill node's hostname
    assert verification.error.startswith(f"verification mismatch on {prefill_host} at 120 tokens: ")
    [report] = verification.evidence["reports"]
    [prompt] = report["prompts"]
    assert prompt["match"] is False
    assert verification.evidence["ok"] is False
    if prompt["error"] is None:
        # The usual outcome: the damaged KV was imported (the remote path served, no
        # fallback) and the evidence names the first divergent step.
        assert prompt["remote_path"] == "remote"
        divergence = prompt["first_divergence"]
        assert divergence["kind"] in {"token", "logits"}
        assert divergence["position"] == prompt["prompt_tokens"] + divergence["step"]
        assert f"'position': {divergence['position']}" in verification.error
    else:
        # Rarely a flip lands in the framing (HTTP/2, gRPC or the chunk's header fields)
        # rather than in KV bytes: the transfer fails instead, which fails step 7 too.
        assert "kv" in prompt["error"].lower() or "transfer" in prompt["error"].lower()
    # Steps 3-4 relaunched the engines with the link's checksum mode none.
    prefill_name = f"dep{world.deployment_id}-prefill"
    assert world.engine_ready("remote", prefill_name)["kv_checksum"] == "none"
    # on_failure runs right after the failure is recorded: the safe state follows at once.
    dep = wait_for(lambda: world.deployment.state == "failed" and world.deployment, 30)
    assert dep.remote_share_percent == 0

    # The cause removed (the fault cleared above; checksums may stay off on a sound link).
    run_services.run_retry(actor=None, run=run_of(run.pk), from_index=6)
    with topo.Traffic(world.gateway_url, world.pki.ssl_context()):
        wait_for(lambda: ended(run.pk), timeout=600, what="retried run ends")

    assert run_of(run.pk).state == "succeeded", describe(run.pk)
    steps = steps_of(run.pk)
    assert steps["verification"].attempt == 2
    assert steps["verification"].evidence["ok"] is True
    assert "attempt 1 failed: verification mismatch" in steps["verification"].log_excerpt
    assert steps["remote_prefill"].attempt == 1  # earlier steps kept, not re-run
    dep = world.deployment
    assert (dep.state, dep.remote_share_percent) == ("active", 100)


def test_redis_restarted_mid_canary_and_the_canary_continues(start_worker, db_open, tmp_path):
    world = db_open
    redis = topo.RedisServer(tmp_path)
    beat = topo.start_beat(tmp_path, redis.url, _database_url())
    flows.deployment_set_remote_share(
        actor=None, deployment=world.deployment, percent=0, reason="test: before a new canary"
    )
    try:
        with override_settings(CELERY_BROKER_URL=redis.url, CELERY_BROKER_TRANSPORT_OPTIONS={}):
            celery_client._app.cache_clear()
            worker = start_worker(stale_s=3, broker_url=redis.url)
            with topo.Traffic(world.gateway_url, world.pki.ssl_context()):
                run = flows.canary_start(
                    actor=None, deployment=world.deployment, params={"recheck_s": 1}
                )
                wait_for(
                    lambda: "started_at" in steps_of(run.pk)["share_50"].evidence,
                    timeout=300,
                    what="the canary holds its first step",
                )
                redis.restart()  # every queued re-check is lost with it
                restarted_at = time.time()
                # kombu 5.7's Redis transport can die restoring an unacknowledged (countdown)
                # message when the broker goes away ("Unrecoverable error ... hostname"), at
                # once or a while later; the worker's systemd unit restarts it
                # (Restart=always): here the test does, whenever it finds it dead.
                workers = [worker]

                def canary_ended() -> bool:
                    if workers[-1].proc.poll() is not None:
                        workers.append(start_worker(stale_s=3, broker_url=redis.url))
                    return ended(run.pk)

                wait_for(canary_ended, timeout=300, what="canary ends")
    finally:
        celery_client._app.cache_clear()
        beat.terminate()
        beat.wait(15)
        redis.stop()

    assert run_of(run.pk).state == "succeeded", describe(run.pk)
    steps = steps_of(run.pk)
    assert steps["share_50"].finished_at.timestamp() > restarted_at
    assert all(g["passed"] for g in steps["share_100"].evidence["gates"])
    assert world.deployment.remote_share_percent == 100


def _probe_round(world: World, after: Any) -> MetricSample:
    """Queue the beat's probe-links job (a real worker runs it) and wait for its sample."""
    from orchestrator.tasks.housekeeping import probe_links

    link = Link.objects.get()
    probe_links.delay()
    return wait_for(
        lambda: MetricSample.objects.filter(
            subject_type="inventory.link", subject_id=str(link.pk), name="link_measured_ratio",
            at__gt=after,
        ).last(),
        timeout=120, what="a link probe sample",
    )  # fmt: skip


def test_link_probe_job_charts_the_link_and_a_throttled_link_fires_link_rate_low(
    start_worker, db_open
):
    from django.contrib.auth import get_user_model
    from django.test import Client
    from django.utils import timezone

    from console.alerts.models import Alert
    from console.alerts.services import alert_rules_sync_defaults, alerts_evaluate
    from console.core.choices import Role
    from console.core.roles import role_group
    from console.inventory.services import link_update

    world = db_open
    # The shipped rules come with a migration; a module that flushed the test database
    # before this one took them with it.
    alert_rules_sync_defaults()
    start_worker(stale_s=3)
    assert world.deployment.state == "active"  # the deploy tests above left it serving
    started = timezone.now()
    # Deployment step 2's probe began the link's history.
    assert MetricSample.objects.filter(name="link_measured_mbit_s", at__lt=started).exists()
    first = _probe_round(world, started)
    measured = first.value * Link.objects.get().provisioned_mbit_s
    assert measured > 0
    # Provisioned well under what this machine's probe reaches unthrottled, so the rule's 0.5
    # holds a wide margin both ways (a 2-core host measures a fraction of the tbf rate).
    link_update(actor=None, link=Link.objects.get(), provisioned_mbit_s=max(1, int(measured * 0.6)))
    alerts_evaluate(now=timezone.now(), notify=False)
    assert not Alert.objects.filter(rule_name="link-rate-low", state="firing").exists()

    world.sites.shape(max(measured / 12, 2.0))
    try:
        throttled = _probe_round(world, first.at)
        assert throttled.value < 0.5, throttled.labels
        alerts_evaluate(now=timezone.now(), notify=False)
        alert = Alert.objects.get(rule_name="link-rate-low", state="firing")
        assert alert.value == pytest.approx(throttled.value)
    finally:
        world.sites.shape(topo.WAN_MBIT)
    restored = _probe_round(world, throttled.at)
    assert restored.value > 0.5, restored.labels
    alerts_evaluate(now=timezone.now(), notify=False)
    alert.refresh_from_db()
    assert alert.state == "resolved"

    # The link page charts the three probes, with the deployment's config versions marked.
    viewer = get_user_model().objects.create_user(username="link-viewer", password="pw-1-tests")
    viewer.groups.add(role_group(Role.VIEWER))
    client = Client()
    client.force_login(viewer)
    page = client.get(f"/links/{Link.objects.get().pk}/").content.decode()
    assert "Measured bandwidth" in page
    assert "No data yet" not in page.split("Round-trip")[0]
    # Loss as TCP saw it at the probing node (its namespace's counters), charted too.
    loss = MetricSample.objects.filter(name="link_tcp_retransmit_ratio").order_by("at")
    assert loss.count() >= 3
    assert all(0 <= s.value < 1 for s in loss)
    assert "No data yet" not in page.split("TCP retransmissions")[1].split("Utilisation")[0]
    assert f"flows v{world.deployment.version}" in page
    assert "stale" not in page.split("last probe")[1][:80]


def test_canary_gate_failure_on_wan_latency_rolls_back_to_zero(start_worker, db_open):
    world = db_open
    start_worker(stale_s=3)
    flows.deployment_set_remote_share(
        actor=None, deployment=world.deployment, percent=0, reason="test: before a new canary"
    )
    world.agent_call(
        "remote",
        lambda a: a.inject_fault("link_degrade", "local", 120, {"latency_ms": 3000}),
    )
    try:
        with topo.Traffic(world.gateway_url, world.pki.ssl_context()):
            run = flows.canary_start(
                actor=None, deployment=world.deployment, params={"recheck_s": 1}
            )
            wait_for(lambda: ended(run.pk), timeout=300, what="canary ends")
    finally:
        world.agent_call("remote", lambda a: a.clear_fault())

    assert run_of(run.pk).state == "rolled_back", describe(run.pk)
    step = steps_of(run.pk)["share_50"]
    assert step.evidence["failed_gate"]["gate"] in {
        "ttft_p50_ratio",
        "ttft_p99_ratio",
        "success_rate",
    }
    assert step.evidence["failed_gate"]["passed"] is False
    assert step.evidence["remote_share_percent"] == 0
    assert steps_of(run.pk)["share_100"].state == "pending"
    dep = world.deployment
    assert dep.remote_share_percent == 0
    assert "rolled back: gate" in dep.snapshots.first().reason

"""Rebalancing carried out on the running fleet: two local decode nodes, each a real
``pdbridge agent`` over mTLS in a network namespace of its own, a remote prefill engine, a
real ``pdbridge gateway`` process polling the console (Django's live server on the test
database) and client load through it; a real Celery worker runs the ``rebalance`` run. The
engines are the gateway tests' engine double processes (a test double for a GPU engine, which
cannot run here): their delays are their compute, and their metrics report it as a real
engine's do, so the capacities the proposal rests on are measured, not written by the test.

The case: the remote site has one instance (slow prefill), the local pool is two decode nodes
and no local prefill -- prefill-bound; the planner's optimum for two local instances is one
prefill / one decode. The telemetry job records the engines' capacities, the hourly job
proposes converting one decode node, an operator approves it through the API, and the run
drains the node from the gateway, stops its decode engine, launches it as a prefill engine,
moves it to a (new) local prefill pool and verifies -- with 0 failed client requests, and the
gateway then prefilling short prompts on that node."""

from __future__ import annotations

import copy
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from console.deployments.config import build_config
from console.deployments.models import Deployment, Pool
from console.deployments.services import deployment_update, pool_create
from console.inventory.services import node_token_issue
from console.runs.models import WorkflowRun
from console.schedules.rebalance import rebalance_propose
from orchestrator import agentops, telemetryops
from orchestrator.agentops import Target
from tests.agents.engines.client import free_port
from tests.agents.gateway.procs import start_double
from tests.console.factories import (
    ModelSpecFactory,
    NodeFactory,
    SiteFactory,
    make_deployment,
    make_tidal_schedule,
)
from tests.console.schedules.conftest import REMOTE_PRICES, case_study
from tests.orchestrator.test_tidal_gateway import (
    EVENT_S,
    Bed,
    Load,
    _gateway,
    _journal,
    agent_bed,
)
from tests.orchestrator.workflows.topology import pinned_port
from tests.support import deadline_in

pytestmark = [
    pytest.mark.netns,
    pytest.mark.slow,
    pytest.mark.django_db(transaction=True),
    pytest.mark.timeout(600),
]

#: The local doubles' compute: 10 ms a token (decode), 20 ms a prefill leg.
LOCAL_DOUBLE = ("--token-delay-s", "0.01", "--prefill-delay-s", "0.02")


@pytest.fixture(scope="module")
def bed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Bed]:
    with agent_bed(tmp_path_factory.mktemp("rebal"), site="local", double_args=LOCAL_DOUBLE) as b:
        yield b


def _scenario() -> dict[str, Any]:
    body = copy.deepcopy(case_study())
    body["remote"]["instances"] = 1  # the optimum for 2 local instances: 1 prefill, 1 decode
    return body


def _wait_run(run_id: int) -> WorkflowRun:
    deadline = deadline_in(EVENT_S * 2)
    while True:
        run = WorkflowRun.objects.get(pk=run_id)
        if run.state not in {"pending", "running"}:
            return run
        assert time.monotonic() < deadline, [(s.name, s.state) for s in run.steps.all()]
        time.sleep(0.5)


def test_an_approved_proposal_converts_a_decode_node_on_the_running_fleet(
    bed: Bed,
    live_server: Any,
    start_worker: Any,
    monkeypatch: Any,
    settings: Any,
    api_as: Any,
    tmp_path: Path,
) -> None:
    # The controller's identity towards the agents, here and in the worker's environment.
    settings.PDBRIDGE_CONTROLLER_INSECURE = False
    for key, value in bed.tls.items():
        monkeypatch.setenv(key, value)
        setattr(settings, key, value)
    monkeypatch.setenv("PDBRIDGE_CONTROLLER_INSECURE", "false")
    local = SiteFactory(name="local", role="both", gpu_hour_price=1.5)
    remote = SiteFactory(name="remote", role="prefill")
    hosts = sorted(bed.nodes)
    nodes = [
        NodeFactory(site=local, hostname=h, agent_address=bed.nodes[h].agent_address) for h in hosts
    ]
    remote_engine = start_double(
        "remote", bed.kv_dir, tmp_path, prefill_delay_s=0.2, max_prompt_chars=1_000_000
    )
    gateway_port = free_port()
    deployment = make_deployment(
        name=f"rebal-{uuid.uuid4().hex[:4]}", model=ModelSpecFactory(name="tiny")
    )
    decode_settings = {
        "engine": "double", "model": "tiny", "host": "0.0.0.0", "kv_insecure": True,
        "port": pinned_port(), "gateway_port": gateway_port,
        # The gateway runs on the host (it polls the live server there), not in a namespace.
        "gateway_host": "127.0.0.1",
    }  # fmt: skip
    decode_pool = pool_create(
        actor=None, deployment=deployment, role="decode", site=local, nodes=nodes,
        engine_settings=decode_settings,
    )  # fmt: skip
    pool_create(
        actor=None, deployment=deployment, role="prefill", site=remote,
        nodes=[NodeFactory(site=remote, hostname="127.0.0.1", agent_address="127.0.0.1:1")],
        engine_settings={"port": int(remote_engine.url.rsplit(":", 1)[1])},
    )  # fmt: skip
    deployment.refresh_from_db()
    deployment = deployment_update(
        actor=None, deployment=deployment, remote_share_percent=50,
        remote_prefill_threshold_tokens=1000,
    )  # fmt: skip
    schedule = make_tidal_schedule(
        deployment=deployment, remote_site=remote, local_site=local, capacity=[1] * 24,
        scenario=_scenario(), remote_prices=REMOTE_PRICES,
    )  # fmt: skip
    worker = start_worker(stale_s=20)
    name = agentops.child_name(deployment.pk, "decode")
    # The decode engines run (the deployment workflow's step 4 would have launched them).
    config_doc = build_config(deployment)
    for target in agentops.targets(config_doc, "decode"):
        engine, launch = agentops.engine_launch_settings(target, config_doc)
        agentops.launch(
            target, kind="decode-engine", name=name, engine=engine, launch_settings=launch,
            deployment_id=deployment.pk, rid=f"setup-{target.hostname}",
        )  # fmt: skip
    gateway = _gateway(
        deployment.pk, live_server.url, node_token_issue(actor=None, node=nodes[0]),
        gateway_port, bed,
    )  # fmt: skip
    ssl_ctx = agentops.http_ssl_context()
    moving = hosts[-1]  # the proposal converts the last decode node by hostname
    try:
        with (
            Load(gateway.url, ssl_ctx, "short prompt", concurrency=3) as short,
            Load(gateway.url, ssl_ctx, "abc " * 2000, concurrency=1) as long,
        ):
            short.wait_for(30)
            long.wait_for(5)
            # The telemetry job, twice: the second collection's window is real traffic.
            telemetryops.collect_deployment(Deployment.objects.get(pk=deployment.pk))
            short.wait_for(len(short.results) + 30)
            telemetryops.collect_deployment(Deployment.objects.get(pk=deployment.pk))
            proposal = rebalance_propose(schedule=schedule)
            assert proposal is not None, "no proposal from the measured capacities"
            assert proposal.measured["producer_rps"] < proposal.measured["consumer_rps"]
            assert [(m["hostname"], m["from"], m["to"]) for m in proposal.moves] == [
                (moving, "decode", "prefill")
            ]

            approved = api_as("operator").post(f"/api/rebalance-proposals/{proposal.pk}/apply/")
            assert approved.status_code == 200, approved.json()
            assert approved.json()["state"] == "applying"
            run = _wait_run(approved.json()["run"])
            steps = {s.name: s for s in run.steps.all()}
            assert run.state == "succeeded", (
                run.error, {n: (s.state, s.error, s.log_excerpt) for n, s in steps.items()},
                worker.log.read_text()[-3000:],
            )  # fmt: skip
            joined_at = time.time()
            before = len(short.results)
            short.wait_for(before + 40)
        results = short.results + long.results
    finally:
        gateway.stop()
        remote_engine.stop()
        for host in hosts:
            target = Target("decode", "local", host, bed.nodes[host].agent_address)
            for child in (name, agentops.child_name(deployment.pk, "prefill")):
                if agentops.child_status(target, child)["state"] != "absent":

                    async def stop(agent: Any, child: str = child) -> Any:
                        return await agent.stop(child)

                    agentops.call(target, stop)

    proposal.refresh_from_db()
    assert proposal.state == "applied"
    # The evidence: drained before anything stopped, the engine launched as prefill.
    assert steps["drain"].evidence["state"] == "applied"
    assert {c["name"] for c in steps["stop"].evidence["children"] if c["action"] == "stopped"} == {
        name
    }
    assert [c["name"] for c in steps["launch"].evidence["children"]] == [
        agentops.child_name(deployment.pk, "prefill")
    ]
    assert all(c["healthy"] for c in steps["launch"].evidence["children"])
    assert [e["role"] for e in steps["verify"].evidence["engines"]] == ["prefill"]
    # The pools say so, and nothing was lost on the way.
    decode_pool.refresh_from_db()
    assert [n.hostname for n in decode_pool.nodes.all()] == hosts[:-1]
    local_prefill = Pool.objects.get(deployment=deployment, role="prefill", site=local)
    assert [n.hostname for n in local_prefill.nodes.all()] == [moving]
    assert not decode_pool.drained_nodes.exists()
    failed = [r for r in results if r[0] != 200]
    assert failed == [], (failed[:5], short.errors, long.errors)
    # The gateway routes accordingly: after the join, short prompts are prefilled on the moved
    # node (prefill legs in its journal) and decoded on the one that stayed decode.
    legs = _journal(bed.nodes[moving])
    assert any(leg["leg"] == "prefill" and leg["ended_at"] > joined_at for leg in legs), legs[-5:]
    assert not any(leg["leg"] != "prefill" and leg["ended_at"] > joined_at + 1 for leg in legs)
    print(
        f"\nrebalance: {len(results)} requests, 0 failed; measured {proposal.measured}; "
        f"drain waited {steps['drain'].evidence['waited_s']} s"
    )

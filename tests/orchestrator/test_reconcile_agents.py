"""The reconcile loop with a real agent: a ``pdbridge agent`` process over mTLS heartbeating to
the console (Django's live server on the test database), a remote prefill node of an active
deployment whose engine is the agents' test health server (``plain``: a test double for a GPU
engine; the agent launches, supervises and stops it like any engine). The agent is killed with
SIGKILL -- its keeper takes the engine down with it -- and started again on another port: the
console follows its address from its heartbeat, the engine is launched again within 30 s of
the agent's return, and during the gap the API shows the missing engine and the node's state
and the ``engines-missing`` alert fires. The beat's tasks are called as the beat calls them
(``reconcile_all`` every second here, every 10 s in production; ``node_mark_missing``,
``alerts_evaluate``)."""

from __future__ import annotations

import os
import signal
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.test import override_settings
from rest_framework.test import APIClient

from console.alerts.models import Alert
from console.alerts.services import alert_rules_sync_defaults, alerts_evaluate
from console.core.models import AuditLog
from console.deployments.models import Deployment
from console.deployments.services import deployment_transition, pool_create
from console.inventory.models import Node
from console.inventory.services import node_mark_missing, node_token_issue
from grpc_kv.certs import create_ca, create_node_cert
from orchestrator import agentops
from orchestrator.agentops import Target
from orchestrator.reconcile import reconcile_all
from tests.agents.conftest import agent_config
from tests.console.factories import ModelSpecFactory, NodeFactory, SiteFactory, make_deployment
from tests.orchestrator.test_tidal_agents import _start
from tests.orchestrator.workflows.topology import pinned_port
from tests.support import deadline_in

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True), pytest.mark.timeout(300)]

#: The issue's bound: engines serving again within 30 s of the agent's return.
BACK_WITHIN_S = 30.0


def _until(check: Any, what: str, timeout_s: float = 60, tick: Any = None) -> Any:
    deadline = deadline_in(timeout_s)
    while True:
        if tick is not None:
            tick()
        value = check()
        if value:
            return value
        last = AuditLog.objects.filter(verb="engine_relaunch").order_by("-id").first()
        assert time.monotonic() < deadline, (what, last and last.after)
        time.sleep(0.5)


def test_an_agent_killed_and_restarted_gets_its_engine_back_and_the_gap_is_shown(
    tmp_path: Path, live_server: Any, admin_user: Any
) -> None:
    alert_rules_sync_defaults()  # a transactional test before this one flushed the shipped rules
    ca = create_ca(tmp_path / "ca")
    certs = {n: create_node_cert(ca, tmp_path / "nodes", n) for n in ("pre-1", "orchestrator")}
    remote = SiteFactory(name="remote", role="prefill")
    local = SiteFactory(name="local", role="decode")
    node = NodeFactory(site=remote, hostname="pre-1", agent_address="127.0.0.1:1")
    decode = NodeFactory(site=local, hostname="dec-1", agent_address="127.0.0.1:1")
    deployment = make_deployment(name="heal", model=ModelSpecFactory(name="tiny"))
    pool_create(actor=None, deployment=deployment, role="decode", site=local, nodes=[decode])
    pool_create(
        actor=None,
        deployment=deployment,
        role="prefill",
        site=remote,
        nodes=[node],
        engine_settings={
            "engine": "plain",
            "model": "tiny",
            "kv_insecure": True,
            "port": pinned_port(),
        },
    )
    for state in ("deploying", "active"):
        deployment.refresh_from_db()
        deployment_transition(actor=None, deployment=deployment, to_state=state)
    token = node_token_issue(actor=None, node=node)
    config = agent_config(
        tmp_path / "agent",
        None,
        node={"name": "pre-1", "site": "remote"},
        console={"url": live_server.url, "token": token, "heartbeat_interval_s": 1},
    )
    config.pop("insecure")
    config["tls"] = {
        "ca": str(ca.ca_file),
        "cert": str(certs["pre-1"].cert_file),
        "key": str(certs["pre-1"].key_file),
        "allowed_identities": ["orchestrator"],
    }
    tls = {
        "PDBRIDGE_CONTROLLER_TLS_CA": str(ca.ca_file),
        "PDBRIDGE_CONTROLLER_TLS_CERT": str(certs["orchestrator"].cert_file),
        "PDBRIDGE_CONTROLLER_TLS_KEY": str(certs["orchestrator"].key_file),
    }
    child = agentops.child_name(deployment.pk, "prefill")
    api = APIClient()
    api.force_authenticate(admin_user)
    processes: list[Any] = []

    def running() -> bool:
        n = Node.objects.get(pk=node.pk)
        return any(
            c["name"] == child and c["state"] == "running" and c["healthy"]
            for c in n.reported_children or []
        )

    def drift() -> list[dict[str, Any]]:
        response = api.get(f"/api/deployments/{deployment.pk}/engines/")
        assert response.status_code == 200, response.content
        return [d for d in response.json() if d["node"] == "pre-1"]

    with override_settings(HEARTBEAT_INTERVAL_S=1, PDBRIDGE_CONTROLLER_INSECURE=False, **tls):
        try:
            proc, port, _ = _start(tmp_path / "agent", config, [])
            processes.append(proc)
            # 1. First life: the node comes online and the loop launches its engine.
            _until(running, "the engine was never launched", tick=reconcile_all)
            assert Node.objects.get(pk=node.pk).agent_address == f"127.0.0.1:{port}"
            assert drift() == []

            # 2. kill -9: the keeper takes the engine with the agent.
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(30)
            gone = time.monotonic()
            last = Node.objects.get(pk=node.pk).last_heartbeat_at
            node_mark_missing(now=last + timedelta(seconds=60))
            assert Node.objects.get(pk=node.pk).status == "lost"
            reconcile_all()  # records the engine missing (the node is not online)
            [shown] = drift()
            assert shown == {
                "site": "remote",
                "node": "pre-1",
                "child": child,
                "state": "node lost",
            }
            alerts_evaluate(notify=False)
            alert = Alert.objects.get(rule_name="engines-missing", state="firing")
            assert alert.subject_id == str(deployment.pk)

            # 3. Back on another port: its heartbeat says where; the engine comes back.
            config["listen"] = "127.0.0.1:0"
            (tmp_path / "agent" / "state" / "agent.json").unlink()
            proc, new_port, _ = _start(tmp_path / "agent", config, [])
            processes.append(proc)
            returned = time.monotonic()
            _until(
                lambda: Node.objects.get(pk=node.pk).agent_address == f"127.0.0.1:{new_port}",
                "the heartbeat never carried the new address",
            )
            _until(running, "the engine never came back", BACK_WITHIN_S * 2, tick=reconcile_all)
            back_s = time.monotonic() - returned
            print(f"\nengine serving again {back_s:.1f} s after the agent's return "
                  f"({returned - gone:.1f} s gap)")  # fmt: skip
            assert back_s <= BACK_WITHIN_S
            assert drift() == []
            state = agentops.child_status(
                Target("prefill", "remote", "pre-1", f"127.0.0.1:{new_port}"), child
            )
            assert (state["state"], state["healthy"]) == ("running", True)
            relaunches = AuditLog.objects.filter(verb="engine_relaunch")
            assert relaunches.count() == 2, [r.after for r in relaunches]  # both lives
            assert Deployment.objects.get(pk=deployment.pk).state == "active"
        finally:
            for p in processes:
                if p.poll() is None:
                    p.terminate()
                    p.wait(30)

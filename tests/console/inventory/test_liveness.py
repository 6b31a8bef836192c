"""The liveness loop does not blame the nodes for the console's own outages: while its probe of
the console's listener fails nobody is judged, nodes silent across an outage (or across a gap
in the loop itself) get the grace after it, and a node that stays silent is still marked.

The last test is the operator's case (#44) with real processes: two agents heartbeat to the
console served as the testbed serves it; the console stalls (SIGSTOP) for longer than the lost
deadline; no node is marked ``lost`` (nor ``degraded``), and they are ``online`` afterwards."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from django.utils import timezone

from console.core.models import AuditLog
from console.inventory.liveness import LivenessReport, liveness_check
from console.inventory.models import Node
from console.inventory.services import missed_beats, node_token_issue
from pdbridge.procgroup import free_port
from tests.agents.conftest import AgentProc, agent_config, agent_factory  # noqa: F401
from tests.console.conftest import World, world  # noqa: F401  (the console's test world)
from tests.consoleproc import ConsoleProcess, test_database_url
from tests.support import scaled, wait_for

pytestmark = pytest.mark.django_db(transaction=True)


def _beat(node: Any, at: datetime) -> None:
    Node.objects.filter(pk=node.pk).update(status="online", last_heartbeat_at=at)


def _turns(start: datetime, end: datetime, every_s: float = 10.0) -> LivenessReport:
    """The loop's turns from ``start`` to ``end`` every ``every_s`` (as the beat job runs it);
    returns the last turn's report."""
    at, report = start, liveness_check(now=start)
    while at < end:
        at = min(end, at + timedelta(seconds=every_s))
        report = liveness_check(now=at)
    return report


def _status(node: Any) -> str:
    return str(Node.objects.get(pk=node.pk).status)


@pytest.fixture
def liveness(settings: Any) -> Any:
    settings.HEARTBEAT_INTERVAL_S = 10
    settings.HEARTBEAT_MISSED_LIMIT = 3
    settings.HEARTBEAT_OUTAGE_GRACE_S = 90
    settings.LIVENESS_PROBE_TIMEOUT_S = 2
    return settings


def test_while_the_probe_fails_nobody_is_judged_then_the_grace_runs_from_the_recovery(
    liveness: Any,
    world: World,  # noqa: F811
    live_server: Any,
) -> None:
    t0 = timezone.now()
    _beat(world.decode_node, t0)
    liveness.LIVENESS_PROBE_URL = f"http://127.0.0.1:{free_port('127.0.0.1')}"  # nobody there

    blind = liveness_check(now=t0 + timedelta(seconds=40))
    later = _turns(t0 + timedelta(seconds=50), t0 + timedelta(hours=1))

    assert (blind.blind, later.blind) == (True, True)
    assert "probe of http://127.0.0.1:" in blind.reason
    assert _status(world.decode_node) == "online"

    liveness.LIVENESS_PROBE_URL = live_server.url  # the console answers again
    back = t0 + timedelta(hours=1, seconds=10)
    heard = liveness_check(now=back)

    assert (heard.blind, heard.blind_until) == (False, back)
    assert _turns(back, back + timedelta(seconds=89)).changed == {"degraded": [], "lost": []}
    assert _status(world.decode_node) == "online"
    assert liveness_check(now=back + timedelta(seconds=91)).changed == {
        "degraded": [],
        "lost": [world.decode_node.pk],
    }


def test_a_node_silent_before_the_outage_is_still_marked_lost_after_the_grace(
    liveness: Any,
    world: World,  # noqa: F811
    live_server: Any,
) -> None:
    t0 = timezone.now()
    liveness.LIVENESS_PROBE_URL = live_server.url
    _beat(world.decode_node, t0)
    _beat(world.prefill_node, t0)
    liveness_check(now=t0 + timedelta(seconds=5))
    _beat(world.prefill_node, t0 + timedelta(seconds=16))  # only the prefill node beats on

    assert liveness_check(now=t0 + timedelta(seconds=20)).changed == {
        "degraded": [world.decode_node.pk],
        "lost": [],
    }
    _beat(world.prefill_node, t0 + timedelta(seconds=30))
    assert liveness_check(now=t0 + timedelta(seconds=36)).changed == {
        "degraded": [],
        "lost": [world.decode_node.pk],
    }


def test_a_gap_in_the_loop_itself_gives_silent_nodes_the_grace(
    liveness: Any,
    world: World,  # noqa: F811
) -> None:
    liveness.LIVENESS_PROBE_URL = ""  # only the gap rule
    t0 = timezone.now()
    _beat(world.decode_node, t0)
    liveness_check(now=t0 + timedelta(seconds=5))

    resumed = t0 + timedelta(seconds=300)  # the worker was down for almost 5 minutes
    report = liveness_check(now=resumed)

    assert report.blind_until == resumed
    assert report.changed == {"degraded": [], "lost": []}
    assert _turns(resumed, resumed + timedelta(seconds=89)).changed["lost"] == []
    assert liveness_check(now=resumed + timedelta(seconds=91)).changed["lost"] == [
        world.decode_node.pk
    ]


@pytest.mark.slow
def test_a_console_stall_longer_than_the_lost_deadline_marks_no_heartbeating_node_lost(
    settings: Any,
    world: World,  # noqa: F811
    agent_factory: Callable[..., AgentProc],  # noqa: F811
    tmp_path: Path,
) -> None:
    settings.HEARTBEAT_INTERVAL_S = 1
    settings.HEARTBEAT_MISSED_LIMIT = 2  # lost after 2.5 s of silence
    settings.HEARTBEAT_OUTAGE_GRACE_S = scaled(10)  # agents retry every 1 s at most
    settings.LIVENESS_PROBE_TIMEOUT_S = 1
    console = ConsoleProcess(
        tmp_path / "console",
        database_url=test_database_url(),
        env={"PDBRIDGE_HEARTBEAT_INTERVAL_S": "1", "PDBRIDGE_HEARTBEAT_MISSED_LIMIT": "2"},
    )
    try:
        settings.LIVENESS_PROBE_URL, settings.LIVENESS_PROBE_CA = console.url, str(console.ca)
        nodes = [world.decode_node, world.prefill_node]
        for node, site in zip(nodes, ["local", "remote"], strict=True):
            token = node_token_issue(actor=None, node=node)
            agent_factory(
                agent_config(
                    tmp_path / node.hostname, None,
                    node={"name": node.hostname, "site": site},
                    console={"url": console.url, "ca": str(console.ca), "token": token,
                             "heartbeat_interval_s": 1, "timeout_s": 1, "backoff_max_s": 1},
                ),
                subdir=node.hostname,
            )  # fmt: skip
        wait_for(lambda: liveness_check() and {_status(n) for n in nodes} == {"online"}, 120)
        started = timezone.now()

        console.pause()
        reports = []

        def silent_past_the_lost_deadline() -> bool:
            reports.append(liveness_check())
            now = timezone.now()
            return all(
                missed_beats(last_heartbeat_at=n.last_heartbeat_at, now=now) >= 2 * 2
                for n in Node.objects.filter(pk__in=[n.pk for n in nodes])
            )

        try:
            wait_for(silent_past_the_lost_deadline, 120, interval=0.3)
        finally:
            console.resume()
        resumed = timezone.now()

        def beating_again() -> bool:
            liveness_check()
            return all(
                n.last_heartbeat_at > resumed
                for n in Node.objects.filter(pk__in=[n.pk for n in nodes])
            )

        wait_for(beating_again, 120, interval=0.3)
        liveness_check()

        assert any(r.blind for r in reports)  # the loop saw the console stalled
        assert {_status(n) for n in nodes} == {"online"}
        escalations = AuditLog.objects.filter(
            verb="node_status", created_at__gte=started, after__status__in=["degraded", "lost"]
        )
        assert list(escalations.values_list("object_id", "after")) == []
    finally:
        console.stop()


def test_a_wrong_probe_does_not_stop_nodes_from_being_lost_while_beats_arrive(
    liveness: Any,
    world: World,  # noqa: F811
) -> None:
    """The probe fails (a wrong URL or CA) but beats still arrive: the console hears, so the
    loop judges as usual -- a silent node is lost -- and says the probe is wrong."""
    t0 = timezone.now()
    _beat(world.decode_node, t0 - timedelta(seconds=60))  # silent for a minute
    _beat(world.prefill_node, t0 - timedelta(seconds=2))  # beating
    liveness.LIVENESS_PROBE_URL = f"http://127.0.0.1:{free_port('127.0.0.1')}"  # wrong

    first = liveness_check(now=t0)  # the probe fails: blind, as in a real stall
    _beat(world.prefill_node, t0 + timedelta(seconds=5))  # ... yet a beat is recorded
    report = liveness_check(now=t0 + timedelta(seconds=10))

    assert first.blind is True
    assert report.blind is False
    assert _status(world.decode_node) == "lost"
    assert _status(world.prefill_node) == "online"

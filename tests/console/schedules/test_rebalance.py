"""Rebalancing: measured producer vs consumer throughput against the planner's optimum split
of the local pool; proposals with reasons; apply moves nodes through the pool services."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from console.deployments.services import pool_create, pool_update
from console.runs.models import WorkflowRun
from console.schedules.models import RebalanceProposal
from console.schedules.rebalance import (
    rebalance_apply,
    rebalance_dismiss,
    rebalance_due,
    rebalance_propose,
)
from console.schedules.services import tidal_schedule_update
from console.telemetry.services import sample_record
from tests.console.factories import NodeFactory

pytestmark = pytest.mark.django_db

NOW = datetime(2026, 11, 30, 12, 0, tzinfo=UTC)


@pytest.fixture
def local8(tidal):
    """8 local instances as the case study has them: 6 prefill + 2 decode (the planner's
    optimum is 3 / 5, so this split is prefill-heavy: decode-bound)."""
    tidal.local.role = "both"
    tidal.local.save()
    prefill_nodes = [NodeFactory(site=tidal.local, hostname=f"loc-p{i}") for i in range(6)]
    extra_decode = NodeFactory(site=tidal.local, hostname="dec-2")
    pool_update(actor=None, pool=tidal.decode_pool, nodes=[tidal.decode_node, extra_decode])
    tidal.local_prefill = pool_create(
        actor=None,
        deployment=tidal.deployment,
        role="prefill",
        site=tidal.local,
        nodes=prefill_nodes,
    )
    return tidal


def measure(world, producer_remote: float, producer_local: float, consumer: float) -> None:
    series = [
        ("prefill_requests_per_second", producer_remote, {"path": "remote"}),
        ("prefill_requests_per_second", producer_local, {"path": "local"}),
        ("decode_requests_per_second", consumer, None),
    ]
    for minutes in (5, 25, 45):
        for name, value, labels in series:
            sample_record(
                subject=world.deployment,
                name=name,
                value=value,
                labels=labels,
                at=NOW - timedelta(minutes=minutes),
            )


def test_decode_bound_load_proposes_converting_prefill_nodes_to_decode(local8):
    measure(local8, producer_remote=2.0, producer_local=1.0, consumer=1.5)

    proposal = rebalance_propose(schedule=local8.schedule, now=NOW)

    assert proposal is not None
    assert proposal.measured["producer_rps"] == pytest.approx(3.0)
    assert proposal.measured["consumer_rps"] == pytest.approx(1.5)
    assert proposal.current_split == {"n_prefill": 6, "n_decode": 2}
    assert proposal.target_split == {"n_prefill": 3, "n_decode": 5}
    assert [(m["hostname"], m["from"], m["to"]) for m in proposal.moves] == [
        ("loc-p0", "prefill", "decode"),
        ("loc-p1", "prefill", "decode"),
        ("loc-p2", "prefill", "decode"),
    ]
    assert "decode-bound" in proposal.reason
    # Asking again with the same measurements keeps the open proposal (no churn).
    assert rebalance_propose(schedule=local8.schedule, now=NOW) == proposal


def test_apply_moves_the_nodes_through_the_pool_services(local8):
    measure(local8, 2.0, 1.0, 1.5)
    proposal = rebalance_propose(schedule=local8.schedule, now=NOW)
    version = local8.deployment.__class__.objects.get(pk=local8.deployment.pk).version

    applied = rebalance_apply(actor=None, proposal=proposal)

    assert applied.state == "applied"
    assert local8.local_prefill.nodes.count() == 3
    assert sorted(local8.decode_pool.nodes.values_list("hostname", flat=True)) == [
        "dec-1",
        "dec-2",
        "loc-p0",
        "loc-p1",
        "loc-p2",
    ]
    deployment = local8.deployment.__class__.objects.get(pk=local8.deployment.pk)
    assert deployment.version == version + 2  # one snapshot per pool changed
    with pytest.raises(Exception, match="is applied, not proposed"):
        rebalance_apply(actor=None, proposal=applied)


def test_balanced_or_unmeasured_load_or_a_disagreeing_planner_proposes_nothing(local8):
    assert rebalance_propose(schedule=local8.schedule, now=NOW) is None  # no samples
    measure(local8, 1.0, 0.5, 1.5)  # ratio 1.0
    assert rebalance_propose(schedule=local8.schedule, now=NOW) is None
    # Prefill-bound measurement, but the planner wants fewer prefill nodes, not more.
    measure(local8, 0.1, 0.1, 3.0)
    assert rebalance_propose(schedule=local8.schedule, now=NOW) is None
    assert not RebalanceProposal.objects.exists()


def test_auto_apply_only_when_enabled_and_never_during_a_canary(local8):
    measure(local8, 2.0, 1.0, 1.5)
    rebalance_due(now=NOW)
    proposal = RebalanceProposal.objects.get()
    assert proposal.state == "proposed"
    rebalance_dismiss(actor=None, proposal=proposal)

    tidal_schedule_update(actor=None, schedule=local8.schedule, rebalance_auto_apply=True)
    WorkflowRun.objects.create(
        kind="canary",
        state="running",
        target_type="deployments.deployment",
        target_id=str(local8.deployment.pk),
    )
    rebalance_due(now=NOW)
    assert RebalanceProposal.objects.filter(state="proposed").count() == 1
    assert local8.local_prefill.nodes.count() == 6

    WorkflowRun.objects.filter(kind="canary").update(state="succeeded")
    rebalance_due(now=NOW)
    assert RebalanceProposal.objects.filter(state="applied").count() == 1
    assert local8.local_prefill.nodes.count() == 3

"""Rebalancing: measured producer vs consumer capacity against the planner's optimum split
of the local pool; proposals with reasons; approving one starts its ``rebalance`` run, whose
``join`` moves the nodes through the pool services (the run against real agents:
tests/orchestrator/test_rebalance_fleet.py)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from console.deployments.services import pool_create, pool_update
from console.runs.models import WorkflowRun
from console.schedules.models import RebalanceProposal
from console.schedules.rebalance import (
    REBALANCE_STEPS,
    rebalance_apply,
    rebalance_dismiss,
    rebalance_due,
    rebalance_finish,
    rebalance_move_nodes,
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


def test_approving_starts_the_run_whose_join_moves_the_nodes_through_the_pool_services(local8):
    measure(local8, 2.0, 1.0, 1.5)
    proposal = rebalance_propose(schedule=local8.schedule, now=NOW)
    version = local8.deployment.__class__.objects.get(pk=local8.deployment.pk).version

    applying = rebalance_apply(actor=None, proposal=proposal)

    assert applying.state == "applying"
    run = applying.run
    assert run.kind == "rebalance"
    assert [s.name for s in run.steps.order_by("index")] == REBALANCE_STEPS
    assert run.params == {"proposal": proposal.pk, "deployment": local8.deployment.pk}
    assert local8.local_prefill.nodes.count() == 6  # nothing moves before the engines do
    with pytest.raises(Exception, match="is applying, not proposed"):
        rebalance_apply(actor=None, proposal=applying)

    assert rebalance_move_nodes(proposal=applying) == version + 2  # one snapshot per pool
    assert local8.local_prefill.nodes.count() == 3
    assert sorted(local8.decode_pool.nodes.values_list("hostname", flat=True)) == [
        "dec-1",
        "dec-2",
        "loc-p0",
        "loc-p1",
        "loc-p2",
    ]
    # A join that runs again (its worker died after the move) moves nothing twice.
    assert rebalance_move_nodes(proposal=applying) == version + 2
    rebalance_finish(proposal_id=proposal.pk, ok=False)  # a step failed ...
    proposal.refresh_from_db()
    assert proposal.state == "failed"
    rebalance_finish(proposal_id=proposal.pk, ok=True)  # ... and its retry went through
    proposal.refresh_from_db()
    assert proposal.state == "applied"
    assert proposal.decided_by_label == "rebalance"
    rebalance_finish(proposal_id=proposal.pk, ok=False)  # an applied one stays applied
    proposal.refresh_from_db()
    assert proposal.state == "applied"


def test_a_move_that_would_empty_a_pool_or_no_longer_applies_is_refused(local8):
    measure(local8, 2.0, 1.0, 1.5)
    proposal = rebalance_propose(schedule=local8.schedule, now=NOW)
    every = [
        {"node": n.pk, "hostname": n.hostname, "from": "prefill", "to": "decode"}
        for n in local8.local_prefill.nodes.all()
    ]
    RebalanceProposal.objects.filter(pk=proposal.pk).update(moves=every)
    proposal.refresh_from_db()
    with pytest.raises(Exception, match="would leave the local prefill pool empty"):
        rebalance_apply(actor=None, proposal=proposal)

    RebalanceProposal.objects.filter(pk=proposal.pk).update(moves=every[:1])
    proposal.refresh_from_db()
    pool_update(
        actor=None, pool=local8.local_prefill, nodes=list(local8.local_prefill.nodes.all())[1:]
    )
    with pytest.raises(Exception, match="is no longer in the prefill pool"):
        rebalance_apply(actor=None, proposal=proposal)
    proposal.refresh_from_db()
    assert proposal.state == "proposed"
    assert proposal.run is None


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
    applying = RebalanceProposal.objects.get(state="applying")
    assert applying.run.kind == "rebalance"
    # While it runs, the next hour proposes nothing new and applies nothing else.
    rebalance_due(now=NOW)
    assert RebalanceProposal.objects.filter(state__in=["proposed", "applying"]).count() == 1

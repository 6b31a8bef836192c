"""The beat's hourly apply over a simulated day (clock injected): the right plan each hour,
through the deployment services (config snapshot + audit), idempotent per hour, never over an
active kill switch or a canary in progress.

Agents: none is called here (the console never calls agents); the evidence checked is the
recorded scale intent (``TidalApplication.scale``). ``tests/orchestrator/test_tidal_agents.py``
carries the intent out on real agents."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from console.core.models import AuditLog
from console.deployments.models import Deployment
from console.deployments.services import deployment_set_kill_switch, deployment_transition
from console.runs.models import WorkflowRun
from console.schedules.models import TidalApplication
from console.schedules.services import tidal_apply_due, tidal_apply_hour, tidal_schedule_update

pytestmark = pytest.mark.django_db

DAY = datetime(2026, 11, 30, tzinfo=UTC)
EXPECTED_REMOTE = [4] * 12 + [2] * 6 + [0] * 4 + [4] * 2


def deployment(world) -> Deployment:
    return Deployment.objects.get(pk=world.deployment.pk)


def test_a_simulated_day_applies_each_hours_plan_and_respects_the_kill_switch(tidal):
    kill_hours = {9, 10}
    seen = []
    seen_threshold = [deployment(tidal).remote_prefill_threshold_tokens]
    for hour in range(24):
        now = DAY + timedelta(hours=hour, minutes=1)
        if hour == 9:
            deployment_set_kill_switch(actor=None, deployment=deployment(tidal), enabled=True)
        if hour == 11:
            deployment_set_kill_switch(actor=None, deployment=deployment(tidal), enabled=False)
        # Three beat ticks per hour: the first applies, the others find the hour done.
        for minute in (1, 20, 59):
            tidal_apply_due(now=now.replace(minute=minute))
        row = TidalApplication.objects.get(
            schedule=tidal.schedule, hour_start=DAY + timedelta(hours=hour)
        )
        d = deployment(tidal)
        seen.append((hour, row.outcome, row.plan["remote_instances"], d.remote_share_percent))
        if hour in kill_hours:
            assert row.outcome == "skipped_kill_switch"
            assert row.checks == 3  # re-checked on every tick while the switch stays on
            assert d.kill_switch is True
        else:
            assert row.outcome in {"applied", "unchanged"}
            assert row.checks == 1
            assert row.plan["remote_instances"] == EXPECTED_REMOTE[hour]
            assert d.remote_share_percent == (100 if EXPECTED_REMOTE[hour] else 0)
            if EXPECTED_REMOTE[hour]:
                assert d.remote_prefill_threshold_tokens == row.plan["threshold_tokens"]
            else:  # nothing remote: the deployment keeps the threshold it had
                assert d.remote_prefill_threshold_tokens == seen_threshold[-1]
            seen_threshold.append(d.remote_prefill_threshold_tokens)
            assert row.config_version == d.version
            assert len(row.scale["run"]) == EXPECTED_REMOTE[hour]
            assert row.scale["agent_calls"].startswith("pending")

    assert TidalApplication.objects.filter(schedule=tidal.schedule).count() == 24
    # The share changes only when the plan changes: 0 -> 100 at hour 0, 100 -> 0 at 18,
    # 0 -> 100 at 22 (the kill switch leaves the share alone; it is independent).
    outcomes = {hour: outcome for hour, outcome, _, _ in seen}
    assert outcomes[0] == "applied"
    assert outcomes[1] == "unchanged"
    assert outcomes[12] == "applied"  # 4 -> 2 remote instances: a scale change, same config
    assert outcomes[18] == "applied"
    assert outcomes[22] == "applied"


def test_apply_goes_through_the_deployment_services(tidal):
    before = deployment(tidal).version

    row = tidal_apply_hour(schedule_id=tidal.schedule.pk, now=DAY + timedelta(hours=2))

    d = deployment(tidal)
    assert d.version == before + 1
    snapshot = d.snapshots.get(version=d.version)
    assert snapshot.reason == "tidal 02:00 UTC"
    assert snapshot.diff["routing.remote_share_percent"] == {"from": 0, "to": 100}
    assert AuditLog.objects.filter(
        object_type="deployments.deployment", object_id=str(d.pk), action="update"
    ).exists()
    assert row.before["remote_share_percent"] == 0
    assert row.after == {
        "remote_share_percent": 100,
        "remote_prefill_threshold_tokens": row.plan["threshold_tokens"],
        "kill_switch": False,
        "config_version": d.version,
    }


def test_a_canary_in_progress_is_never_overridden_and_the_hour_applies_after_it(tidal):
    canary = WorkflowRun.objects.create(
        kind="canary",
        state="running",
        target_type="deployments.deployment",
        target_id=str(tidal.deployment.pk),
    )
    version = deployment(tidal).version
    now = DAY + timedelta(hours=3, minutes=5)

    row = tidal_apply_hour(schedule_id=tidal.schedule.pk, now=now)

    assert row.outcome == "skipped_canary"
    assert row.plan["canary_run"] == canary.pk
    assert deployment(tidal).version == version
    canary.state = "succeeded"
    canary.save()
    row = tidal_apply_hour(schedule_id=tidal.schedule.pk, now=now + timedelta(minutes=1))
    assert row.outcome == "applied"
    assert row.checks == 2
    assert deployment(tidal).remote_share_percent == 100


def test_other_kinds_of_runs_do_not_block_and_a_disabled_schedule_does_nothing(tidal):
    WorkflowRun.objects.create(
        kind="deploy",
        state="running",
        target_type="deployments.deployment",
        target_id=str(tidal.deployment.pk),
    )
    row = tidal_apply_hour(schedule_id=tidal.schedule.pk, now=DAY)
    assert row.outcome == "applied"

    tidal_schedule_update(actor=None, schedule=tidal.schedule, enabled=False)
    assert tidal_apply_hour(schedule_id=tidal.schedule.pk, now=DAY + timedelta(hours=19)) is None
    assert tidal_apply_due(now=DAY + timedelta(hours=19)) == []
    assert deployment(tidal).remote_share_percent == 100


def test_hours_are_the_schedules_local_hours(tidal):
    # 18:30 UTC is 03:30 in Tokyo: the cheap night hour (4 remote), not the evening peak.
    tidal_schedule_update(actor=None, schedule=tidal.schedule, timezone="Asia/Tokyo")

    row = tidal_apply_hour(schedule_id=tidal.schedule.pk, now=DAY + timedelta(hours=18, minutes=30))

    assert row.hour == 3
    assert row.plan["remote_instances"] == 4
    assert row.hour_start == DAY + timedelta(hours=18)
    assert deployment(tidal).snapshots.first().reason == "tidal 03:00 Asia/Tokyo"


def test_a_lost_node_is_not_scheduled_and_the_shortfall_is_recorded(tidal):
    tidal.prefill_node.status = "lost"
    tidal.prefill_node.save()

    row = tidal_apply_hour(schedule_id=tidal.schedule.pk, now=DAY)

    assert row.scale["run"] == ["pre-2", "pre-3", "pre-4"]
    assert row.scale["stop"] == ["pre-1"]
    assert row.scale["short_by"] == 1


def test_a_plan_that_cannot_be_computed_is_recorded_as_failed(tidal):
    tidal.schedule.capacity = [4] * 23  # bypasses the service on purpose: a corrupted row
    tidal.schedule.save()

    row = tidal_apply_hour(schedule_id=tidal.schedule.pk, now=DAY)

    assert row.outcome == "failed"
    assert "capacity" in row.error
    assert deployment(tidal).remote_share_percent == 0


def test_a_deployment_that_is_not_active_is_left_to_its_workflow(tidal):
    d = deployment(tidal)
    deployment_transition(actor=None, deployment=d, to_state="deploying")
    version = deployment(tidal).version

    row = tidal_apply_hour(schedule_id=tidal.schedule.pk, now=DAY)

    assert row.outcome == "skipped_inactive"
    assert deployment(tidal).version == version
    assert deployment(tidal).remote_share_percent == 0
    deployment_transition(actor=None, deployment=deployment(tidal), to_state="active")
    row = tidal_apply_hour(schedule_id=tidal.schedule.pk, now=DAY + timedelta(minutes=1))
    assert row.outcome == "applied"


def test_dst_fall_back_gives_the_repeated_local_hour_its_own_row(tidal):
    # Europe/Paris leaves summer time on 2026-10-25: 02:00-03:00 local happens twice
    # (00:00 and 01:00 UTC). Each is its own hour, applied once.
    tidal_schedule_update(actor=None, schedule=tidal.schedule, timezone="Europe/Paris")
    first = datetime(2026, 10, 25, 0, 30, tzinfo=UTC)

    a = tidal_apply_hour(schedule_id=tidal.schedule.pk, now=first)
    b = tidal_apply_hour(schedule_id=tidal.schedule.pk, now=first + timedelta(hours=1))
    again = tidal_apply_hour(
        schedule_id=tidal.schedule.pk, now=first + timedelta(hours=1, minutes=5)
    )

    assert (a.hour, b.hour) == (2, 2)
    assert a.pk != b.pk
    assert again.pk == b.pk
    assert TidalApplication.objects.filter(schedule=tidal.schedule).count() == 2

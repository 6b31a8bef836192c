"""The recorded-traffic cost comparison (``console.schedules.selectors.tidal_recorded_cost``
over ``console.schedules.recorded.compare``): a simulated day applied by the beat's own
service, gateway request rates recorded as the scrape records them, priced hour by hour with
and without the schedule; gaps stay gaps; held and static hours; the schedule's zone."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from console.deployments.services import deployment_set_kill_switch
from console.schedules.models import TidalApplication
from console.schedules.recorded import CostInputs, RecordedHour, compare
from console.schedules.selectors import tidal_recorded_cost
from console.schedules.services import tidal_apply_hour, tidal_inputs, tidal_schedule_update
from console.telemetry import names
from console.telemetry.services import samples_record_many
from tests.console.schedules.conftest import LOCAL_PRICE, REMOTE_PRICES

pytestmark = pytest.mark.django_db

DAY = datetime(2026, 11, 30, tzinfo=UTC)
PLANNED = [4] * 12 + [2] * 6 + [0] * 4 + [4] * 2  # the case study's plan (test_tidal_apply.py)
GPUS = 8  # the schedule's gpus_per_instance (default)
LOCAL = 8  # the case study's local instances
GAPS = {5, 6}  # hours with no sample at all


def record(deployment, at, remote, local, fallback=0.0):
    """One scrape's rates, as ``orchestrator.telemetryops.record_window`` writes them."""
    for path, rate in (("remote", remote), ("local", local), ("fallback", fallback)):
        samples_record_many(
            subject=deployment, values={names.REQUESTS: rate}, labels={"path": path}, at=at
        )


def apply_day(schedule, day=DAY):
    for hour in range(24):
        tidal_apply_hour(schedule_id=schedule.pk, now=day + timedelta(hours=hour, minutes=1))


def record_day(deployment, day=DAY, gaps=frozenset(GAPS)):
    """Two scrapes an hour: remote 2 and 4 req/s (mean 3), local 1 req/s, fallback 0."""
    for hour in range(24):
        if hour in gaps:
            continue
        start = day + timedelta(hours=hour)
        record(deployment, start + timedelta(minutes=10), remote=2.0, local=1.0)
        record(deployment, start + timedelta(minutes=40), remote=4.0, local=1.0)


def hour_cost(remote_instances, hour):
    return GPUS * (remote_instances * REMOTE_PRICES[hour] + LOCAL * LOCAL_PRICE)


def tokens_per_request(schedule):
    s = tidal_inputs(schedule).scenario
    return float(s.lengths.mean + s.decode.output_tokens)


def test_a_recorded_day_is_priced_as_scheduled_and_without_the_schedule(tidal):
    apply_day(tidal.schedule)
    record_day(tidal.deployment)
    tpr = tokens_per_request(tidal.schedule)

    answer = tidal_recorded_cost(schedule=tidal.schedule, days=1, now=DAY + timedelta(days=1))

    hours = answer["hours"]
    assert [h["hour"] for h in hours] == list(range(24))
    assert hours[0]["hour_start"] == "2026-11-30T00:00:00+00:00"
    assert answer["window"]["since"] == "2026-11-30T00:00:00+00:00"
    assert answer["window"]["until"] == "2026-12-01T00:00:00+00:00"
    assert answer["hours_with_data"] == 22
    assert answer["hours_without_data"] == 2
    assert answer["static_remote_instances"] == 4  # the remote prefill pool's four nodes
    assert answer["tokens_per_request"] == tpr
    for h in hours:
        hour = h["hour"]
        assert h["scheduled"]["remote_instances"] == PLANNED[hour]
        assert h["scheduled"]["source"] == "applied"
        assert h["scheduled"]["cost"] == pytest.approx(hour_cost(PLANNED[hour], hour))
        assert h["static"]["cost"] == pytest.approx(hour_cost(4, hour))
        if hour in GAPS:
            assert h["gap"] is True
            assert h["requests"] is None
            assert h["scheduled"]["cost_per_million_tokens"] is None
            assert h["static"]["cost_per_million_tokens"] is None
            continue
        assert h["gap"] is False
        assert h["samples"] == 6  # 2 scrapes x 3 paths
        assert h["requests_by_path"] == {"remote": 10_800.0, "local": 3600.0, "fallback": 0.0}
        assert h["requests"] == 14_400.0
        assert h["remote_request_share"] == 0.75
        assert h["tokens"] == pytest.approx(14_400.0 * tpr)
        assert h["scheduled"]["cost_per_million_tokens"] == pytest.approx(
            hour_cost(PLANNED[hour], hour) / (14_400.0 * tpr) * 1e6
        )

    served = [h for h in range(24) if h not in GAPS]
    scheduled = sum(hour_cost(PLANNED[h], h) for h in served)
    static = sum(hour_cost(4, h) for h in served)
    tokens = 22 * 14_400.0 * tpr
    totals = answer["totals"]
    assert totals["scheduled"]["cost"] == pytest.approx(scheduled)
    assert totals["static"]["cost"] == pytest.approx(static)
    assert totals["scheduled"]["tokens"] == totals["static"]["tokens"] == pytest.approx(tokens)
    assert totals["scheduled"]["cost_per_million_tokens"] == pytest.approx(scheduled / tokens * 1e6)
    assert totals["static"]["cost_per_million_tokens"] == pytest.approx(static / tokens * 1e6)
    assert answer["saving"]["cost"] == pytest.approx(static - scheduled)
    assert answer["saving"]["share"] == pytest.approx(1 - scheduled / static)
    assert answer["saving"]["share"] > 0  # the peak hours 18-21 ran no remote instance
    assert answer["empty"] is False


def test_a_skipped_hour_holds_what_the_last_applied_hour_left(tidal):
    for hour in range(12):
        tidal_apply_hour(schedule_id=tidal.schedule.pk, now=DAY + timedelta(hours=hour, minutes=1))
    deployment_set_kill_switch(actor=None, deployment=tidal.deployment, enabled=True)
    tidal_apply_hour(schedule_id=tidal.schedule.pk, now=DAY + timedelta(hours=12, minutes=1))
    record_day(tidal.deployment, gaps=frozenset())

    answer = tidal_recorded_cost(schedule=tidal.schedule, days=1, now=DAY + timedelta(days=1))

    noon = answer["hours"][12]["scheduled"]
    assert (
        TidalApplication.objects.get(hour_start=DAY + timedelta(hours=12)).plan["remote_instances"]
        == 2
    )  # what the hour would have run
    assert noon == {
        "remote_instances": 4,  # held from hour 11: the kill switch stopped the change
        "source": "held",
        "outcome": "skipped_kill_switch",
        "remote_share_percent": 100,
        "cost": pytest.approx(hour_cost(4, 12)),
        "cost_per_million_tokens": pytest.approx(
            hour_cost(4, 12) / (14_400.0 * tokens_per_request(tidal.schedule)) * 1e6
        ),
    }
    # No row after hour 12 (beat stopped): still held, without an outcome of its own.
    assert answer["hours"][13]["scheduled"]["source"] == "held"
    assert answer["hours"][13]["scheduled"]["outcome"] is None
    assert answer["hours"][23]["scheduled"]["remote_instances"] == 4


def test_hours_before_any_apply_are_static_and_a_row_before_the_window_carries_over(tidal):
    apply_day(tidal.schedule)
    record_day(tidal.deployment, day=DAY - timedelta(days=1), gaps=frozenset())
    record_day(tidal.deployment, day=DAY + timedelta(days=1), gaps=frozenset())

    before = tidal_recorded_cost(schedule=tidal.schedule, days=1, now=DAY)
    after = tidal_recorded_cost(
        schedule=tidal.schedule, days=1, now=DAY + timedelta(days=2, minutes=30)
    )

    assert {h["scheduled"]["source"] for h in before["hours"]} == {"static"}
    assert before["saving"] == {"cost": 0.0, "share": 0.0}  # nothing scheduled yet
    assert {h["scheduled"]["source"] for h in after["hours"]} == {"held"}
    assert {h["scheduled"]["remote_instances"] for h in after["hours"]} == {4}  # hour 23
    assert after["window"]["until"] == "2026-12-02T00:00:00+00:00"  # the current hour is out


def test_no_recorded_traffic_is_all_gaps_never_invented(tidal):
    apply_day(tidal.schedule)

    answer = tidal_recorded_cost(schedule=tidal.schedule, days=7, now=DAY + timedelta(days=1))

    assert answer["empty"] is True
    assert len(answer["hours"]) == 7 * 24
    assert answer["hours_with_data"] == 0
    assert answer["hours_without_data"] == 168
    assert {h["gap"] for h in answer["hours"]} == {True}
    assert answer["totals"]["scheduled"] == {
        "cost": 0.0,
        "tokens": 0.0,
        "cost_per_million_tokens": None,
    }
    assert answer["saving"] == {"cost": 0.0, "share": None}


def test_static_count_can_be_overridden_and_idle_hours_cost_without_a_rate(tidal):
    apply_day(tidal.schedule)
    record(tidal.deployment, DAY + timedelta(hours=3, minutes=5), remote=0.0, local=0.0)

    answer = tidal_recorded_cost(
        schedule=tidal.schedule, days=1, static_instances=0, now=DAY + timedelta(days=1)
    )

    idle = answer["hours"][3]
    assert idle["gap"] is False
    assert idle["requests"] == 0.0
    assert idle["static"]["cost"] == pytest.approx(GPUS * LOCAL * LOCAL_PRICE)
    assert idle["scheduled"]["cost_per_million_tokens"] is None
    assert answer["hours_idle"] == 1
    assert answer["static_remote_instances"] == 0
    assert answer["totals"]["scheduled"]["cost"] == pytest.approx(hour_cost(4, 3))
    assert answer["empty"] is True  # samples, but not a single request


def test_hours_follow_the_schedules_zone(tidal):
    tidal_schedule_update(actor=None, schedule=tidal.schedule, timezone="Asia/Kolkata")
    record(tidal.deployment, DAY + timedelta(minutes=10), remote=1.0, local=0.0)  # 05:40 IST

    answer = tidal_recorded_cost(schedule=tidal.schedule, days=1, now=DAY + timedelta(hours=1))

    found = [h for h in answer["hours"] if not h["gap"]]
    assert len(found) == 1
    assert found[0]["hour_start"] == "2026-11-30T05:00:00+05:30"
    assert found[0]["hour"] == 5
    assert found[0]["remote_price"] == REMOTE_PRICES[5]
    assert answer["window"]["until"] == "2026-11-30T06:00:00+05:30"


def test_compare_prices_each_hour_from_its_own_hour_of_the_day():
    hours = [
        RecordedHour(
            hour_start=DAY + timedelta(hours=h),
            rates_by_path={"remote": 1.0} if h != 1 else None,
            samples=1 if h != 1 else 0,
            remote_instances=2 if h == 0 else 0,
            source="applied",
        )
        for h in range(3)
    ]
    answer = compare(
        CostInputs(
            hours=hours,
            remote_prices=[10.0, 20.0, 30.0] + [0.0] * 21,
            local_prices=[1.0] * 24,
            gpus_per_instance=1,
            local_instances=1,
            static_remote_instances=2,
            tokens_per_request=1000.0,
        )
    )

    assert [h["scheduled"]["cost"] for h in answer["hours"]] == [21.0, 1.0, 1.0]
    assert [h["static"]["cost"] for h in answer["hours"]] == [21.0, 41.0, 61.0]
    assert answer["totals"]["scheduled"]["cost"] == 22.0  # hour 1 is a gap: left out
    assert answer["totals"]["static"]["cost"] == 82.0
    assert answer["totals"]["static"]["tokens"] == 2 * 3600 * 1000.0
    assert answer["saving"]["cost"] == 60.0


def test_compare_refuses_a_price_table_that_is_not_24_hours():
    with pytest.raises(ValueError, match="remote_prices: must hold 24"):
        compare(
            CostInputs(
                hours=[],
                remote_prices=[1.0],
                local_prices=[1.0] * 24,
                gpus_per_instance=1,
                local_instances=1,
                static_remote_instances=0,
                tokens_per_request=1.0,
            )
        )


def test_the_night_the_clocks_go_back_has_two_hours_at_two(tidal):
    tidal_schedule_update(actor=None, schedule=tidal.schedule, timezone="Europe/Paris")
    change = datetime(2026, 10, 25, tzinfo=UTC)  # 03:00 CEST -> 02:00 CET at 01:00 UTC
    record(tidal.deployment, change + timedelta(minutes=10), remote=1.0, local=0.0)  # 02:10 CEST
    record(tidal.deployment, change + timedelta(hours=1, minutes=10), remote=2.0, local=0.0)

    answer = tidal_recorded_cost(schedule=tidal.schedule, days=1, now=change + timedelta(hours=3))

    found = [(h["hour_start"], h["requests"]) for h in answer["hours"] if not h["gap"]]
    assert found == [
        ("2026-10-25T02:00:00+02:00", 3600.0),
        ("2026-10-25T02:00:00+01:00", 7200.0),
    ]
    assert len(answer["hours"]) == 24  # 24 elapsed hours, whatever the wall clock says

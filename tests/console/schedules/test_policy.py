"""The tidal policy (pure): per hour, the cheapest plan within the TTFT limit."""

from __future__ import annotations

from dataclasses import replace

import pytest

from console.planner.inputs import parse_scenario
from console.planner.model import optimise
from console.schedules.policy import TidalInputs, day_plan, hour_plan
from tests.console.schedules.conftest import CAPACITY, LOCAL_PRICE, REMOTE_PRICES, case_study


@pytest.fixture(scope="module")
def inputs() -> TidalInputs:
    return TidalInputs(
        scenario=parse_scenario(case_study()),
        remote_prices=list(REMOTE_PRICES),
        local_prices=[LOCAL_PRICE] * 24,
        capacity=list(CAPACITY),
        gpus_per_instance=8,
        ttft_limit_s=10.0,
    )


def test_day_plan_goes_remote_when_cheap_and_local_at_the_price_peak(inputs):
    plan = day_plan(inputs)

    remote_by_hour = [h["remote_instances"] for h in plan["hours"]]
    assert remote_by_hour == [4] * 12 + [2] * 6 + [0] * 4 + [4] * 2
    shares = [h["remote_share_percent"] for h in plan["hours"]]
    assert shares == [100] * 18 + [0] * 4 + [100] * 2
    assert [h["hour"] for h in plan["hours"]] == list(range(24))


def test_day_plan_costs_match_the_planner_throughput_and_prices(inputs):
    plan = day_plan(inputs)
    full, *_ = optimise(replace(inputs.scenario, remote_instances=4))
    tokens_per_request = inputs.scenario.lengths.mean + inputs.scenario.decode.output_tokens

    night = plan["hours"][3]
    assert night["lambda_max_rps"] == pytest.approx(full.lambda_max)
    assert night["threshold_tokens"] == pytest.approx(full.threshold, abs=1)
    expected_cost = 8 * (4 * 1.0 + 8 * LOCAL_PRICE)
    assert night["cost_per_hour"] == pytest.approx(expected_cost)
    assert night["cost_per_million_tokens"] == pytest.approx(
        expected_cost / (full.lambda_max * 3600 * tokens_per_request) * 1e6
    )


def test_tidal_beats_both_baselines_on_this_price_curve(inputs):
    totals = day_plan(inputs)["totals"]

    tidal = totals["tidal"]["cost_per_million_tokens"]
    assert tidal < totals["all_local"]["cost_per_million_tokens"]
    assert tidal < totals["always_remote"]["cost_per_million_tokens"]
    # All-local holds no remote instance: its cost is the local pool alone.
    assert totals["all_local"]["cost_per_day"] == pytest.approx(24 * 8 * 8 * LOCAL_PRICE)


def test_ttft_limit_below_the_remote_path_keeps_prefill_local(inputs):
    remote_ttft = day_plan(inputs)["hours"][0]["ttft_s"]
    local = day_plan(replace(inputs, capacity=[0] * 24))["hours"][0]["ttft_s"]
    assert local > remote_ttft  # the case study: long prompts on slow local prefill are slower

    # A limit under both: nothing is feasible, the lowest TTFT wins and the hour is flagged.
    strict = day_plan(replace(inputs, ttft_limit_s=remote_ttft / 2))
    assert strict["hours"][0]["remote_instances"] == 4
    assert strict["hours"][0]["ttft_within_limit"] is False
    assert strict["totals"]["tidal"]["hours_over_ttft_limit"] == 24


def test_hour_plan_equals_the_days_plan_for_that_hour(inputs):
    day = day_plan(inputs)["hours"]
    for hour in (0, 13, 19):
        assert hour_plan(inputs, hour).as_dict() == day[hour]


def test_tables_must_hold_24_values(inputs):
    with pytest.raises(ValueError, match="capacity: must hold 24"):
        day_plan(replace(inputs, capacity=[1] * 23))
    with pytest.raises(ValueError, match="remote_prices: every hourly value"):
        day_plan(replace(inputs, remote_prices=[1.0] * 23 + [float("nan")]))


def test_a_demand_curve_keeps_quiet_hours_local_and_busy_hours_remote(inputs):
    local_capacity = day_plan(replace(inputs, capacity=[0] * 24))["hours"][0]["lambda_max_rps"]
    # Quiet night (all-local carries it), busy day (needs the remote pool), a peak no plan carries.
    demand = [0.5 * local_capacity] * 8 + [1.5 * local_capacity] * 14 + [100.0] * 2

    plan = day_plan(replace(inputs, demand_rps=demand))

    hours = plan["hours"]
    assert [h["remote_instances"] for h in hours[:8]] == [0] * 8  # cheap remote, but not needed
    assert all(h["meets_demand"] for h in hours[:22])
    assert all(h["remote_instances"] > 0 for h in hours[8:18])
    assert hours[3]["served_rps"] == pytest.approx(0.5 * local_capacity)
    # The peak: nothing carries 100 req/s; the plan serves as much as it can, flagged.
    assert hours[22]["meets_demand"] is False
    assert hours[22]["remote_instances"] == 4
    assert plan["totals"]["tidal"]["hours_short_of_demand"] == 2
    # Cost per million tokens counts the tokens served, not the capacity.
    tokens_per_request = inputs.scenario.lengths.mean + inputs.scenario.decode.output_tokens
    assert hours[3]["cost_per_million_tokens"] == pytest.approx(
        hours[3]["cost_per_hour"] / (hours[3]["served_rps"] * 3600 * tokens_per_request) * 1e6
    )


def test_demand_table_must_hold_24_values(inputs):
    with pytest.raises(ValueError, match="demand_rps: must hold 24"):
        day_plan(replace(inputs, demand_rps=[1.0] * 3))

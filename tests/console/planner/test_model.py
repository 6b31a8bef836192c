import math

import numpy as np
import pytest

from console.planner.distributions import Histogram
from console.planner.inputs import parse_scenario
from console.planner.model import (
    Scenario,
    evaluate,
    homogeneous_baseline,
    naive_baseline,
    plan_at,
    threshold_grid,
)
from console.planner.presets import PRESETS, preset_scenario
from console.planner.profiles import DecodeProfile, KvProfile, PrefillProfile


def rel(value, expected):
    return abs(value - expected) / expected


@pytest.fixture(scope="module")
def case_study():
    return evaluate(parse_scenario(preset_scenario("prfaas-case-study")))


# --- the paper's case study, within 2 % -------------------------------------------------------


def test_case_study_optimum_matches_the_paper(case_study):
    optimum = case_study["optimum"]

    assert rel(optimum["threshold_tokens"], 19_400) < 0.02
    assert (optimum["n_prefill"], optimum["n_decode"]) == (3, 5)
    assert rel(optimum["lambda_max_rps"], 3.24) < 0.02


def test_case_study_baselines_and_gains_match_the_paper(case_study):
    homogeneous = case_study["baselines"]["homogeneous"]
    naive = case_study["baselines"]["naive_heterogeneous"]

    assert homogeneous["instances"] == 12
    assert (homogeneous["n_prefill"], homogeneous["n_decode"]) == (9, 3)
    assert rel(homogeneous["lambda_max_rps"], 2.11) < 0.02
    assert rel(naive["lambda_max_rps"], 2.45) < 0.02
    assert rel(case_study["gain"]["vs_homogeneous"], 1.54) < 0.02
    assert rel(case_study["gain"]["vs_naive_heterogeneous"], 1.32) < 0.02


def test_case_study_remote_pool_is_compute_bound_on_a_small_share_of_the_link(case_study):
    optimum = case_study["optimum"]

    # At the optimum both prefill paths saturate together (the paper's observation).
    assert set(optimum["binding_stages"]) == {"remote_compute", "local_prefill"}
    assert optimum["egress_gbps"] < 0.2 * 100
    assert case_study["verdict"]["decision"] == "offload"


def test_case_study_preset_carries_the_paper_figures():
    paper = PRESETS["prfaas-case-study"]["paper"]

    assert paper["lambda_max_rps"] == 3.24
    assert paper["homogeneous_split"] == [9, 3]


# --- the formulas on a hand-computed scenario -----------------------------------------------


def two_point_scenario(**overrides):
    """Half the prompts are 1,000 tokens, half 10,000: with t = 5,000, p = 0.5, l_long = 10,000,
    l_short = 1,000 exactly."""
    base = {
        "remote_instances": 2,
        "remote_prefill": PrefillProfile(a=0.5, b=1e-4, c=0.0),  # T(10k) = 1.5 s
        "local_instances": 4,
        "local_prefill": PrefillProfile(a=0.2, b=3e-4, c=0.0),  # T(1k) = 0.5 s
        "kv": KvProfile.linear(1e6, 1e4),  # S(10k) = 101 MB
        "decode": DecodeProfile(batch_size=10, step_time_s=0.02, output_tokens=500),  # 1 req/s
        "link_gbps": 8.08,  # 1.01e9 B/s -> 10 transfers/s of 101 MB
        "lengths": Histogram.from_bins([(1000, 1000, 1), (10000, 10000, 1)]),
        "thresholds": np.array([5000.0]),
    }
    base.update(overrides)
    return Scenario(**base)


def test_plan_formula_by_hand():
    s = two_point_scenario()

    plan = plan_at(s, 5000.0, n_prefill=1)

    # remote = min(2 / 1.5, 1.01e9 / 1.01e8) = 1.333; / p = 2.667
    assert plan.offload_share == pytest.approx(0.5)
    assert plan.l_long == pytest.approx(10_000)
    assert plan.l_short == pytest.approx(1_000)
    assert plan.capacities["remote_compute"] == pytest.approx(2 / 1.5 / 0.5)
    assert plan.capacities["remote_link"] == pytest.approx(10 / 0.5)
    # local = 1 / 0.5 = 2 req/s; / (1 - p) = 4
    assert plan.capacities["local_prefill"] == pytest.approx(4.0)
    # decode = 3 x 10 / (0.02 x 500) = 3 req/s
    assert plan.capacities["decode"] == pytest.approx(3.0)
    assert plan.lambda_max == pytest.approx(2 / 1.5 / 0.5)
    assert plan.binding == ["remote_compute"]
    # egress = Lambda x p x S(l_long) x 8 bits
    assert plan.egress_gbps == pytest.approx(plan.lambda_max * 0.5 * 1.01e8 * 8 / 1e9)


def test_grid_search_picks_the_best_split():
    s = two_point_scenario()

    result = evaluate(s, with_sweeps=True)

    # Splits at t = 5000: N_p=1 -> min(2.667, 4, 3) = 2.667; N_p=2 -> min(2.667, 8, 2) = 2.
    assert (result["optimum"]["n_prefill"], result["optimum"]["n_decode"]) == (1, 3)
    assert result["optimum"]["lambda_max_rps"] == pytest.approx(8 / 3)
    assert result["sweeps"]["split"]["lambda_max_rps"] == pytest.approx(
        [0, 8 / 3, 2, 1, 0], rel=1e-5
    )


def test_thin_link_binds_the_remote_stage():
    s = two_point_scenario(link_gbps=0.808)  # 1 transfer/s of 101 MB

    plan = plan_at(s, 5000.0, n_prefill=1)

    assert plan.capacities["remote_link"] == pytest.approx(2.0)
    assert plan.binding[0] == "remote_link"
    assert plan.egress_gbps == pytest.approx(0.808)


def test_baselines_by_hand():
    s = two_point_scenario()

    # Homogeneous: E[L] = 5500, T_local = 0.2 + 1.65 = 1.85 s; 6 instances:
    # N_p=3 -> min(1.62, 3) = 1.62 ; N_p=4 -> min(2.16, 2) = 2 ; N_p=5 -> min(2.7, 1) = 1.
    homogeneous = homogeneous_baseline(s, 6)
    naive = naive_baseline(s)

    assert homogeneous["n_prefill"] == 4
    assert homogeneous["lambda_max_rps"] == pytest.approx(2.0)
    # Naive: T_remote(5500) = 1.05 s -> 1.905 req/s; decode 4 x 1 = 4 req/s.
    assert naive["lambda_max_rps"] == pytest.approx(2 / 1.05)
    assert naive["binding_stage"] == "remote_compute"


def test_nothing_offloaded_above_every_prompt_and_everything_below():
    s = two_point_scenario()

    none_remote = plan_at(s, 20_000.0, n_prefill=2)
    all_remote = plan_at(s, 0.0, n_prefill=0)

    assert none_remote.offload_share == 0
    assert none_remote.egress_gbps == 0
    assert math.isinf(none_remote.capacities["remote_compute"])
    assert all_remote.offload_share == 1
    assert math.isinf(all_remote.capacities["local_prefill"])
    assert all_remote.lambda_max == pytest.approx(naive_baseline(s)["lambda_max_rps"])


def test_no_remote_instances_means_no_offload():
    s = two_point_scenario(remote_instances=0, thresholds=threshold_grid(1000, 10000, 50))

    result = evaluate(s)

    assert result["optimum"]["offload_share"] == 0
    assert result["optimum"]["lambda_max_rps"] == pytest.approx(
        homogeneous_baseline(s, 4)["lambda_max_rps"]
    )


def test_ties_go_to_the_highest_threshold():
    # Decode binds (0.1 req/s per decode instance, 3 of them at N_p = 1) at both thresholds:
    # the plan that offloads least (least link) wins.
    s = two_point_scenario(
        decode=DecodeProfile(batch_size=1, step_time_s=0.02, output_tokens=500),
        thresholds=np.array([5000.0, 20000.0]),
        zoom=False,
    )

    result = evaluate(s)

    assert result["optimum"]["lambda_max_rps"] == pytest.approx(0.1 * 3)
    assert result["optimum"]["threshold_tokens"] == 20_000
    assert result["optimum"]["offload_share"] == 0


def test_sweeps_cover_the_grid_and_every_split(case_study):
    sweeps = case_study["sweeps"]

    assert len(sweeps["threshold"]["threshold_tokens"]) == 1000
    assert sweeps["threshold"]["threshold_tokens"][0] == 128
    assert sweeps["threshold"]["threshold_tokens"][-1] == 131072
    assert sweeps["split"]["n_prefill"] == list(range(9))
    assert max(sweeps["threshold"]["lambda_max_rps"]) <= case_study["optimum"]["lambda_max_rps"]
    best_by_split = sweeps["split"]["lambda_max_rps"]
    assert best_by_split.index(max(best_by_split)) == 3


def test_zoom_is_never_worse_than_the_grid():
    body = preset_scenario("prfaas-case-study")
    body["grid"] = {"thresholds": 40, "zoom": False}
    coarse = evaluate(parse_scenario(body), with_sweeps=False)["optimum"]
    body["grid"]["zoom"] = True
    zoomed = evaluate(parse_scenario(body), with_sweeps=False)["optimum"]

    assert zoomed["lambda_max_rps"] >= coarse["lambda_max_rps"]
    assert rel(zoomed["threshold_tokens"], 19_400) < 0.02


def test_log_spaced_grid_finds_the_same_optimum():
    body = preset_scenario("prfaas-case-study")
    body["grid"] = {"thresholds": 200, "spacing": "log"}

    optimum = evaluate(parse_scenario(body), with_sweeps=False)["optimum"]

    assert rel(optimum["lambda_max_rps"], 3.24) < 0.02
    assert (optimum["n_prefill"], optimum["n_decode"]) == (3, 5)


def test_vectorised_grid_agrees_with_a_plain_python_loop():
    from dataclasses import replace

    from bench.planner import scalar_grid
    from console.planner.model import optimise

    body = preset_scenario("prfaas-case-study")
    body["grid"] = {"thresholds": 150}
    s = replace(parse_scenario(body), zoom=False)

    best_lambda, best_threshold, best_split = scalar_grid(s)
    plan, *_ = optimise(s)

    assert plan.lambda_max == pytest.approx(best_lambda, rel=1e-9)
    assert plan.threshold == pytest.approx(best_threshold)
    assert plan.n_prefill == best_split


def test_expected_prefill_time_averages_the_time_not_the_length():
    # Short prompts 1,000 and 2,000 tokens, long ones 10,000; quadratic local prefill.
    local = PrefillProfile(a=0.1, b=0.0, c=1e-7)  # T(1k) = 0.2 s, T(2k) = 0.5 s
    s = two_point_scenario(
        local_prefill=local,
        lengths=Histogram.from_bins([(1000, 1000, 1), (2000, 2000, 1), (10000, 10000, 1)]),
    )
    from dataclasses import replace

    at_mean = plan_at(s, 5000.0, n_prefill=1)
    expected = plan_at(replace(s, prefill_time="expected"), 5000.0, n_prefill=1)

    # T(E[L | short]) = T(1500) = 0.325 s; E[T(L) | short] = (0.2 + 0.5) / 2 = 0.35 s.
    assert at_mean.capacities["local_prefill"] == pytest.approx(1 / 0.325 / (2 / 3))
    assert expected.capacities["local_prefill"] == pytest.approx(1 / 0.35 / (2 / 3))
    # A single long length: both modes agree on the remote side.
    assert expected.capacities["remote_compute"] == pytest.approx(
        at_mean.capacities["remote_compute"]
    )


def test_expected_prefill_time_on_the_case_study():
    body = preset_scenario("prfaas-case-study")
    body["method"] = {"prefill_time": "expected"}

    result = evaluate(parse_scenario(body), with_sweeps=False)

    # 4 / E[T_remote(L)] with E[T] = 1.68256 s (numerical integration of the truncated
    # log-normal), against 4 / T_remote(E[L]) = 2.467 req/s in the paper's form.
    assert result["baselines"]["naive_heterogeneous"]["lambda_max_rps"] == pytest.approx(
        4 / 1.6825594, rel=1e-5
    )
    assert result["method"] == {"prefill_time": "expected"}
    assert result["optimum"]["lambda_max_rps"] < 3.24


def test_measured_points_preset_lands_near_the_papers_figures():
    result = evaluate(parse_scenario(preset_scenario("prfaas-measured-points")), with_sweeps=False)

    fitted = result["profiles"]["remote_prefill"]["coefficients"]
    # The fit of the four measured prefill times recovers the paper's quadratic closely.
    assert fitted == pytest.approx([0.389, 4.21e-5, 9.94e-11], rel=0.06)
    assert result["profiles"]["kv"]["source"] == "points"
    assert (result["optimum"]["n_prefill"], result["optimum"]["n_decode"]) == (3, 5)
    assert rel(result["optimum"]["threshold_tokens"], 19_400) < 0.03
    assert rel(result["optimum"]["lambda_max_rps"], 3.24) < 0.03
    assert rel(result["gain"]["vs_homogeneous"], 1.54) < 0.03

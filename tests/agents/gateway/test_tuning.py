"""The threshold re-tuner: pressure and measured remote/local TTFT move the factor within the
operator's bounds; the TTFT averages count only streamed requests near the threshold."""

import pytest

from agents.gateway.tuning import Ewma, ThresholdTuner, TtftRatio, TuningSettings

SETTINGS = TuningSettings(step=2.0, max_factor=4.0, min_factor=0.25)


def test_pressure_raises_to_the_cap_and_relaxes_to_one_whatever_the_floor():
    tuner = ThresholdTuner(SETTINGS)

    steps = [tuner.update(0.95) for _ in range(3)]
    assert steps == [(1.0, 2.0), (2.0, 4.0), None]
    assert tuner.last_reason == "pressure"
    down = [tuner.update(0.1) for _ in range(3)]

    assert down == [(4.0, 2.0), (2.0, 1.0), None]
    assert tuner.last_reason == "relax"


def test_remote_slower_than_local_raises_without_pressure():
    tuner = ThresholdTuner(SETTINGS)

    assert tuner.update(0.1, ttft_ratio=1.5) == (1.0, 2.0)
    assert tuner.last_reason == "ttft"
    assert tuner.effective(100) == 200


def test_remote_clearly_faster_lowers_below_the_configured_threshold_to_the_floor():
    tuner = ThresholdTuner(SETTINGS)

    steps = [tuner.update(0.1, ttft_ratio=0.5) for _ in range(4)]

    assert steps == [(1.0, 0.5), (0.5, 0.25), None, None]
    assert tuner.last_reason == "ttft"
    assert tuner.effective(100) == 25


def test_below_one_the_factor_holds_between_the_bounds_and_climbs_back_without_evidence():
    tuner = ThresholdTuner(SETTINGS)
    tuner.update(0.1, ttft_ratio=0.5)

    assert tuner.update(0.1, ttft_ratio=0.9) == (0.5, 1.0)  # no longer clearly faster
    assert tuner.update(0.1, ttft_ratio=0.5) == (1.0, 0.5)
    assert tuner.update(0.7, ttft_ratio=0.5) is None  # some pressure: hold
    assert tuner.update(None, ttft_ratio=0.5) == (0.5, 1.0)  # no remote site in play
    assert tuner.last_reason == "relax"


def test_pressure_wins_over_a_fast_remote():
    tuner = ThresholdTuner(SETTINGS)

    assert tuner.update(0.95, ttft_ratio=0.1) == (1.0, 2.0)
    assert tuner.last_reason == "pressure"


def test_default_floor_never_goes_below_the_configured_threshold():
    tuner = ThresholdTuner(TuningSettings())

    assert tuner.update(0.1, ttft_ratio=0.1) is None
    assert tuner.factor == 1.0


def test_ttft_ratio_counts_requests_within_a_factor_of_two_of_the_threshold():
    ratio = TtftRatio(alpha=1.0, min_samples=2)

    counted = [
        ratio.add("local", 80, 100, 0.08),  # 1 s per 1,000 tokens
        ratio.add("local", 40, 100, 9.0),  # too short to say anything about 100
        ratio.add("remote", 150, 100, 0.3),  # 2 s per 1,000 tokens
        ratio.add("remote", 201, 100, 9.0),  # too long
        ratio.add("fallback", 150, 100, 9.0),
    ]

    assert counted == [True, False, True, False, False]
    assert ratio.ratio() is None  # one sample each, two needed
    ratio.add("local", 100, 100, 0.1)
    ratio.add("remote", 100, 100, 0.2)
    assert ratio.ratio() == pytest.approx(2.0)
    assert ratio.snapshot() == {
        "remote_s_per_ktok": 2.0,
        "local_s_per_ktok": 1.0,
        "remote_samples": 2,
        "local_samples": 2,
        "ratio": 2.0,
    }


def test_ewma_weights_new_samples_by_alpha():
    ewma = Ewma(0.5)

    assert [ewma.add(x) for x in (2.0, 0.0, 0.0)] == [2.0, 1.0, 0.5]
    assert ewma.samples == 3

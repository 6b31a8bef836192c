import math

import numpy as np
import pytest

from console.planner.distributions import Histogram, TruncatedLogNormal, parse_histogram_csv
from console.planner.errors import PlannerInputError

CASE = TruncatedLogNormal(mu=9.90, sigma=1.00, lower=128, upper=131072)


def fine_histogram(dist, bins=50_000):
    """The log-normal density integrated numerically on a fine grid."""
    edges = np.linspace(dist.lower, dist.upper, bins + 1)
    mid = (edges[:-1] + edges[1:]) / 2
    density = np.exp(-((np.log(mid) - dist.mu) ** 2) / (2 * dist.sigma**2)) / mid
    return Histogram.from_bins(list(zip(edges[:-1], edges[1:], density, strict=True)))


def test_closed_form_matches_numerical_integration():
    numeric = fine_histogram(CASE)
    ts = np.array([200.0, 1000.0, 19_400.0, 60_000.0, 131_000.0])

    np.testing.assert_allclose(CASE.cdf(ts), numeric.cdf(ts), rtol=1e-5, atol=1e-9)
    np.testing.assert_allclose(
        CASE.partial_mean(ts), numeric.partial_mean(ts), rtol=1e-5, atol=1e-3
    )
    assert CASE.mean == pytest.approx(numeric.mean, rel=1e-6)


def test_case_study_mean_is_about_27k_tokens():
    # The paper: "mean about 27K tokens".
    assert CASE.mean == pytest.approx(27_486, abs=1)


def test_truncated_lognormal_ends():
    assert CASE.cdf(128) == 0
    assert CASE.cdf(131072) == 1
    assert CASE.cdf(10) == 0
    assert CASE.partial_mean(1e9) == pytest.approx(CASE.mean)


def test_untruncated_limit_is_the_lognormal_mean():
    wide = TruncatedLogNormal(mu=5.0, sigma=0.5, lower=1e-6, upper=1e9)

    assert wide.mean == pytest.approx(math.exp(5.0 + 0.125), rel=1e-9)
    assert wide.cdf(math.exp(5.0)) == pytest.approx(0.5, abs=1e-12)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"sigma": 0.0}, "sigma"),
        ({"sigma": -1.0}, "sigma"),
        ({"mu": math.nan}, "mu"),
        ({"lower": 0.0}, "lower"),
        ({"upper": 100.0}, "upper"),
        ({"upper": math.inf}, "upper"),
        ({"mu": 200.0}, "mu"),  # all the mass far above the bounds
    ],
)
def test_bad_lognormal_names_the_field(kwargs, field):
    params = {"mu": 9.9, "sigma": 1.0, "lower": 128.0, "upper": 131072.0, **kwargs}

    with pytest.raises(PlannerInputError) as err:
        TruncatedLogNormal(**params)

    assert err.value.field == field


def test_histogram_is_uniform_inside_bins_and_exact_for_point_masses():
    h = Histogram.from_bins([(10, 20, 1), (0, 10, 1), (30, 30, 2)])  # any order

    assert h.cdf([-1, 0, 5, 10, 15, 20, 29, 30]).tolist() == [0, 0, 0.125, 0.25, 0.375, 0.5, 0.5, 1]
    assert h.partial_mean(5) == pytest.approx(0.25 * 0.5 * 2.5)
    assert h.partial_mean(20) == pytest.approx(0.25 * 5 + 0.25 * 15)
    assert h.mean == pytest.approx(20.0)
    assert (h.lower, h.upper) == (0, 30)


@pytest.mark.parametrize(
    ("bins", "field"),
    [
        ([], "bins"),
        ([(0, 10, 0)], "bins"),
        ([(0, 10, -1)], "bins[0]"),
        ([(10, 5, 1)], "bins[0]"),
        ([(-5, 5, 1)], "bins[0]"),
        ([(0, 10, 1), (5, 15, 1)], "bins[1]"),
        ([(0, math.nan, 1)], "bins[0]"),
    ],
)
def test_bad_histogram_names_the_bin(bins, field):
    with pytest.raises(PlannerInputError) as err:
        Histogram.from_bins(bins)

    assert err.value.field == field


def test_csv_with_header_bins():
    h = parse_histogram_csv("lo,hi,count\n# comment\n0,100,3\n\n100,200,1\n")

    assert h.cdf(100) == pytest.approx(0.75)


def test_csv_point_masses():
    h = parse_histogram_csv("length,count\n1000,1\n3000,3\n")

    assert h.mean == pytest.approx(2500)
    assert h.cdf(1000) == pytest.approx(0.25)


@pytest.mark.parametrize(
    ("text", "field"),
    [
        ("", "csv"),
        ("lo,hi,count\n", "csv"),
        ("0,10,1\nx,10,1\n", "csv line 2"),
        ("0,10,1,4\n", "csv line 1"),
        ("0,10,1\n5,1\n", "csv line 2"),
        ("0,10,nan\n", "csv[0]"),
    ],
)
def test_bad_csv_names_the_line(text, field):
    with pytest.raises(PlannerInputError) as err:
        parse_histogram_csv(text)

    assert err.value.field == field


def test_second_moment_closed_form_matches_numerical_integration():
    numeric = fine_histogram(CASE)
    ts = np.array([1000.0, 19_400.0, 60_000.0])

    np.testing.assert_allclose(CASE.partial_moment2(ts), numeric.partial_moment2(ts), rtol=1e-5)
    assert CASE.moment2 == pytest.approx(numeric.moment2, rel=1e-6)


def test_histogram_second_moment_by_hand():
    h = Histogram.from_bins([(0, 10, 1), (30, 30, 1)])

    # Uniform on [0, 10]: E[L^2] = 100 / 3; point mass at 30: 900.
    assert h.moment2 == pytest.approx((100 / 3 + 900) / 2)
    assert h.partial_moment2(5) == pytest.approx(0.5 * 0.5 * 25 / 3)

import numpy as np
import pytest

from console.planner.errors import PlannerInputError
from console.planner.kvsize import kv_bytes
from console.planner.profiles import KIB, MIB, DecodeProfile, KvProfile, PrefillProfile

HYBRID = {
    "dtype_bytes": 2,
    "layers": [
        {"kind": "sliding", "count": 40, "window": 4096, "kv_heads": 4, "head_dim": 128},
        {"kind": "full", "count": 8, "kv_heads": 4, "head_dim": 128},
        {
            "kind": "linear",
            "count": 12,
            "num_heads": 16,
            "key_head_dim": 128,
            "value_head_dim": 128,
        },
    ],
}


def test_quadratic_fit_recovers_the_h200_curve():
    truth = PrefillProfile(a=0.389, b=4.21e-5, c=9.94e-11)
    lengths = [1024, 8192, 32768, 65536, 131072]

    fitted = PrefillProfile.fit([[x, float(truth(x))] for x in lengths])

    assert fitted.a == pytest.approx(0.389, rel=1e-6)
    assert fitted.b == pytest.approx(4.21e-5, rel=1e-6)
    assert fitted.c == pytest.approx(9.94e-11, rel=1e-6)
    assert fitted.fitted_from == 5
    assert fitted.fit_rms_s < 1e-9


def test_fit_of_the_papers_measured_points_is_close():
    # The 1T hybrid on 8xH200 (paper): 1K 0.44 s, 8K 0.72 s, 32K 1.84 s, 128K 7.40 s.
    fitted = PrefillProfile.fit([[1024, 0.44], [8192, 0.72], [32768, 1.84], [131072, 7.40]])

    assert float(fitted(131072)) == pytest.approx(7.40, rel=0.02)
    assert fitted.fit_rms_s < 0.05


@pytest.mark.parametrize(
    ("points", "field"),
    [
        ([[1, 1], [2, 2]], "points"),
        ([[1, 1], [1, 2], [3, 3]], "points"),
        ([[1, 1], [2, -2], [3, 3]], "points[1]"),
        ([[1, 1], [2, "x"], [3, 3]], "points[1]"),
        ([[1, 1], [2], [3, 3]], "points[1]"),
        ("1,2,3", "points"),
    ],
)
def test_bad_points_name_the_point(points, field):
    with pytest.raises(PlannerInputError) as err:
        PrefillProfile.fit(points)

    assert err.value.field == field


def test_prefill_that_dips_below_zero_is_rejected():
    profile = PrefillProfile(a=0.1, b=-1e-4, c=0.0)

    with pytest.raises(PlannerInputError, match="prefill time must be > 0") as err:
        profile.check_positive(128, 131072, "local.prefill")

    assert err.value.field == "local.prefill"


def test_kv_linear_is_the_papers_formula():
    kv = KvProfile.linear(172 * MIB, 16.7 * KIB)

    assert float(kv(32768)) == pytest.approx(172 * MIB + 16.7 * KIB * 32768)


def test_kv_from_architecture_matches_kvsize_at_every_length():
    kv = KvProfile.from_architecture(HYBRID, upper=131072)
    lengths = [0, 1, 100, 4095, 4096, 4097, 20000, 131072]

    assert kv(lengths).tolist() == [float(kv_bytes(HYBRID, n)) for n in lengths]


def test_kv_points_interpolate_and_extend_along_the_end_segments():
    kv = KvProfile.from_points([[1000, 2000], [2000, 3000]])

    assert kv([500, 1500, 3000]).tolist() == [1500, 2500, 4000]


def test_kv_bad_architecture_names_the_nested_field():
    with pytest.raises(PlannerInputError) as err:
        KvProfile.from_architecture({"layers": [{"kind": "full", "count": 2}]}, upper=10)

    assert err.value.field == "kv.architecture.layers[0].kv_heads"


def test_kv_extrapolated_to_zero_is_rejected():
    kv = KvProfile.from_points([[1000, 100], [2000, 1100]])  # reaches 0 at 900 tokens

    with pytest.raises(PlannerInputError, match="KV size must be > 0"):
        kv.check_positive(128, 4000, "kv")


def test_decode_rate():
    assert DecodeProfile(20, 0.025, 1024).requests_per_s == pytest.approx(20 / 25.6)
    with pytest.raises(PlannerInputError):
        DecodeProfile(0, 0.025, 1024)
    assert np.isfinite(DecodeProfile(1, 1e-9, 1).requests_per_s)

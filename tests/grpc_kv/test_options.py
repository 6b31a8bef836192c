"""The sender's rate ceiling derived from its knobs."""

import pytest

from grpc_kv.api import LinkOptions


@pytest.mark.parametrize(
    ("knobs", "ceiling"),
    [
        ({}, 0.0),  # link rate unknown: no pacing
        ({"link_rate_bps": 1e9}, 0.7e9),  # the guide's 70 % of the measured link
        ({"link_rate_bps": 1e9, "utilisation_ceiling": 1.0}, 0.0),  # whole link: no pacing
        ({"link_rate_bps": 1e9, "utilisation_ceiling": 1.0, "rate_limit_bps": 5e8}, 5e8),
        ({"rate_limit_bps": 2e8}, 2e8),
    ],
)
def test_rate_ceiling(knobs, ceiling):
    assert LinkOptions(**knobs).rate_ceiling_bps == pytest.approx(ceiling)

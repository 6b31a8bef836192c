import copy
import math

import pytest

from console.planner.errors import PlannerInputError
from console.planner.inputs import parse_scenario
from console.planner.presets import preset_scenario

BASE = preset_scenario("prfaas-case-study")


def with_change(path, value):
    """The case study with one value replaced (``None`` deletes it); path like ``a.b.0``."""
    body = copy.deepcopy(BASE)
    *parents, last = path.split(".")
    node = body
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node[key]
    if isinstance(node, list):
        node[int(last)] = value
    elif value is None:
        del node[last]
    else:
        node[last] = value
    return body


# (path to change, new value, field the error must name)
BAD = [
    ("remote.instances", -1, "remote.instances"),
    ("remote.instances", 2.5, "remote.instances"),
    ("remote.instances", True, "remote.instances"),
    ("remote.instances", 10**9, "remote.instances"),
    ("local.instances", 0, "local.instances"),
    ("local.instances", None, "local.instances"),
    ("remote.prefill", {}, "remote.prefill"),
    ("remote.prefill", {"coefficients": [1, 2]}, "remote.prefill.coefficients"),
    ("remote.prefill.coefficients.1", "fast", "remote.prefill.coefficients[1]"),
    ("remote.prefill.coefficients.0", -5.0, "remote.prefill"),
    ("local.prefill", {"points": [[1, 1], [2, 2]]}, "local.prefill.points"),
    ("local.prefill", {"points": [[1, 1], [2, 2]], "coefficients": [1, 1, 1]}, "local.prefill"),
    ("kv", {}, "kv"),
    ("kv.fixed_bytes", -1, "kv.fixed_bytes"),
    ("kv.per_token_bytes", "16.7KiB", "kv.per_token_bytes"),
    ("kv", {"fixed_bytes": 0, "per_token_bytes": 0}, "kv"),
    ("kv", {"points": [[1, 5]]}, "kv.points"),
    ("kv", {"architecture": {"layers": []}}, "kv.architecture.layers"),
    ("kv", {"architecture": {"layers": [{"kind": "x"}]}}, "kv.architecture.layers[0].kind"),
    ("decode.batch_size", 0, "decode.batch_size"),
    ("decode.step_time_ms", -25, "decode.step_time_ms"),
    ("decode.output_tokens", None, "decode.output_tokens"),
    ("decode.speed", 3, "decode.speed"),
    ("link.bandwidth_gbps", 0, "link.bandwidth_gbps"),
    ("link.bandwidth_gbps", math.inf, "link.bandwidth_gbps"),
    ("link.utilisation_ceiling", 1.5, "link.utilisation_ceiling"),
    ("link.utilisation_ceiling", 0, "link.utilisation_ceiling"),
    ("lengths.kind", "normal", "lengths.kind"),
    ("lengths.sigma", 0, "lengths.sigma"),
    ("lengths.sigma", math.nan, "lengths.sigma"),
    ("lengths.lower", -1, "lengths.lower"),
    ("lengths.upper", 64, "lengths.upper"),
    ("lengths.mu", None, "lengths.mu"),
    ("lengths", {"kind": "histogram"}, "lengths"),
    ("lengths", {"kind": "histogram", "csv": 5}, "lengths.csv"),
    ("lengths", {"kind": "histogram", "csv": "a,b\n1,x\n"}, "lengths.csv line 2"),
    ("lengths", {"kind": "histogram", "bins": [[0, 10]]}, "lengths.bins[0]"),
    ("lengths", {"kind": "histogram", "bins": []}, "lengths.bins"),
    ("lengths", {"kind": "histogram", "bins": [[0, 10, 0]]}, "lengths.bins"),
    ("grid", {"thresholds": 0}, "grid.thresholds"),
    ("grid", {"thresholds": 10**7}, "grid.thresholds"),
    ("grid", {"threshold_values": []}, "grid.threshold_values"),
    ("grid", {"threshold_values": [100, -1]}, "grid.threshold_values[1]"),
    ("grid", {"threshold_values": [1], "thresholds": 5}, "grid"),
    ("grid", {"spacing": "cubic"}, "grid.spacing"),
    ("grid", {"zoom": "yes"}, "grid.zoom"),
    ("baseline", {"homogeneous_instances": 0}, "baseline.homogeneous_instances"),
    ("verdict", {"min_gain": -1}, "verdict.min_gain"),
    ("method", {"prefill_time": "median"}, "method.prefill_time"),
    ("method", {"speed": 1}, "method.speed"),
    ("extra", 1, "extra"),
]


@pytest.mark.parametrize(("path", "value", "field"), BAD)
def test_bad_input_names_the_field(path, value, field):
    with pytest.raises(PlannerInputError) as err:
        parse_scenario(with_change(path, value))

    assert err.value.field == field


def test_body_must_be_an_object():
    with pytest.raises(PlannerInputError):
        parse_scenario([1, 2, 3])


def test_defaults_for_the_optional_parts():
    body = copy.deepcopy(BASE)
    for key in ("grid", "baseline", "verdict"):
        body.pop(key, None)
    del body["link"]["utilisation_ceiling"]

    s = parse_scenario(body)

    assert len(s.thresholds) == 1000
    assert s.homogeneous_size == 12  # remote + local
    assert s.utilisation_ceiling == 0.7
    assert s.min_gain == 1.1


def test_measured_points_and_histogram_inputs_are_accepted():
    body = copy.deepcopy(BASE)
    body["local"]["prefill"] = {"points": [[1024, 0.61], [8192, 1.6], [32768, 5.8], [131072, 29]]}
    body["kv"] = {"points": [[1024, 200e6], [8192, 324e6], [32768, 735e6], [131072, 2429e6]]}
    body["lengths"] = {"kind": "histogram", "csv": "lo,hi,count\n128,4096,30\n4096,65536,60\n"}

    s = parse_scenario(body)

    assert s.local_prefill.fitted_from == 4
    assert s.kv.source == "points"
    assert s.lengths.upper == 65536


def test_grid_cells_are_bounded():
    body = with_change("grid", {"thresholds": 100_000})
    body["local"]["instances"] = 100  # 100,000 x 101 cells

    with pytest.raises(PlannerInputError, match="at most 2,000,000") as err:
        parse_scenario(body)

    assert err.value.field == "grid.thresholds"

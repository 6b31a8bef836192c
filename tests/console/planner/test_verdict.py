import copy

import pytest

from console.planner.inputs import parse_scenario
from console.planner.model import evaluate
from console.planner.presets import preset_scenario

DENSE_GQA = {  # a 60-layer dense GQA model: 240 KiB of KV per token
    "dtype_bytes": 2,
    "layers": [{"kind": "full", "count": 60, "kv_heads": 8, "head_dim": 128}],
}
HYBRID_3_1 = {  # linear + full 3:1, with a dense-like full-attention layer every fourth
    "dtype_bytes": 2,
    "state_dtype_bytes": 4,
    "layers": [
        {"kind": "full", "count": 15, "kv_heads": 2, "head_dim": 128},
        {
            "kind": "linear",
            "count": 45,
            "num_heads": 16,
            "key_head_dim": 128,
            "value_head_dim": 128,
        },
    ],
}


def run(**changes):
    body = preset_scenario("prfaas-case-study")
    for key, value in changes.items():
        body[key] = {**body.get(key, {}), **value} if isinstance(value, dict) else value
    return evaluate(parse_scenario(copy.deepcopy(body)), with_sweeps=False)["verdict"]


def test_case_study_offloads():
    verdict = run()

    assert verdict["decision"] == "offload"
    assert verdict["checks"]["link"]["passed"] is True
    assert verdict["checks"]["gain"]["gain"] == pytest.approx(1.54, rel=0.02)
    assert "19" in verdict["reason"]


def test_dense_model_stays_local():
    body = preset_scenario("prfaas-case-study")
    body["kv"] = {"architecture": DENSE_GQA}

    verdict = evaluate(parse_scenario(body), with_sweeps=False)["verdict"]

    assert verdict["decision"] == "stay_local"
    assert verdict["checks"]["dense"]["passed"] is False
    assert verdict["reason"].startswith("Dense model")


def test_hybrid_architecture_passes_the_dense_check():
    body = preset_scenario("prfaas-case-study")
    body["kv"] = {"architecture": HYBRID_3_1}

    verdict = evaluate(parse_scenario(body), with_sweeps=False)["verdict"]

    assert verdict["checks"]["dense"]["passed"] is True
    assert verdict["decision"] == "offload"


def test_thin_link_stays_local_and_says_what_fits():
    verdict = run(link={"bandwidth_gbps": 5})

    link = verdict["checks"]["link"]
    assert verdict["decision"] == "stay_local"
    assert link["passed"] is False
    assert link["demand_gbps"] == pytest.approx(12.2, rel=0.05)
    assert link["usable_gbps"] == pytest.approx(3.5)
    assert link["within_ceiling"]["egress_gbps"] <= 3.5 * (1 + 1e-9)
    assert verdict["reason"].startswith("Thin link")


def test_small_gain_stays_local():
    verdict = run(verdict={"min_gain": 2.0})

    assert verdict["decision"] == "stay_local"
    assert verdict["checks"]["gain"]["passed"] is False
    assert verdict["reason"].startswith("Small gain")


def test_every_failed_check_is_listed():
    verdict = run(link={"bandwidth_gbps": 5}, verdict={"min_gain": 5.0})

    assert [r.split(":")[0] for r in verdict["reasons"]] == ["Thin link", "Small gain"]

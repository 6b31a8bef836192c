import copy
import json
import math

import pytest

from console.planner.presets import preset_scenario
from tests.conftest import role_client

pytestmark = pytest.mark.django_db

EVALUATE = "/api/planner/evaluate/"
KV_SIZE = "/api/planner/kv-size/"
PRESETS = "/api/planner/presets/"

HYBRID = {
    "dtype_bytes": 2,
    "layers": [
        {"kind": "full", "count": 12, "kv_heads": 4, "head_dim": 128},
        {
            "kind": "linear",
            "count": 36,
            "num_heads": 16,
            "key_head_dim": 128,
            "value_head_dim": 128,
        },
    ],
}


def small_case_study():
    body = preset_scenario("prfaas-case-study")
    body["grid"] = {"thresholds": 100}
    return body


def strict_json(response):
    """Parse as strict JSON: NaN or Infinity in a response would break real clients."""

    def reject(constant):
        raise AssertionError(f"non-JSON constant {constant}")

    return json.loads(response.content, parse_constant=reject)


@pytest.mark.parametrize(
    ("role", "expected"),
    [("anonymous", 401), ("none", 403), ("viewer", 200), ("operator", 200), ("admin", 200)],
)
def test_any_role_may_use_the_planner(api_as, make_user, role, expected):
    if role == "none":
        from rest_framework.test import APIClient

        from console.core.services_tokens import api_token_issue

        api = APIClient()
        api.credentials(
            HTTP_AUTHORIZATION=f"Token {api_token_issue(actor=None, user=make_user(None))[1]}"
        )
    else:
        api = role_client(api_as, role)

    responses = [
        api.post(EVALUATE + "?sweeps=false", small_case_study()),
        api.post(KV_SIZE, {"architecture": HYBRID, "lengths": [1024]}),
        api.get(PRESETS),
    ]

    assert [r.status_code for r in responses] == [expected] * 3


def test_evaluate_reproduces_the_case_study(api_as):
    response = api_as("viewer").post(EVALUATE, preset_scenario("prfaas-case-study"))

    assert response.status_code == 200
    body = strict_json(response)
    assert body["optimum"]["n_prefill"] == 3
    assert body["optimum"]["lambda_max_rps"] == pytest.approx(3.24, rel=0.02)
    assert body["optimum"]["stage_capacity_rps"]["decode"] == pytest.approx(3.90625)
    assert body["baselines"]["homogeneous"]["lambda_max_rps"] == pytest.approx(2.11, rel=0.02)
    assert body["verdict"]["decision"] == "offload"
    assert len(body["sweeps"]["threshold"]["lambda_max_rps"]) == 1000
    assert body["sweeps"]["split"]["n_prefill"] == list(range(9))


def test_sweeps_can_be_left_out(api_as):
    response = api_as("viewer").post(EVALUATE + "?sweeps=false", small_case_study())

    assert response.status_code == 200
    assert "sweeps" not in response.json()


def test_unused_stage_capacity_is_null_not_infinity(api_as):
    body = small_case_study()
    body["remote"]["instances"] = 0

    response = api_as("viewer").post(EVALUATE, body)

    data = strict_json(response)
    assert data["optimum"]["offload_share"] == 0
    assert data["optimum"]["stage_capacity_rps"]["remote_compute"] is None


def test_validation_error_names_the_field(api_as):
    body = small_case_study()
    body["lengths"]["sigma"] = -1

    response = api_as("viewer").post(EVALUATE, body)

    assert response.status_code == 400
    assert response.json() == {"lengths.sigma": ["must be > 0"]}


@pytest.mark.parametrize(
    "raw",
    ['{"remote": NaN}', "[1, 2]", '"text"', "{", "null", '{"lengths": Infinity}'],
)
def test_malformed_bodies_are_400(api_as, raw):
    response = api_as("viewer").post(EVALUATE, raw, content_type="application/json")

    assert response.status_code == 400
    assert response.json()


def test_presets_list_the_case_study_with_the_paper_figures(api_as):
    response = api_as("viewer").get(PRESETS)

    assert response.status_code == 200
    presets = {p["name"]: p for p in response.json()["results"]}
    assert set(presets) == {"prfaas-case-study", "prfaas-measured-points"}
    preset = presets["prfaas-case-study"]
    assert preset["paper"]["lambda_max_rps"] == 3.24
    assert api_as("viewer").post(EVALUATE + "?sweeps=false", preset["scenario"]).status_code == 200


def test_kv_size_bytes_bandwidth_and_link_share(api_as):
    response = api_as("viewer").post(
        KV_SIZE,
        {
            "architecture": HYBRID,
            "lengths": [0, 32768],
            "concurrency": 4,
            "window_s": 2.0,
            "link_gbps": 100,
        },
    )

    assert response.status_code == 200
    body = response.json()
    fixed = 36 * 16 * 128 * 128 * 2
    per_token = 12 * 2 * 4 * 128 * 2
    zero, long = body["lengths"]
    assert zero["bytes"] == fixed
    assert long["bytes"] == fixed + per_token * 32768
    assert long["dense_bytes"] == 48 * 2 * 4 * 128 * 2 * 32768
    assert long["reduction_vs_dense"] == pytest.approx(long["dense_bytes"] / long["bytes"])
    assert long["gbps_needed"] == pytest.approx(long["bytes"] * 8 * 4 / 2.0 / 1e9)
    assert long["link_share"] == pytest.approx(long["gbps_needed"] / 100)
    assert long["fits"] is True
    assert body["dense"] is False


def test_kv_size_of_a_dense_model_on_a_thin_link_does_not_fit(api_as):
    dense = {"layers": [{"kind": "full", "count": 60, "kv_heads": 8, "head_dim": 128}]}

    response = api_as("viewer").post(
        KV_SIZE,
        {"architecture": dense, "lengths": [32768], "concurrency": 8, "link_gbps": 10},
    )

    row = response.json()["lengths"][0]
    assert response.json()["dense"] is True
    assert row["fits"] is False
    assert row["link_share"] > 1


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"lengths": [1]}, "architecture"),
        ({"architecture": HYBRID, "lengths": []}, "lengths"),
        ({"architecture": HYBRID, "lengths": [-1]}, "lengths"),
        ({"architecture": HYBRID, "lengths": ["x"]}, "lengths"),
        ({"architecture": HYBRID, "lengths": [1], "window_s": 0}, "window_s"),
        ({"architecture": HYBRID, "lengths": [1], "concurrency": 0}, "concurrency"),
        ({"architecture": HYBRID, "lengths": [1], "link_gbps": -3}, "link_gbps"),
        ({"architecture": HYBRID, "lengths": [1], "utilisation_ceiling": 2}, "utilisation_ceiling"),
        (
            {"architecture": {"layers": [{"kind": "sliding"}]}, "lengths": [1]},
            "architecture.layers[0].window",
        ),
        ({"architecture": "dense", "lengths": [1]}, "architecture.architecture"),
        ({"model": 1, "lengths": [1]}, "model"),
    ],
)
def test_kv_size_validation_names_the_field(api_as, body, field):
    response = api_as("viewer").post(KV_SIZE, body)

    assert response.status_code == 400
    assert field in response.json()


# --- degenerate inputs: never a 500 -------------------------------------------------------------

NASTY = [None, 0, -1, 1e-300, 1e300, -1e300, 10**30, "", "12", True, [], {}, [1, 2, 3], 0.5]
LEAVES = [
    "remote.instances",
    "remote.prefill",
    "remote.prefill.coefficients",
    "remote.prefill.coefficients.0",
    "remote.prefill.coefficients.2",
    "local.instances",
    "local.prefill.coefficients.1",
    "kv",
    "kv.fixed_bytes",
    "kv.per_token_bytes",
    "decode.batch_size",
    "decode.step_time_ms",
    "decode.output_tokens",
    "link.bandwidth_gbps",
    "link.utilisation_ceiling",
    "lengths",
    "lengths.mu",
    "lengths.sigma",
    "lengths.lower",
    "lengths.upper",
    "grid",
    "grid.thresholds",
    "baseline",
    "verdict",
]


def set_path(body, path, value):
    *parents, last = path.split(".")
    node = body
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node[key]
    if isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value


def test_degenerate_inputs_never_500(api_as):
    api = api_as("viewer")
    base = preset_scenario("prfaas-case-study")
    base["grid"] = {"thresholds": 50}
    statuses = {}

    for path in LEAVES:
        for value in NASTY:
            body = copy.deepcopy(base)
            set_path(body, path, value)
            response = api.post(EVALUATE + "?sweeps=false", body)
            statuses[(path, repr(value))] = response.status_code
            if response.status_code == 200:
                strict_json(response)
            else:
                assert response.status_code == 400, (path, value, response.content)
                assert response.json(), (path, value)

    # Sanity: the sweep exercised both outcomes.
    assert 200 in statuses.values()
    assert 400 in statuses.values()


@pytest.mark.parametrize(
    "lengths",
    [
        {"kind": "histogram", "bins": [[1000, 1000, 1]]},  # one point mass
        {"kind": "histogram", "bins": [[0, 0, 5], [0, 10, 1]]},  # mass at zero tokens
        {"kind": "lognormal", "mu": 4.9, "sigma": 0.01, "lower": 128, "upper": 131072},
        {"kind": "lognormal", "mu": 20, "sigma": 3, "lower": 1, "upper": 1e9},
    ],
)
def test_extreme_distributions_answer(api_as, lengths):
    body = small_case_study()
    body["lengths"] = lengths

    response = api_as("viewer").post(EVALUATE, body)

    assert response.status_code == 200, response.content
    data = strict_json(response)
    assert data["optimum"]["lambda_max_rps"] >= 0
    assert not math.isnan(data["optimum"]["offload_share"])


# --- catalog models instead of raw architectures ------------------------------------------------


def test_kv_size_of_a_catalog_model(api_as):
    from tests.console.factories import ModelSpecFactory

    model = ModelSpecFactory(name="hybrid-3-1", architecture=HYBRID)

    by_id = api_as("viewer").post(KV_SIZE, {"model": model.pk, "lengths": [4096]})
    by_arch = api_as("viewer").post(KV_SIZE, {"architecture": HYBRID, "lengths": [4096]})

    assert by_id.status_code == 200
    assert by_id.json()["model"] == {"id": model.pk, "name": "hybrid-3-1"}
    assert by_id.json()["lengths"] == by_arch.json()["lengths"]


def test_kv_size_wants_exactly_one_of_model_and_architecture(api_as):
    from tests.console.factories import ModelSpecFactory

    model = ModelSpecFactory(architecture=HYBRID)

    both = api_as("viewer").post(
        KV_SIZE, {"model": model.pk, "architecture": HYBRID, "lengths": [1]}
    )
    unknown = api_as("viewer").post(KV_SIZE, {"model": model.pk + 1000, "lengths": [1]})

    assert both.status_code == 400
    assert "architecture" in both.json()
    assert unknown.status_code == 400
    assert "model" in unknown.json()
    huge = api_as("viewer").post(KV_SIZE, {"model": 10**30, "lengths": [1]})
    assert huge.status_code == 400
    assert "model" in huge.json()


def test_evaluate_with_a_catalog_model(api_as):
    from tests.console.factories import DENSE_ARCH, ModelSpecFactory

    dense = ModelSpecFactory(name="dense-gqa", architecture=DENSE_ARCH)
    body = small_case_study()
    body["kv"] = {"model": dense.pk}

    response = api_as("viewer").post(EVALUATE + "?sweeps=false", body)

    assert response.status_code == 200
    data = response.json()
    assert data["profiles"]["kv"]["model"] == {"id": dense.pk, "name": "dense-gqa"}
    assert data["profiles"]["kv"]["source"] == "architecture"
    assert data["verdict"]["checks"]["dense"]["passed"] is False
    assert data["verdict"]["decision"] == "stay_local"


@pytest.mark.parametrize(
    ("kv", "field"),
    [
        ({"model": 999_999}, "kv.model"),
        ({"model": 10**30}, "kv.model"),  # beyond bigint: still a 400, not a database error
        ({"model": "dense"}, "kv.model"),
        ({"model": True}, "kv.model"),
        ({"model": 1, "fixed_bytes": 5}, "kv"),
    ],
)
def test_evaluate_bad_model_reference_names_the_field(api_as, kv, field):
    body = small_case_study()
    body["kv"] = kv

    response = api_as("viewer").post(EVALUATE, body)

    assert response.status_code == 400
    assert field in response.json()


def test_planner_endpoints_are_in_the_openapi_schema(api_as):
    response = api_as("viewer").get("/api/schema/", {"format": "json"})

    assert response.status_code == 200
    paths = json.loads(response.content)["paths"]
    assert {EVALUATE, KV_SIZE, PRESETS} <= set(paths)

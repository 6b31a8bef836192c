"""Shipped planner scenarios, in the request-body form ``inputs.parse_scenario`` reads.

``prfaas-case-study`` is the case study of the PrfaaS paper (Qin et al., 2026, section on the
1T hybrid model): 4 remote 8xH200 prefill instances, 8 local 8xH20 PD instances, a
100 Gbit/s link. The local prefill curve is back-solved (the paper does not publish it):
``T_local(l) = 0.47 + 3.08 x (4.21e-5 l + 9.94e-11 l^2)``. Units as the paper means them:
MiB/KiB are binary (2^20, 2^10 bytes), Gbit/s decimal (1e9 bit/s). The paper's expected
figures are listed with each preset so tests and the UI can show "paper vs model".

``prfaas-measured-points`` is the same case study built the way an operator would build it:
the remote prefill curve least-squares fitted to the paper's four measured prefill times of
the 1T hybrid on 8xH200 (1K 0.44 s, 8K 0.72 s, 32K 1.84 s, 128K 7.40 s) and the KV size
interpolated between its four measured sizes (190.8 / 308.9 / 701.3 / 2316.3 MiB).

Callers: ``GET /api/planner/presets/``, tests, ``bench.planner``. Pure data.
"""

from __future__ import annotations

import copy
from typing import Any

from console.planner.profiles import KIB, MIB

_H200_PREFILL = [0.389, 4.21e-5, 9.94e-11]
_H20_SLOWDOWN = 3.08

PRESETS: dict[str, dict[str, Any]] = {
    "prfaas-case-study": {
        "title": "PrfaaS case study: 1T hybrid (KDA:MLA 3:1), 4x 8xH200 remote, 8x 8xH20 local",
        "source": "Qin et al., Prefill-as-a-Service (arXiv 2604.15039), case study",
        "scenario": {
            "remote": {"instances": 4, "prefill": {"coefficients": list(_H200_PREFILL)}},
            "local": {
                "instances": 8,
                "prefill": {
                    "coefficients": [
                        0.47,
                        _H20_SLOWDOWN * _H200_PREFILL[1],
                        _H20_SLOWDOWN * _H200_PREFILL[2],
                    ]
                },
            },
            "kv": {"fixed_bytes": 172 * MIB, "per_token_bytes": 16.7 * KIB},
            "decode": {"batch_size": 20, "step_time_ms": 25, "output_tokens": 1024},
            "link": {"bandwidth_gbps": 100, "utilisation_ceiling": 0.7},
            "lengths": {
                "kind": "lognormal",
                "mu": 9.90,
                "sigma": 1.00,
                "lower": 128,
                "upper": 131072,
            },
            "grid": {"thresholds": 1000, "spacing": "linear"},
            "baseline": {"homogeneous_instances": 12},
        },
        "paper": {
            "threshold_tokens": 19400,
            "n_prefill": 3,
            "n_decode": 5,
            "lambda_max_rps": 3.24,
            "homogeneous_rps": 2.11,
            "homogeneous_split": [9, 3],
            "naive_heterogeneous_rps": 2.45,
            "gain_vs_homogeneous": 1.54,
            "gain_vs_naive_heterogeneous": 1.32,
        },
    },
}


# The paper's measurements of its 1T hybrid (KDA:MLA 3:1) on one 8xH200 instance.
_MEASURED_PREFILL_S = [[1024, 0.44], [8192, 0.72], [32768, 1.84], [131072, 7.40]]
_MEASURED_KV_BYTES = [
    [1024, 190.8 * MIB],
    [8192, 308.9 * MIB],
    [32768, 701.3 * MIB],
    [131072, 2316.3 * MIB],
]


def _measured_points_scenario() -> dict[str, Any]:
    """The case study with the remote prefill curve fitted to the paper's four measured
    prefill times and the KV size interpolated between its four measured sizes."""
    body = copy.deepcopy(PRESETS["prfaas-case-study"]["scenario"])
    body["remote"]["prefill"] = {"points": copy.deepcopy(_MEASURED_PREFILL_S)}
    body["kv"] = {"points": copy.deepcopy(_MEASURED_KV_BYTES)}
    return body


PRESETS["prfaas-measured-points"] = {
    "title": "PrfaaS case study from the paper's measured points (H200 prefill times, KV sizes)",
    "source": "Qin et al., Prefill-as-a-Service: the 1T hybrid's measurements on 8xH200",
    "scenario": _measured_points_scenario(),
    "paper": PRESETS["prfaas-case-study"]["paper"],
}


def preset_list() -> list[dict[str, Any]]:
    """Every preset (deep copies: callers may edit them into their own scenario)."""
    return [{"name": name, **copy.deepcopy(body)} for name, body in PRESETS.items()]


def preset_scenario(name: str) -> dict[str, Any]:
    """The request body of one preset; ``KeyError`` when unknown."""
    return copy.deepcopy(PRESETS[name]["scenario"])

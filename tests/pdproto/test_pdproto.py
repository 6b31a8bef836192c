"""pdproto: the names shared by the gateway, the engines and the vLLM connector."""

from __future__ import annotations

import subprocess
import sys

from agents.gateway.metrics import FALLBACK_CAUSES as GATEWAY_FALLBACK_CAUSES
from agents.gateway.metrics import PATHS as GATEWAY_PATHS
from pdproto import FALLBACK_CAUSES, PATHS, PULL_PREFILL_KV, pulled_kv_params, push_kv_params
from tests.support import subprocess_env


def test_push_kv_params_names_one_transfer_on_both_legs():
    prefill, decode = push_kv_params("t1", "10.0.0.2:7400", 2.5)

    assert prefill == {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "transfer_id": "t1",
        "kv_destination": "10.0.0.2:7400",
    }
    assert decode == {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "transfer_id": "t1",
        "deadline_s": 2.5,
    }


def test_pulled_kv_params_copies_the_answers_params_or_says_none():
    answer = {"kv_transfer_params": {"remote_engine_id": "e1", "remote_block_ids": [1, 2]}}

    pulled = pulled_kv_params(answer)

    assert pulled == {"remote_engine_id": "e1", "remote_block_ids": [1, 2]}
    assert pulled is not answer["kv_transfer_params"]
    assert pulled_kv_params({"kv_transfer_params": {}}) is None
    assert pulled_kv_params({"choices": []}) is None
    assert pulled_kv_params(["not", "a", "dict"]) is None


def test_pull_prefill_params_are_read_only():
    assert PULL_PREFILL_KV["do_remote_decode"] is True
    assert dict(PULL_PREFILL_KV)["remote_host"] is None
    assert not hasattr(PULL_PREFILL_KV, "__setitem__")


def test_the_gateways_metric_labels_are_the_shared_names():
    # The gateway labels its metrics with the shared lists themselves, not copies.
    assert GATEWAY_FALLBACK_CAUSES is FALLBACK_CAUSES
    assert GATEWAY_PATHS is PATHS


def test_importing_pdproto_loads_nothing_of_pdbridge_nor_its_dependencies():
    code = (
        "import sys, pdproto, pdproto.kv, pdproto.causes, pdproto.http\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
        "{'agents', 'console', 'orchestrator', 'grpc_kv', 'pdbridge', 'django', 'aiohttp', "
        "'torch', 'grpc', 'pdbridge_vllm'})\n"
        "print(','.join(bad))\n"
    )

    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True, text=True, env=subprocess_env(), timeout=60, check=True,
    )  # fmt: skip

    assert out.stdout.strip() == ""

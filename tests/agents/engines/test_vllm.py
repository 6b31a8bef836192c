"""The vLLM adapter: generated command lines and environment per role, and the adapter's
process lifecycle against a recording stand-in executable (a test double: vLLM needs a GPU)."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest

from agents.engines.base import (
    PULL_PREFILL_KV,
    AdapterError,
    EngineSpec,
    adapter_names,
    get_adapter,
)
from agents.engines.vllm import VllmAdapter
from agents.engines.vllm import main as vllm_main
from tests.agents.engines.client import free_port


def _spec(**kw) -> EngineSpec:
    base = {
        "role": "prefill",
        "model": "/models/qwen3-next",
        "served_model_name": "qwen3-next",
        "port": 8100,
        "chunked_prefill_tokens": 2048,
        "max_model_len": 32768,
        "tensor_parallel_size": 4,
        "engine_id": "pf-a",
        "kv_connector": "NixlConnector",
    }
    return EngineSpec(**{**base, **kw})


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_prefill_command_line():
    argv = VllmAdapter(_spec()).command()

    assert argv[:3] == ["vllm", "serve", "/models/qwen3-next"]
    assert _flag(argv, "--port") == "8100"
    assert _flag(argv, "--tensor-parallel-size") == "4"
    assert _flag(argv, "--max-model-len") == "32768"
    assert _flag(argv, "--max-num-batched-tokens") == "2048"
    assert "--enable-chunked-prefill" in argv
    assert json.loads(_flag(argv, "--kv-transfer-config")) == {
        "kv_connector": "NixlConnector",
        "kv_role": "kv_producer",
        "engine_id": "pf-a",
    }


def test_pdbridge_connector_is_the_default_and_names_its_module():
    spec = EngineSpec(
        role="decode",
        model="/models/qwen3-next",
        kv_connector_extra_config={"listen": "0.0.0.0:7070"},
        kv_load_failure_policy="recompute",
    )

    config = json.loads(_flag(VllmAdapter(spec).command(), "--kv-transfer-config"))

    assert config == {
        "kv_connector": "PdbridgeConnector",
        "kv_role": "kv_consumer",
        "kv_connector_module_path": "pdbridge_vllm.connector",
        "kv_connector_extra_config": {"listen": "0.0.0.0:7070"},
        "kv_load_failure_policy": "recompute",
    }


def test_pdbridge_connector_on_decode_needs_a_listen_address():
    spec = EngineSpec(role="decode", model="/models/m")

    with pytest.raises(AdapterError, match=r"kv_connector_extra_config\.listen"):
        VllmAdapter(spec).command()


def test_role_both_runs_without_connector():
    argv = VllmAdapter(_spec(role="both")).command()

    assert "--kv-transfer-config" not in argv


def test_environment_per_role():
    env = VllmAdapter(
        _spec(
            devices="0,1,2,3",
            kv_side_channel_host="10.0.0.5",
            kv_side_channel_port=5600,
            host="0.0.0.0",
        )
    ).environment()

    assert env == {
        "CUDA_VISIBLE_DEVICES": "0,1,2,3",
        "PYTORCH_CUDA_ALLOC_CONF": "",
        "VLLM_NIXL_SIDE_CHANNEL_HOST": "10.0.0.5",
        "VLLM_NIXL_SIDE_CHANNEL_PORT": "5600",
    }


def test_nixl_on_a_public_host_needs_a_side_channel_host():
    with pytest.raises(AdapterError, match="kv_side_channel_host"):
        VllmAdapter(_spec(host="0.0.0.0")).environment()


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("role", "router"),
        ("tensor_parallel_size", 0),
        ("chunked_prefill_tokens", 0),
        ("port", 70000),
        ("kv_load_failure_policy", "retry"),
    ],
)
def test_invalid_spec_names_the_field(field, value):
    with pytest.raises(AdapterError, match=field):
        VllmAdapter(_spec(**{field: value}))


def test_registry_is_lazy_and_complete():
    assert adapter_names() == ["reference", "vllm"]
    assert get_adapter("vllm") is VllmAdapter
    assert get_adapter("reference").name == "reference"
    with pytest.raises(AdapterError, match="unknown adapter 'sglang'"):
        get_adapter("sglang")


def test_vllm_command_cli_prints_argv(capsys):
    assert (
        vllm_main(
            [
                "--role",
                "decode",
                "--model",
                "m",
                "--kv-connector-extra-config",
                '{"listen": "127.0.0.1:7070"}',
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)

    assert out["argv"][:3] == ["vllm", "serve", "m"]
    assert json.loads(_flag(out["argv"], "--kv-transfer-config"))["kv_role"] == "kv_consumer"
    assert (
        vllm_main(["--role", "decode", "--model", "m", "--kv-connector-extra-config", "[1]"]) == 2
    )


def test_adapter_lifecycle_against_recording_stand_in(tmp_path: Path, monkeypatch):
    record = tmp_path / "record.json"
    monkeypatch.setenv("FAKE_VLLM_RECORD", str(record))
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    stand_in = [sys.executable, str(Path(__file__).with_name("fake_vllm.py"))]
    adapter = VllmAdapter(_spec(role="decode", port=free_port(), executable=stand_in, devices="1"))

    adapter.start()
    try:
        ready = asyncio.run(adapter.wait_ready(timeout_s=30))
        healthy = asyncio.run(adapter.health())
        metrics = asyncio.run(adapter.metrics())
    finally:
        code = adapter.stop(grace_s=10)

    assert ready
    assert healthy
    assert metrics['vllm:num_requests_waiting{engine="0",model_name="qwen3-next"}'] == 5.0
    recorded = json.loads(record.read_text())
    assert recorded["argv"] == adapter.command()[2:]
    assert recorded["env"]["CUDA_VISIBLE_DEVICES"] == "1"
    assert recorded["env"]["PYTORCH_CUDA_ALLOC_CONF"] is None  # removed: connectors refuse it
    assert code == 0
    assert not asyncio.run(adapter.health())


def test_missing_executable_is_a_clear_error():
    adapter = VllmAdapter(_spec(executable=["/nonexistent/vllm"]))

    with pytest.raises(AdapterError, match="executable"):
        adapter.start()


@pytest.fixture
def stand_ins(tmp_path: Path):
    """Start a prefill and a decode stand-in (``env``: extra variables of the decode one);
    yields a starter returning both adapters and the decode one's record file."""
    started: list[VllmAdapter] = []

    def start(**decode_env: str) -> tuple[VllmAdapter, VllmAdapter, Path]:
        stand_in = [sys.executable, str(Path(__file__).with_name("fake_vllm.py"))]
        pair = []
        for role, env in (("prefill", {}), ("decode", decode_env)):
            record = tmp_path / f"{role}.json"
            spec = _spec(
                role=role,
                port=free_port(),
                executable=stand_in,
                env={"FAKE_VLLM_RECORD": str(record), **env},
            )
            adapter = VllmAdapter(spec)
            adapter.start()
            started.append(adapter)
            assert asyncio.run(adapter.wait_ready(timeout_s=30))
            pair.append(adapter)
        return pair[0], pair[1], tmp_path / "decode.json"

    yield start
    for adapter in started:
        adapter.stop(grace_s=10)


def _verify(prefill: VllmAdapter, decode: VllmAdapter, *extra: str) -> tuple[int, dict]:
    from agents.engines.verify import main as verify_main

    out = decode.spec.env["FAKE_VLLM_RECORD"] + ".report"
    code = verify_main(
        [
            "--prefill",
            prefill.spec.base_url,
            "--decode",
            decode.spec.base_url,
            "--model",
            "qwen3-next",
            "--kv-destination",
            "unused:1",
            "--lengths",
            "40,90",
            "--max-tokens",
            "5",
            "--output",
            out,
            *extra,
        ]
    )
    return code, json.loads(Path(out).read_text())


def test_verify_against_vllm_compares_top_k_logprobs(stand_ins):
    """vLLM has no logits digests: ``--logprobs K`` must request top-k logprobs and compare
    them step by step, and ask for the token ids vLLM only returns on request."""
    prefill, decode, record = stand_ins()

    code, report = _verify(prefill, decode, "--logprobs", "3")

    assert code == 0
    assert [(p["tokens_compared"], p["logits_compared"]) for p in report["prompts"]] == [(5, 5)] * 2
    requests = json.loads(record.read_text())["requests"]
    assert len(requests) == 4  # decode leg + local run per prompt
    assert all(r["logprobs"] == 3 and r["return_token_ids"] is True for r in requests)


def test_verify_against_vllm_catches_logprob_drift_with_the_same_tokens(stand_ins):
    """The decode leg's tokens equal the local run's but its logprobs drifted (damaged KV):
    only the logprob comparison can see it."""
    prefill, decode, _ = stand_ins(FAKE_VLLM_REMOTE_LOGPROB_SHIFT="0.01")

    code, report = _verify(prefill, decode, "--logprobs", "2")
    tokens_only_code, tokens_only = _verify(prefill, decode)

    assert code == 1
    assert report["ok"] is False
    divergence = report["prompts"][0]["first_divergence"]
    assert (divergence["kind"], divergence["step"]) == ("logprobs", 1)
    assert divergence["position"] == report["prompts"][0]["prompt_tokens"] + 1
    # Without --logprobs there is nothing but tokens to compare, and they agree.
    assert tokens_only_code == 0
    assert all(p["logits_compared"] == 0 for p in tokens_only["prompts"])


def test_verify_refuses_to_pass_an_engine_without_token_ids(stand_ins):
    """A vLLM older than 0.10.2 ignores ``return_token_ids``: zero tokens compared is an error
    (exit 2), never a match."""
    prefill, decode, _ = stand_ins(FAKE_VLLM_OLD="1")

    code, report = _verify(prefill, decode)

    assert code == 2
    assert report["ok"] is False
    assert all("no token ids" in p["error"] for p in report["prompts"])
    assert all(p["match"] is False for p in report["prompts"])


def test_verify_in_pull_mode_hands_the_prefill_answers_kv_params_to_the_decode_leg(stand_ins):
    """vLLM's built-in connectors (``--kv-mode pull``, a deployment's ``kv_transfer.mode``):
    the prefill leg goes first with one token and NixlConnector's empty remote fields, and the
    decode leg carries what the prefill answered."""
    prefill, decode, record = stand_ins()

    code, report = _verify(prefill, decode, "--kv-mode", "pull", "--logprobs", "2")

    assert code == 0, report
    assert report["kv_mode"] == "pull"
    assert all(p["match"] and p["tokens_compared"] == 5 for p in report["prompts"])
    prefill_legs = json.loads(Path(prefill.spec.env["FAKE_VLLM_RECORD"]).read_text())["requests"]
    assert [(r["max_tokens"], r["kv_transfer_params"]) for r in prefill_legs] == [
        (1, dict(PULL_PREFILL_KV))
    ] * 2
    decode_legs = [
        r for r in json.loads(record.read_text())["requests"] if "kv_transfer_params" in r
    ]
    assert [r["kv_transfer_params"]["remote_engine_id"] for r in decode_legs] == [
        "qwen3-next-engine"
    ] * 2

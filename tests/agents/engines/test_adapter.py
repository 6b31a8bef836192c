"""The reference engine through the adapter contract: start (as a process and in process),
ready, metrics, graceful stop."""

from __future__ import annotations

import asyncio
import sys

import aiohttp
import pytest

from agents.engines.base import AdapterError, EngineSpec, get_adapter
from agents.engines.verify import compare, make_prompt
from tests.agents.engines.client import free_port, post
from tests.support import repo_root


def test_reference_adapter_lifecycle(models_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(repo_root()))
    spec = EngineSpec(
        role="decode",
        model="gemma3",
        port=free_port(),
        chunked_prefill_tokens=64,
        kv_connector_extra_config={
            "kv_spool": str(tmp_path),
            "models_dir": str(models_dir),
            "dtype": "bfloat16",
        },
    )
    adapter = get_adapter("reference")(spec)

    assert adapter.command()[:3] == [sys.executable, "-m", "pdbridge.cli"]
    adapter.start()
    try:
        ready = asyncio.run(adapter.wait_ready(timeout_s=120))
        metrics = asyncio.run(adapter.metrics())
    finally:
        code = adapter.stop(grace_s=15)

    assert ready
    assert metrics['vllm:num_requests_running{model_name="gemma3"}'] == 0.0
    assert code == 0  # SIGTERM -> graceful shutdown


def test_reference_adapter_in_process_start_serves_the_same_bits(engine_pair, models_dir):
    """In-process start (no engine process: tests, the embedded demo) builds the engine the
    way ``pdbridge engine serve`` does: the same greedy tokens and logits digests as the
    process engine with the same chunk and thread count; stop ends it."""
    process_engine, _ = engine_pair
    spec = EngineSpec(
        role="both",
        model="gemma3",
        port=0,
        chunked_prefill_tokens=64,
        kv_connector_extra_config={"models_dir": str(models_dir)},
    )
    adapter = get_adapter("reference")(spec)
    body = {
        "model": "gemma3",
        "prompt": make_prompt(100, seed=1),
        "max_tokens": 6,
        "temperature": 0,
        "ignore_eos": True,
    }

    async def scenario() -> tuple[dict, bool, dict, dict, bool]:
        ready = await adapter.start_in_process()
        try:
            is_ready = await adapter.wait_ready(timeout_s=30)
            timeout = aiohttp.ClientTimeout(total=60)
            async with (
                aiohttp.ClientSession(timeout=timeout) as session,
                session.post(f"{spec.base_url}/v1/completions", json=body) as resp,
            ):
                answer = await resp.json()
            metrics = await adapter.metrics()
        finally:
            await adapter.stop_in_process()
        return ready, is_ready, answer, metrics, await adapter.health()

    ready, is_ready, answer, metrics, healthy_after_stop = asyncio.run(scenario())
    _, _, from_process = post(f"{process_engine.url}/v1/completions", body)

    assert ready["port"] == spec.port != 0
    assert ready["models"]["gemma3"] == process_engine.ready["models"]["gemma3"]
    assert is_ready
    assert compare(from_process, answer) == (True, 6, 6, None)
    assert metrics['vllm:generation_tokens_total{model_name="gemma3"}'] == 6.0
    assert not healthy_after_stop


def test_vllm_adapter_has_no_in_process_start():
    adapter = get_adapter("vllm")(EngineSpec(role="decode", model="/models/x"))

    with pytest.raises(AdapterError, match="runs only as its own process"):
        asyncio.run(adapter.start_in_process())

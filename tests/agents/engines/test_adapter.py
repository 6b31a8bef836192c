"""The reference engine through the adapter contract: start, ready, metrics, graceful stop."""

from __future__ import annotations

import asyncio
import sys

from agents.engines.base import EngineSpec, get_adapter
from tests.agents.engines.client import free_port
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

"""The engines' API key on the node: read from the agent's environment or a secret file
(``agents.engines.apikey``), handed to vLLM through ``VLLM_API_KEY`` (never on the command
line, which every user of the host can read), and never accepted over the wire."""

from __future__ import annotations

from pathlib import Path

import pytest

from agents.config import AgentConfig
from agents.engines.apikey import engine_api_key
from agents.engines.base import EngineSpec
from agents.engines.vllm import VllmAdapter
from agents.launch import ChildSpec, EngineRegistryAdapter, LaunchError

KEY = "engine-key-for-tests-0123456789"  # a test key, not a secret


def test_the_vllm_adapter_passes_the_key_in_vllms_variable_not_on_the_command_line():
    adapter = VllmAdapter(
        EngineSpec(
            role="decode",
            model="/models/m",
            api_key=KEY,
            kv_connector_extra_config={"listen": "127.0.0.1:7070"},
        )
    )

    assert adapter.environment()["VLLM_API_KEY"] == KEY
    assert KEY not in " ".join(adapter.command())
    assert KEY not in repr(adapter.spec)
    assert "VLLM_API_KEY" not in VllmAdapter(EngineSpec(role="both", model="m")).environment()


def test_the_agent_starts_engines_with_the_nodes_key(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
):
    secret = tmp_path / "engine-key"
    secret.write_text(KEY + "\n")
    monkeypatch.setenv("PDBRIDGE_ENGINE_API_KEY_FILE", str(secret))
    listen = {"listen": "127.0.0.1:7070"}
    spec = ChildSpec(
        "dec", "decode-engine", "vllm", {"model": "/models/m", "kv_connector_extra_config": listen}
    )

    plan = EngineRegistryAdapter("vllm", AgentConfig()).plan(spec, 8100, "")

    assert plan.env["VLLM_API_KEY"] == KEY
    assert KEY not in " ".join(plan.argv)


def test_the_key_is_never_taken_over_the_wire():
    spec = ChildSpec("dec", "decode-engine", "vllm", {"model": "/models/m", "api_key": KEY})

    with pytest.raises(LaunchError) as error:
        EngineRegistryAdapter("vllm", AgentConfig()).plan(spec, 8100, "")

    assert "settings.api_key" in str(error.value)
    assert "never over the wire" in str(error.value)


def test_bad_key_sources_are_named(tmp_path: Path):
    assert engine_api_key({}) is None
    with pytest.raises(ValueError, match=r"PDBRIDGE_ENGINE_API_KEY_FILE: .*No such file"):
        engine_api_key({"PDBRIDGE_ENGINE_API_KEY_FILE": str(tmp_path / "absent")})
    with pytest.raises(ValueError, match="PDBRIDGE_ENGINE_API_KEY: must be one non-empty"):
        engine_api_key({"PDBRIDGE_ENGINE_API_KEY": "  "})

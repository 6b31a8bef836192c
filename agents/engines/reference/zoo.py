"""The reference engine's model zoo: tiny hybrid-attention architectures from transformers,
deterministic weights written as safetensors and identified by their sha256.

Who calls it: the reference engine at start-up (``load_model``), ``pdbridge engine build``,
tests and benchmarks. Everything here is blocking CPU work (a tiny model builds in well under
a second, apart from the ~3 s transformers import). Failures surface as ``ModelError`` with
the offending field or file named.

Weights are initialised so that the linear-attention state matters (``initializer_range``
0.1, decay ``A_log`` drawn from log(0.001..0.05)): with library defaults a zeroed state left
greedy tokens unchanged, which would make token-only verification blind to a broken transfer.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from agents.engines.reference.checkpoints import (
    DEFAULT_SEED,
    META_FILE,
    REAL_SMOLLM2,
    WEIGHTS_FILE,
    ModelError,
    default_models_dir,
    smollm2_dir,
    zoo_dir,
)
from agents.engines.reference.checkpoints import weights_file as _weights_file
from agents.engines.reference.tokenizer import ByteTokenizer, Tokenizer

__all__ = [
    "ARCHITECTURES",
    "DEFAULT_SEED",
    "META_FILE",
    "REAL_SMOLLM2",
    "WEIGHTS_FILE",
    "ByteTokenizer",
    "LoadedModel",
    "ModelError",
    "default_models_dir",
    "smollm2_dir",
]

log = logging.getLogger("pdbridge.engines.zoo")

#: Vocabulary of the generated models: 256 bytes, three specials, rounded up.
VOCAB_SIZE = 320
#: Sliding window of the Gemma-3 tiny model's local layers (tokens).
SLIDING_WINDOW = 32
#: Longest prompt + output the tiny models accept (their rotary tables are sized for it).
MAX_MODEL_LEN = 8192
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _common(layers: int) -> dict[str, Any]:
    return {
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": layers,
        "initializer_range": 0.1,
        "max_position_embeddings": MAX_MODEL_LEN,
        "bos_token_id": ByteTokenizer.BOS,
        "eos_token_id": ByteTokenizer.EOS,
        "pad_token_id": ByteTokenizer.PAD,
        "tie_word_embeddings": False,
    }


def _config(arch: str) -> Any:
    """The tiny transformers config of a zoo architecture (all the same width: hidden 64)."""
    import transformers

    if arch == "qwen3-next":
        # Gated DeltaNet linear attention x3 + full attention (the 3:1 of Qwen3-Next).
        return transformers.Qwen3NextConfig(
            **_common(4),
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            linear_conv_kernel_dim=4,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
            layer_types=["linear_attention"] * 3 + ["full_attention"],
        )
    if arch == "gemma3":
        return transformers.Gemma3TextConfig(
            **_common(4),
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            sliding_window=SLIDING_WINDOW,
            layer_types=["sliding_attention"] * 3 + ["full_attention"],
        )
    if arch == "kimi-linear":
        # KDA linear attention + MLA; needs explicit layer_types with an attention layer.
        return transformers.KimiLinearConfig(
            **_common(4),
            moe_intermediate_size=32,
            num_attention_heads=4,
            num_key_value_heads=4,
            kv_lora_rank=16,
            q_lora_rank=None,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=16,
            num_local_experts=4,
            num_experts_per_tok=2,
            n_shared_experts=1,
            linear_head_dim=16,
            linear_num_heads=4,
            layer_types=["linear_attention"] * 3 + ["full_attention"],
        )
    if arch == "dense":
        # The baseline: every layer full attention, same width and KV heads.
        return transformers.LlamaConfig(
            **_common(4), num_attention_heads=4, num_key_value_heads=2, head_dim=16
        )
    raise ModelError(f"model: unknown architecture {arch!r}; known: {', '.join(ARCHITECTURES)}")


ARCHITECTURES: tuple[str, ...] = ("qwen3-next", "gemma3", "kimi-linear", "dense")


def quiet_transformers() -> None:
    """No progress bars or advisory warnings from transformers in engine logs."""
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def file_sha256(path: Path) -> str:
    """sha256 of a file's bytes (blocking; reads in 1 MiB blocks)."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def architecture_hash(config: Any, dtype: str) -> str:
    """Hash of what decides the cache layout and numerics besides the weights: the model config
    (minus bookkeeping keys) and the serving dtype. Two engines whose hashes differ cannot
    exchange caches."""
    items = {
        k: v
        for k, v in config.to_dict().items()
        if k
        not in {"transformers_version", "_name_or_path", "dtype", "torch_dtype", "architectures"}
    }
    canonical = json.dumps({"config": items, "dtype": dtype}, sort_keys=True, default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()


def _sensitive_init(model: torch.nn.Module, seed: int) -> None:
    """Draw every linear-attention decay from log(0.001..0.05) so the recurrent state carries
    information across many tokens (see the module docstring for why)."""
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("A_log"):
                low, high = 0.001, 0.05
                draw = torch.rand(param.shape, generator=gen, dtype=torch.float32)
                param.copy_(torch.log(low + (high - low) * draw).to(param.dtype))


def build_weights(arch: str, directory: Path, seed: int = DEFAULT_SEED) -> str:
    """Generate the deterministic fp32 weights of ``arch`` from ``seed`` into ``directory``
    (config.json, model.safetensors, pdbridge-model.json) and return the weights sha256.

    Blocking. Same seed + same torch/transformers build -> the same bytes, hence the same hash.
    """
    import transformers

    config = _config(arch)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    _sensitive_init(model, seed)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    sha = file_sha256(directory / WEIGHTS_FILE)
    meta = {"architecture": arch, "seed": seed, "weights_sha256": sha, "tokenizer": "byte"}
    (directory / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    log.info("model_built", extra={"arch": arch, "seed": seed, "sha256": sha})
    return sha


@dataclass
class LoadedModel:
    """A model ready to serve: the torch module in eval mode, its tokenizer and identity.

    ``fingerprint`` (weights sha256 + architecture hash) travels in every KV transfer header;
    a receiver refuses a transfer whose fingerprint differs from its own model's.
    """

    name: str
    architecture: str
    model: Any
    tokenizer: Tokenizer
    dtype: str
    weights_sha256: str
    architecture_hash: str
    max_model_len: int
    path: Path

    @property
    def fingerprint(self) -> str:
        return f"{self.weights_sha256}:{self.architecture_hash}"

    @property
    def config(self) -> Any:
        return self.model.config


def resolve_model(spec: str, models_dir: Path | None = None, seed: int = DEFAULT_SEED) -> Path:
    """Map ``--model`` to a checkpoint directory: an existing directory is used as is; a zoo
    architecture name is generated (once) under ``models_dir``. Blocking."""
    path = Path(spec)
    if path.is_dir():
        return path
    if spec == REAL_SMOLLM2:
        return smollm2_dir()
    if spec not in ARCHITECTURES:
        raise ModelError(
            f"model: {spec!r} is neither a checkpoint directory nor a zoo architecture "
            f"({', '.join(ARCHITECTURES)})"
        )
    directory = zoo_dir(spec, models_dir, seed)
    if not (directory / META_FILE).exists():
        build_weights(spec, directory, seed)
    return directory


def load_model(
    path: Path,
    *,
    name: str,
    dtype: str = "float32",
    expect_sha256: str | None = None,
) -> LoadedModel:
    """Load a checkpoint directory for serving. Refuses (``ModelError``) when the weights sha256
    differs from ``expect_sha256``: the cross-site hash alignment check. Blocking.

    Both engines of a pair must load the same way (this function, same dtype): a bf16 model
    cast after loading would also cast the rotary buffers and so differ numerically.
    """
    import transformers

    if dtype not in DTYPES:
        raise ModelError(f"dtype: {dtype!r} is not one of {', '.join(DTYPES)}")
    weights, gguf_file = _weights_file(path)
    sha = file_sha256(weights)
    if expect_sha256 is not None and sha != expect_sha256:
        raise ModelError(
            f"expect_sha256: weights of {path} hash to {sha}, expected {expect_sha256}; refusing to serve"
        )
    meta_path = path / META_FILE
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
    extra = {"gguf_file": gguf_file} if gguf_file else {}
    # transformers reports an unusable checkpoint (unknown model type, broken config, missing
    # tokenizer files) with OSError/ValueError/KeyError from deep inside; the engine must say
    # which directory and why, and exit cleanly instead of with a traceback.
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=DTYPES[dtype], **extra
        ).eval()
    except (OSError, ValueError, KeyError) as exc:
        raise ModelError(f"model: {path} cannot be loaded as a causal LM: {exc}") from exc
    tokenizer: Tokenizer
    if meta.get("tokenizer") == "byte":
        tokenizer = ByteTokenizer()
    else:
        from agents.engines.reference.tokenizer import HFTokenizer

        try:
            tokenizer = HFTokenizer(path, gguf_file)
        except (OSError, ValueError, KeyError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ModelError(
                f"model: {path} has no tokenizer transformers can load offline ({first}); a "
                "checkpoint directory needs its own tokenizer files (tokenizer.json, ...)"
            ) from exc
    text_config = model.config.get_text_config(decoder=True)
    max_len = int(getattr(text_config, "max_position_embeddings", MAX_MODEL_LEN))
    return LoadedModel(
        name=name,
        architecture=str(meta.get("architecture", text_config.model_type)),
        model=model,
        tokenizer=tokenizer,
        dtype=dtype,
        weights_sha256=sha,
        architecture_hash=architecture_hash(model.config, dtype),
        max_model_len=min(max_len, MAX_MODEL_LEN) if meta else max_len,
        path=path,
    )

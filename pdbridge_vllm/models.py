"""Tiny Hugging Face checkpoints for real vLLM on CPUs, built offline (no model hub here): the
vLLM tests, ``make bench-vllm`` and ``make run RUN_ARGS="--engine vllm"`` serve them.

``python -m pdbridge_vllm.models DIR [--arch qwen3|gemma3|qwen3-next]`` writes ``DIR/<arch>``
(config, safetensors weights from a fixed seed, a byte-level BPE tokenizer trained on a fixed
text) unless it already holds a complete build. Runs in vLLM's environment (transformers,
tokenizers). Shapes are the ones vLLM 0.32's CPU kernels accept (``../shared/notes/vllm-cpu.md``):
Qwen3-Next only in bf16 and with linear-attention head dims of 128.

Weights are drawn with a wide initialiser so that every layer's KV and the linear state move
greedy tokens and top-k logprobs: with library defaults a zeroed layer can leave them unchanged,
and a verification would be blind to a broken transfer.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

ARCHES = ("qwen3", "gemma3", "qwen3-next")
VOCAB = 4096
SEED = 1234
_DONE = "pdbridge-model.json"


def _config(arch: str) -> Any:
    import transformers as tf

    common: dict[str, Any] = {
        "vocab_size": VOCAB,
        "max_position_embeddings": 16384,
        "initializer_range": 0.1,
        "tie_word_embeddings": False,
    }
    if arch == "qwen3":
        return tf.Qwen3Config(
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=64,
            dtype="float32",
            **common,
        )
    if arch == "gemma3":
        return tf.Gemma3TextConfig(
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=6,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=64,
            sliding_window=64,
            layer_types=["sliding_attention"] * 5 + ["full_attention"],
            dtype="float32",
            **common,
        )
    if arch == "qwen3-next":
        return tf.Qwen3NextConfig(
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=4,
            layer_types=["linear_attention"] * 3 + ["full_attention"],
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=64,
            linear_num_key_heads=2,
            linear_num_value_heads=2,
            linear_key_head_dim=128,
            linear_value_head_dim=128,
            linear_conv_kernel_dim=4,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=64,
            shared_expert_intermediate_size=64,
            dtype="bfloat16",
            **common,
        )
    raise SystemExit(f"--arch: {arch!r} is not one of {', '.join(ARCHES)}")


def _corpus() -> list[str]:
    words = [
        "prefill",
        "decode",
        "remote",
        "local",
        "cache",
        "layer",
        "token",
        "window",
        "state",
        "link",
        "site",
        "bandwidth",
        "latency",
        "transfer",
        "block",
        "chunk",
        "model",
        "weight",
        "gateway",
        "fallback",
        "drill",
        "canary",
        "threshold",
    ]
    lines = []
    for i in range(2000):
        lines.append(" ".join(words[(i * 7 + j * 3) % len(words)] for j in range(12)) + f" {i}.")
    return lines


def _tokenizer(directory: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB - 8,
        special_tokens=["<|endoftext|>", "<|pad|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_corpus(), trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",  # noqa: S106 - a token, not a password
        pad_token="<|pad|>",  # noqa: S106
    )
    fast.save_pretrained(directory)


def build(root: Path, arch: str) -> Path:
    """``root/arch``, built now unless complete; returns the directory."""
    directory = root / arch
    if (directory / _DONE).is_file():
        return directory
    import torch
    import transformers as tf

    torch.manual_seed(SEED)
    config = _config(arch)
    dtype = torch.bfloat16 if arch == "qwen3-next" else torch.float32
    if arch == "gemma3":
        model = tf.Gemma3ForCausalLM(config)
    else:
        model = tf.AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                continue
            if name.endswith("A_log"):
                param.copy_(torch.empty_like(param).uniform_(-6.9, -3.0))
            elif param.dim() >= 2:
                param.normal_(0.0, 0.1)
    model = model.to(dtype)  # type: ignore[arg-type]
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    _tokenizer(directory)
    (directory / _DONE).write_text(json.dumps({"arch": arch, "seed": SEED}))
    return directory


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m pdbridge_vllm.models")
    parser.add_argument("root", type=Path)
    parser.add_argument("--arch", choices=ARCHES, action="append")
    args = parser.parse_args()
    for arch in args.arch or ARCHES:
        print(build(args.root, arch))


if __name__ == "__main__":
    main()

"""The oracle itself: a restored cache continues bit-identically, and each kind of corruption
a broken transfer could cause (zeroed linear or conv states, decode positions shifted by one,
fp32 state rounded to bf16, one layer's KV lost) is reported as a mismatch. In-process: the
cross-process version of the positive case is test_crossprocess.py."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch

from agents.engines.reference import kvstate, zoo
from agents.engines.reference.runner import Runner, set_threads

STEPS = 8


@pytest.fixture(scope="module")
def runners(models_dir) -> dict[str, Runner]:
    set_threads(1)
    zoo.quiet_transformers()
    out = {}
    for arch in ("qwen3-next", "gemma3", "kimi-linear", "dense"):
        path = zoo.resolve_model(arch, models_dir)
        out[arch] = Runner(zoo.load_model(path, name=arch), chunk_tokens=64)
    return out


def _prompt(n: int) -> list[int]:
    g = torch.Generator().manual_seed(n)
    return [256, *(int(x) for x in torch.randint(0, 256, (n - 1,), generator=g))]


def _run(
    runner: Runner,
    ids: list[int],
    mutate: Callable[[kvstate.Manifest, dict[str, bytes]], dict[str, bytes]] | None = None,
    shift: int = 0,
):
    cache, logits = runner.prefill(ids)
    manifest, segments = kvstate.export_cache(cache, len(ids), logits)
    manifest = kvstate.Manifest.from_json(manifest.to_json())
    if mutate is not None:
        segments = mutate(manifest, segments)
    cache2, logits2 = kvstate.import_cache(runner.loaded.model.config, manifest, segments)
    return runner.generate(cache2, logits2, len(ids), STEPS, position_shift=shift)


def _reference(runner: Runner, ids: list[int]):
    cache, logits = runner.prefill(ids)
    return runner.generate(cache, logits, len(ids), STEPS)


def _zero(pattern: str):
    def mutate(manifest, segments):
        return {k: (bytes(len(v)) if pattern in k else v) for k, v in segments.items()}

    return mutate


def _bf16_round(manifest, segments):
    out = dict(segments)
    for spec in manifest.segments:
        if ".rec" in spec.name and spec.dtype == "float32":
            t = kvstate.bytes_tensor(segments[spec.name], spec.dtype, spec.shape)
            out[spec.name] = kvstate.tensor_bytes(t.to(torch.bfloat16).to(torch.float32))
    return out


def _drop_layer(layer: int):
    def mutate(manifest, segments):
        return {
            k: (bytes(len(v)) if k.startswith(f"L{layer}.") else v) for k, v in segments.items()
        }

    return mutate


@pytest.mark.parametrize("arch", ["qwen3-next", "gemma3", "kimi-linear", "dense"])
@pytest.mark.parametrize("length", [20, 100])
def test_restored_cache_continues_bit_identically(runners, arch, length):
    ids = _prompt(length)

    assert _run(runners[arch], ids) == _reference(runners[arch], ids)


@pytest.mark.parametrize(
    ("arch", "mutation", "shift"),
    [
        ("qwen3-next", _zero(".rec"), 0),
        ("qwen3-next", _zero(".conv"), 0),
        ("qwen3-next", None, 1),
        ("qwen3-next", _bf16_round, 0),
        ("qwen3-next", _drop_layer(3), 0),
        ("kimi-linear", _zero(".rec"), 0),
        ("kimi-linear", _zero(".conv"), 0),
        ("kimi-linear", _bf16_round, 0),
        ("gemma3", None, 1),
        ("gemma3", _drop_layer(0), 0),
        ("dense", _drop_layer(2), 0),
    ],
    ids=[
        "q-zero-rec",
        "q-zero-conv",
        "q-shift",
        "q-bf16-state",
        "q-drop-full",
        "k-zero-rec",
        "k-zero-conv",
        "k-bf16-state",
        "g-shift",
        "g-drop-sliding",
        "d-drop",
    ],
)
def test_corruption_is_reported_as_mismatch(runners, arch, mutation, shift):
    ids = _prompt(100)
    reference = _reference(runners[arch], ids)

    corrupted = _run(runners[arch], ids, mutation, shift)

    assert corrupted != reference
    first = next(i for i, (a, b) in enumerate(zip(reference, corrupted, strict=True)) if a != b)
    assert first <= 1  # caught at the first or second step by the logits digest


def test_sensitive_init_makes_tokens_themselves_flip(runners):
    """With the zoo's initialisation a zeroed linear state changes greedy tokens, not only logits."""
    ids = _prompt(100)
    reference = [t for t, _ in _reference(runners["qwen3-next"], ids)]

    corrupted = [t for t, _ in _run(runners["qwen3-next"], ids, _zero(".rec"))]

    assert corrupted != reference


def test_import_refuses_missing_segment(runners):
    runner = runners["qwen3-next"]
    cache, logits = runner.prefill(_prompt(30))
    manifest, segments = kvstate.export_cache(cache, 30, logits)
    del segments["L0.rec0"]

    with pytest.raises(kvstate.KvLayoutError, match=r"L0\.rec0"):
        kvstate.import_cache(runner.loaded.model.config, manifest, segments)


def test_import_refuses_wrong_size_and_other_layout(runners):
    q, g = runners["qwen3-next"], runners["gemma3"]
    cache, logits = q.prefill(_prompt(30))
    manifest, segments = kvstate.export_cache(cache, 30, logits)

    with pytest.raises(kvstate.KvLayoutError, match="layer_kinds"):
        kvstate.import_cache(g.loaded.model.config, manifest, segments)
    segments["L3.k"] = segments["L3.k"][:-2]
    with pytest.raises(kvstate.KvLayoutError, match="segment size"):
        kvstate.import_cache(q.loaded.model.config, manifest, segments)


def test_streamed_full_kv_chunks_concatenate_to_the_whole(runners):
    runner = runners["qwen3-next"]
    ids = _prompt(150)
    pieces: dict[str, list[bytes]] = {}

    def on_chunk(cache, start, end, logits):
        for name, data in kvstate.full_kv_slice(cache, start, end).items():
            pieces.setdefault(name, []).append(data)

    cache, logits = runner.prefill(ids, on_chunk)
    _, whole = kvstate.export_cache(cache, len(ids), logits)

    assert sorted(pieces) == ["L3.k", "L3.v"]
    assert all(len(p) == 3 for p in pieces.values())  # 64 + 64 + 22 tokens
    assert {k: b"".join(v) for k, v in pieces.items()} == {k: whole[k] for k in pieces}


def test_sliding_layers_ship_only_the_window(runners):
    runner = runners["gemma3"]
    cache, logits = runner.prefill(_prompt(100))
    manifest, _ = kvstate.export_cache(cache, 100, logits)

    shapes = {s.name: s.shape for s in manifest.segments}
    assert shapes["L0.k"][0] == zoo.SLIDING_WINDOW - 1
    assert shapes["L3.k"][0] == 100
    assert manifest.cumulative_lengths == {0: 100, 1: 100, 2: 100}


def test_bf16_model_keeps_fp32_recurrent_state(models_dir):
    lm = zoo.load_model(zoo.resolve_model("qwen3-next", models_dir), name="q", dtype="bfloat16")
    cache, logits = Runner(lm, 64).prefill(_prompt(40))
    manifest, segments = kvstate.export_cache(cache, 40, logits)

    dtypes = {s.name: s.dtype for s in manifest.segments}
    assert dtypes["L0.rec0"] == "float32"
    assert dtypes["L3.k"] == "bfloat16"
    raw = kvstate.bytes_tensor(segments["L3.k"], "bfloat16", manifest.segments[-3].shape)
    assert raw.dtype == torch.bfloat16
    assert np.frombuffer(segments["L3.k"], dtype=np.int16).size == raw.numel()

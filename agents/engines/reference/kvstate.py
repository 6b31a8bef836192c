"""Cache <-> named byte segments: how a prefill engine's transformers cache travels.

Layout (one transfer = a manifest + segments; names are stable, bytes are raw little-endian
tensors in their own dtype, never cast in transport):

* ``L{i}.k`` / ``L{i}.v`` of a **full** attention layer: token-major ``(T, B, H, D)`` so
  that each prefill chunk's new tokens are appended at the end (streamable while computing).
* ``L{i}.k`` / ``L{i}.v`` of a **sliding** layer: its last ``W-1`` tokens, token-major, sent
  when prefill is final, with the layer's ``cumulative_length`` in the manifest (positions and
  masks go wrong without it).
* ``L{i}.conv{s}`` / ``L{i}.rec{s}`` of a **linear** layer: the conv and recurrent states
  (recurrent states stay fp32 inside bf16 models), sent when final.
* ``logits``: the last prompt position's logits, so the decoder picks the same first token.

Import restores every layer through the cache layer's own update methods (assigning tensors
directly skips the flag that sends single-token steps down the recurrent path).

Called by the runner (export, from the compute thread) and the decode path (import). Blocking
CPU work, sub-millisecond for the tiny models. Malformed input raises ``KvLayoutError``.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

FULL, SLIDING, LINEAR, LOGITS = "full", "sliding", "linear-state", "logits"

_TORCH_TO_NAME = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
_NAME_TO_TORCH = {v: k for k, v in _TORCH_TO_NAME.items()}


class KvLayoutError(Exception):
    """A serialized cache does not match the manifest or the model's cache layout."""


@dataclass(frozen=True)
class SegmentSpec:
    """One named segment: which layer, what kind, dtype and final shape."""

    name: str
    layer: int
    kind: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * _NAME_TO_TORCH[self.dtype].itemsize


@dataclass
class Manifest:
    """What a transfer holds: prompt length, per-layer kinds, sliding cumulative lengths and
    segment specs. Serialised to JSON in the transfer header."""

    prompt_tokens: int
    layer_kinds: list[str]
    segments: list[SegmentSpec]
    cumulative_lengths: dict[int, int] = field(default_factory=dict)
    #: sha256 of the prompt token ids: the decoder refuses KV computed for another prompt.
    prompt_digest: str = ""

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["cumulative_lengths"] = {str(k): v for k, v in self.cumulative_lengths.items()}
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Manifest:
        try:
            return cls(
                prompt_tokens=int(data["prompt_tokens"]),
                layer_kinds=[str(k) for k in data["layer_kinds"]],
                segments=[
                    SegmentSpec(
                        name=str(s["name"]),
                        layer=int(s["layer"]),
                        kind=str(s["kind"]),
                        dtype=str(s["dtype"]),
                        shape=tuple(int(x) for x in s["shape"]),
                    )
                    for s in data["segments"]
                ],
                cumulative_lengths={int(k): int(v) for k, v in data["cumulative_lengths"].items()},
                prompt_digest=str(data.get("prompt_digest", "")),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise KvLayoutError(f"manifest: malformed ({exc})") from exc


def layer_kind(layer: Any) -> str:
    """Classify a transformers cache layer. Linear layers win over their attention mix-ins."""
    from transformers.cache_utils import (
        DynamicLayer,
        DynamicSlidingWindowLayer,
        LinearAttentionCacheLayerMixin,
    )

    if isinstance(layer, LinearAttentionCacheLayerMixin):
        if isinstance(layer, DynamicLayer):
            raise KvLayoutError(
                f"layer type {type(layer).__name__} (linear + attention) unsupported"
            )
        return LINEAR
    if isinstance(layer, DynamicSlidingWindowLayer):
        return SLIDING
    if isinstance(layer, DynamicLayer):
        return FULL
    raise KvLayoutError(f"layer type {type(layer).__name__} unsupported")


def _token_major(t: torch.Tensor) -> torch.Tensor:
    # (B, H, T, D) -> (T, B, H, D): appending tokens appends bytes.
    return t.permute(2, 0, 1, 3).contiguous()


def tensor_bytes(t: torch.Tensor) -> bytes:
    """Raw bytes of a tensor in its own dtype (bf16 through an int16 view: numpy has no bf16)."""
    t = t.detach().contiguous().cpu()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().tobytes()
    return t.numpy().tobytes()


def bytes_tensor(data: bytes, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """Inverse of ``tensor_bytes``; raises ``KvLayoutError`` when the size is wrong."""
    tdtype = _NAME_TO_TORCH.get(dtype)
    if tdtype is None:
        raise KvLayoutError(f"dtype: {dtype!r} unsupported")
    expected = int(np.prod(shape)) * tdtype.itemsize
    if len(data) != expected:
        raise KvLayoutError(f"segment size {len(data)} != {expected} for {dtype}{list(shape)}")
    if tdtype == torch.bfloat16:
        return (
            torch.from_numpy(np.frombuffer(data, dtype=np.int16).copy())
            .view(torch.bfloat16)
            .reshape(shape)
        )
    npdtype = {torch.float32: np.float32, torch.float16: np.float16}[tdtype]
    return torch.from_numpy(np.frombuffer(data, dtype=npdtype).copy()).reshape(shape)


def full_kv_slice(cache: Any, start: int, end: int) -> dict[str, bytes]:
    """The token range [start, end) of every full-attention layer, token-major: what a prefill
    engine appends to the transfer after each chunk."""
    out: dict[str, bytes] = {}
    for i, layer in enumerate(cache.layers):
        if layer_kind(layer) == FULL:
            out[f"L{i}.k"] = tensor_bytes(_token_major(layer.keys[:, :, start:end, :]))
            out[f"L{i}.v"] = tensor_bytes(_token_major(layer.values[:, :, start:end, :]))
    return out


def prompt_digest(ids: list[int]) -> str:
    """sha256 of prompt token ids (int32 little-endian)."""
    return hashlib.sha256(np.asarray(ids, dtype="<i4").tobytes()).hexdigest()


def build_manifest(cache: Any, prompt_tokens: int, logits: torch.Tensor) -> Manifest:
    """The full manifest, computable once the first prefill chunk ran (shapes of the final
    sliding window and linear states do not depend on later chunks)."""
    kinds: list[str] = []
    specs: list[SegmentSpec] = []
    cumulative: dict[int, int] = {}
    for i, layer in enumerate(cache.layers):
        kind = layer_kind(layer)
        kinds.append(kind)
        if kind in (FULL, SLIDING):
            b, h, _, d = layer.keys.shape
            t = prompt_tokens if kind == FULL else min(prompt_tokens, layer.sliding_window - 1)
            dtype = _TORCH_TO_NAME[layer.keys.dtype]
            specs.append(SegmentSpec(f"L{i}.k", i, kind, dtype, (t, b, h, d)))
            vd = layer.values.shape[-1]
            specs.append(SegmentSpec(f"L{i}.v", i, kind, dtype, (t, b, h, vd)))
            if kind == SLIDING:
                cumulative[i] = prompt_tokens
        else:
            for s in range(layer.number_of_states):
                if layer.is_conv_states_initialized[s]:
                    c = layer.conv_states[s]
                    specs.append(
                        SegmentSpec(
                            f"L{i}.conv{s}", i, kind, _TORCH_TO_NAME[c.dtype], tuple(c.shape)
                        )
                    )
                if layer.is_recurrent_states_initialized[s]:
                    r = layer.recurrent_states[s]
                    specs.append(
                        SegmentSpec(
                            f"L{i}.rec{s}", i, kind, _TORCH_TO_NAME[r.dtype], tuple(r.shape)
                        )
                    )
    specs.append(
        SegmentSpec("logits", -1, LOGITS, _TORCH_TO_NAME[logits.dtype], tuple(logits.shape))
    )
    return Manifest(prompt_tokens, kinds, specs, cumulative)


def final_segments(cache: Any, manifest: Manifest, logits: torch.Tensor) -> dict[str, bytes]:
    """Segments only known when prefill is complete: sliding windows, linear states, logits."""
    out: dict[str, bytes] = {}
    for spec in manifest.segments:
        if spec.kind == LOGITS:
            out[spec.name] = tensor_bytes(logits)
            continue
        layer = cache.layers[spec.layer]
        if spec.kind == SLIDING:
            t = layer.keys if spec.name.endswith(".k") else layer.values
            out[spec.name] = tensor_bytes(_token_major(t))
        elif spec.kind == LINEAR:
            s = int(spec.name.rsplit("conv" if ".conv" in spec.name else "rec", 1)[1])
            t = layer.conv_states[s] if ".conv" in spec.name else layer.recurrent_states[s]
            out[spec.name] = tensor_bytes(t)
    return out


def export_cache(
    cache: Any, prompt_tokens: int, logits: torch.Tensor
) -> tuple[Manifest, dict[str, bytes]]:
    """The whole cache at once (tests, benchmarks, the spool of a non-streaming prefill)."""
    manifest = build_manifest(cache, prompt_tokens, logits)
    segments = full_kv_slice(cache, 0, prompt_tokens)
    segments.update(final_segments(cache, manifest, logits))
    return manifest, segments


def import_cache(
    config: Any, manifest: Manifest, segments: dict[str, bytes]
) -> tuple[Any, torch.Tensor]:
    """Rebuild a ``DynamicCache`` for ``config`` from a manifest and its segments; returns the
    cache and the last prompt position's logits. Raises ``KvLayoutError`` when a segment is
    missing, has the wrong size, or the layer kinds differ from the model's."""
    from transformers import DynamicCache

    cache: Any = DynamicCache(config=config)
    kinds = [layer_kind(layer) for layer in cache.layers]
    if kinds != manifest.layer_kinds:
        raise KvLayoutError(f"layer_kinds: transfer has {manifest.layer_kinds}, model has {kinds}")
    tensors: dict[str, torch.Tensor] = {}
    for spec in manifest.segments:
        if spec.name not in segments:
            raise KvLayoutError(f"segment {spec.name!r} missing")
        tensors[spec.name] = bytes_tensor(segments[spec.name], spec.dtype, spec.shape)
    logits: torch.Tensor | None = None
    for spec in manifest.segments:
        t = tensors[spec.name]
        if spec.kind == LOGITS:
            logits = t
        elif spec.kind in (FULL, SLIDING) and spec.name.endswith(".k"):
            layer: Any = cache.layers[spec.layer]
            v = tensors[spec.name[:-1] + "v"]
            layer.update(t.permute(1, 2, 0, 3).contiguous(), v.permute(1, 2, 0, 3).contiguous())
            if spec.kind == SLIDING:
                # update() counted only the W-1 tokens shipped; the layer saw the whole prompt.
                layer.cumulative_length = manifest.cumulative_lengths[spec.layer]
        elif spec.kind == LINEAR:
            layer = cache.layers[spec.layer]
            if ".conv" in spec.name:
                s = int(spec.name.rsplit("conv", 1)[1])
                layer.update_conv_state(t, state_idx=s, conv_kernel_size=t.shape[-1])
            else:
                s = int(spec.name.rsplit("rec", 1)[1])
                layer.update_recurrent_state(t, state_idx=s)
    if logits is None:
        raise KvLayoutError("segment 'logits' missing")
    return cache, logits

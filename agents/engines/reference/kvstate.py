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
CPU work, sub-millisecond for the tiny models. Malformed input raises ``KvLayoutError``; a
manifest whose layout is not the model's (``ModelLayout.check``: layer kinds, the set of
segments, every segment's layer, kind, dtype and shape, sliding lengths) raises
``ManifestMismatch`` before any byte is imported.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np
import torch

FULL, SLIDING, LINEAR, LOGITS = "full", "sliding", "linear-state", "logits"

_TORCH_TO_NAME = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
_NAME_TO_TORCH = {v: k for k, v in _TORCH_TO_NAME.items()}


class KvLayoutError(Exception):
    """A serialized cache does not match the manifest or the model's cache layout."""


class ManifestMismatch(KvLayoutError):
    """A transfer's manifest describes another layout than the model's (layer kinds, a
    segment missing or extra, a layer, kind, dtype or shape that differs): the decode engine
    refuses it before any byte is imported. The message names the first difference."""


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


@dataclass(frozen=True)
class ModelLayout:
    """What a transfer for one model must hold, read from a cache the model itself filled
    (``Runner.layout``, once per model) rather than derived from its config, so it is right
    for every architecture the cache layer supports.

    ``segments`` are the probe's specs; the token dimension of full layers follows the
    prompt, that of sliding layers too up to ``windows[layer]`` (``W-1``) tokens; linear
    states and logits have fixed shapes."""

    layer_kinds: tuple[str, ...]
    segments: tuple[SegmentSpec, ...]
    windows: dict[int, int] = field(default_factory=dict)

    def expected(self, prompt_tokens: int) -> dict[str, SegmentSpec]:
        """Every segment a transfer of a ``prompt_tokens`` prompt holds, by name."""
        out: dict[str, SegmentSpec] = {}
        for spec in self.segments:
            if spec.kind == FULL:
                spec = replace(spec, shape=(prompt_tokens, *spec.shape[1:]))
            elif spec.kind == SLIDING:
                kept = min(prompt_tokens, self.windows[spec.layer])
                spec = replace(spec, shape=(kept, *spec.shape[1:]))
            out[spec.name] = spec
        return out

    def check(self, manifest: Manifest) -> None:
        """Raise ``ManifestMismatch`` naming the first way ``manifest`` differs from this
        layout. Pure and cheap (a few hundred comparisons): runs on the event loop when the
        header arrives, before the receiver reads any segment."""
        if manifest.prompt_tokens < 1:
            raise ManifestMismatch(f"prompt_tokens: {manifest.prompt_tokens}, at least 1 expected")
        if tuple(manifest.layer_kinds) != self.layer_kinds:
            raise ManifestMismatch(
                f"layer_kinds: transfer has {manifest.layer_kinds}, model has "
                f"{list(self.layer_kinds)}"
            )
        expected = self.expected(manifest.prompt_tokens)
        names = [spec.name for spec in manifest.segments]
        duplicated = sorted({n for n in names if names.count(n) > 1})
        if duplicated:
            raise ManifestMismatch(f"segments listed twice: {', '.join(duplicated)}")
        missing = [n for n in expected if n not in names]
        if missing:
            # A layer without its state would decode from zeros: never imported.
            raise ManifestMismatch(f"segments missing: {', '.join(missing)}")
        extra = [n for n in names if n not in expected]
        if extra:
            raise ManifestMismatch(f"segments not in the model's layout: {', '.join(extra)}")
        for spec in manifest.segments:
            want = expected[spec.name]
            if (spec.layer, spec.kind) != (want.layer, want.kind):
                raise ManifestMismatch(
                    f"segment {spec.name!r}: layer {spec.layer} kind {spec.kind}, the model's is "
                    f"layer {want.layer} kind {want.kind}"
                )
            if spec.dtype != want.dtype:
                raise ManifestMismatch(
                    f"segment {spec.name!r}: dtype {spec.dtype}, the model's is {want.dtype}"
                )
            if spec.shape != want.shape:
                raise ManifestMismatch(
                    f"segment {spec.name!r}: shape {list(spec.shape)}, the model's is "
                    f"{list(want.shape)} for {manifest.prompt_tokens} prompt tokens"
                )
        for layer in self.windows:
            seen = manifest.cumulative_lengths.get(layer)
            if seen != manifest.prompt_tokens:
                raise ManifestMismatch(
                    f"cumulative_lengths: layer {layer} has {seen}, expected "
                    f"{manifest.prompt_tokens} (the prompt's length)"
                )


def layout_of(cache: Any, logits: torch.Tensor) -> ModelLayout:
    """The layout of a cache the model filled with a short prefill (see ``Runner.layout``)."""
    manifest = build_manifest(cache, 1, logits)
    windows = {
        i: int(layer.sliding_window) - 1
        for i, layer in enumerate(cache.layers)
        if manifest.layer_kinds[i] == SLIDING
    }
    return ModelLayout(tuple(manifest.layer_kinds), tuple(manifest.segments), windows)


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
    config: Any,
    manifest: Manifest,
    segments: dict[str, bytes],
    layout: ModelLayout | None = None,
) -> tuple[Any, torch.Tensor]:
    """Rebuild a ``DynamicCache`` for ``config`` from a manifest and its segments; returns the
    cache and the last prompt position's logits. With the model's ``layout`` the manifest is
    checked against it first (``ManifestMismatch``, nothing imported). Raises
    ``KvLayoutError`` when a segment is missing, has the wrong size, or the layer kinds
    differ from the model's."""
    from transformers import DynamicCache

    if layout is not None:
        layout.check(manifest)
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

"""KVCache size of a model architecture, from its layer layout. Pure Python (no Django), so the
planner, the engines and the benchmarks share one formula.

An architecture is a JSON object::

    {
      "dtype_bytes": 2,            # bytes per KV element (bf16 = 2)
      "state_dtype_bytes": 4,      # bytes per recurrent-state element (default: dtype_bytes)
      "layers": [                  # groups of identical layers, in any order
        {"kind": "full",    "count": 15, "kv_heads": 2, "head_dim": 256},
        {"kind": "linear",  "count": 45, "num_heads": 16, "key_head_dim": 128, "value_head_dim": 128,
                            "conv_dim": 8192, "conv_kernel": 4},
        {"kind": "sliding", "count": 40, "window": 128, "kv_heads": 4, "head_dim": 128},
        {"kind": "mla",     "count": 10, "kv_lora_rank": 512, "rope_head_dim": 64},
        {"kind": "conv",    "count": 4,  "conv_dim": 2048, "conv_kernel": 3}
      ]
    }

Per request of ``l`` tokens (the deployment guide's formulas):

* ``full`` (MHA/GQA): ``2 x kv_heads x head_dim x dtype_bytes x l`` per layer;
* ``mla`` (latent attention): ``(kv_lora_rank + rope_head_dim) x dtype_bytes x l`` per layer;
* ``sliding`` (window W): ``2 x kv_heads x head_dim x dtype_bytes x min(l, W)`` per layer;
* ``linear`` (linear attention / SSM): a fixed recurrent state ``num_heads x key_head_dim x
  value_head_dim x state_dtype_bytes`` plus a short-convolution state ``conv_dim x (conv_kernel
  - 1) x dtype_bytes``, independent of ``l``;
* ``conv`` (short convolution only): ``conv_dim x (conv_kernel - 1) x dtype_bytes``.

A group says how many layers it has with ``count`` (default 1), or which ones with an explicit
per-layer list ``indices`` (0-based positions in the model, as a model's config lists its layer
types): ``{"kind": "full", "indices": [3, 7, 11, 15]}``. Either every group lists indices or
none does; listed, the indices of all groups together are each layer exactly once
(0 .. N-1), so the layout is the model's real order. ``count`` then follows from the list (a
``count`` that disagrees is an error). The size formulas only need the counts; the order is
kept (and hashed) because it is what the layer-by-layer KV manifest follows.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

LAYER_KINDS = ("full", "mla", "sliding", "linear", "conv")

_REQUIRED: dict[str, tuple[str, ...]] = {
    "full": ("kv_heads", "head_dim"),
    "mla": ("kv_lora_rank", "rope_head_dim"),
    "sliding": ("window", "kv_heads", "head_dim"),
    "linear": ("num_heads", "key_head_dim", "value_head_dim"),
    "conv": ("conv_dim", "conv_kernel"),
}
_OPTIONAL: dict[str, tuple[str, ...]] = {
    "linear": ("conv_dim", "conv_kernel"),
}


class ArchitectureError(ValueError):
    """An invalid architecture. ``field`` is the JSON path of the offending value."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


def _positive_int(value: Any, field: str, *, allow_zero: bool = False) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ArchitectureError(field, "must be an integer")
    if value < 0 or (value == 0 and not allow_zero):
        raise ArchitectureError(field, "must be positive" if not allow_zero else "must be >= 0")
    return value


def _layer_indices(value: Any, field: str) -> list[int]:
    """An explicit per-layer list: distinct 0-based layer positions, returned sorted."""
    if not isinstance(value, list) or not value:
        raise ArchitectureError(field, "must be a non-empty list of layer positions")
    indices = [_positive_int(v, f"{field}[{i}]", allow_zero=True) for i, v in enumerate(value)]
    if len(set(indices)) != len(indices):
        raise ArchitectureError(field, "lists a layer twice")
    return sorted(indices)


def _check_layer_order(groups: list[dict[str, Any]]) -> None:
    """Listed indices: every group lists them, and together they are 0 .. N-1 once each."""
    listed = ["indices" in g for g in groups]
    if not any(listed):
        return
    if not all(listed):
        first = listed.index(False)
        raise ArchitectureError(
            f"layers[{first}].indices",
            "is required here: either every layer group lists its indices or none does",
        )
    owner: dict[int, int] = {}
    for number, group in enumerate(groups):
        for index in group["indices"]:
            if index in owner:
                raise ArchitectureError(
                    f"layers[{number}].indices",
                    f"layer {index} is already in layers[{owner[index]}]",
                )
            owner[index] = number
    total = len(owner)
    gaps = sorted(set(range(total)) - set(owner))
    if gaps:
        raise ArchitectureError(
            "layers",
            f"the indices of {total} layers must be 0 to {total - 1}; {gaps[0]} is missing",
        )


def validate_architecture(arch: Any) -> dict[str, Any]:
    """Check an architecture dict and return it normalised (defaults filled in).

    Raises ``ArchitectureError`` naming the first offending field (``layers[2].window``)."""
    if not isinstance(arch, dict):
        raise ArchitectureError("architecture", "must be an object")
    dtype_bytes = _positive_int(arch.get("dtype_bytes", 2), "dtype_bytes")
    state_dtype_bytes = _positive_int(
        arch.get("state_dtype_bytes", dtype_bytes), "state_dtype_bytes"
    )
    layers = arch.get("layers")
    if not isinstance(layers, list) or not layers:
        raise ArchitectureError("layers", "must be a non-empty list of layer groups")
    normalised = []
    for index, group in enumerate(layers):
        where = f"layers[{index}]"
        if not isinstance(group, dict):
            raise ArchitectureError(where, "must be an object")
        kind = group.get("kind")
        if kind not in LAYER_KINDS:
            raise ArchitectureError(f"{where}.kind", f"must be one of {', '.join(LAYER_KINDS)}")
        known = {"kind", "count", "indices", *_REQUIRED[kind], *_OPTIONAL.get(kind, ())}
        unknown = sorted(set(group) - known)
        if unknown:
            raise ArchitectureError(f"{where}.{unknown[0]}", f"is not a field of a {kind} layer")
        item: dict[str, Any] = {"kind": kind}
        if "indices" in group:
            item["indices"] = _layer_indices(group["indices"], f"{where}.indices")
            count = len(item["indices"])
            if "count" in group and _positive_int(group["count"], f"{where}.count") != count:
                raise ArchitectureError(
                    f"{where}.count", f"is {group['count']} but indices lists {count} layers"
                )
            item["count"] = count
        else:
            item["count"] = _positive_int(group.get("count", 1), f"{where}.count")
        for name in _REQUIRED[kind]:
            if name not in group:
                raise ArchitectureError(f"{where}.{name}", f"is required for a {kind} layer")
            item[name] = _positive_int(group[name], f"{where}.{name}")
        for name in _OPTIONAL.get(kind, ()):
            if name in group:
                item[name] = _positive_int(group[name], f"{where}.{name}", allow_zero=True)
        if kind in {"conv", "linear"} and item.get("conv_kernel", 1) < 1:
            raise ArchitectureError(f"{where}.conv_kernel", "must be >= 1")
        normalised.append(item)
    _check_layer_order(normalised)
    return {
        "dtype_bytes": dtype_bytes,
        "state_dtype_bytes": state_dtype_bytes,
        "layers": normalised,
    }


@dataclass(frozen=True)
class KvSize:
    """KV bytes of one request at ``tokens`` tokens, split by how they scale."""

    tokens: int
    fixed_bytes: int  # linear-attention and convolution states: independent of length
    per_token_bytes: int  # full-attention and MLA bytes per token
    windowed_bytes: int  # sliding-window layers at this length (grows until the window is full)

    @property
    def total_bytes(self) -> int:
        return self.fixed_bytes + self.per_token_bytes * self.tokens + self.windowed_bytes


def _conv_state(group: dict[str, Any], dtype_bytes: int) -> int:
    kernel = int(group.get("conv_kernel", 1))
    return int(group.get("conv_dim", 0)) * max(kernel - 1, 0) * dtype_bytes


def kv_size(arch: dict[str, Any], tokens: int) -> KvSize:
    """KV bytes for a request of ``tokens`` prompt tokens (``arch`` as validated above)."""
    if tokens < 0:
        raise ValueError("tokens: must be >= 0")
    arch = validate_architecture(arch)
    b, sb = arch["dtype_bytes"], arch["state_dtype_bytes"]
    fixed = per_token = windowed = 0
    for g in arch["layers"]:
        n = g["count"]
        if g["kind"] == "full":
            per_token += n * 2 * g["kv_heads"] * g["head_dim"] * b
        elif g["kind"] == "mla":
            per_token += n * (g["kv_lora_rank"] + g["rope_head_dim"]) * b
        elif g["kind"] == "sliding":
            windowed += n * 2 * g["kv_heads"] * g["head_dim"] * b * min(tokens, g["window"])
        elif g["kind"] == "linear":
            fixed += n * (
                g["num_heads"] * g["key_head_dim"] * g["value_head_dim"] * sb + _conv_state(g, b)
            )
        else:  # conv
            fixed += n * _conv_state(g, b)
    return KvSize(
        tokens=tokens, fixed_bytes=fixed, per_token_bytes=per_token, windowed_bytes=windowed
    )


def kv_bytes(arch: dict[str, Any], tokens: int) -> int:
    """Total KV bytes for one request of ``tokens`` tokens."""
    return kv_size(arch, tokens).total_bytes


def dense_equivalent(arch: dict[str, Any]) -> dict[str, Any]:
    """The same model with every layer as full attention (the widest KV of its full/sliding
    layers, or 8 KV heads x 128 when it has none): the baseline for "how much does the hybrid
    layout save"."""
    arch = validate_architecture(arch)
    attention = [g for g in arch["layers"] if g["kind"] in {"full", "sliding"}]
    if attention:
        widest = max(attention, key=lambda g: g["kv_heads"] * g["head_dim"])
        kv_heads, head_dim = widest["kv_heads"], widest["head_dim"]
    else:
        kv_heads, head_dim = 8, 128
    count = sum(g["count"] for g in arch["layers"])
    return {
        "dtype_bytes": arch["dtype_bytes"],
        "state_dtype_bytes": arch["state_dtype_bytes"],
        "layers": [{"kind": "full", "count": count, "kv_heads": kv_heads, "head_dim": head_dim}],
    }


def architecture_hash(arch: dict[str, Any]) -> str:
    """A stable sha256 of the normalised architecture (part of the model fingerprint)."""
    canonical = json.dumps(validate_architecture(arch), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def is_dense(arch: dict[str, Any]) -> bool:
    """True when every layer is full attention (KV grows with every layer: the guide's
    "dense model", for which cross-datacenter prefill does not pay off)."""
    return all(g["kind"] == "full" for g in validate_architecture(arch)["layers"])

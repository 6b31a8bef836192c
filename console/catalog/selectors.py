"""Catalog reads: KV size of a model at given prompt lengths, next to its dense equivalent
(the same layer count, all full attention). Called by the kv-size endpoint; pure computation
through ``console.planner.kvsize``."""

from __future__ import annotations

from typing import Any

from console.catalog.models import ModelSpec
from console.planner.kvsize import dense_equivalent, kv_size

DEFAULT_TOKENS = (1024, 4096, 32768, 131072)
MAX_TOKENS = 10_000_000
MAX_LENGTHS = 64


def parse_tokens(raw: str | None) -> list[int]:
    """``"1024,4096"`` -> ``[1024, 4096]``; ``ValueError`` with a message for the client."""
    if raw is None or raw.strip() == "":
        return list(DEFAULT_TOKENS)
    values = []
    for part in raw.split(","):
        part = part.strip()
        if not (part.isascii() and part.isdigit()):
            raise ValueError(f"Expected comma-separated non-negative integers, got {part!r}.")
        value = int(part)
        if value > MAX_TOKENS:
            raise ValueError(f"At most {MAX_TOKENS} tokens, got {value}.")
        values.append(value)
    if len(values) > MAX_LENGTHS:
        raise ValueError(f"At most {MAX_LENGTHS} lengths.")
    return values


def _ratio(numerator: int, denominator: int) -> float | None:
    return round(numerator / denominator, 3) if denominator else None


def model_kv_sizes(
    model: ModelSpec, tokens: list[int], baseline: ModelSpec | None = None
) -> dict[str, Any]:
    """Per length: KV bytes split by how they scale, the dense-equivalent bytes and the
    reduction factor (dense / model); with ``baseline`` (for example the dense GQA model),
    also its bytes and the reduction against it (baseline / model)."""
    dense = dense_equivalent(model.architecture)
    results = []
    for length in tokens:
        size = kv_size(model.architecture, length)
        dense_bytes = kv_size(dense, length).total_bytes
        row: dict[str, Any] = {
            "tokens": length,
            "kv_bytes": size.total_bytes,
            "fixed_bytes": size.fixed_bytes,
            "per_token_bytes": size.per_token_bytes,
            "windowed_bytes": size.windowed_bytes,
            "dense_equivalent_bytes": dense_bytes,
            "reduction": _ratio(dense_bytes, size.total_bytes),
        }
        if baseline is not None:
            baseline_bytes = kv_size(baseline.architecture, length).total_bytes
            row["baseline_bytes"] = baseline_bytes
            row["reduction_vs_baseline"] = _ratio(baseline_bytes, size.total_bytes)
        results.append(row)
    return {
        "model": model.pk,
        "name": model.name,
        "architecture_hash": model.architecture_hash,
        "dense_equivalent": dense,
        "baseline": baseline.name if baseline is not None else None,
        "results": results,
    }

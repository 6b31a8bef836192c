"""Link demand of shipping KVCache: bytes per request and the bandwidth ``concurrency``
transfers need to finish within a tolerable window. Pure Python (no Django).

For each prompt length ``l``: ``bytes = kv_bytes(arch, l)``;
``Gbit/s needed = bytes x 8 x concurrency / window_s / 1e9``;
``link share = needed / link_gbps`` and it ``fits`` when the share is at most the link's
utilisation ceiling. The dense equivalent (every layer full attention) is shown alongside, so
the hybrid layout's saving reads directly.

Callers: ``POST /api/planner/kv-size/`` and the deployment workflow's capacity step. Pure and
blocking; raises ``PlannerInputError`` naming the field.
"""

from __future__ import annotations

import math
from typing import Any

from console.planner.errors import PlannerInputError
from console.planner.kvsize import (
    ArchitectureError,
    architecture_hash,
    dense_equivalent,
    is_dense,
    kv_size,
    validate_architecture,
)
from console.planner.model import GBIT

MAX_LENGTHS = 1000


def transfer_demand(
    *,
    architecture: Any,
    lengths: list[int],
    concurrency: int = 1,
    window_s: float = 1.0,
    link_gbps: float | None = None,
    utilisation_ceiling: float = 0.7,
) -> dict[str, Any]:
    """KV bytes and bandwidth per prompt length; see the module docstring."""
    try:
        arch = validate_architecture(architecture)
    except ArchitectureError as exc:
        raise PlannerInputError(f"architecture.{exc.field}", exc.message) from None
    if not lengths:
        raise PlannerInputError("lengths", "must hold at least one prompt length")
    if len(lengths) > MAX_LENGTHS:
        raise PlannerInputError("lengths", f"must hold at most {MAX_LENGTHS} lengths")
    if concurrency < 1:
        raise PlannerInputError("concurrency", "must be >= 1")
    if not (math.isfinite(window_s) and window_s > 0):
        raise PlannerInputError("window_s", "must be > 0")
    if link_gbps is not None and not (math.isfinite(link_gbps) and link_gbps > 0):
        raise PlannerInputError("link_gbps", "must be > 0")
    if not (0 < utilisation_ceiling <= 1):
        raise PlannerInputError("utilisation_ceiling", "must be in (0, 1]")
    dense = dense_equivalent(arch)
    rows = []
    for i, tokens in enumerate(lengths):
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
            raise PlannerInputError(f"lengths[{i}]", "must be an integer >= 0")
        size = kv_size(arch, tokens)
        dense_bytes = kv_size(dense, tokens).total_bytes
        needed = size.total_bytes * 8.0 * concurrency / window_s / GBIT
        row: dict[str, Any] = {
            "tokens": tokens,
            "bytes": size.total_bytes,
            "fixed_bytes": size.fixed_bytes,
            "per_token_bytes": size.per_token_bytes,
            "windowed_bytes": size.windowed_bytes,
            "dense_bytes": dense_bytes,
            "reduction_vs_dense": dense_bytes / size.total_bytes if size.total_bytes else None,
            "gbps_needed": needed,
        }
        if link_gbps is not None:
            row["link_share"] = needed / link_gbps
            row["fits"] = needed <= link_gbps * utilisation_ceiling
        rows.append(row)
    return {
        "architecture_hash": architecture_hash(arch),
        "dense": is_dense(arch),
        "concurrency": concurrency,
        "window_s": window_s,
        "link_gbps": link_gbps,
        "utilisation_ceiling": utilisation_ceiling,
        "lengths": rows,
    }

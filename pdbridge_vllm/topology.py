"""This worker's transfer layout, read from vLLM: its KV-cache groups and their pages, how
tensor parallelism splits each page, and the worker's rank. What vLLM shapes it does not
describe well enough to split is marked so (``shard=None``): such a model still transfers
between engines at the same TP size, and a pairing at different sizes is refused with the
tensor named."""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
from vllm.v1.kv_cache_interface import MambaSpec, SlidingWindowSpec

from grpc_kv import api as kv
from pdbridge_vllm.config import ConfigError
from pdbridge_vllm.layout import GroupLayout, KvLayout, LayerPages, cdiv, state_kind
from pdbridge_vllm.shards import ShardSpec

log = logging.getLogger("vllm.pdbridge")


def tensor_parallel() -> tuple[int, int]:
    """(rank, size) of this worker's tensor-parallel group; (0, 1) outside a worker."""
    try:
        from vllm.distributed.parallel_state import (
            get_tensor_model_parallel_rank,
            get_tensor_model_parallel_world_size,
        )

        return get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
    except (AssertionError, ImportError, RuntimeError):
        return 0, 1


def check_parallelism(vllm_config: Any) -> None:
    """Refuse at start what the connector does not support: pipeline parallelism (each
    stage would hold some layers' KV and nothing joins them yet) and data parallelism on a
    decode engine (its ranks would share one KV listener)."""
    parallel = vllm_config.parallel_config
    if parallel.pipeline_parallel_size > 1:
        raise ConfigError(
            f"pipeline_parallel_size {parallel.pipeline_parallel_size}: pdbridge's connector "
            "supports tensor parallelism only (pipeline parallel 1 on both sides)"
        )
    transfer = vllm_config.kv_transfer_config
    if getattr(parallel, "data_parallel_size", 1) > 1 and transfer.is_kv_consumer:
        raise ConfigError(
            f"data_parallel_size {parallel.data_parallel_size} on a kv_consumer: its engines "
            "would share one KV listener; run one decode engine per data-parallel rank"
        )


def state_views(raw: torch.Tensor, spec: MambaSpec) -> list[torch.Tensor]:
    """A linear-attention layer's cache as vLLM hands it over, a raw ``[B, 1, 1, C]`` byte
    view, cut into its typed states (conv, recurrent: ``[B, *shape]`` each), as the layer
    itself does (``MambaBase.bind_kv_cache``): each is then its own tensor of the transfer,
    with its own split across TP ranks, and the page padding never travels."""
    if raw.dim() != 4 or raw.shape[1] != 1 or raw.shape[2] != 1:
        return [raw]
    pages = raw.squeeze(dim=2).squeeze(dim=1)
    views, offset = [], 0
    for shape, dtype in zip(spec.shapes, spec.dtypes, strict=True):
        size = math.prod(shape) * torch.tensor([], dtype=dtype).element_size()
        views.append(pages[:, offset : offset + size].view(dtype).view(-1, *shape))
        offset += size
    return views


def build(
    vllm_config: Any, kv_cache_config: Any, caches: dict[str, list[torch.Tensor]]
) -> KvLayout:
    """The layout of this worker's registered caches (``caches``: layer -> its tensors;
    linear-attention layers' raw pages are replaced by their typed states here)."""
    rank, tp = tensor_parallel()
    heads = _attention_heads(vllm_config, tp)
    groups = []
    for gid in kv_cache_config.transfer_group_ids:
        group = kv_cache_config.kv_cache_groups[gid]
        spec = group.kv_cache_spec
        if isinstance(spec, MambaSpec):
            kind, window = "state", 0
        elif isinstance(spec, SlidingWindowSpec):
            kind, window = "sliding", cdiv(spec.sliding_window, spec.block_size) + 1
        else:
            kind, window = "full", 0
        pages = []
        for layer in group.layer_names:
            if kind == "state" and len(caches[layer]) == 1:
                caches[layer] = state_views(caches[layer][0], spec)
            tensors = caches[layer]
            for i, tensor in enumerate(tensors):
                page = tensor[0]
                shape = tuple(page.shape)
                pages.append(
                    LayerPages(
                        name=layer if len(tensors) == 1 else f"{layer}#{i}",
                        page_bytes=page.numel() * page.element_size(),
                        dtype=str(page.dtype).removeprefix("torch."),
                        page_shape=shape,
                        kind=state_kind(i)
                        if kind == "state"
                        else (kv.LayerKind.SLIDING if kind == "sliding" else kv.LayerKind.FULL),
                        shard=_state_shard(spec, i, shape, tp)
                        if kind == "state"
                        else _attention_shard(shape, heads),
                    )
                )
        groups.append(GroupLayout(kind, spec.block_size, window, tuple(pages)))
    layout = KvLayout(tuple(groups), tp=tp, rank=rank)
    unknown = [p.name for p in layout.tensors().values() if p.shard is None]
    if unknown and tp > 1:
        log.warning(
            "pdbridge_kv_shards_unknown tensors=%s: transfers only to and from engines at "
            "tensor parallel %d",
            unknown[:4],
            tp,
        )
    return layout


def _attention_heads(vllm_config: Any, tp: int) -> tuple[int, int] | None:
    """(total KV heads, this rank's) of the model's attention, or None for MLA (one latent
    replicated on every rank: not split by heads)."""
    model = vllm_config.model_config
    if getattr(model, "use_mla", False):
        return None
    total = int(model.get_total_num_kv_heads())
    return total, max(1, total // tp)


def _attention_shard(shape: tuple[int, ...], heads: tuple[int, int] | None) -> ShardSpec | None:
    """A page ``[heads, block, 2 * head dim]`` (vLLM's logical per-layer view: K and V of a
    head side by side) splits by heads along axis 0."""
    if heads is None or len(shape) != 3:
        return None
    total, local = heads
    if shape[0] != local:
        return None
    return ShardSpec(0, (total,))


def _state_shard(spec: MambaSpec, index: int, shape: tuple[int, ...], tp: int) -> ShardSpec | None:
    """Linear-attention state: the conv state's channels by sub-projection (GDN: Q, K, V;
    Mamba2: x, B, C; vLLM's own ``derive_mamba_conv_split``), the recurrent state by heads.
    A state every rank holds whole (``tp_replicated``) has no split the connector knows."""
    if getattr(spec, "tp_replicated", False) or len(spec.shapes) != 2:
        return None
    if tuple(shape) != tuple(spec.shapes[index]):
        return None
    if index == 1:
        return ShardSpec(0, (shape[0] * tp,)) if shape else None
    if index != 0:
        return None
    try:
        from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

        axis = 0 if is_conv_state_dim_first() else 1
    except ImportError:
        return None
    if len(shape) != 2:
        return None
    dims = _conv_parts(spec, shape[axis])
    if dims is None:
        return None
    return ShardSpec(axis, tuple(d * tp for d in dims))


def _conv_parts(spec: MambaSpec, channels: int) -> tuple[int, ...] | None:
    """This rank's conv channels by sub-projection, as vLLM's ``derive_mamba_conv_split``
    decomposes them (which asserts the (dim, state) layout; vLLM's CPU backend keeps
    (state, dim), so the decomposition is repeated here for either)."""
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum as Kind

    temporal = spec.shapes[1]
    if spec.mamba_type == Kind.MAMBA1:
        return (channels,)
    if spec.mamba_type == Kind.MAMBA2 and len(temporal) >= 2:
        x_local = temporal[0] * temporal[1]
        rest = channels - x_local
        return (x_local, rest // 2, rest // 2) if rest > 0 and rest % 2 == 0 else None
    if spec.mamba_type == Kind.GDN_ATTN and len(temporal) >= 2:
        value = temporal[0] * temporal[1]
        rest = channels - value
        return (rest // 2, rest // 2, value) if rest > 0 and rest % 2 == 0 else None
    return None

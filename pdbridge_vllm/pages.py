"""Pages between vLLM's paged KV caches and the link, on the worker: copied out of the cache for
a transfer (and cut into the part each decode rank holds), written back into the decode
request's blocks (at this rank's place of each part) as verified segments arrive. torch only:
tested without vLLM."""

from __future__ import annotations

import torch

from grpc_kv import api as kv
from pdbridge_vllm.layout import KvLayout
from pdbridge_vllm.shards import Plan, Run

NULL_BLOCK = 0  # vLLM's block pool hands out block 0 as the null block, never to a request


def copy_pages(tensor: torch.Tensor, block_ids: list[int]) -> torch.Tensor:
    """The pages of ``block_ids`` of one layer's cache, ``[len(block_ids), *page]``, a copy
    on the host: vLLM may reuse the blocks once the transfer is done (on a GPU this is the
    one device-to-host copy)."""
    index = torch.tensor(block_ids, dtype=torch.long, device=tensor.device)
    return tensor.index_select(0, index).contiguous().cpu()


def page_bytes(tensor: torch.Tensor, block_ids: list[int]) -> bytes:
    """:func:`copy_pages` as bytes."""
    return as_bytes(copy_pages(tensor, block_ids))


def as_bytes(pages: torch.Tensor) -> bytes:
    return pages.contiguous().view(torch.uint8).numpy().tobytes()


class Cutter:
    """The part of a batch of pages (:func:`copy_pages`) that one decode rank gets (a
    :class:`~pdbridge_vllm.shards.Plan`): the whole pages when the shards match, else the
    selected runs of each page along the TP axis, concatenated. Runs on the link's loop."""

    def __init__(self, layout: KvLayout) -> None:
        self._tensors = layout.tensors()
        self._tp = layout.tp

    def __call__(self, pages: torch.Tensor, name: str, plan: Plan) -> bytes:
        tensor = self._tensors[name]
        spec = tensor.spec(self._tp)
        if plan.identity(name, spec):
            return as_bytes(pages)
        axis = spec.axis + 1  # pages carry the block index first
        parts = [pages.narrow(axis, src, length) for src, _, length in plan.tensors[name]]
        return as_bytes(torch.cat(parts, dim=axis))


class PageWriter:
    """Where each arriving page of one part of a load goes: the request's block at that
    position of the layer's group (the running slot for linear state), or nowhere for
    positions this engine already holds (its own prefix cache) or keeps as null (outside a
    sliding window); within the page, the whole of it, or (``plan``: another rank's shard)
    the runs of this rank's page along the TP axis that the sending rank holds. Segments
    need not end on page boundaries; a partial page waits for the rest. Runs on the link's
    thread."""

    def __init__(
        self,
        layout: KvLayout,
        caches: dict[str, list[torch.Tensor]],
        block_ids: tuple[list[int], ...],
        n_tokens: int,
        local_tokens: int,
        plan: Plan | None = None,
    ) -> None:
        """``block_ids``: the request's blocks per group, a state group's clipped to its
        running slot (vLLM's ``clip_ssm_state_blocks``)."""
        self._caches = caches
        self._pages = {p.name: p for g in layout.groups for p in g.layers}
        self._tp = layout.tp
        #: name -> (bytes of one arriving page part, runs to place; None: the whole page)
        self._parts: dict[str, tuple[int, tuple[Run, ...] | None]] = {}
        for name, pages in self._pages.items():
            runs = plan.tensors.get(name) if plan is not None else None
            if plan is None or (runs and plan.identity(name, pages.spec(self._tp))):
                self._parts[name] = (pages.page_bytes, None)
            elif runs:
                self._parts[name] = (pages.part_bytes(self._tp, runs), runs)
        self._targets: dict[str, list[int | None]] = {}
        for g, group in enumerate(layout.groups):
            ids = block_ids[g] if g < len(block_ids) else []
            if group.kind == "state":
                slot = list(ids)[-1:]
                blocks: list[int | None] = [slot[0] if slot and slot[0] != NULL_BLOCK else None]
            else:
                local = local_tokens // group.block_size
                blocks = [
                    ids[p] if local <= p < len(ids) and ids[p] != NULL_BLOCK else None
                    for p in group.positions(n_tokens)
                ]
            for pages in group.layers:
                self._targets[pages.name] = blocks
        self._pending = {name: bytearray() for name in self._targets}
        self._written = dict.fromkeys(self._targets, 0)

    def write(self, segment: kv.Segment) -> None:
        name = segment.layer
        pages = self._pages[name]
        size, runs = self._parts[name]  # KeyError: a layer this part has no runs of
        buf = self._pending[name]
        buf += segment.data
        whole = len(buf) // size
        if not whole:
            return
        chunk = buf[: whole * size]  # a copy: the pages outlive this segment's buffer
        del buf[: whole * size]
        src = torch.frombuffer(chunk, dtype=torch.uint8)
        tensor = self._caches[pages.layer][pages.tensor]
        targets = self._targets[name]
        axis = pages.spec(self._tp).axis
        for k in range(whole):
            index = self._written[name] + k
            block = targets[index] if index < len(targets) else None
            if block is None:
                continue
            dst = tensor[block]
            part = src[k * size : (k + 1) * size].view(dst.dtype)
            if runs is None:
                dst.copy_(part.view(dst.shape))
                continue
            shape = list(dst.shape)
            shape[axis] = sum(length for _, _, length in runs)
            part = part.view(shape)
            offset = 0
            for _, at, length in runs:
                dst.narrow(axis, at, length).copy_(part.narrow(axis, offset, length))
                offset += length
        self._written[name] += whole


def request_amx_permission(caches: dict[str, list[torch.Tensor]]) -> bool:
    """On x86 CPUs with AMX, ask Linux for the AMX tile state (``arch_prctl``) for this
    process when the KV cache lives in host memory; returns whether it was asked.

    vLLM's CPU attention runs AMX instructions for bf16 KV, and Linux allows them only after
    the process asked. torch's oneDNN asks on its first large bf16 matmul, which a local
    prefill provides; a decode engine whose first request is a remote one computes a single
    token (no such matmul) and its first attention call died of SIGILL ("Fatal Python error:
    Illegal instruction" in ``cpu_attention_with_kv_cache``, 2026-12-04)."""
    on_host = any(t.device.type == "cpu" for tensors in caches.values() for t in tensors)
    if not on_host or not torch.cpu._is_amx_tile_supported():
        return False
    return bool(torch.cpu._init_amx())

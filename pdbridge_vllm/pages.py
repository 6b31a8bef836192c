"""Pages between vLLM's paged KV caches and the link, on the worker: copied out of the cache for
a transfer, written back into the decode request's blocks as verified segments arrive."""

from __future__ import annotations

import torch
from vllm.distributed.kv_transfer.kv_connector.utils import clip_ssm_state_blocks

from grpc_kv import api as kv
from pdbridge_vllm.layout import KvLayout

NULL_BLOCK = 0  # vLLM's block pool hands out block 0 as the null block, never to a request


def page_bytes(tensor: torch.Tensor, block_ids: list[int]) -> bytes:
    """The pages of ``block_ids`` of one layer's cache, as contiguous bytes on the host (a
    copy: vLLM may reuse the blocks once the transfer is done; on a GPU this is the one
    device-to-host copy)."""
    index = torch.tensor(block_ids, dtype=torch.long, device=tensor.device)
    pages = tensor.index_select(0, index).contiguous()
    return pages.cpu().view(torch.uint8).numpy().tobytes()


class PageWriter:
    """Where each arriving page of a load goes: the request's block at that position of the
    layer's group (the running slot for linear state), or nowhere for positions this engine
    already holds (its own prefix cache) or keeps as null (outside a sliding window). Segments
    need not end on page boundaries; a partial page waits for the rest. Runs on the link's
    thread."""

    def __init__(
        self,
        layout: KvLayout,
        caches: dict[str, list[torch.Tensor]],
        block_ids: tuple[list[int], ...],
        n_tokens: int,
        local_tokens: int,
        spec_blocks: list[int],
    ) -> None:
        self._caches = caches
        self._pages = {p.name: p for g in layout.groups for p in g.layers}
        self._targets: dict[str, list[int | None]] = {}
        for g, group in enumerate(layout.groups):
            ids = block_ids[g] if g < len(block_ids) else []
            if group.kind == "state":
                slot = clip_ssm_state_blocks(list(ids), spec_blocks[g])
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
        buf = self._pending[name]
        buf += segment.data
        size = pages.page_bytes
        whole = len(buf) // size
        if not whole:
            return
        chunk = buf[: whole * size]  # a copy: the pages outlive this segment's buffer
        del buf[: whole * size]
        src = torch.frombuffer(chunk, dtype=torch.uint8)
        tensor = self._caches[pages.layer][pages.tensor]
        targets = self._targets[name]
        for k in range(whole):
            index = self._written[name] + k
            block = targets[index] if index < len(targets) else None
            if block is not None:
                dst = tensor[block]
                dst.copy_(src[k * size : (k + 1) * size].view(dst.dtype).view(dst.shape))
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

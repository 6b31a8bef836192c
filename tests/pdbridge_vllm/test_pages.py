"""Pages through the connector's copy, cut and write, with real tensors shaped as vLLM's CPU
backend shapes them: attention pages ``[heads, block, K|V]`` (full and sliding window), a Gated
DeltaNet conv state ``(state, channels)`` made of three sub-projections and its recurrent state
``[heads, v, k]``. For every pairing of prefill and decode tensor-parallel sizes up to 4, each
decode rank's cache must end up holding exactly its shard of the prefill engine's KV, byte for
byte, in the blocks the request owns (other blocks untouched); the same bytes split into
arbitrary segments land the same way."""

from __future__ import annotations

import itertools

import pytest
import torch

from grpc_kv.api import LayerKind, Segment
from pdbridge_vllm.layout import GroupLayout, KvLayout, LayerPages
from pdbridge_vllm.pages import Cutter, PageWriter, copy_pages
from pdbridge_vllm.shards import ShardSpec, held, sources

BLOCK = 4
N_TOKENS = 11  # three attention blocks, the last partial
NUM_BLOCKS = 9
#: name -> (group kind, global page shape, split, dtype, layer kind)
TENSORS = {
    "attn.full": ("full", (4, BLOCK, 6), ShardSpec(0, (4,)), torch.float32, LayerKind.FULL),
    "attn.swa": ("sliding", (2, BLOCK, 6), ShardSpec(0, (2,)), torch.float32, LayerKind.SLIDING),
    "gdn#0": ("state", (3, 32), ShardSpec(1, (8, 8, 16)), torch.bfloat16, LayerKind.CONV_STATE),
    "gdn#1": ("state", (4, 5, 3), ShardSpec(0, (4,)), torch.float32, LayerKind.LINEAR_STATE),
}
# The request's blocks per group (full, sliding, state); sliding keeps only its window tail
# (positions before it are vLLM's null block 0 and never written).
BLOCK_IDS = ([3, 5, 7], [0, 2, 6], [8])


def _shard(full: torch.Tensor, spec: ShardSpec, rank: int, tp: int) -> torch.Tensor:
    """A rank's pages of the global ``full`` ([blocks, *global page])."""
    axis, parts, base = spec.axis + 1, [], 0
    for size in spec.segments:
        units = held(size, tp, rank)
        parts.append(full.narrow(axis, base + units.start, len(units)))
        base += size
    return torch.cat(parts, dim=axis).contiguous()


def _local_shape(shape: tuple[int, ...], spec: ShardSpec, tp: int) -> tuple[int, ...]:
    out = list(shape)
    out[spec.axis] = spec.local_size(tp)
    return tuple(out)


def _layout(tp: int, rank: int) -> KvLayout:
    groups = []
    for kind, window in (("full", 0), ("sliding", 2), ("state", 0)):
        pages = []
        for name, (g, shape, spec, dtype, layer_kind) in TENSORS.items():
            if g != kind:
                continue
            local = _local_shape(shape, spec, tp)
            size = torch.Size(local).numel() * torch.tensor([], dtype=dtype).element_size()
            dtype_name = str(dtype).removeprefix("torch.")
            pages.append(LayerPages(name, size, dtype_name, local, layer_kind, spec))
        groups.append(GroupLayout(kind, BLOCK, window, tuple(pages)))
    return KvLayout(tuple(groups), tp=tp, rank=rank)


def _caches(global_kv: dict[str, torch.Tensor], tp: int, rank: int) -> dict[str, list]:
    caches: dict[str, list[torch.Tensor]] = {}
    for name, (_, _, spec, _, _) in TENSORS.items():
        layer, _, index = name.partition("#")
        caches.setdefault(layer, [])
        tensor = _shard(global_kv[name], spec, rank, tp)
        if index:
            caches[layer].insert(int(index), tensor)
        else:
            caches[layer].append(tensor)
    return caches


def _global_kv() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return {
        name: torch.randn((NUM_BLOCKS, *shape), generator=gen).to(dtype)
        for name, (_, shape, _, dtype, _) in TENSORS.items()
    }


def _send(layout: KvLayout, caches: dict, plan, chunk: int | None) -> list[Segment]:
    """What one prefill rank sends one decode rank, as the link would deliver it."""
    cut, segments = Cutter(layout), []
    for g, group in enumerate(layout.groups):
        positions = group.positions(N_TOKENS)
        ids = BLOCK_IDS[g][positions.start : positions.stop]
        for pages in group.layers:
            if pages.name not in plan.tensors:
                continue
            data = cut(copy_pages(caches[pages.layer][pages.tensor], ids), pages.name, plan)
            step = chunk or len(data)
            for offset in range(0, len(data), step):
                piece = data[offset : offset + step]
                final = offset + step >= len(data)
                segments.append(Segment(pages.name, offset, piece, final))
    return segments


@pytest.mark.parametrize("chunk", [None, 37])
@pytest.mark.parametrize(("n", "m"), list(itertools.product((1, 2, 4), (1, 2, 4))))
def test_each_decode_rank_ends_up_with_exactly_its_shard(n, m, chunk):
    global_kv = _global_kv()
    for r in range(m):
        decode = _layout(m, r)
        caches = _caches({k: torch.zeros_like(v) for k, v in global_kv.items()}, m, r)
        specs = decode.specs(n)
        for p in sources(specs, r, m, n):
            prefill = _layout(n, p)
            writer = PageWriter(decode, caches, BLOCK_IDS, N_TOKENS, 0, decode.plan_from(p, n))
            for segment in _send(prefill, _caches(global_kv, n, p), prefill.plan_to(r, m), chunk):
                writer.write(segment)
        want = _caches(global_kv, m, r)
        for g, group in enumerate(decode.groups):
            held_ids = [b for b in BLOCK_IDS[g] if b != 0]
            if group.kind == "sliding":
                held_ids = BLOCK_IDS[g][group.positions(N_TOKENS).start :]
            for pages in group.layers:
                got = caches[pages.layer][pages.tensor]
                expected = want[pages.layer][pages.tensor]
                assert torch.equal(got[held_ids], expected[held_ids]), (n, m, r, pages.name)
                others = [b for b in range(NUM_BLOCKS) if b not in held_ids]
                assert not got[others].any(), (n, m, r, pages.name, "wrote outside its blocks")


def test_equal_shards_go_as_whole_pages_without_a_copy_of_their_parts():
    layout = _layout(2, 1)
    plan = layout.plan_to(1, 2)
    assert all(plan.identity(name, TENSORS[name][2]) for name in TENSORS)
    pages = copy_pages(_caches(_global_kv(), 2, 1)["attn.full"][0], [3, 5])
    assert Cutter(layout)(pages, "attn.full", plan) == pages.numpy().tobytes()

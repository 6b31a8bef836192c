"""Tensor parallelism on either side of the link: what each prefill rank sends each decode rank,
checked against the definition (every unit a decode rank holds arrives exactly once, at its
place) for every pairing of sizes up to 8 and the splits the connector meets (attention heads,
replicated heads, GDN's conv state of three sub-projections)."""

from __future__ import annotations

import itertools

import pytest

from grpc_kv.api import LayerKind
from pdbridge_vllm.layout import GroupLayout, KvLayout, LayerPages
from pdbridge_vllm.shards import (
    ShardError,
    ShardSpec,
    held,
    part_id,
    plan,
    runs,
    sources,
    targets,
)

SIZES = (1, 2, 4, 8)
SPECS = {
    "two KV heads": ShardSpec(0, (2,)),
    "eight KV heads": ShardSpec(0, (8,)),
    "one KV head": ShardSpec(0, (1,)),
    "GDN conv [Q|K|V]": ShardSpec(0, (16, 16, 32)),
    "recurrent state on axis 1": ShardSpec(1, (8,)),
}


def _local(spec: ShardSpec, rank: int, tp: int) -> list[tuple[int, int]]:
    """A rank's page along the axis, unit by unit, as (segment, global unit)."""
    return [(j, u) for j, size in enumerate(spec.segments) for u in held(size, tp, rank)]


def test_a_rank_holds_an_even_share_or_one_replicated_unit():
    assert [held(8, 2, r) for r in range(2)] == [range(0, 4), range(4, 8)]
    assert [held(2, 4, r) for r in range(4)] == [range(0, 1), range(0, 1), range(1, 2), range(1, 2)]
    assert held(1, 8, 7) == range(0, 1)


@pytest.mark.parametrize("name", sorted(SPECS))
@pytest.mark.parametrize(("n", "m"), list(itertools.product(SIZES, SIZES)))
def test_every_decode_rank_gets_each_of_its_units_once_at_its_place(name, n, m):
    spec = SPECS[name]
    if any(size % t and t % size for size in spec.segments for t in (n, m)):
        with pytest.raises(ShardError):
            spec.check(n if any(size % n and n % size for size in spec.segments) else m)
        return
    specs = {"t": spec}
    for r in range(m):
        want = _local(spec, r, m)
        got: list[tuple[int, int] | None] = [None] * len(want)
        for p in sources(specs, r, m, n):
            have = _local(spec, p, n)
            for src, dst, length in plan(specs, (p, n), (r, m)).tensors["t"]:
                for i in range(length):
                    assert got[dst + i] is None, (p, r, dst + i, "written twice")
                    got[dst + i] = have[src + i]
        assert got == want, (n, m, r)
        assert spec.local_size(m) == len(want)


def test_a_replicated_head_is_sent_by_its_first_holder_only():
    specs = {"attn": ShardSpec(0, (2,))}
    # Prefill TP 4 over 2 heads: ranks 0, 1 hold head 0, ranks 2, 3 head 1.
    assert sources(specs, 0, 1, 4) == [0, 2]
    assert [len(targets(specs, p, 4, 1)) for p in range(4)] == [1, 0, 1, 0]
    # Decode TP 4: every rank needs its head, from the one prefill rank.
    assert [plan(specs, (0, 1), (r, 4)).tensors["attn"] for r in range(4)] == [
        ((0, 0, 1),),
        ((0, 0, 1),),
        ((1, 0, 1),),
        ((1, 0, 1),),
    ]


def test_gdn_conv_state_splits_each_sub_projection_on_its_own():
    spec = ShardSpec(0, (128, 128, 256))
    assert runs(spec, (0, 1), (1, 2)) == [(64, 0, 64), (192, 64, 64), (384, 128, 128)]
    assert runs(spec, (1, 2), (0, 1)) == [(0, 64, 64), (64, 192, 64), (128, 384, 128)]


def test_equal_sizes_send_whole_pages_rank_to_rank():
    specs = {"attn": ShardSpec(0, (4,)), "conv": ShardSpec(0, (8, 8, 16))}
    for tp in SIZES[:3]:
        for rank in range(tp):
            (only,) = targets(specs, rank, tp, tp)
            assert only.dst == (rank, tp)
            assert only.identity("attn", specs["attn"])
            assert only.identity("conv", specs["conv"])


def test_the_first_part_keeps_the_gateways_transfer_id():
    assert part_id("abc", 0) == "abc"
    assert part_id("abc", 2) == "abc~2"


def _layout(tp: int, rank: int, shard: bool = True) -> KvLayout:
    heads = 2 // min(tp, 2)
    attn = LayerPages(
        "attn.0",
        heads * 128 * 128 * 4,
        "float32",
        (heads, 128, 128),
        LayerKind.FULL,
        ShardSpec(0, (2,)) if shard else None,
    )
    return KvLayout((GroupLayout("full", 128, 0, (attn,)),), tp=tp, rank=rank)


def test_layouts_at_different_sizes_describe_the_same_engine_and_parts_are_checked():
    prefill = [_layout(2, r) for r in range(2)]
    decode = _layout(1, 0)
    assert prefill[0].describe() == decode.describe()
    for p, layout in enumerate(prefill):
        part = layout.plan_to(0, 1)
        attr = layout.to_attr(300, part, k=p)
        assert decode.check_attr(attr, 300, k=p) is None
        assert "expects part" in (decode.check_attr(attr, 300, k=1 - p) or "")
        (spec,) = layout.manifest(300, part)
        assert spec.shape == (1, 128, 128)
        assert spec.length == 3 * 128 * 128 * 4
    wrong = _layout(2, 0).to_attr(300, _layout(1, 0).plan_to(1, 2))
    assert "decode rank [1, 2]" in (decode.check_attr(wrong, 300) or "")


def test_an_unknown_split_pairs_only_equal_sizes_and_says_which_tensor():
    assert _layout(2, 0, shard=False).plan_to(0, 2).tensors["attn.0"] == ((0, 0, 1),)
    with pytest.raises(ShardError, match=r"attn\.0"):
        _layout(2, 0, shard=False).plan_to(0, 1)

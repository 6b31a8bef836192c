"""Tensor parallelism on either side of the link, vLLM-free (tested without vLLM).

With tensor parallelism every worker (TP rank) of an engine holds a *shard* of each KV page:
its KV heads of an attention layer, its share of a linear-attention layer's conv channels and
recurrent-state heads. Prefill and decode may run at different TP sizes (heterogeneous
hardware is the premise), so a prefill rank ships to each decode rank exactly the part of its
shard that rank holds -- no more (the WAN carries every byte once per decode rank that needs
it), and each decode rank writes what it receives at the right offset of its own pages.

A page's shard is described by a :class:`ShardSpec`: the page axis TP splits (heads for
attention, channels or heads for state) and the *global* sizes of the sub-projections along
it (one for attention heads; GDN's conv state is ``[Q | K | V]``, each split on its own, as
vLLM's ``derive_mamba_conv_split`` describes). Rank ``r`` of ``tp`` holds, of a segment of
``S`` units, ``[r * S // tp, r * S // tp + max(1, S // tp))``: an even split when ``tp``
divides ``S``, and one replicated unit per rank when ``S`` divides ``tp`` (vLLM's rule for KV
heads when TP exceeds their count).

A :class:`Plan` is what one prefill rank sends one decode rank: per tensor, runs of
``(source offset, destination offset, length)`` along the axis. Both sides compute the same
plan from the two TP sizes and the global specs (which travel in the transfer's header), so no
offsets go over the wire. A unit held by several prefill ranks (replicated heads) is sent by
the first of them only.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

Run = tuple[int, int, int]  # (source offset, destination offset, length) along the axis


class ShardError(ValueError):
    """A TP size that does not split a segment evenly (nor replicates it): the message names
    both."""


@dataclass(frozen=True)
class ShardSpec:
    """How TP splits one tensor's page: along ``axis``, segment by segment (global sizes)."""

    axis: int
    segments: tuple[int, ...]

    @property
    def total(self) -> int:
        return sum(self.segments)

    def local_size(self, tp: int) -> int:
        """This page's size along ``axis`` on a rank of an engine at ``tp``."""
        return sum(len(held(size, tp, 0)) for size in self.segments)

    def check(self, tp: int) -> None:
        for size in self.segments:
            if size % tp and tp % size:
                raise ShardError(
                    f"a segment of {size} units cannot be split over tensor parallel {tp} "
                    "(neither divides the other)"
                )

    def describe(self) -> list[object]:
        return [self.axis, list(self.segments)]


def held(size: int, tp: int, rank: int) -> range:
    """The units of a segment of ``size`` that rank ``rank`` of ``tp`` holds."""
    start = rank * size // tp
    return range(start, start + max(1, size // tp))


def _owner(unit: int, size: int, tp: int) -> int:
    """The first rank holding ``unit`` (the one that sends it when several do)."""
    return next(r for r in range(tp) if unit in held(size, tp, r))


def runs(spec: ShardSpec, src: tuple[int, int], dst: tuple[int, int]) -> list[Run]:
    """What prefill rank ``src = (rank, tp)`` sends decode rank ``dst = (rank, tp)`` of a
    tensor split as ``spec``: runs along the axis, in the destination's order."""
    (p, n), (r, m) = src, dst
    out: list[Run] = []
    src_base = dst_base = 0
    for size in spec.segments:
        mine, theirs = held(size, n, p), held(size, m, r)
        units = [u for u in theirs if u in mine and _owner(u, size, n) == p]
        for u in units:
            s, d = src_base + u - mine.start, dst_base + u - theirs.start
            if out and out[-1][0] + out[-1][2] == s and out[-1][1] + out[-1][2] == d:
                out[-1] = (out[-1][0], out[-1][1], out[-1][2] + 1)
            else:
                out.append((s, d, 1))
        src_base += len(mine)
        dst_base += len(theirs)
    return out


@dataclass(frozen=True)
class Plan:
    """What prefill rank ``src`` sends decode rank ``dst``: runs per tensor name (a tensor
    with no runs is not in the transfer at all)."""

    src: tuple[int, int]
    dst: tuple[int, int]
    tensors: Mapping[str, tuple[Run, ...]]

    @property
    def empty(self) -> bool:
        return not self.tensors

    def identity(self, name: str, spec: ShardSpec) -> bool:
        """Whether ``name``'s whole page goes as it is (equal shards: the common case)."""
        local = spec.local_size(self.src[1])
        return self.tensors.get(name) == ((0, 0, local),) and local == spec.local_size(self.dst[1])


def plan(specs: Mapping[str, ShardSpec], src: tuple[int, int], dst: tuple[int, int]) -> Plan:
    tensors = {name: tuple(r) for name, spec in specs.items() if (r := runs(spec, src, dst))}
    return Plan(src, dst, tensors)


def targets(specs: Mapping[str, ShardSpec], rank: int, tp: int, dst_tp: int) -> list[Plan]:
    """The non-empty plans of prefill rank ``rank`` of ``tp`` towards a decode engine at
    ``dst_tp``, by decode rank."""
    out = (plan(specs, (rank, tp), (r, dst_tp)) for r in range(dst_tp))
    return [p for p in out if not p.empty]


def sources(specs: Mapping[str, ShardSpec], rank: int, tp: int, src_tp: int) -> list[int]:
    """The prefill ranks (of an engine at ``src_tp``) that send decode rank ``rank`` of
    ``tp`` anything, in order: the k-th of them sends sub-transfer k (:func:`part_id`)."""
    return [p for p in range(src_tp) if not plan(specs, (p, src_tp), (rank, tp)).empty]


def part_id(transfer_id: str, k: int) -> str:
    """The transfer id of the k-th part a decode rank receives for one request: the gateway's
    id for the first (so logs and traces find it as before), ``id~k`` for the others."""
    return transfer_id if k == 0 else f"{transfer_id}~{k}"


def sub_shape(shape: Iterable[int], spec: ShardSpec, rs: Iterable[Run]) -> tuple[int, ...]:
    """The shape of the part of a page that ``rs`` select."""
    out = list(shape)
    out[spec.axis] = sum(length for _, _, length in rs)
    return tuple(out)


def global_shape(shape: Iterable[int], spec: ShardSpec) -> tuple[int, ...]:
    out = list(shape)
    out[spec.axis] = spec.total
    return tuple(out)

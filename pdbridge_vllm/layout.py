"""How a request's paged KV maps onto a grpc_kv transfer, vLLM-free (tested without vLLM).

vLLM keeps KV per *KV-cache group* (full attention, one per sliding-window layer set, one per
linear-attention layer set with hybrid models), addressed as (group, block id); block ids are
reused across groups and every layer's cache is a view of one backing buffer, so the connector
never ships "a layer's tensor": it ships, for every layer, the pages of the blocks the request
owns in that layer's group, in *position* order (the request's i-th block of the group):

* ``full``: every block the prompt's tokens touch, positions ``0 .. cdiv(n, block_size)``;
* ``sliding``: only the tail the window still sees (``cdiv(window, block) + 1`` blocks, as
  vLLM's own NIXL connector clips it);
* ``state`` (Mamba / Gated DeltaNet conv and recurrent state): one page, the running slot.

Each (layer, tensor) is one layer of the transfer's manifest, its pages concatenated; positions
are implied by the layout, which travels in the header (``LAYOUT_ATTR``) so the decode side can
refuse a transfer laid out for another configuration before writing any block.

With tensor parallelism a page is one rank's shard (:mod:`pdbridge_vllm.shards`): the layout
describes every tensor by its *global* page (all ranks together) and how TP splits it, so two
engines at different TP sizes describe the same layout, and a transfer's header says which
prefill rank sent it to which decode rank.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from grpc_kv.api import LayerKind, LayerSpec
from pdbridge_vllm.shards import (
    Plan,
    ShardError,
    ShardSpec,
    global_shape,
    plan,
    sub_shape,
)
from pdbridge_vllm.shards import sources as shard_sources

LAYOUT_ATTR = "pdbridge.vllm.layout"
LAYOUT_VERSION = 2
GROUP_KINDS = ("full", "sliding", "state")


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class LayerPages:
    """One tensor of one layer: what a page (one block's bytes) of it is."""

    name: str  # the transfer's layer name: the vLLM layer name, plus "#i" for its i-th tensor
    page_bytes: int  # this rank's page
    dtype: str
    page_shape: tuple[int, ...]  # this rank's page
    kind: LayerKind
    #: How TP splits the page (None: as if along axis 0, evenly -- the connector knows no
    #: better for this tensor, and refuses to pair engines at different TP sizes with it).
    shard: ShardSpec | None = None

    def spec(self, tp: int) -> ShardSpec:
        if self.shard is not None:
            return self.shard
        return ShardSpec(0, (self.page_shape[0] * tp,))

    def describe(self, tp: int) -> list[object]:
        spec = self.spec(tp)
        return [
            self.name,
            self.dtype,
            list(global_shape(self.page_shape, spec)),
            spec.describe(),
            self.shard is not None,
        ]

    def part_bytes(self, tp: int, runs: tuple[tuple[int, int, int], ...]) -> int:
        """Bytes of the part of one page that ``runs`` select."""
        spec = self.spec(tp)
        return self.page_bytes // self.page_shape[spec.axis] * sum(n for _, _, n in runs)

    @property
    def layer(self) -> str:
        return self.name.partition("#")[0]

    @property
    def tensor(self) -> int:
        _, _, index = self.name.partition("#")
        return int(index or 0)


@dataclass(frozen=True)
class GroupLayout:
    kind: str
    block_size: int
    window_blocks: int
    layers: tuple[LayerPages, ...]

    def positions(self, n_tokens: int) -> range:
        """The positions (the request's i-th block of this group) a transfer carries."""
        if self.kind == "state":
            return range(1)
        blocks = cdiv(n_tokens, self.block_size)
        if self.kind == "sliding":
            return range(max(0, blocks - self.window_blocks), blocks)
        return range(blocks)

    def ready_until(self, computed: int, n_tokens: int) -> int:
        """Positions whose tokens are all computed once ``computed`` tokens are (the last,
        partial block counts once the prompt is done)."""
        if self.kind == "state":
            return 1 if computed >= n_tokens else 0
        if computed >= n_tokens:
            return cdiv(n_tokens, self.block_size)
        return computed // self.block_size


@dataclass(frozen=True)
class KvLayout:
    """The transfer layout of one vLLM worker (one per transfer group, in vLLM's order): this
    rank's pages, and the engine's tensor-parallel size and this worker's rank in it."""

    groups: tuple[GroupLayout, ...]
    tp: int = 1
    rank: int = 0

    def group_of(self, layer_name: str) -> int | None:
        for index, group in enumerate(self.groups):
            if any(pages.layer == layer_name for pages in group.layers):
                return index
        return None

    def first_attention(self) -> LayerPages | None:
        return next((p for g in self.groups if g.kind != "state" for p in g.layers), None)

    def tensors(self) -> dict[str, LayerPages]:
        return {p.name: p for g in self.groups for p in g.layers}

    def specs(self, other_tp: int) -> dict[str, ShardSpec]:
        """Every tensor's split, for pairing with an engine at ``other_tp``; raises
        ShardError when the sizes differ and a tensor's split is unknown, or uneven."""
        specs = {}
        for pages in self.tensors().values():
            if pages.shard is None and other_tp != self.tp:
                raise ShardError(
                    f"tensor parallel {self.tp} here, {other_tp} on the other side: the split "
                    f"of {pages.name} ({pages.kind.name.lower()}) across ranks is not known to "
                    "the connector; run both sides at the same tensor-parallel size"
                )
            spec = pages.spec(self.tp)
            spec.check(self.tp)
            spec.check(other_tp)
            specs[pages.name] = spec
        return specs

    def plan_to(self, rank: int, tp: int) -> Plan:
        """What this (prefill) rank sends decode rank ``rank`` of ``tp``."""
        return plan(self.specs(tp), (self.rank, self.tp), (rank, tp))

    def plan_from(self, rank: int, tp: int) -> Plan:
        """What prefill rank ``rank`` of ``tp`` sends this (decode) rank."""
        return plan(self.specs(tp), (rank, tp), (self.rank, self.tp))

    def manifest(self, n_tokens: int, part: Plan | None = None) -> tuple[LayerSpec, ...]:
        """The layers of a transfer of ``n_tokens``: every tensor's pages, or (``part``) the
        parts of them one rank sends another."""
        specs = []
        for group in self.groups:
            count = len(group.positions(n_tokens))
            for pages in group.layers:
                shape, size = pages.page_shape, pages.page_bytes
                if part is not None:
                    runs = part.tensors.get(pages.name)
                    if not runs:
                        continue
                    shape = sub_shape(shape, pages.spec(self.tp), runs)
                    size = pages.part_bytes(self.tp, runs)
                specs.append(
                    LayerSpec(
                        name=pages.name,
                        kind=pages.kind,
                        dtype=pages.dtype,
                        shape=shape,
                        length=count * size,
                    )
                )
        return tuple(specs)

    def bytes_for(self, n_tokens: int) -> int:
        return sum(spec.length for spec in self.manifest(n_tokens))

    def describe(self) -> list[dict[str, object]]:
        """The engine's layout, the same at every TP size (global pages and their splits)."""
        return [
            {
                "kind": g.kind,
                "block_size": g.block_size,
                "window_blocks": g.window_blocks,
                "layers": [p.describe(self.tp) for p in g.layers],
            }
            for g in self.groups
        ]

    def to_attr(self, n_tokens: int, part: Plan | None = None, k: int = 0) -> str:
        """The header attribute of a transfer (``part``: of sub-transfer ``k`` of a plan)."""
        src, dst = (part.src, part.dst) if part is not None else ((self.rank, self.tp), (0, 1))
        return json.dumps(
            {
                "version": LAYOUT_VERSION,
                "n_tokens": n_tokens,
                "src": list(src),
                "dst": list(dst),
                "part": k,
                "groups": self.describe(),
            },
            separators=(",", ":"),
        )

    def check_attr(self, text: str | None, n_tokens: int, k: int = 0) -> str | None:
        """Why a transfer whose header says ``text`` cannot be loaded by this (decode) rank
        as its ``k``-th part (None when it can): another layout (model configuration, block
        size, dtype, window), another token count, or a part meant for another rank."""
        theirs, reason = self._parse(text)
        if theirs is None:
            return reason
        if theirs.get("n_tokens") != n_tokens:
            return (
                f"header: the transfer carries {theirs.get('n_tokens')!r} tokens, "
                f"this request expects {n_tokens}"
            )
        if theirs.get("groups") != json.loads(json.dumps(self.describe())):
            return (
                "header: the KV layout differs from this engine's (another model "
                "configuration, block size, dtype or window)"
            )
        dst = theirs.get("dst")
        if dst != [self.rank, self.tp]:
            return (
                f"header: the part is for decode rank {dst!r} ([rank, tensor parallel]), "
                f"this is rank [{self.rank}, {self.tp}]"
            )
        src_rank, src_tp = self.source(text)
        try:
            expected = self.sources(src_tp)
        except ShardError as exc:
            return f"header: {exc}"
        if theirs.get("part") != k or k >= len(expected) or expected[k] != src_rank:
            return (
                f"header: part {theirs.get('part')!r} comes from prefill rank {src_rank} of "
                f"{src_tp}; this rank expects part {k} from rank "
                f"{expected[k] if k < len(expected) else None} of {expected}"
            )
        return None

    def source(self, text: str | None) -> tuple[int, int]:
        """The prefill (rank, tensor parallel) a header's attribute names ((0, 1) if none)."""
        theirs, _ = self._parse(text)
        src = theirs.get("src") if theirs else None
        if (
            isinstance(src, list)
            and len(src) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) for v in src)
            and 0 <= src[0] < src[1]
        ):
            return src[0], src[1]
        return 0, 1

    def sources(self, src_tp: int) -> list[int]:
        """The prefill ranks of an engine at ``src_tp`` that send this rank a part, in the
        order of the parts."""
        return shard_sources(self.specs(src_tp), self.rank, self.tp, src_tp)

    @staticmethod
    def _parse(text: str | None) -> tuple[Mapping[str, Any] | None, str]:
        if not text:
            return None, f"header: no {LAYOUT_ATTR} (not sent by pdbridge's vLLM connector)"
        try:
            theirs = json.loads(text)
        except ValueError:
            return None, f"header: {LAYOUT_ATTR} is not JSON"
        if not isinstance(theirs, dict) or theirs.get("version") != LAYOUT_VERSION:
            version = theirs.get("version") if isinstance(theirs, dict) else theirs
            return None, f"header: {LAYOUT_ATTR} version {version!r:.40} is not {LAYOUT_VERSION}"
        return theirs, ""


def state_kind(tensor_index: int) -> LayerKind:
    """Mamba-style layers register (conv state, recurrent state)."""
    return LayerKind.CONV_STATE if tensor_index == 0 else LayerKind.LINEAR_STATE

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
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from grpc_kv.api import LayerKind, LayerSpec

LAYOUT_ATTR = "pdbridge.vllm.layout"
LAYOUT_VERSION = 1
GROUP_KINDS = ("full", "sliding", "state")


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class LayerPages:
    """One tensor of one layer: what a page (one block's bytes) of it is."""

    name: str  # the transfer's layer name: the vLLM layer name, plus "#i" for its i-th tensor
    page_bytes: int
    dtype: str
    page_shape: tuple[int, ...]
    kind: LayerKind

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
    """The transfer layout of one vLLM instance (one per transfer group, in vLLM's order)."""

    groups: tuple[GroupLayout, ...]

    def group_of(self, layer_name: str) -> int | None:
        for index, group in enumerate(self.groups):
            if any(pages.layer == layer_name for pages in group.layers):
                return index
        return None

    def first_attention(self) -> LayerPages | None:
        return next((p for g in self.groups if g.kind != "state" for p in g.layers), None)

    def manifest(self, n_tokens: int) -> tuple[LayerSpec, ...]:
        specs = []
        for group in self.groups:
            count = len(group.positions(n_tokens))
            for pages in group.layers:
                specs.append(
                    LayerSpec(
                        name=pages.name,
                        kind=pages.kind,
                        dtype=pages.dtype,
                        shape=pages.page_shape,
                        length=count * pages.page_bytes,
                    )
                )
        return tuple(specs)

    def bytes_for(self, n_tokens: int) -> int:
        return sum(spec.length for spec in self.manifest(n_tokens))

    def describe(self) -> list[dict[str, object]]:
        return [
            {
                "kind": g.kind,
                "block_size": g.block_size,
                "window_blocks": g.window_blocks,
                "layers": [[p.name, p.page_bytes, p.dtype, list(p.page_shape)] for p in g.layers],
            }
            for g in self.groups
        ]

    def to_attr(self, n_tokens: int) -> str:
        return json.dumps(
            {"version": LAYOUT_VERSION, "n_tokens": n_tokens, "groups": self.describe()},
            separators=(",", ":"),
        )

    def check_attr(self, text: str | None, n_tokens: int) -> str | None:
        """Why a transfer whose header says ``text`` cannot be loaded here (None when it can):
        another layout (model configuration, block size, dtype, window) or another token count."""
        if not text:
            return f"header: no {LAYOUT_ATTR} (not sent by pdbridge's vLLM connector)"
        try:
            theirs = json.loads(text)
        except ValueError:
            return f"header: {LAYOUT_ATTR} is not JSON"
        if not isinstance(theirs, dict) or theirs.get("version") != LAYOUT_VERSION:
            return f"header: {LAYOUT_ATTR} version {theirs!r:.40} is not {LAYOUT_VERSION}"
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
        return None


def state_kind(tensor_index: int) -> LayerKind:
    """Mamba-style layers register (conv state, recurrent state)."""
    return LayerKind.CONV_STATE if tensor_index == 0 else LayerKind.LINEAR_STATE

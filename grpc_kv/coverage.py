"""Where every verified byte of a transfer lands, checked in sequence order.

Chunk checksums already cover each chunk's placement fields (``grpc_kv.codec.chunk_seed``),
so damage in flight is resent, never placed. This is the second line, for what a checksum
cannot see: a sender that places bytes wrongly (a bug, or ``checksum none`` in diagnostics),
or a local-socket stream from a broken receiver. In sequence order, each layer's segments must
continue exactly where its previous one ended (no overlap, no hole), nothing may follow a
layer's final segment, no layer may outgrow its declared length, and at the end every layer of
the manifest must have ended -- exactly at its declared length where one is declared.

Used by the receiver's store (as chunks become contiguous) and by the local socket's engine
side (as segments arrive). Pure bookkeeping, non-blocking; a violation raises
:class:`CoverageError` naming the layer, the offsets and the sequence number.
"""

from __future__ import annotations

from grpc_kv.manifest import TransferHeader


class CoverageError(ValueError):
    """Bytes would land where they must not (overlap, hole, past a layer's end or final
    segment, a layer outside the manifest), or a layer ended short of its declared length."""


class Coverage:
    """The running coverage of one transfer's layers (see module docstring)."""

    def __init__(self, header: TransferHeader) -> None:
        self._specs = {spec.name: spec for spec in header.layers}
        self._ends: dict[str, int] = {}
        self._final: set[str] = set()

    def place(self, seq: int, layer: str, offset: int, length: int, final: bool) -> None:
        """Account for the next segment in sequence order; CoverageError if it may not land."""
        spec = self._specs.get(layer)
        if self._specs and spec is None:
            raise CoverageError(f"chunk {seq}: layer {layer!r} is not in the layout manifest")
        if layer in self._final:
            raise CoverageError(f"chunk {seq}: layer {layer!r} continues after its final chunk")
        end = self._ends.get(layer, 0)
        if offset != end:
            what = "overlaps" if offset < end else "leaves a hole before"
            raise CoverageError(
                f"chunk {seq}: layer {layer!r} at offset {offset} {what} byte {end}, "
                "where its previous chunk ended"
            )
        end += length
        declared = spec.length if spec is not None else 0
        if declared and end > declared:
            raise CoverageError(
                f"chunk {seq}: layer {layer!r} runs to byte {end}, past its declared "
                f"length {declared}"
            )
        if final and declared and end != declared:
            raise CoverageError(
                f"chunk {seq}: layer {layer!r} ends at byte {end}, short of its declared "
                f"length {declared}"
            )
        self._ends[layer] = end
        if final:
            self._final.add(layer)

    def incomplete(self) -> str | None:
        """Why the transfer does not cover its manifest exactly (None when it does): a layer
        of the manifest, or one that was sent, whose final segment never came."""
        for name in (*self._specs, *self._ends):
            if name not in self._final:
                held = self._ends.get(name, 0)
                declared = self._specs[name].length if name in self._specs else 0
                size = f" of {declared}" if declared else ""
                return f"layer {name!r} is incomplete: {held}{size} bytes and no final chunk"
        return None

"""Plain-Python views of a transfer's header: ids, model fingerprint, layout manifest.

Producers build these (the prefill engine knows its layers); the receiver hands them to the
consumer before any data. Conversion to and from the wire messages lives here only.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, field
from typing import Any

import xxhash

from grpc_kv.protocol import pb

MAX_ID_LENGTH = 128


class LayerKind(enum.StrEnum):
    FULL = "full"
    SLIDING = "sliding"
    LINEAR_STATE = "linear-state"
    CONV_STATE = "conv-state"
    UNSPECIFIED = "unspecified"


_KIND_TO_PB = {
    LayerKind.UNSPECIFIED: pb.LAYER_KIND_UNSPECIFIED,
    LayerKind.FULL: pb.LAYER_KIND_FULL,
    LayerKind.SLIDING: pb.LAYER_KIND_SLIDING,
    LayerKind.LINEAR_STATE: pb.LAYER_KIND_LINEAR_STATE,
    LayerKind.CONV_STATE: pb.LAYER_KIND_CONV_STATE,
}
_PB_TO_KIND = {v: k for k, v in _KIND_TO_PB.items()}


@dataclass(frozen=True)
class Fingerprint:
    """Identity of the model that computed the KV: weights sha256 + architecture hash.
    A decode engine refuses KV computed by another model."""

    weights_sha256: str
    arch_hash: str

    def __str__(self) -> str:
        return f"{self.weights_sha256[:12]}/{self.arch_hash[:12]}"


@dataclass(frozen=True)
class LayerSpec:
    """One layer of the layout manifest. ``length`` is the declared byte length (0 = not
    known up front; segments are then append-only until the layer's final one)."""

    name: str
    kind: LayerKind = LayerKind.UNSPECIFIED
    dtype: str = ""
    shape: tuple[int, ...] = ()
    offset: int = 0
    length: int = 0


@dataclass(frozen=True)
class TransferHeader:
    """What the receiver learns before any data: ids, fingerprint, layout, free attributes."""

    transfer_id: str
    fingerprint: Fingerprint
    request_id: str = ""
    layers: tuple[LayerSpec, ...] = ()
    attrs: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        validate_header(self)

    def layer(self, name: str) -> LayerSpec | None:
        return next((spec for spec in self.layers if spec.name == name), None)

    def digest(self) -> int:
        """xxh3-64 of a canonical encoding of every field (attrs sorted; never 0): what the
        sender states in Begin and seeds every chunk's checksum with, so the receiver can
        tell a header damaged in flight and no chunk can be placed under another header.
        Protobuf's own serialisation is not canonical (map order), hence JSON here."""
        canonical = [
            self.transfer_id,
            self.request_id,
            self.fingerprint.weights_sha256,
            self.fingerprint.arch_hash,
            [
                [s.name, s.kind.value, s.dtype, list(s.shape), s.offset, s.length]
                for s in self.layers
            ],
            sorted(self.attrs.items()),
        ]
        encoded = json.dumps(canonical, separators=(",", ":"), ensure_ascii=False).encode()
        return int(xxhash.xxh3_64_intdigest(encoded)) or 1

    def to_pb(self) -> Any:
        return pb.TransferHeader(
            transfer_id=self.transfer_id,
            request_id=self.request_id,
            fingerprint=pb.Fingerprint(
                weights_sha256=self.fingerprint.weights_sha256,
                arch_hash=self.fingerprint.arch_hash,
            ),
            layers=[
                pb.LayerSpec(
                    name=s.name,
                    kind=_KIND_TO_PB[s.kind],
                    dtype=s.dtype,
                    shape=list(s.shape),
                    offset=s.offset,
                    length=s.length,
                )
                for s in self.layers
            ],
            attrs=dict(self.attrs),
        )

    @classmethod
    def from_pb(cls, msg: Any) -> TransferHeader:
        """Raises ValueError naming the field when the message is not a valid header."""
        return cls(
            transfer_id=msg.transfer_id,
            request_id=msg.request_id,
            fingerprint=fingerprint_from_pb(msg.fingerprint),
            layers=tuple(
                LayerSpec(
                    name=s.name,
                    kind=_PB_TO_KIND.get(s.kind, LayerKind.UNSPECIFIED),
                    dtype=s.dtype,
                    shape=tuple(s.shape),
                    offset=s.offset,
                    length=s.length,
                )
                for s in msg.layers
            ),
            attrs=dict(msg.attrs),
        )


def fingerprint_from_pb(msg: Any) -> Fingerprint:
    return Fingerprint(weights_sha256=msg.weights_sha256, arch_hash=msg.arch_hash)


def validate_header(header: TransferHeader) -> None:
    """Raise ValueError naming the offending field."""
    if not header.transfer_id or len(header.transfer_id) > MAX_ID_LENGTH:
        raise ValueError(f"header.transfer_id: 1..{MAX_ID_LENGTH} characters required")
    if len(header.request_id) > MAX_ID_LENGTH:
        raise ValueError(f"header.request_id: at most {MAX_ID_LENGTH} characters")
    if not header.fingerprint.weights_sha256 or not header.fingerprint.arch_hash:
        raise ValueError("header.fingerprint: weights_sha256 and arch_hash are required")
    names = [spec.name for spec in header.layers]
    if len(set(names)) != len(names):
        raise ValueError("header.layers: layer names must be unique")
    for spec in header.layers:
        if not spec.name:
            raise ValueError("header.layers[].name: must not be empty")
        if spec.length < 0:
            raise ValueError(f"header.layers[{spec.name}].length: must be >= 0")

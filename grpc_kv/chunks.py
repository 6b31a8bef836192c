"""Verifying one received chunk, before the store places it: its declared size, its codec,
its decompressed length and its checksum over the payload, its placement fields and the
transfer's header. Shared by both data paths' receivers (gRPC and bulk); pure and blocking, so
a receiver runs it in a worker thread for big chunks."""

from __future__ import annotations

from typing import Any

from grpc_kv.codec import (
    PB_TO_CODEC,
    Checksum,
    Codec,
    CodecError,
    CorruptChunk,
    checksum,
    chunk_seed,
    decompress,
)


class ChunkRejected(Exception):
    """A chunk is malformed or contradicts the header: INVALID_ARGUMENT to the sender."""


def decode_chunk(
    chunk: Any, payload: bytes | memoryview, kind: Checksum, max_chunk: int, header_digest: int
) -> bytes | memoryview:
    """Decode and verify one chunk whose payload was cut out of its frame (blocking).
    An uncompressed payload comes back as the same view, uncopied. ChunkRejected for
    impossible chunks, CorruptChunk when bytes do not match the checksum, which covers the
    chunk's placement fields and the transfer's header too (``chunk_seed``): a flipped
    offset, seq, layer name or final flag is a resend, like a flipped payload byte (never
    with ``Checksum.NONE``, which verifies nothing; sizes and bombs are still refused)."""
    if chunk.raw_length > max_chunk:
        raise ChunkRejected(f"chunk.raw_length {chunk.raw_length} exceeds the maximum {max_chunk}")
    codec = PB_TO_CODEC.get(chunk.codec)
    if codec is None:
        raise ChunkRejected(f"chunk.codec {chunk.codec} is unknown")
    data: bytes | memoryview
    try:
        if codec is Codec.NONE and len(payload) == chunk.raw_length:
            data = payload
        else:
            data = decompress(codec, payload, chunk.raw_length)
    except CodecError as exc:
        raise ChunkRejected(f"chunk {chunk.seq}: {exc}") from exc
    # Checksum.NONE (diagnostic mode): nothing to verify; the bounds above still held.
    if kind is Checksum.NONE:
        return data
    seed = chunk_seed(
        header_digest, chunk.seq, chunk.layer, chunk.offset, chunk.raw_length, chunk.layer_final
    )
    if checksum(kind, data, seed) != chunk.checksum:
        raise CorruptChunk(f"chunk {chunk.seq}: checksum mismatch")
    return data

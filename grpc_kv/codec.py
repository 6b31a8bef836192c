"""Chunk codec of the KV link: chunking, compression, checksums, the transfer digest.

Pure functions, blocking, CPU-bound (zstandard and numpy release the GIL, so callers run
large chunks in a worker thread). Failures surface as :class:`CodecError` (bad input from
a peer: the receiver turns it into INVALID_ARGUMENT) or :class:`CorruptChunk` (payload does
not match its checksum: the receiver asks for a resend).
"""

from __future__ import annotations

import enum
import struct
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import crc32c
import numpy as np
import xxhash
import zstandard

from grpc_kv.protocol import pb


class CodecError(ValueError):
    """A chunk is malformed: declared sizes are impossible or it inflates past them."""


class CorruptChunk(ValueError):
    """A chunk decoded but its bytes do not match the checksum: resend it."""


class Codec(enum.StrEnum):
    """Per-chunk compression. ``auto`` is resolved per chunk by :class:`AutoCodec`."""

    NONE = "none"
    ZSTD = "zstd"
    ZSTD_BYTEPLANE = "zstd-byteplane"
    AUTO = "auto"


class Checksum(enum.StrEnum):
    """Per-chunk checksum of the raw bytes. ``none`` is a diagnostic mode, never for
    production: chunks are neither checksummed nor verified, so bytes damaged in flight
    reach the consumer (it lets tests prove that the engines' own verification catches
    them). Decompression stays bounded in every mode."""

    XXH3 = "xxh3"
    CRC32C = "crc32c"
    NONE = "none"


CODEC_TO_PB = {
    Codec.NONE: pb.CODEC_NONE,
    Codec.ZSTD: pb.CODEC_ZSTD,
    Codec.ZSTD_BYTEPLANE: pb.CODEC_ZSTD_BYTEPLANE,
}
PB_TO_CODEC = {v: k for k, v in CODEC_TO_PB.items()}
CHECKSUM_TO_PB = {
    Checksum.XXH3: pb.CHECKSUM_XXH3_64,
    Checksum.CRC32C: pb.CHECKSUM_CRC32C,
    Checksum.NONE: pb.CHECKSUM_NONE,
}
PB_TO_CHECKSUM = {v: k for k, v in CHECKSUM_TO_PB.items()}


def checksum(kind: Checksum, data: bytes | memoryview, seed: int = 0) -> int:
    """Checksum of raw bytes: xxh3-64 or crc32c (both tens of GB/s); 0 for ``none``.

    ``seed`` (a :func:`chunk_seed`) binds the value to the fields that decide where the bytes
    land: xxh3 takes it as its seed, crc32c as its initial value (its low 32 bits), so the
    binding costs no second pass over the data."""
    if kind is Checksum.NONE:
        return 0
    if kind is Checksum.CRC32C:
        return int(crc32c.crc32c(data, seed & 0xFFFFFFFF))
    return int(xxhash.xxh3_64_intdigest(data, seed))


_SEED_FIELDS = struct.Struct("<QQQQB")


def chunk_seed(
    header_digest: int, seq: int, layer: str, offset: int, raw_length: int, final: bool
) -> int:
    """The checksum seed of one chunk: xxh3-64 over the transfer's header digest (ids,
    fingerprint, layout manifest: :meth:`grpc_kv.manifest.TransferHeader.digest`) and the
    chunk's own placement fields. A chunk whose seq, layer, offset, length or final flag
    changed in flight -- or that belongs to another transfer -- fails its checksum exactly as
    a damaged payload does, and is resent."""
    fields = _SEED_FIELDS.pack(header_digest, seq, offset, raw_length, final)
    return int(xxhash.xxh3_64_intdigest(fields + layer.encode()))


def transfer_digest(checksums: Iterable[int]) -> int:
    """xxh3-64 over the chunk checksums (8 bytes little-endian each) in sequence order."""
    h = xxhash.xxh3_64()
    for value in checksums:
        h.update(struct.pack("<Q", value))
    return int(h.intdigest())


def split_byteplanes(data: bytes | memoryview) -> bytes:
    """Low bytes of every 16-bit value, then high bytes; an odd trailing byte goes last.
    The exponent bytes of bf16/fp16 cluster, so zstd finds far more redundancy."""
    even = len(data) - (len(data) % 2)
    words = np.frombuffer(data, dtype=np.uint8, count=even).reshape(-1, 2)
    planes = np.ascontiguousarray(words.T).tobytes()
    return planes + bytes(data[even:])


def merge_byteplanes(planes: bytes | memoryview) -> bytes:
    """Inverse of :func:`split_byteplanes`."""
    even = len(planes) - (len(planes) % 2)
    split = np.frombuffer(planes, dtype=np.uint8, count=even).reshape(2, -1)
    return np.ascontiguousarray(split.T).tobytes() + bytes(planes[even:])


def compress(codec: Codec, data: bytes | memoryview, level: int = 1) -> bytes:
    """Encode raw bytes with a concrete codec (never ``auto``)."""
    if codec is Codec.NONE:
        return bytes(data)
    if codec is Codec.ZSTD_BYTEPLANE:
        data = split_byteplanes(data)
    elif codec is not Codec.ZSTD:
        raise ValueError(f"codec {codec} must be resolved before compressing")
    return zstandard.ZstdCompressor(level=level, write_content_size=True).compress(data)


def max_payload(codec: Codec, raw_length: int) -> int:
    """The largest payload a well-formed chunk of ``raw_length`` raw bytes can have."""
    if codec is Codec.NONE:
        return raw_length
    # zstd's worst case bound (ZSTD_compressBound) plus frame header slack.
    return raw_length + (raw_length >> 8) + 128


def decompress(codec: Codec, payload: bytes | memoryview, raw_length: int) -> bytes:
    """Decode a payload into exactly ``raw_length`` bytes, never allocating more.

    Raises CodecError when the payload is larger than any honest encoding of raw_length
    bytes, declares another content size, or inflates past raw_length (a bomb); raises
    CorruptChunk when zstd cannot decode it (damaged in flight).
    """
    if len(payload) > max_payload(codec, raw_length):
        raise CodecError(
            f"payload of {len(payload)} bytes exceeds the bound for raw_length {raw_length}"
        )
    if codec is Codec.NONE:
        if len(payload) != raw_length:
            raise CodecError(f"payload is {len(payload)} bytes, raw_length says {raw_length}")
        return payload if isinstance(payload, bytes) else bytes(payload)
    try:
        params = zstandard.get_frame_parameters(payload)
    except zstandard.ZstdError as exc:
        raise CorruptChunk(f"not a zstd frame: {exc}") from exc
    if params.content_size not in (raw_length, zstandard.CONTENTSIZE_UNKNOWN):
        raise CodecError(
            f"zstd frame declares {params.content_size} bytes, raw_length says {raw_length}"
        )
    out = _bounded_inflate(payload, raw_length)
    if codec is Codec.ZSTD_BYTEPLANE:
        out = merge_byteplanes(out)
    return out


def _bounded_inflate(payload: bytes | memoryview, raw_length: int) -> bytes:
    try:
        # Read at most raw_length + 1 bytes: one more than allowed proves a bomb without ever
        # holding more than that in memory.
        reader = zstandard.ZstdDecompressor().stream_reader(bytes(payload))
        out = reader.read(raw_length + 1)
    except zstandard.ZstdError as exc:
        raise CorruptChunk(f"zstd decode failed: {exc}") from exc
    if len(out) > raw_length:
        raise CodecError(f"chunk inflates past its raw_length of {raw_length} bytes")
    if len(out) != raw_length:
        raise CorruptChunk(f"chunk inflates to {len(out)} bytes, raw_length says {raw_length}")
    return out


def split(data: bytes | memoryview, chunk_size: int) -> Iterator[tuple[int, memoryview]]:
    """(offset, view) pieces of at most ``chunk_size`` bytes; one empty piece for empty data."""
    view = memoryview(data).cast("B")
    if len(view) == 0:
        yield 0, view
        return
    for start in range(0, len(view), chunk_size):
        yield start, view[start : start + chunk_size]


@dataclass
class CodecSpeed:
    """Measured throughput (raw bytes/s) and compression ratio of one codec on a sample."""

    codec: Codec
    bytes_per_s: float
    ratio: float


class AutoCodec:
    """Chooses a codec per chunk: compress only when it shortens the transfer.

    Called by the sender (blocking, cheap after the first call). Estimates, for each codec,
    the time to move ``n`` raw bytes as max(encode time, wire time) — encoding and sending
    overlap across chunks — and picks the smallest; ``none`` wins on fast links. Codec
    speeds are measured on a sample of the first chunk and refreshed every ``refresh_s``.
    """

    def __init__(self, level: int = 1, sample_bytes: int = 1 << 20, refresh_s: float = 30.0):
        self.level = level
        self.sample_bytes = sample_bytes
        self.refresh_s = refresh_s
        self._speeds: list[CodecSpeed] = []
        self._measured_at = 0.0

    def measure(self, sample: bytes | memoryview) -> list[CodecSpeed]:
        speeds = []
        sample = memoryview(sample)[: self.sample_bytes]
        for codec in (Codec.ZSTD, Codec.ZSTD_BYTEPLANE):
            compress(codec, sample[:65536], self.level)  # warm up: first calls are slow
            start = time.perf_counter()
            out = compress(codec, sample, self.level)
            elapsed = max(time.perf_counter() - start, 1e-6)
            speeds.append(CodecSpeed(codec, len(sample) / elapsed, len(sample) / max(len(out), 1)))
        self._speeds = speeds
        self._measured_at = time.monotonic()
        return speeds

    def observe(self, codec: Codec, raw_bytes: int, seconds: float) -> None:
        """Fold a real encode (raw bytes in ``seconds``, in the sender's pipeline) into the
        codec's speed: the sample measured alone is optimistic once the transport and the
        producer compete for the same cores."""
        if seconds <= 0 or raw_bytes < 4096:
            return
        for speed in self._speeds:
            if speed.codec is codec:
                speed.bytes_per_s = 0.5 * speed.bytes_per_s + 0.5 * raw_bytes / seconds

    def choose(self, data: bytes | memoryview, link_bytes_per_s: float) -> Codec:
        """The codec for this chunk given the link's rate in bytes/s (0 = unknown: taken
        for a slow link, where the wire dominates: the most compressing codec if it saves
        the 20 % asked of any, else none)."""
        if len(data) < 4096:
            return Codec.NONE
        if not self._speeds or time.monotonic() - self._measured_at > self.refresh_s:
            self.measure(data)
        if link_bytes_per_s <= 0:
            densest = max(self._speeds, key=lambda s: s.ratio)
            return densest.codec if densest.ratio >= 1 / 0.8 else Codec.NONE
        plain = 1.0 / link_bytes_per_s
        best = min(
            self._speeds,
            key=lambda s: max(1.0 / s.bytes_per_s, 1.0 / (s.ratio * link_bytes_per_s)),
        )
        per_byte = max(1.0 / best.bytes_per_s, 1.0 / (best.ratio * link_bytes_per_s))
        # Compress only for a 20% gain: the estimate is optimistic (the CPU is shared with
        # the transport and the producer).
        return best.codec if per_byte < plain * 0.8 else Codec.NONE

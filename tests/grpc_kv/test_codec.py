import os

import pytest
import torch
import zstandard

from grpc_kv.codec import (
    AutoCodec,
    Checksum,
    Codec,
    CodecError,
    CorruptChunk,
    checksum,
    compress,
    decompress,
    merge_byteplanes,
    split,
    split_byteplanes,
    transfer_digest,
)
from tests.grpc_kv.kvtest import bf16_normal, tensor_bytes

CONCRETE = [Codec.NONE, Codec.ZSTD, Codec.ZSTD_BYTEPLANE]
DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.int8]


@pytest.mark.parametrize("codec", CONCRETE)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("numel", [0, 1, 7, 4099])
def test_round_trip_is_exact(codec, dtype, numel):
    raw = tensor_bytes(dtype, numel, seed=numel)

    assert decompress(codec, compress(codec, raw), len(raw)) == raw


@pytest.mark.parametrize("n", [0, 1, 2, 3, 1001])
def test_byteplanes_invert(n):
    raw = os.urandom(n)

    assert merge_byteplanes(split_byteplanes(raw)) == raw


def test_byteplanes_compress_bf16_better_than_plain_zstd():
    raw = bf16_normal(1 << 20)

    plain = len(compress(Codec.ZSTD, raw))
    planes = len(compress(Codec.ZSTD_BYTEPLANE, raw))

    assert planes < plain < len(raw)


def test_decompression_bomb_is_rejected_without_inflating():
    bomb = zstandard.ZstdCompressor(write_content_size=False).compress(bytes(64 << 20))

    with pytest.raises(CodecError, match="inflates past"):
        decompress(Codec.ZSTD, bomb, 4096)


def test_frame_declaring_more_than_raw_length_is_rejected():
    payload = compress(Codec.ZSTD, bytes(10_000))

    with pytest.raises(CodecError, match="declares 10000"):
        decompress(Codec.ZSTD, payload, 5_000)


def test_payload_larger_than_any_encoding_is_rejected():
    with pytest.raises(CodecError, match="exceeds the bound"):
        decompress(Codec.ZSTD, os.urandom(5000), 100)


def test_uncompressed_payload_must_match_raw_length():
    with pytest.raises(CodecError, match="raw_length says 11"):
        decompress(Codec.NONE, b"0123456789", 11)


def test_garbage_zstd_payload_is_corrupt_not_invalid():
    with pytest.raises(CorruptChunk):
        decompress(Codec.ZSTD, b"\x00" * 64, 1000)


@pytest.mark.parametrize("kind", [Checksum.XXH3, Checksum.CRC32C])
def test_checksums_detect_one_flipped_bit(kind):
    raw = bytearray(os.urandom(4096))
    before = checksum(kind, raw)

    raw[1234] ^= 0x01

    assert checksum(kind, raw) != before


def test_checksum_none_is_zero_whatever_the_bytes():
    """The diagnostic mode computes nothing (and the receiver verifies nothing)."""
    assert checksum(Checksum.NONE, os.urandom(4096)) == 0


def test_transfer_digest_depends_on_order():
    assert transfer_digest([1, 2, 3]) != transfer_digest([2, 1, 3])
    assert transfer_digest([1, 2, 3]) == transfer_digest(iter([1, 2, 3]))


def test_split_sizes_and_empty_input():
    pieces = [(o, len(v)) for o, v in split(b"x" * 10, 4)]

    assert pieces == [(0, 4), (4, 4), (8, 2)]
    assert [(o, len(v)) for o, v in split(b"", 4)] == [(0, 0)]


def test_auto_skips_compression_on_fast_links_and_uses_it_on_slow_ones():
    raw = bf16_normal(1 << 20)
    auto = AutoCodec()

    slow = auto.choose(raw, 200e6 / 8)  # 200 Mbit/s
    fast = auto.choose(raw, 100e9 / 8)  # 100 Gbit/s

    assert slow in (Codec.ZSTD, Codec.ZSTD_BYTEPLANE)
    assert fast is Codec.NONE


def test_auto_leaves_incompressible_data_alone():
    assert AutoCodec().choose(os.urandom(1 << 20), 200e6 / 8) is Codec.NONE


def test_auto_on_a_link_of_unknown_rate_compresses_what_compresses_and_nothing_else():
    assert AutoCodec().choose(bf16_normal(1 << 20), 0) is Codec.ZSTD_BYTEPLANE  # ratio ~1.46
    assert AutoCodec().choose(os.urandom(1 << 20), 0) is Codec.NONE

"""The hand-made framing around chunk payloads: the receiver's zero-copy cut of the payload,
the sender's lazy frames of immutable bytes, and the allocator tuning both ends apply."""

import asyncio
import os
import subprocess
import sys

import pytest

from grpc_kv.api import LinkOptions, open_transfer
from grpc_kv.protocol import pb
from grpc_kv.wire import CHUNK_PAYLOAD_FIELD, FrameError, split_field, with_field
from tests.grpc_kv.kvtest import (
    INSECURE,
    RawClient,
    chunk_checksum,
    chunk_frame,
    make_header,
    receiver,
    run,
)
from tests.support import subprocess_env, unavailable


def test_split_field_cuts_the_payload_out_and_protobuf_parses_the_rest():
    frame = chunk_frame("t1", 7, "l0", 128, b"payload bytes", final=True)

    head, payload = split_field(frame, CHUNK_PAYLOAD_FIELD)

    assert bytes(payload) == b"payload bytes"
    chunk = pb.Chunk.FromString(head)
    assert (chunk.transfer_id, chunk.seq, chunk.offset, chunk.layer_final) == ("t1", 7, 128, True)
    assert chunk.payload == b""


def test_split_field_finds_a_payload_anywhere_and_the_last_occurrence_wins():
    small = pb.Chunk(transfer_id="t1", seq=3).SerializeToString()
    first = pb.Chunk(payload=b"old").SerializeToString()
    last = pb.Chunk(payload=b"new").SerializeToString()

    head, payload = split_field(first + small + last, CHUNK_PAYLOAD_FIELD)

    assert bytes(payload) == b"new" == pb.Chunk.FromString(first + small + last).payload
    assert pb.Chunk.FromString(head).seq == 3


def test_split_field_without_the_field_gives_an_empty_payload():
    head, payload = split_field(pb.Chunk(seq=1).SerializeToString(), CHUNK_PAYLOAD_FIELD)
    assert len(payload) == 0
    assert pb.Chunk.FromString(head).seq == 1


@pytest.mark.parametrize("size", [0, 1, 127, 128, 300_000])
def test_with_field_frames_what_protobuf_would_and_split_field_cuts_it_back(size):
    data = os.urandom(size)
    small = pb.Chunk(transfer_id="t1", seq=3, layer="model.layers.3", offset=4096)
    small_bytes = small.SerializeToString()

    frame = with_field(small_bytes, CHUNK_PAYLOAD_FIELD, memoryview(data))

    by_protobuf = pb.Chunk(
        transfer_id="t1", seq=3, layer="model.layers.3", offset=4096, payload=data
    )
    assert pb.Chunk.FromString(frame) == by_protobuf
    # Byte for byte too, except that proto3 leaves an empty field out (same message).
    assert frame == by_protobuf.SerializeToString() or (
        size == 0 and frame == small_bytes + b"\x4a\x00"
    )
    head, payload = split_field(frame, CHUNK_PAYLOAD_FIELD)
    assert pb.Chunk.FromString(head) == small
    assert bytes(payload) == data


@pytest.mark.parametrize(
    "frame",
    [b"\x4a\x10short", b"\x08", b"\x08\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01", b"\x0b"],
    ids=["length past the end", "truncated varint", "overlong varint", "group wire type"],
)
def test_split_field_rejects_malformed_frames(frame):
    with pytest.raises(FrameError):
        split_field(frame, CHUNK_PAYLOAD_FIELD)


def test_receiver_accepts_a_frame_with_the_payload_before_the_small_fields():
    async def scenario():
        async with receiver() as (server, target):
            raw = RawClient(target)
            header = make_header({"l0": 0})
            await raw.begin(header)
            data = os.urandom(4096)
            small = pb.Chunk(
                transfer_id=header.transfer_id,
                seq=0,
                layer="l0",
                layer_final=True,
                raw_length=len(data),
                checksum=chunk_checksum(header, 0, "l0", 0, data, final=True),
            ).SerializeToString()
            consumer = asyncio.create_task(server.open(header.transfer_id, 10.0))
            acks = await raw.push([pb.Chunk(payload=data).SerializeToString() + small])
            async with await consumer as reader:
                first = await anext(aiter(reader))
            await raw.close()
            return acks, first, data

    acks, first, data = run(scenario())

    assert [a.status for a in acks] == [pb.ACK_OK]
    assert first.data == data


@pytest.mark.parametrize("kind", ["bytes", "bytearray"])
def test_a_buffer_changed_after_send_layer_returns_does_not_change_what_arrives(kind):
    """bytes are framed lazily (referenced until acked): safe, they cannot change. Any other
    buffer is copied by send_layer, so the producer may reuse it at once."""
    original = os.urandom(1 << 20)
    options = LinkOptions(chunk_size_bytes=64 * 1024, compression="none", window=2)

    async def scenario():
        async with receiver() as (server, target):
            header = make_header({"kv": len(original)})
            consumer = asyncio.create_task(server.open(header.transfer_id, 20.0))
            buffer = bytes(original) if kind == "bytes" else bytearray(original)
            async with open_transfer(target, header, options, INSECURE) as tx:
                await tx.send_layer("kv", buffer)
                if isinstance(buffer, bytearray):
                    buffer[:] = bytes(len(buffer))  # the producer reuses its buffer
                summary = await tx.finish()
            async with await consumer as reader:
                received = b"".join([s.data async for s in reader])
            return summary, received

    summary, received = run(scenario())

    assert received == original
    assert summary.chunks == 16


def test_allocator_tuning_applies_on_glibc_and_can_be_switched_off():
    code = "from grpc_kv.alloc import tune_allocator; print(tune_allocator())"
    env = subprocess_env()
    on = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    env["PDBRIDGE_KV_MALLOC_TUNING"] = "0"
    off = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert off.stdout.strip() == "False", off.stderr
    if os.confstr("CS_GNU_LIBC_VERSION") is None:
        unavailable("mallopt is glibc's")
    assert on.stdout.strip() == "True", on.stderr

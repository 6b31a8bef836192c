"""Hostile or broken input: INVALID_ARGUMENT, counted, and the server keeps serving."""

import asyncio

import grpc
import pytest
import zstandard

from grpc_kv.api import LinkOptions, ReceiverOptions, open_transfer
from grpc_kv.protocol import pb
from tests.grpc_kv.kvtest import INSECURE, RawClient, chunk_frame, make_header, receiver, run

BOMB = zstandard.ZstdCompressor(write_content_size=False).compress(bytes(256 << 20))


def bad_frames(tid):
    """Frames of transfer ``tid`` (a header, for checksums that a correct sender states)."""
    return {
        "not protobuf": b"\xff\xff\xff\xff\x0f garbage",
        "unknown layer": chunk_frame(tid, 0, "nope", 0, b"abc"),
        "past the declared layer length": chunk_frame(tid, 0, "l0", 4000, b"x" * 200),
        "longer than declared": chunk_frame(tid, 0, "l0", 0, b"x" * 100, raw_length=50),
        "over the maximum chunk": chunk_frame(
            tid, 0, "l0", 0, b"abc", raw_length=(1 << 20) + 1, codec=1, payload=b"x"
        ),
        "decompression bomb": chunk_frame(
            tid, 0, "l0", 0, b"", raw_length=4096, codec=1, payload=BOMB
        ),
        "unknown codec": chunk_frame(tid, 0, "l0", 0, b"abc", codec=9),
        "payload cut short": chunk_frame(tid, 0, "l0", 0, b"x" * 100)[:-10],
    }


# Checksum none (diagnostic mode) verifies no bytes, but every bound still holds.
@pytest.mark.parametrize("checksum", [pb.CHECKSUM_XXH3_64, pb.CHECKSUM_NONE], ids=["xxh3", "none"])
@pytest.mark.parametrize("kind", list(bad_frames("x")))
def test_bad_frame_is_invalid_argument_and_others_still_transfer(kind, checksum):
    async def scenario():
        options = ReceiverOptions(max_chunk_bytes=1 << 20, accept_unverified=True)
        async with receiver(options) as (server, target):
            raw = RawClient(target)
            bad = make_header({"l0": 4096})
            await raw.begin(bad, checksum=checksum)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await raw.push([bad_frames(bad)[kind]])
            await raw.close()
            # Another transfer on the same server is unaffected.
            good = make_header({"l0": 0})
            consumer = asyncio.create_task(server.open(good.transfer_id, 5.0))
            async with open_transfer(target, good, LinkOptions(), INSECURE) as tx:
                await tx.send_layer("l0", b"fine" * 1000)
                await tx.finish()
            async with await consumer as reader:
                data = b"".join([s.data async for s in reader])
            invalid = server.metrics.value("pdbridge_kv_invalid_frames_total", role="receiver")
            return err.value, data, invalid

    err, data, invalid = run(scenario())

    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert data == b"fine" * 1000
    assert invalid == 1


def test_chunk_for_a_transfer_never_begun_is_not_found():
    async def scenario():
        async with receiver() as (_server, target):
            raw = RawClient(target)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await raw.push([chunk_frame("ghost", 0, "l0", 0, b"abc")])
            await raw.close()
            return err.value.code()

    assert run(scenario()) == grpc.StatusCode.NOT_FOUND


def test_corrupt_chunk_is_answered_resend_and_never_delivered():
    async def scenario():
        async with receiver() as (server, target):
            raw = RawClient(target)
            header = make_header({"l0": 0})
            await raw.begin(header)
            acks = await raw.push(
                [
                    chunk_frame(header, 0, "l0", 0, b"good", corrupt=True),
                    chunk_frame(header, 0, "l0", 0, b"good"),
                ]
            )
            failures = server.metrics.value("pdbridge_kv_checksum_failures_total", role="receiver")
            await raw.close()
            return acks, failures, server.memory_in_use

    acks, failures, memory = run(scenario())

    assert [a.status for a in acks] == [1, 0]  # ACK_CORRUPT, then ACK_OK
    assert failures == 1
    assert memory == 4


def test_a_receiver_refuses_unverified_transfers_unless_told_to_accept_them():
    """checksum none is a sender-side diagnostic: a receiver not started for it refuses the
    transfer at Begin, before any byte, so unverified KV never reaches a decode engine."""

    async def scenario():
        async with receiver() as (_server, target):
            raw = RawClient(target)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await raw.begin(make_header({"l0": 4096}), checksum=pb.CHECKSUM_NONE)
            await raw.close()
        return err.value

    err = run(scenario())

    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "refuses unverified transfers" in err.details()

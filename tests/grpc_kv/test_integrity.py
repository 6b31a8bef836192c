"""Integrity over everything that decides where a byte lands: single bits flipped inside
chunk heads (offset, seq, layer name, final flag) on plaintext links, on both data paths and
through compression. With checksums on, every transfer delivers exactly the bytes sent (the
damaged chunk is resent); with checksums off (diagnostics), the receiver's coverage check
fails it by name rather than deliver wrong bytes. Real receivers, real sockets, the fault
proxy in the path.
"""

import asyncio
import contextlib
import os

import grpc
import pytest

from grpc_kv.api import LinkOptions, ReceiverOptions, TransferFailed, open_transfer
from grpc_kv.codec import transfer_digest
from grpc_kv.faultproxy import FaultProxy, Flip
from grpc_kv.results import TransferError
from grpc_kv.wire import varint
from tests.grpc_kv.kvtest import (
    INSECURE,
    RawClient,
    chunk_checksum,
    chunk_frame,
    make_header,
    receiver,
    run,
)

CHUNK = 16 * 1024
PER_LAYER = 8
# Two layer names one bit apart, of the same size: a flip could swap their chunks.
LAYERS = ("L0.rec0", "L1.rec0")


def layer_head(name: str) -> bytes:
    """A Chunk head's layer field: tag 3, length-delimited."""
    return b"\x1a" + varint(len(name)) + name.encode()


def flip_for(field: str, transfer_id: str) -> Flip:
    """A one-bit flip of ``field`` in a chunk head of layer L0 (the first distinct
    occurrence: a resent copy of the same chunk passes untouched)."""
    tid = transfer_id.encode()
    head = layer_head(LAYERS[0])
    last_offset = (PER_LAYER - 1) * CHUNK
    if field == "offset":  # offset 16384 -> 16385 ... (tag 4 follows the layer name)
        return Flip(direction="upstream", pattern=head + b"\x20", at=0, mask=0x01, limit=1)
    if field == "seq":  # seq n -> n ^ 2 (tag 2 follows the transfer id)
        pattern = b"\x0a" + varint(len(tid)) + tid + b"\x10"
        return Flip(direction="upstream", pattern=pattern, at=0, mask=0x02, limit=1)
    if field == "layer":  # L0.rec0 -> L1.rec0
        return Flip(direction="upstream", pattern=b"\x1a\x07L0", at=-1, mask=0x01, limit=1)
    if field == "final":  # the last chunk of L0 loses its final flag
        pattern = head + b"\x20" + varint(last_offset) + b"\x28\x01"
        return Flip(direction="upstream", pattern=pattern, at=-1, mask=0x01, limit=1)
    raise AssertionError(field)


async def proxied(server, data_path):
    """(target for the sender, proxy): the proxy sits where the chunks travel."""
    if data_path == "bulk":
        proxy = FaultProxy(upstream=f"127.0.0.1:{server.bulk.port}")
        server.bulk.advertised_port = await proxy.start()
        return f"127.0.0.1:{server.port}", proxy
    proxy = FaultProxy(upstream=f"127.0.0.1:{server.port}")
    return f"127.0.0.1:{await proxy.start()}", proxy


async def one_transfer(server, target, proxy, field, options):
    """Send both layers through a fresh flip; (data, received or the error, flips)."""
    data = {name: os.urandom(PER_LAYER * CHUNK) for name in LAYERS}
    header = make_header({name: len(v) for name, v in data.items()})
    flip = proxy.add(flip_for(field, header.transfer_id))
    consumer = asyncio.create_task(server.open(header.transfer_id, 30.0))
    try:
        async with open_transfer(target, header, options, INSECURE) as tx:
            for name, value in data.items():
                await tx.send_layer(name, value)
            await tx.finish()
        received: dict[str, bytearray] = {}
        async with await consumer as reader:
            async for segment in reader:
                received.setdefault(segment.layer, bytearray()).extend(segment.data)
        outcome: object = {k: bytes(v) for k, v in received.items()}
    except (TransferError, TransferFailed) as exc:
        outcome = exc
        consumer.cancel()
        await asyncio.gather(consumer, return_exceptions=True)
    finally:
        proxy.remove(flip)
    return data, outcome, flip.flipped


def flipped_transfers(data_path, field, options, receiver_options):
    """Run transfers until one had its head flipped (a pattern split across two of the
    proxy's reads is left alone, so a single transfer may see none); every outcome."""

    async def scenario():
        async with receiver(receiver_options) as (server, _):
            target, proxy = await proxied(server, data_path)
            outcomes = []
            try:
                for _ in range(4):
                    data, outcome, flips = await one_transfer(server, target, proxy, field, options)
                    outcomes.append((data, outcome, flips))
                    if flips:
                        break
            finally:
                await proxy.stop()
            failures = server.metrics.value("pdbridge_kv_checksum_failures_total", role="receiver")
            return outcomes, failures, server.memory_in_use

    return run(scenario(), timeout=120)


FIELDS = ["offset", "seq", "layer", "final"]


@pytest.mark.parametrize("compression", ["none", "zstd"])
@pytest.mark.parametrize("field", FIELDS)
@pytest.mark.parametrize("data_path", ["grpc", "bulk"])
def test_a_bit_flipped_in_a_chunk_head_is_resent_and_the_bytes_arrive_exactly(
    data_path, field, compression
):
    options = LinkOptions(
        chunk_size_bytes=CHUNK,
        compression=compression,
        data_path=data_path,
        timeout_ms=30_000,
        rpc_timeout_ms=1000,
    )

    outcomes, failures, memory = flipped_transfers(
        data_path, field, options, ReceiverOptions(bulk=data_path == "bulk")
    )

    assert outcomes[-1][2] == 1  # the head really was damaged in flight, once
    for data, outcome, _ in outcomes:
        assert outcome == data  # every byte where it was sent, none twice, none missing
    if field != "seq":
        # A damaged seq may name a chunk already held (acknowledged as a duplicate and
        # resent after a stall); every other flip fails the header-bound checksum.
        assert failures == 1
    assert memory == 0


@pytest.mark.parametrize("field", FIELDS)
@pytest.mark.parametrize("data_path", ["grpc", "bulk"])
def test_without_checksums_a_misplaced_chunk_fails_by_name_and_never_delivers(data_path, field):
    """checksum none (diagnostics) verifies no bytes, so a flip in a head reaches the store:
    its coverage check refuses anything but exact placement."""
    options = LinkOptions(
        chunk_size_bytes=CHUNK,
        compression="none",
        checksum="none",
        data_path=data_path,
        timeout_ms=30_000,
        rpc_timeout_ms=1000,
    )
    receiver_options = ReceiverOptions(bulk=data_path == "bulk", accept_unverified=True)

    outcomes, _, memory = flipped_transfers(data_path, field, options, receiver_options)

    data, outcome, flips = outcomes[-1]
    assert flips == 1
    if isinstance(outcome, Exception):
        assert "layer coverage" in str(outcome) or "never sent" in str(outcome), outcome
    else:
        assert outcome == data, "delivered bytes that differ from those sent"
    assert memory == 0


# A sender that places its (correctly checksummed) chunks wrongly: the store's coverage check.
# (seq, offset, length, final) of each chunk of layer l0, declared 3000 bytes.
MISPLACED = {
    "overlap": ([(0, 0, 1000, False), (1, 500, 1000, False)], "at offset 500 overlaps byte 1000"),
    "hole": ([(0, 0, 1000, False), (1, 2000, 1000, True)], "leaves a hole before byte 1000"),
    "after final": ([(0, 0, 3000, True), (1, 3000, 0, False)], "continues after its final chunk"),
    "short last chunk": ([(0, 0, 1000, False), (1, 1000, 1000, True)], "short of its declared"),
    "no final chunk": ([(0, 0, 1000, False), (1, 1000, 2000, False)], "incomplete: 3000 of 3000"),
}


@pytest.mark.parametrize("case", list(MISPLACED))
def test_chunks_that_would_misplace_bytes_fail_the_transfer_by_name(case):
    """Each chunk passes its checksum (the sender meant it so), but together they do not
    cover the layer exactly once: the consumer gets TransferFailed naming where, never the
    bytes, and the sender's Finish is refused."""
    chunks, named = MISPLACED[case]

    async def scenario():
        async with receiver() as (server, target):
            raw = RawClient(target)
            header = make_header({"l0": 3000})
            await raw.begin(header)
            consumer = asyncio.create_task(server.open(header.transfer_id, 10.0))
            frames, sums = [], []
            for seq, offset, length, final in chunks:
                data = os.urandom(length)
                frames.append(chunk_frame(header, seq, "l0", offset, data, final=final))
                sums.append(chunk_checksum(header, seq, "l0", offset, data, final=final))
            with contextlib.suppress(grpc.aio.AioRpcError):
                await raw.push(frames)
            finish_error = None
            try:
                await raw.finish(header.transfer_id, len(chunks), 3000, transfer_digest(sums))
            except grpc.aio.AioRpcError as exc:
                finish_error = exc
            await raw.close()
            with pytest.raises(TransferFailed) as err:
                async with await consumer as reader:
                    _ = [segment async for segment in reader]
            return err.value, finish_error, server.memory_in_use

    error, finish_error, memory = run(scenario())

    assert "layer coverage" in str(error)
    assert named in str(error)
    assert finish_error is not None  # the sender learns it too
    assert memory == 0

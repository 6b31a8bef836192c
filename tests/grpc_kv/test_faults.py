"""The link under faults injected by the userspace fault proxy: corruption, cuts, dead paths."""

import asyncio
import gc
import logging
import os
import time

import pytest

from grpc_kv.api import (
    Link,
    LinkMetrics,
    LinkOptions,
    ReceiverOptions,
    ReceiverUnreachable,
    TransferFailed,
    TransferTimeout,
    open_transfer,
)
from grpc_kv.faultproxy import Bandwidth, Drop, FaultProxy, Flip, Latency
from tests.grpc_kv.kvtest import INSECURE, make_header, receiver, run
from tests.support import connections_to

MARKER = b"\x00PDBRIDGE-FLIP-ME\x00"


async def proxied(target):
    proxy = FaultProxy(upstream=target)
    port = await proxy.start()
    return proxy, f"127.0.0.1:{port}"


async def send_through(server, via, data, options, timeout_s=30.0):
    """One layer of ``data`` sent to ``server`` through ``via``: (summary, bytes received)."""
    header = make_header({"kv": len(data)})
    consumer = asyncio.create_task(server.open(header.transfer_id, timeout_s))
    async with open_transfer(via, header, options, INSECURE) as tx:
        await tx.send_layer("kv", data)
        summary = await tx.finish()
    async with await consumer as reader:
        received = b"".join([s.data async for s in reader])
    return summary, received


def marked_chunks(count, size):
    """Random chunks, each holding MARKER followed by its own 8-byte id mid-payload."""
    chunks = []
    for i in range(count):
        body = bytearray(os.urandom(size))
        at = size // 2
        body[at : at + len(MARKER) + 8] = MARKER + i.to_bytes(8, "little")
        chunks.append(bytes(body))
    return chunks


def test_hundred_chunks_corrupted_in_flight_are_detected_resent_and_never_delivered():
    chunk = 64 * 1024
    data = b"".join(marked_chunks(150, chunk))
    options = LinkOptions(
        chunk_size_bytes=chunk, compression="none", connections=2, window=8, timeout_ms=30_000
    )

    async def scenario():
        async with receiver() as (server, target):
            proxy, via = await proxied(target)
            flip = proxy.add(Flip(direction="upstream", pattern=MARKER, context=8, limit=100))
            summary, received = await send_through(server, via, data, options)
            failures = server.metrics.value("pdbridge_kv_checksum_failures_total", role="receiver")
            await proxy.stop()
            return flip.flipped, failures, summary, received

    flipped, failures, summary, received = run(scenario())

    assert flipped == 100
    assert failures == 100
    assert summary.checksum_failures == 100
    assert summary.retransmits == 100
    assert received == data


def test_an_answer_lost_on_a_path_that_goes_on_resends_its_chunk_and_no_other():
    """The answers to a stream's chunks come back in the order written; when one is lost and
    the stream goes on (a black hole restored over frames that happened to be whole: CI,
    stop 32), the next answer names a later chunk. Taken as the oldest chunk's answer, it
    put every later answer one chunk off, each read as corrupt, until a chunk ran out of
    retries ("chunk 34 failed 4 times"). The chunk whose answer was lost goes again."""
    chunk = 64 * 1024
    data = os.urandom(40 * chunk)
    options = LinkOptions(
        chunk_size_bytes=chunk, compression="none", connections=1, window=4, timeout_ms=30_000
    )
    # The gRPC message holding Ack(seq=10, status OK, contiguous < 128): 4 bytes long.
    answer_to_10 = b"\x00\x00\x00\x00\x04\x08\x0a\x18"

    async def scenario():
        async with receiver() as (server, target):
            proxy, via = await proxied(target)
            drop = proxy.add(Drop(direction="downstream", pattern=answer_to_10))
            summary, received = await send_through(server, via, data, options)
            await proxy.stop()
            return drop.dropped, summary, received

    dropped, summary, received = run(scenario())

    assert dropped == 1
    assert received == data
    assert summary.checksum_failures == 0  # nothing was damaged: no answer taken for corrupt
    assert 1 <= summary.retransmits <= options.window  # the unanswered chunk (and any
    # answered in the same dropped read), not the rest of the transfer


@pytest.mark.parametrize("mode", ["reset", "blackhole"])
def test_link_cut_and_restored_within_the_deadline_resumes_resending_at_most_the_window(mode):
    chunk, window = 256 * 1024, 4
    data = os.urandom(24 << 20)
    options = LinkOptions(
        chunk_size_bytes=chunk, compression="none", connections=2, window=window, timeout_ms=15_000
    )

    async def scenario():
        async with receiver() as (server, target):
            proxy, via = await proxied(target)
            proxy.add(Bandwidth(direction="upstream", bytes_per_s=20e6))  # ~1.2 s at full rate
            header = make_header({"kv": len(data)})
            consumer = asyncio.create_task(server.open(header.transfer_id, 15.0))

            async def cut_midway():
                while (
                    server.metrics.value("pdbridge_kv_bytes_raw_total", role="receiver")
                    < len(data) / 3
                ):
                    await asyncio.sleep(0.01)
                proxy.cut(mode)
                await asyncio.sleep(0.5)
                proxy.restore()

            cutter = asyncio.create_task(cut_midway())
            async with open_transfer(via, header, options, INSECURE) as tx:
                await tx.send_layer("kv", data)
                summary = await tx.finish()
            await cutter
            async with await consumer as reader:
                received = b"".join([s.data async for s in reader])
            resets = proxy.stats.resets
            await proxy.stop()
            return summary, received, resets

    summary, received, resets = run(scenario())

    assert resets >= 1 or mode == "blackhole"
    assert received == data
    assert summary.resumes >= 1
    # A reset kills every connection at once: at most the window goes again. In a black
    # hole each connection is declared dead on its own stall timer, so a chunk moved from
    # the first one may go once more over the second before that one is declared dead.
    assert summary.resent_bytes <= window * chunk * (1 if mode == "reset" else 2)
    assert summary.resent_bytes < len(data) // 10


@pytest.mark.parametrize("mode", ["blackhole", "reset"])
def test_link_down_past_the_deadline_fails_both_sides_in_time_and_frees_memory(mode):
    deadline_ms = 2000
    options = LinkOptions(
        chunk_size_bytes=64 * 1024, compression="none", timeout_ms=deadline_ms, rpc_timeout_ms=500
    )

    async def scenario():
        async with receiver() as (server, target):
            baseline = server.memory_in_use
            proxy, via = await proxied(target)
            header = make_header({"kv": 0})
            times = {}
            start = time.monotonic()

            async def consume():
                try:
                    async with await server.open(header.transfer_id, 30.0) as reader:
                        async for _ in reader:
                            pass
                except TransferFailed:
                    times["receiver"] = time.monotonic() - start

            async def doomed_transfer():
                async with open_transfer(via, header, options, INSECURE) as tx:
                    await tx.send_layer("kv", os.urandom(1 << 20), final=False)
                    while not server.metrics.value("pdbridge_kv_chunks_total", role="receiver"):
                        await asyncio.sleep(0.01)
                    proxy.cut(mode)
                    await tx.send_layer("kv", os.urandom(1 << 20), final=True)
                    await tx.finish()

            consumer = asyncio.create_task(consume())
            with pytest.raises(TransferTimeout):
                await doomed_transfer()
            times["sender"] = time.monotonic() - start
            await consumer
            await proxy.stop()
            return times, baseline, server.memory_in_use, server.active_transfers

    times, baseline, memory, active = run(scenario())

    assert times["sender"] <= deadline_ms / 1000 + 1.0
    assert times["receiver"] <= deadline_ms / 1000 + 1.0
    assert memory == baseline == 0
    assert active == 0


@pytest.mark.parametrize("mode", ["blackhole", "reset"])
def test_a_cut_mid_transfer_longer_than_unreachable_ms_fails_as_unreachable_not_at_the_deadline(
    mode,
):
    """Cut after the first chunks and left cut: the sender resumes while the outage is
    shorter than ``unreachable_ms``, then fails ``ReceiverUnreachable`` -- seconds, not the
    30 s deadline -- so the request can be served another way."""
    options = LinkOptions(
        chunk_size_bytes=64 * 1024, compression="none", timeout_ms=30000, rpc_timeout_ms=500,
        unreachable_ms=1500,
    )  # fmt: skip

    async def scenario():
        async with receiver() as (server, target):
            proxy, via = await proxied(target)
            header = make_header({"kv": 0})
            reader = asyncio.ensure_future(server.open(header.transfer_id, 60.0))
            started = cut_at = time.monotonic()
            error = None
            try:
                async with open_transfer(via, header, options, INSECURE) as tx:
                    await tx.send_layer("kv", os.urandom(1 << 20), final=False)
                    while not server.metrics.value("pdbridge_kv_chunks_total", role="receiver"):
                        await asyncio.sleep(0.01)
                    proxy.cut(mode)
                    cut_at = time.monotonic()
                    await tx.send_layer("kv", os.urandom(1 << 20), final=True)
                    await tx.finish()
            except ReceiverUnreachable as exc:
                error = exc
            failed_after = time.monotonic() - cut_at
            reader.cancel()
            await proxy.stop()
            return error, failed_after, time.monotonic() - started

    error, failed_after, _ = run(scenario())

    assert "push: receiver" in str(error) or "begin: receiver" in str(error), error
    assert "unreachable for 1500 ms" in str(error)
    assert 1.5 * 0.9 <= failed_after < 10  # the bound plus a stall check, not the deadline


def test_a_slow_link_is_not_unreachable_and_a_short_cut_on_it_resumes():
    """A link so slow that no ack comes for longer than ``unreachable_ms`` (each 64 KiB chunk
    takes ~2 s at 32 KB/s, the bound is 1 s) is slow, not unreachable: a 0.3 s cut on it is
    resumed and the transfer completes, whole."""
    options = LinkOptions(
        chunk_size_bytes=64 * 1024, compression="none", connections=1, window=2,
        timeout_ms=60000, rpc_timeout_ms=2000, unreachable_ms=1000,
    )  # fmt: skip
    data = os.urandom(256 * 1024)

    async def scenario():
        async with receiver() as (server, target):
            proxy, via = await proxied(target)
            proxy.add(Bandwidth(direction="upstream", bytes_per_s=32 * 1024))
            header = make_header({"kv": len(data)})

            async def consume():
                got = bytearray()
                async with await server.open(header.transfer_id, 60.0) as reader:
                    async for segment in reader:
                        got += segment.data
                return bytes(got)

            consumer = asyncio.create_task(consume())
            async with open_transfer(via, header, options, INSECURE) as tx:
                await tx.send_layer("kv", data[:131072], final=False)
                # Past the bound without an ack: the first chunk is still on the slow wire.
                await asyncio.sleep(1.5)
                proxy.cut("reset")
                await asyncio.sleep(0.3)
                proxy.restore()
                await tx.send_layer("kv", data[131072:], final=True)
                summary = await tx.finish()
            got = await consumer
            await proxy.stop()
            return summary, got

    summary, got = run(scenario())

    assert got == data
    assert summary.resumes >= 1


def test_a_finish_whose_answer_is_lost_is_asked_again_and_the_delivered_transfer_completes():
    """The receiver accepts the trailer, its consumer reads everything (the transfer ends
    there), and the connection drops before the answer reaches the sender: the sender asks
    again and is told ok -- not "has ended", which failed a transfer that was delivered (seen
    when a flipped TLS record dropped a vLLM producer's connection under its Finish)."""
    options = LinkOptions(
        chunk_size_bytes=64 * 1024, compression="none", connections=1, timeout_ms=60000,
        rpc_timeout_ms=10000,
    )  # fmt: skip
    data = os.urandom(256 * 1024)

    async def scenario():
        async with receiver() as (server, target):
            proxy, via = await proxied(target)
            # Every answer spends 0.4 s on the way back: the cut lands while Finish's is on it.
            proxy.add(Latency(direction="downstream", ms=400))
            header = make_header({"kv": len(data)})

            async def consume():
                got = bytearray()
                async with await server.open(header.transfer_id, 60.0) as reader:
                    async for segment in reader:
                        got += segment.data
                proxy.cut("reset")  # the transfer has ended at the receiver: now drop the path
                proxy.restore()
                return bytes(got)

            consumer = asyncio.create_task(consume())
            async with open_transfer(via, header, options, INSECURE) as tx:
                await tx.send_layer("kv", data)
                summary = await tx.finish()
            got = await consumer
            resets = proxy.stats.resets
            await proxy.stop()
            return summary, got, resets

    summary, got, resets = run(scenario())

    assert resets >= 1  # the answer to the first Finish was on the dropped connection
    assert got == data
    assert summary.bytes_raw == len(data)


def test_every_way_a_transfer_ends_closes_its_connections_without_the_cyclic_gc():
    """A grpc.aio call keeps its TCP connection until the call object is freed, channel
    closed or not; reference cycles through the workers' tracebacks once kept one open per
    transfer until a full GC (a descriptor leak in long-lived engines). Finished, abandoned
    and failed transfers must all release their connections by reference counting alone."""
    options = LinkOptions(
        chunk_size_bytes=64 * 1024, compression="none", timeout_ms=1500, rpc_timeout_ms=300
    )

    async def settle(proxy):  # failed ones wait for the rate-limited collection (<= 2.5 s)
        for _ in range(200):
            if not connections_to(proxy.port):
                break
            await asyncio.sleep(0.02)
        return connections_to(proxy.port)

    async def scenario():
        open_after = {}
        async with receiver() as (server, target):
            proxy, via = await proxied(target)

            header = make_header({"kv": 1 << 20})
            consumer = asyncio.create_task(server.open(header.transfer_id, 10.0))
            async with open_transfer(via, header, options, INSECURE) as tx:
                await tx.send_layer("kv", os.urandom(1 << 20))
                await tx.finish()
            async with await consumer as reader:
                assert sum([len(s.data) async for s in reader]) == 1 << 20
            open_after["finished"] = await settle(proxy)

            async def abandoned():
                async with open_transfer(via, make_header({"kv": 0}), options, INSECURE) as tx:
                    await tx.send_layer("kv", os.urandom(1 << 20), final=False)
                    raise RuntimeError("producer gave up")

            with pytest.raises(RuntimeError, match="producer gave up"):
                await abandoned()
            open_after["abandoned"] = await settle(proxy)

            async def doomed():  # like an engine's request: nothing kept after it fails
                try:
                    async with open_transfer(via, make_header({"kv": 0}), options, INSECURE) as tx:
                        await tx.send_layer("kv", os.urandom(1 << 20), final=False)
                        proxy.cut("blackhole")
                        await tx.send_layer("kv", os.urandom(1 << 20), final=True)
                        await tx.finish()
                except TransferTimeout:
                    return "timeout"
                return "finished"

            assert await doomed() == "timeout"
            proxy.restore()
            open_after["failed"] = await settle(proxy)
            await proxy.stop()
        return open_after

    gc.disable()
    try:
        open_after = run(scenario())
    finally:
        gc.enable()

    assert open_after == {"finished": 0, "abandoned": 0, "failed": 0}


def test_checksum_none_lets_a_flipped_byte_reach_the_consumer_and_says_so(caplog):
    """The diagnostic mode really verifies nothing: what the proxy damages is delivered
    damaged (no resend), counted as unverified, and each end warns once per link."""
    chunk = 64 * 1024
    data = b"".join(marked_chunks(4, chunk))
    options = LinkOptions(
        chunk_size_bytes=chunk,
        compression="none",
        checksum="none",
        connections=1,
        timeout_ms=30_000,
    )

    async def scenario():
        async with receiver(ReceiverOptions(accept_unverified=True)) as (server, target):
            proxy, via = await proxied(target)
            flip = proxy.add(Flip(direction="upstream", pattern=MARKER, context=8, limit=1))
            link = Link(via, options, INSECURE, metrics=LinkMetrics())
            received, summaries = [], []
            for _ in range(2):  # two transfers over one link: one warning per end
                header = make_header({"kv": len(data)})
                consumer = asyncio.create_task(server.open(header.transfer_id, 30.0))
                async with open_transfer(via, header, link=link) as tx:
                    await tx.send_layer("kv", data)
                    summaries.append(await tx.finish())
                async with await consumer as reader:
                    received.append(b"".join([s.data async for s in reader]))
            await link.close()
            await proxy.stop()
            counts = {
                "receiver_failures": server.metrics.value(
                    "pdbridge_kv_checksum_failures_total", role="receiver"
                ),
                "receiver_unverified": server.metrics.value(
                    "pdbridge_kv_unverified_chunks_total", role="receiver"
                ),
                "sender_unverified": link.metrics.value(
                    "pdbridge_kv_unverified_chunks_total", role="sender"
                ),
            }
            return flip.flipped, received, summaries, counts

    with caplog.at_level(logging.WARNING, logger="grpc_kv"):
        flipped, received, summaries, counts = run(scenario())

    assert flipped == 1
    damaged = received[0]
    assert len(damaged) == len(data)
    diff = [i for i in range(len(data)) if damaged[i] != data[i]]
    marker_ends = {i * chunk + chunk // 2 + len(MARKER) - 1 for i in range(4)}
    assert len(diff) == 1
    assert diff[0] in marker_ends
    assert damaged[diff[0]] == data[diff[0]] ^ 0xFF
    assert received[1] == data
    assert [s.checksum for s in summaries] == ["none", "none"]
    assert [s.checksum_failures for s in summaries] == [0, 0]
    assert [s.retransmits for s in summaries] == [0, 0]
    assert counts == {"receiver_failures": 0, "receiver_unverified": 8, "sender_unverified": 8}
    warnings = [r.getMessage() for r in caplog.records if "checksum_disabled" in r.getMessage()]
    assert len([w for w in warnings if "target=" in w]) == 1
    assert len([w for w in warnings if "peer=" in w]) == 1

"""Transfers between a real sender and a real receiver on loopback."""

import asyncio
import os
import time

import grpc
import pytest
import torch

from grpc_kv.api import (
    FingerprintMismatch,
    LinkOptions,
    ReceiverOptions,
    TransferFailed,
    TransferRefused,
    open_transfer,
)
from grpc_kv.codec import transfer_digest
from tests.grpc_kv.kvtest import (
    FP,
    INSECURE,
    OTHER_FP,
    RawClient,
    bf16_normal,
    chunk_checksum,
    chunk_frame,
    make_header,
    receiver,
    run,
    tensor_bytes,
)

SMALL = LinkOptions(chunk_size_bytes=64 * 1024, timeout_ms=20_000)


async def collect(server, transfer_id, **kw):
    async with await server.open(transfer_id, 10.0, **kw) as reader:
        header = reader.header
        segments = [s async for s in reader]
    return header, segments


def layers_of(segments):
    out: dict[str, bytearray] = {}
    for s in segments:
        buf = out.setdefault(s.layer, bytearray())
        assert s.offset == len(buf)
        buf += s.data
    return {k: bytes(v) for k, v in out.items()}


@pytest.mark.parametrize("compression", ["none", "zstd", "zstd-byteplane", "auto"])
def test_tensors_round_trip_exactly_under_every_codec(compression):
    tensors = {
        "bf16": tensor_bytes(torch.bfloat16, 70_001, seed=1),
        "fp16": tensor_bytes(torch.float16, 3, seed=2),
        "fp32": tensor_bytes(torch.float32, 50_000, seed=3),
        "int8": tensor_bytes(torch.int8, 99_999, seed=4),
        "empty": b"",
    }
    options = SMALL.replace(compression=compression, link_rate_bps=200e6)

    async def scenario():
        async with receiver() as (server, target):
            header = make_header({k: len(v) for k, v in tensors.items()})
            consumer = asyncio.create_task(collect(server, header.transfer_id))
            async with open_transfer(target, header, options, INSECURE) as tx:
                for name, data in tensors.items():
                    await tx.send_layer(name, data)
                summary = await tx.finish()
            got_header, segments = await consumer
            return got_header, segments, summary, server.memory_in_use

    got_header, segments, summary, memory = run(scenario())

    assert layers_of(segments) == tensors
    assert got_header.fingerprint == FP
    assert [s.layer for s in segments if s.final] == list(tensors)
    assert summary.bytes_raw == sum(map(len, tensors.values()))
    assert summary.retransmits == 0
    assert memory == 0


def test_an_uncompressed_chunk_reaches_the_consumer_as_a_view_of_its_frame_not_a_copy():
    data = os.urandom(3 * 64 * 1024)

    async def scenario():
        async with receiver() as (server, target):
            header = make_header({"kv": len(data)})
            consumer = asyncio.create_task(collect(server, header.transfer_id))
            async with open_transfer(target, header, SMALL, INSECURE) as tx:
                await tx.send_layer("kv", data)
                summary = await tx.finish()
            _, segments = await consumer
            return segments, summary

    segments, summary = run(scenario())

    assert summary.data_path == "grpc"
    assert layers_of(segments) == {"kv": data}
    for segment in segments:  # the received frame (immutable bytes): payload and small fields
        assert isinstance(segment.data, memoryview)
        assert isinstance(segment.data.obj, bytes)
        assert len(segment.data.obj) > len(segment.data)


def test_layers_reach_the_consumer_while_the_producer_is_still_sending():
    first, second = bf16_normal(200_000, seed=1), bf16_normal(200_000, seed=2)

    async def scenario():
        async with receiver() as (server, target):
            header = make_header({"l0": 0, "l1": 0})
            first_seen = asyncio.Event()

            async def consume():
                async with await server.open(header.transfer_id, 10.0) as reader:
                    got = []
                    async for segment in reader:
                        got.append(segment)
                        if segment.layer == "l0" and segment.final:
                            first_seen.set()
                    return got

            consumer = asyncio.create_task(consume())
            async with open_transfer(target, header, SMALL, INSECURE) as tx:
                # Append-only segments: prefill pushes a layer's KV chunk by chunk.
                await tx.send_layer("l0", first[:100_000], final=False)
                await tx.send_layer("l0", first[100_000:], final=True)
                await asyncio.wait_for(first_seen.wait(), 5)  # before l1 exists at all
                await tx.send_layer("l1", second)
                await tx.finish()
            return await consumer

    segments = run(scenario())

    assert layers_of(segments) == {"l0": first, "l1": second}


def test_send_layer_rejects_gaps_unknown_layers_and_data_after_final():
    async def scenario():
        async with receiver() as (_server, target):
            header = make_header({"l0": 0})
            async with open_transfer(target, header, SMALL, INSECURE) as tx:
                await tx.send_layer("l0", b"abcd", final=False)
                with pytest.raises(ValueError, match="continues at 4"):
                    await tx.send_layer("l0", b"x", offset=10)
                with pytest.raises(ValueError, match="not in the header"):
                    await tx.send_layer("nope", b"x")
                await tx.send_layer("l0", b"ef", final=True)
                with pytest.raises(ValueError, match="already sent with final"):
                    await tx.send_layer("l0", b"x")
                await tx.cancel("test done")

    run(scenario())


def test_fingerprint_mismatch_is_refused_before_any_data():
    async def scenario():
        async with receiver() as (server, target):
            header = make_header({"l0": 0}, fingerprint=OTHER_FP)
            waiting = asyncio.create_task(
                collect(server, header.transfer_id, expect_fingerprint=FP)
            )
            await asyncio.sleep(0.05)  # the decode side registers its expectation first
            with pytest.raises(TransferRefused, match="fingerprint mismatch") as refused:
                async with open_transfer(target, header, SMALL, INSECURE) as tx:
                    await tx.send_layer("l0", b"x" * 1000)
            with pytest.raises(FingerprintMismatch):
                await waiting
            return (
                refused.value.code,
                server.metrics.value("pdbridge_kv_bytes_raw_total", role="receiver"),
                server.memory_in_use,
            )

    code, received, memory = run(scenario())

    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert received == 0
    assert memory == 0


def test_receiver_serving_one_model_refuses_another():
    async def scenario():
        async with receiver(accept_fingerprints={FP}) as (_server, target):
            with pytest.raises(TransferRefused, match="not served by this receiver"):
                async with open_transfer(
                    target, make_header(fingerprint=OTHER_FP), SMALL, INSECURE
                ):
                    pass

    run(scenario())


def test_consumer_opening_late_with_wrong_expectation_gets_a_mismatch():
    async def scenario():
        async with receiver() as (server, target):
            header = make_header({"l0": 0})
            async with open_transfer(target, header, SMALL, INSECURE) as tx:
                await tx.send_layer("l0", b"x" * 100)
                await tx.finish()
            with pytest.raises(FingerprintMismatch):
                await server.open(header.transfer_id, 2.0, expect_fingerprint=OTHER_FP)
            return server.memory_in_use

    assert run(scenario()) == 0


def test_transfer_id_reused_after_completion_is_refused():
    async def scenario():
        async with receiver() as (server, target):
            header = make_header({"l0": 0})
            consumer = asyncio.create_task(collect(server, header.transfer_id))
            async with open_transfer(target, header, SMALL, INSECURE) as tx:
                await tx.send_layer("l0", b"x" * 100)
                await tx.finish()
            await consumer
            with pytest.raises(TransferRefused, match="already used") as second:
                async with open_transfer(target, header, SMALL, INSECURE):
                    pass
            return second.value.code

    assert run(scenario()) == grpc.StatusCode.ALREADY_EXISTS


def test_transfer_id_in_use_by_another_sender_is_refused():
    async def scenario():
        async with receiver() as (_server, target):
            raw = RawClient(target)
            header = make_header({"l0": 0})
            await raw.begin(header, session="first")
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await raw.begin(header, session="second")
            resumed = await raw.begin(header, session="first")
            await raw.close()
            return err.value.code(), resumed.resumed

    code, resumed = run(scenario())

    assert code == grpc.StatusCode.ALREADY_EXISTS
    assert resumed is True


def test_duplicate_and_reordered_chunks_are_idempotent():
    data = [bytes([i]) * 1000 for i in range(5)]

    async def scenario():
        async with receiver() as (server, target):
            raw = RawClient(target)
            header = make_header({"l0": 5000})
            tid = header.transfer_id
            await raw.begin(header)
            frames = [
                chunk_frame(header, i, "l0", i * 1000, d, final=i == 4) for i, d in enumerate(data)
            ]
            order = [3, 1, 1, 0, 4, 3, 2, 0]
            acks = await raw.push([frames[i] for i in order])
            sums = [
                chunk_checksum(header, i, "l0", i * 1000, d, final=i == 4)
                for i, d in enumerate(data)
            ]
            finish = await raw.finish(tid, 5, 5000, transfer_digest(sums))
            _, segments = await collect(server, tid)
            await raw.close()
            return acks, finish, segments

    acks, finish, segments = run(scenario())

    assert [a.status for a in acks] == [0] * 8
    assert [a.contiguous for a in acks] == [0, 0, 0, 2, 2, 2, 5, 5]
    assert finish.ok
    assert [s.offset for s in segments] == [0, 1000, 2000, 3000, 4000]
    assert b"".join(s.data for s in segments) == b"".join(data)


def test_finish_with_missing_chunks_reports_them():
    async def scenario():
        async with receiver() as (_server, target):
            raw = RawClient(target)
            header = make_header({"l0": 0})
            await raw.begin(header)
            await raw.push([chunk_frame(header, 0, "l0", 0, b"abc")])
            reply = await raw.finish(header.transfer_id, 3, 9, 0)
            await raw.close()
            return reply

    reply = run(scenario())

    assert not reply.ok
    assert list(reply.missing) == [1, 2]


def test_protocol_version_mismatch_is_refused_with_a_clear_error():
    async def scenario():
        async with receiver() as (_server, target):
            raw = RawClient(target)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await raw.begin(make_header(), version=2)
            await raw.close()
            return err.value

    err = run(scenario())

    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "pdbridge.kv.v2" in err.details()
    assert "pdbridge.kv.v1" in err.details()


def test_memory_budget_makes_the_sender_back_off_until_the_consumer_drains():
    payload = bf16_normal(1 << 20)
    options = ReceiverOptions(memory_budget_bytes=256 * 1024)

    async def scenario():
        async with receiver(options) as (server, target):
            header = make_header({"l0": 0})
            peak = 0

            async def slow_consumer():
                nonlocal peak
                got = bytearray()
                await asyncio.sleep(0.3)  # let the sender hit the budget first
                async with await server.open(header.transfer_id, 10.0) as reader:
                    async for segment in reader:
                        peak = max(peak, server.memory_in_use + len(segment.data))
                        got += segment.data
                        await asyncio.sleep(0.01)
                return bytes(got)

            consumer = asyncio.create_task(slow_consumer())
            async with open_transfer(
                target, header, SMALL.replace(compression="none"), INSECURE
            ) as tx:
                await tx.send_layer("l0", payload)
                summary = await tx.finish()
            return await consumer, summary, peak

    got, summary, peak = run(scenario())

    assert got == payload
    assert summary.busy > 0
    assert peak <= 256 * 1024 + 64 * 1024


def test_incomplete_transfer_expires_after_ttl_and_frees_memory():
    async def scenario():
        async with receiver(ReceiverOptions(ttl_s=0.3)) as (server, target):
            raw = RawClient(target)
            header = make_header({"l0": 0})
            await raw.begin(header)
            await raw.push([chunk_frame(header, 0, "l0", 0, b"x" * 5000)])
            held = server.memory_in_use
            await asyncio.sleep(0.8)
            with pytest.raises(TransferFailed, match="ttl"):
                await server.open(header.transfer_id, 1.0)
            await raw.close()
            return held, server.memory_in_use, server.active_transfers

    held, after, active = run(scenario())

    assert held == 5000
    assert after == 0
    assert active == 0


def test_consumer_deadline_without_a_sender_fails_cleanly():
    async def scenario():
        async with receiver() as (server, _target):
            start = time.monotonic()
            with pytest.raises(TransferFailed, match="deadline"):
                await server.open("never-sent", 0.3)
            return time.monotonic() - start, server.active_transfers

    elapsed, active = run(scenario())

    assert elapsed < 2.0
    assert active == 0


def test_auto_sends_the_first_chunks_without_waiting_for_the_rate_probe():
    """``auto`` measures a link's rate before it knows it, but the first transfer's chunks go
    meanwhile (compressed: an unknown link is taken for a WAN). The probe once ran in front
    of them: on a vLLM pair the consumer drained up to 32 MiB of TLS probe on a busy core
    before the first chunk, seconds of a first transfer. Here each way is 400 ms, so the
    probe cannot have finished when ``send_layer`` returns; once it has, the rate is known."""
    from grpc_kv import link as link_module
    from grpc_kv.faultproxy import FaultProxy, Latency
    from grpc_kv.link import Link

    data = bf16_normal(256 << 10)
    options = LinkOptions(chunk_size_bytes=64 << 10, compression="auto", timeout_ms=20_000)

    async def scenario():
        async with receiver() as (server, target):
            proxy = FaultProxy(upstream=target)
            via = f"127.0.0.1:{await proxy.start()}"
            proxy.add(Latency(ms=400))
            link = Link(via, options, INSECURE)
            try:
                header = make_header({"kv": len(data)})
                consumer = asyncio.create_task(collect(server, header.transfer_id))
                async with open_transfer(via, header, options, link=link) as tx:
                    await tx.send_layer("kv", data)
                    known_when_sent = via in link_module._MEASURED
                    summary = await tx.finish()
                _, segments = await consumer
                deadline = time.monotonic() + 30
                while link._measuring is not None and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
                return known_when_sent, summary, layers_of(segments), link_module._MEASURED.get(via)
            finally:
                await link.close()
                await proxy.stop()

    known_when_sent, summary, layers, measured = run(scenario())

    assert not known_when_sent
    assert layers == {"kv": data}
    assert set(summary.codecs) == {"zstd-byteplane"}  # unknown rate: compress bf16
    assert measured is not None
    assert measured[1] > 0


def test_the_rate_probe_never_shares_the_link_with_a_transfer():
    """The probe is asked for by the first chunks of a transfer on a link of unknown rate,
    but it waits until no transfer is open on the link: inside one it stretched a vLLM
    request's tail (0.2 -> 0.58 s) and misread the link (43-222 Mbit/s on 200). A transfer
    kept open for a second -- three probes' time -- ends with the rate still unknown; it is
    measured once the link is idle."""
    from grpc_kv import link as link_module
    from grpc_kv.link import Link

    data = bf16_normal(256 << 10)
    options = LinkOptions(chunk_size_bytes=64 << 10, compression="auto", timeout_ms=20_000)

    async def scenario():
        async with receiver() as (server, target):
            link = Link(target, options, INSECURE)
            link_module._MEASURED.pop(target, None)
            try:
                header = make_header({"kv": 4 * len(data)})
                consumer = asyncio.create_task(collect(server, header.transfer_id))
                async with open_transfer(target, header, options, link=link) as tx:
                    for i in range(4):
                        await tx.send_layer("kv", data, final=i == 3)
                        await asyncio.sleep(0.25)
                    summary = await tx.finish()
                    known_inside = target in link_module._MEASURED
                await consumer
                deadline = time.monotonic() + 30
                while target not in link_module._MEASURED and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
                return known_inside, summary, link_module._MEASURED.get(target)
            finally:
                await link.close()

    known_inside, summary, measured = run(scenario())

    assert not known_inside
    assert summary.bytes_raw == 4 * len(data)
    assert measured is not None
    assert measured[1] > 0

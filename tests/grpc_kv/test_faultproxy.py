"""The fault proxy against a plain TCP echo server (no gRPC involved)."""

import asyncio
import time

import pytest

from grpc_kv.faultproxy import (
    PIPE_BYTES,
    READ_SIZE,
    Bandwidth,
    CloseAfter,
    FaultProxy,
    Flip,
    Latency,
)
from tests.grpc_kv.kvtest import run
from tests.support import TIME_SCALE


async def echo_server():
    async def handle(reader, writer):
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


async def with_proxy(body):
    server, port = await echo_server()
    proxy = FaultProxy(upstream=f"127.0.0.1:{port}")
    proxy_port = await proxy.start()
    try:
        return await body(proxy, proxy_port)
    finally:
        await proxy.stop()
        server.close()


async def roundtrip(port, payload, timeout=5.0):
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(payload)
    await writer.drain()
    got = await asyncio.wait_for(reader.readexactly(len(payload)), timeout)
    writer.close()
    return got


def test_clean_proxy_passes_bytes_through():
    async def body(proxy, port):
        return await roundtrip(port, b"hello" * 1000), proxy.stats

    got, stats = run(with_proxy(body))

    assert got == b"hello" * 1000
    assert stats.bytes_upstream == stats.bytes_downstream == 5000


def test_flip_at_an_offset_changes_exactly_that_byte():
    async def body(proxy, port):
        proxy.add(Flip(direction="upstream", offsets=(3,)))
        return await roundtrip(port, b"abcdef")

    assert run(with_proxy(body)) == b"abc" + bytes([ord("d") ^ 0xFF]) + b"ef"


def test_flip_every_n_bytes_flips_each_multiple_of_n_of_each_connection():
    data = bytes(range(256)) * 40  # 10240 bytes

    async def body(proxy, port):
        flip = proxy.add(Flip(direction="upstream", every=4096))
        first = await roundtrip(port, data)
        again = await roundtrip(port, data)  # a new connection counts from 0 again
        return first, again, flip.flipped

    first, again, flipped = run(with_proxy(body))

    assert first == again
    assert [i for i in range(len(data)) if first[i] != data[i]] == [4096, 8192]
    assert (first[4096], first[8192]) == (data[4096] ^ 0xFF, data[8192] ^ 0xFF)
    assert flipped == 4


def test_flip_pattern_flips_each_distinct_occurrence_once():
    marker = b"<MARK>"

    async def body(proxy, port):
        flip = proxy.add(Flip(direction="upstream", pattern=marker, context=2))
        first = await roundtrip(port, b"xx" + marker + b"01" + marker + b"02")
        again = await roundtrip(port, b"xx" + marker + b"01")
        return first, again, flip.flipped

    first, again, flipped = run(with_proxy(body))

    assert first.count(marker) == 0
    assert again == b"xx" + marker + b"01"  # same context: a resent copy passes
    assert flipped == 2


def test_latency_delays_a_round_trip():
    async def body(proxy, port):
        proxy.add(Latency(ms=100))
        start = time.monotonic()
        await roundtrip(port, b"ping")
        return time.monotonic() - start

    assert run(with_proxy(body)) >= 0.19  # 100 ms each way


def test_bandwidth_limits_throughput():
    async def body(proxy, port):
        proxy.add(Bandwidth(direction="upstream", bytes_per_s=1_000_000))
        start = time.monotonic()
        await roundtrip(port, bytes(500_000))
        return time.monotonic() - start

    assert run(with_proxy(body)) >= 0.4


def test_bandwidth_is_shared_by_parallel_connections():
    """A WAN's capacity: four streams at once split the rate (each alone would take 0.2 s;
    with a per-connection limit the four would also finish in about 0.2 s)."""

    async def body(proxy, port):
        proxy.add(Bandwidth(direction="upstream", bytes_per_s=1_000_000))
        start = time.monotonic()
        await asyncio.gather(*(roundtrip(port, bytes(200_000)) for _ in range(4)))
        return time.monotonic() - start

    assert run(with_proxy(body)) >= 0.7


def test_close_after_n_bytes_cuts_the_connection():
    async def body(proxy, port):
        proxy.add(CloseAfter(direction="upstream", bytes=100))
        with pytest.raises((asyncio.IncompleteReadError, ConnectionError)):
            await roundtrip(port, bytes(1000))

    run(with_proxy(body))


def test_cut_refuses_until_restored():
    async def body(proxy, port):
        proxy.cut("reset")
        with pytest.raises((asyncio.IncompleteReadError, ConnectionError)):
            await roundtrip(port, b"x")
        proxy.restore()
        return await roundtrip(port, b"back"), proxy.stats.refused

    got, refused = run(with_proxy(body))

    assert got == b"back"
    assert refused == 1


def test_blackhole_forwards_nothing():
    async def body(proxy, port):
        proxy.cut("blackhole")
        with pytest.raises(TimeoutError):
            await roundtrip(port, b"x", timeout=0.3)

    run(with_proxy(body))


def test_bad_arguments_name_the_field():
    with pytest.raises(ValueError, match="upstream"):
        FaultProxy(upstream="nohost")
    with pytest.raises(ValueError, match="direction"):
        Latency(direction="sideways")


def test_a_slow_next_hop_pushes_back_instead_of_piling_data_up_in_the_proxy():
    """The next hop stops reading: the proxy holds at most ``PIPE_BYTES`` of one direction
    (the sender waits on TCP), and once it reads again every byte arrives, in order. Before,
    a connection could pile 16 MiB per direction into the agent's memory (the soak's RSS step)."""
    payload = bytes(range(256)) * (32 * 1024)  # 8 MiB

    async def body():
        reading = asyncio.Event()
        received = bytearray()

        async def sink(reader, writer):
            await reading.wait()
            while data := await reader.read(1 << 20):
                received.extend(data)
            writer.close()

        server = await asyncio.start_server(sink, "127.0.0.1", 0)
        proxy = FaultProxy(upstream=f"127.0.0.1:{server.sockets[0].getsockname()[1]}")
        port = await proxy.start()
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(payload)
            sending = asyncio.ensure_future(writer.drain())
            deadline = time.monotonic() + 30 * TIME_SCALE
            # The backlog builds up to the pipe's bound (the kernel's buffers take the rest).
            while proxy.stats.buffered_peak < PIPE_BYTES - READ_SIZE:
                assert time.monotonic() < deadline, proxy.stats
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.2)  # were it unbounded, it would keep growing meanwhile
            peak = proxy.stats.buffered_peak
            reading.set()
            await asyncio.wait_for(sending, 30 * TIME_SCALE)
            writer.write_eof()
            while len(received) < len(payload):
                assert time.monotonic() < deadline + 30 * TIME_SCALE, len(received)
                await asyncio.sleep(0.05)
            writer.close()
            return peak, bytes(received)
        finally:
            await proxy.stop()
            server.close()

    peak, received = run(body())
    assert peak <= PIPE_BYTES
    assert received == payload

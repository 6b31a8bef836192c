"""The local stream: an engine in another process than its receiver reads verified
segments over a Unix socket (grpc_kv.local). Real receivers and real sockets; the one
hand-made receiver below speaks the wire format to send what a correct one never would."""

import asyncio
import os
import socket
import struct
import time

import grpc
import pytest

import grpc_kv.local
from grpc_kv.api import (
    FingerprintMismatch,
    LinkOptions,
    ReceiverOptions,
    ReceiverServer,
    TransferFailed,
    TransferRefused,
    open_transfer,
)
from grpc_kv.bulk import PREFIX
from grpc_kv.local import LOCAL_MAGIC, MAX_SEGMENT, REQUEST_PREFIX, consume
from grpc_kv.protocol import pb
from tests.grpc_kv.kvtest import FP, INSECURE, OTHER_FP, make_header, receiver, run

SMALL = LinkOptions(chunk_size_bytes=64 * 1024, timeout_ms=20_000)


async def read_through(socket_path, transfer_id, deadline=10.0, **kw):
    async with consume(socket_path, transfer_id, deadline, **kw) as reader:
        return reader.header, [s async for s in reader]


async def through_an_engine(socket_path, target, data):
    """Send ``data`` as one layer to ``target`` while an engine reads it through
    ``socket_path``; the bytes the engine got."""
    header = make_header({"l0": len(data)})
    engine = asyncio.create_task(read_through(socket_path, header.transfer_id))
    await asyncio.sleep(0.05)
    async with open_transfer(target, header, SMALL, INSECURE) as tx:
        await tx.send_layer("l0", data)
        await tx.finish()
    _, segments = await engine
    return b"".join(bytes(s.data) for s in segments)


@pytest.mark.parametrize("data_path", ["grpc", "bulk"])
def test_segments_reach_the_engine_exactly_in_buffers_of_its_own(tmp_path, data_path):
    socket_path = tmp_path / "kv.sock"
    layers = {"k": os.urandom(200_001), "v": os.urandom(64 * 1024), "empty": b""}

    async def scenario():
        options = ReceiverOptions(bulk=data_path == "bulk")
        async with receiver(options, local_socket=socket_path) as (server, target):
            header = make_header({k: len(v) for k, v in layers.items()})
            engine = asyncio.create_task(read_through(socket_path, header.transfer_id))
            await asyncio.sleep(0.05)
            async with open_transfer(
                target, header, SMALL.replace(data_path=data_path), INSECURE
            ) as tx:
                for name, data in layers.items():
                    await tx.send_layer(name, data)
                summary = await tx.finish()
            got_header, segments = await engine
            await asyncio.sleep(0.05)
            metrics = (
                server.metrics.value("pdbridge_kv_local_bytes_total"),
                server.metrics.value("pdbridge_kv_local_streams"),
            )
            return (
                got_header,
                segments,
                summary,
                server.memory_in_use,
                server.active_transfers,
                metrics,
            )

    got_header, segments, summary, memory, active, metrics = run(scenario())

    assert summary.data_path == data_path
    assert got_header.fingerprint == FP
    got: dict[str, bytearray] = {}
    for segment in segments:
        buf = got.setdefault(segment.layer, bytearray())
        assert segment.offset == len(buf)
        buf += segment.data
        assert isinstance(segment.data, memoryview)  # received into, not copied out again
    assert {k: bytes(v) for k, v in got.items()} == layers
    assert [s.layer for s in segments if s.final] == list(layers)
    assert (memory, active) == (0, 0)
    assert metrics == (sum(map(len, layers.values())), 0)  # handed over, and nobody reading now


def test_an_engine_expecting_another_model_gets_a_mismatch_and_the_sender_is_refused(tmp_path):
    socket_path = tmp_path / "kv.sock"

    async def scenario():
        async with receiver(local_socket=socket_path) as (server, target):
            header = make_header({"l0": 0}, fingerprint=OTHER_FP)
            engine = asyncio.create_task(
                read_through(socket_path, header.transfer_id, expect_fingerprint=FP)
            )
            await asyncio.sleep(0.1)  # the engine registers its expectation first
            with pytest.raises(TransferRefused, match="fingerprint mismatch"):
                async with open_transfer(target, header, SMALL, INSECURE) as tx:
                    await tx.send_layer("l0", b"x" * 1000)
            with pytest.raises(FingerprintMismatch, match="fingerprint mismatch"):
                await engine
            return server.memory_in_use

    assert run(scenario()) == 0


def test_an_engine_whose_transfer_never_comes_fails_at_its_deadline(tmp_path):
    socket_path = tmp_path / "kv.sock"

    async def scenario():
        async with receiver(local_socket=socket_path):
            started = time.monotonic()
            with pytest.raises(TransferFailed, match="deadline") as failed:
                await read_through(socket_path, "never-sent", deadline=0.5)
            return time.monotonic() - started, failed.value

    elapsed, error = run(scenario())

    assert 0.4 < elapsed < 1.5
    assert not isinstance(error, FingerprintMismatch)


def test_an_engine_that_leaves_early_frees_the_transfer_on_the_receiver(tmp_path):
    socket_path = tmp_path / "kv.sock"
    data = os.urandom(40 * 64 * 1024)

    async def scenario():
        async with receiver(local_socket=socket_path) as (server, target):
            header = make_header({"l0": len(data)})
            first = asyncio.Event()
            reading = []

            async def engine():
                async with consume(socket_path, header.transfer_id, 10.0) as reader:
                    async for _segment in reader:
                        reading.append(server.metrics.value("pdbridge_kv_local_streams"))
                        first.set()
                        return  # leaves after one segment: closes the stream

            task = asyncio.create_task(engine())
            await asyncio.sleep(0.05)
            async with open_transfer(target, header, SMALL, INSECURE) as tx:
                await tx.send_layer("l0", data[: 64 * 1024], final=False)
                await asyncio.wait_for(first.wait(), 5)
                await task
                async with asyncio.timeout(5):  # freed at once, not at the next segment
                    while server.active_transfers:
                        await asyncio.sleep(0.01)
                freed = server.memory_in_use
                assert reading == [1]
                assert server.metrics.value("pdbridge_kv_local_streams") == 0

                async def the_rest():
                    await tx.send_layer("l0", data[64 * 1024 :])
                    await tx.finish()

                with pytest.raises(TransferRefused):  # the sender learns it from the receiver
                    await the_rest()
            # The receiver keeps serving: a second transfer reaches a second engine.
            second = await through_an_engine(socket_path, target, b"y" * 1000)
            return freed, server.memory_in_use, second

    freed, memory, second = run(scenario())

    assert freed == memory == 0
    assert second == b"y" * 1000


async def ask(socket_path, raw: bytes) -> pb.Segment:
    """Send ``raw`` as an engine would its request; the receiver's first answer."""
    loop = asyncio.get_running_loop()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.setblocking(False)
    try:
        await loop.sock_connect(sock, str(socket_path))
        if raw:
            await loop.sock_sendall(sock, raw)
        answer = b""
        while True:
            data = await asyncio.wait_for(loop.sock_recv(sock, 65536), 5)
            if not data:
                break
            answer += data
    finally:
        sock.close()
    head_len, data_len = PREFIX.unpack_from(answer)
    assert data_len == 0
    return pb.Segment.FromString(answer[PREFIX.size : PREFIX.size + head_len])


def request(body: bytes, magic: bytes = LOCAL_MAGIC, length: int | None = None) -> bytes:
    return magic + REQUEST_PREFIX.pack(len(body) if length is None else length) + body


@pytest.mark.parametrize(
    ("raw", "named"),
    [
        (request(b"", magic=b"GET / HT"), "bad magic"),
        (request(b"", length=1 << 30), "request of 1073741824 bytes"),
        (request(b"\x0a\xff"), "malformed ConsumeRequest"),
        (request(pb.ConsumeRequest(deadline_s=1).SerializeToString()), "transfer_id: required"),
        (
            request(pb.ConsumeRequest(transfer_id="t", deadline_s=-1).SerializeToString()),
            "deadline_s: -1.0 outside",
        ),
        (b"", "no request within"),
    ],
    ids=["bad magic", "oversize", "malformed", "no transfer id", "negative deadline", "silent"],
)
def test_a_bad_request_is_answered_invalid_argument_and_the_receiver_keeps_serving(
    tmp_path, monkeypatch, raw, named
):
    monkeypatch.setattr(grpc_kv.local, "REQUEST_TIMEOUT_S", 0.3)
    socket_path = tmp_path / "kv.sock"

    async def scenario():
        async with receiver(local_socket=socket_path) as (_server, target):
            answer = await ask(socket_path, raw)
            return answer, await through_an_engine(socket_path, target, b"z" * 10)

    answer, after = run(scenario())

    assert answer.error_code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert named in answer.error
    assert after == b"z" * 10


def frame(head: bytes, data_len: int | None = None, data: bytes = b"") -> bytes:
    return PREFIX.pack(len(head), len(data) if data_len is None else data_len) + head + data


HEADER = frame(pb.Segment(header=make_header({"l0": 0}).to_pb()).SerializeToString())
SEGMENT = pb.Segment(layer="l0", offset=0).SerializeToString()


@pytest.mark.parametrize(
    ("answer", "named"),
    [
        (b"", "closed the stream before the header"),
        (PREFIX.pack(0, 0), "receiver sent no header"),
        (HEADER + PREFIX.pack(0, 5) + b"12345", "head length 0 outside"),
        (HEADER + PREFIX.pack(1 << 20, 0), "head length 1048576 outside"),
        (HEADER + frame(SEGMENT, data_len=MAX_SEGMENT + 1), f"segment of {MAX_SEGMENT + 1} bytes"),
        (HEADER + frame(b"\x12\xff", data=b"x"), "malformed Segment head"),
        (
            HEADER + frame(SEGMENT, data_len=100, data=b"only ten.."),
            "closed the stream mid-transfer",
        ),
        (HEADER + struct.pack("<I", 5), "closed the stream mid-transfer"),
    ],
    ids=[
        "nothing",
        "ended at once",
        "no head",
        "huge head",
        "huge segment",
        "malformed",
        "short data",
        "cut prefix",
    ],
)
def test_what_a_broken_receiver_sends_fails_the_engine_naming_it(tmp_path, answer, named):
    run(read_from_a_fake_receiver(tmp_path / "fake.sock", answer, named))


async def read_from_a_fake_receiver(socket_path, answer: bytes, named: str) -> None:
    """An engine reads transfer ``t-1`` from a receiver that answers ``answer`` whatever it
    is asked, then closes; the engine must fail with TransferFailed matching ``named``."""
    loop = asyncio.get_running_loop()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(socket_path))
    listener.listen(1)
    listener.setblocking(False)

    async def fake_receiver():
        conn, _ = await loop.sock_accept(listener)
        conn.setblocking(False)
        await loop.sock_recv(conn, 65536)  # the request
        await loop.sock_sendall(conn, answer)
        conn.close()

    serving = asyncio.create_task(fake_receiver())
    try:
        with pytest.raises(TransferFailed, match=named):
            await read_through(socket_path, "t-1", deadline=2.0)
    finally:
        await serving
        listener.close()


SIZED_HEADER = frame(pb.Segment(header=make_header({"l0": 8}).to_pb()).SerializeToString())


def seg(layer: str, offset: int, data: bytes, final: bool = False) -> bytes:
    head = pb.Segment(layer=layer, offset=offset, layer_final=final).SerializeToString()
    return frame(head, data=data)


END = PREFIX.pack(0, 0)


@pytest.mark.parametrize(
    ("answer", "named"),
    [
        (seg("l0", 0, b"abcd") + seg("l0", 2, b"cdef"), "at offset 2 overlaps byte 4"),
        (seg("l0", 0, b"ab") + seg("l0", 4, b"efgh"), "at offset 4 leaves a hole before byte 2"),
        (seg("l0", 0, b"abcdefgh", final=True) + seg("l0", 8, b""), "after its final chunk"),
        (seg("l0", 0, b"abcdefghij"), "past its declared length 8"),
        (seg("l0", 0, b"abcd", final=True), "short of its declared length 8"),
        (seg("l9", 0, b"abcd"), "'l9' is not in the layout manifest"),
        (seg("l0", 0, b"abcd") + END, "layer 'l0' is incomplete: 4 of 8 bytes"),
    ],
    ids=["overlap", "hole", "after final", "too long", "short", "unknown layer", "incomplete"],
)
def test_a_receiver_that_misplaces_bytes_fails_the_engine_naming_where(tmp_path, answer, named):
    """The engine checks the coverage of what reaches it too: however the receiver errs, no
    segment lands on a byte twice, past a hole or outside its layer, and a transfer that ends
    with a layer short is a failure, not a success."""
    run(
        read_from_a_fake_receiver(
            tmp_path / "fake.sock", SIZED_HEADER + answer, f"layer coverage: .*{named}"
        )
    )


def test_an_engine_without_a_receiver_is_told_so(tmp_path):
    with pytest.raises(TransferFailed, match="cannot reach the receiver"):
        run(read_through(tmp_path / "nobody.sock", "t-1", deadline=1.0))


def test_a_receiver_that_cannot_create_its_local_socket_says_so_and_releases_its_port(tmp_path):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]

    async def scenario():
        server = ReceiverServer(
            f"127.0.0.1:{port}", tls=INSECURE, local_socket=tmp_path / "missing" / "kv.sock"
        )
        with pytest.raises(RuntimeError, match="local_socket: cannot listen on"):
            await server.start()
        again = ReceiverServer(f"127.0.0.1:{port}", tls=INSECURE)
        assert await again.start() == port
        await again.stop(0.1)

    run(scenario())


def test_concurrent_transfers_each_reach_their_own_engine(tmp_path):
    socket_path = tmp_path / "kv.sock"
    payloads = [os.urandom(300_000 + i) for i in range(4)]

    async def scenario():
        async with receiver(local_socket=socket_path) as (server, target):
            got = await asyncio.gather(
                *(through_an_engine(socket_path, target, data) for data in payloads)
            )
            return got, server.memory_in_use

    got, memory = run(scenario())

    assert got == payloads
    assert memory == 0


@pytest.mark.parametrize(("mode", "expected"), [(None, 0o600), (0o660, 0o660)])
def test_the_local_socket_admits_only_its_owner_unless_told_otherwise(tmp_path, mode, expected):
    socket_path = tmp_path / "kv.sock"
    kw = {} if mode is None else {"local_socket_mode": mode}

    async def scenario():
        async with receiver(local_socket=socket_path, **kw):
            return socket_path.stat().st_mode & 0o777

    assert run(scenario()) == expected
    assert not socket_path.exists()  # removed when the receiver stops


def test_an_engine_reading_when_the_receiver_stops_is_told_at_once(tmp_path):
    socket_path = tmp_path / "kv.sock"

    async def scenario():
        async with receiver(local_socket=socket_path) as (server, target):
            header = make_header({"l0": 0})
            engine = asyncio.create_task(read_through(socket_path, header.transfer_id))
            async with open_transfer(target, header, SMALL, INSECURE) as tx:
                await tx.send_layer("l0", b"x" * 1000, final=False)
                await asyncio.sleep(0.2)  # the engine has the header and a segment
                started = time.monotonic()
                await server.stop(0.1)
                with pytest.raises(TransferFailed, match="closed the stream mid-transfer"):
                    await engine
                await tx.cancel("receiver gone")
                return time.monotonic() - started

    assert run(scenario()) < 2.0

"""The bulk data path (``data_path="bulk"``): chunks over raw TCP / TLS data connections.

Real receivers, real sockets, the fault proxy in front of the data port; hand-made frames
from a raw socket for what a correct sender never sends.
"""

import asyncio
import os
import socket
import ssl
import time

import grpc
import pytest
import torch

import grpc_kv.bulk
import grpc_kv.bulk_server
from grpc_kv.api import (
    LinkOptions,
    ReceiverOptions,
    TLSConfig,
    TransferFailed,
    TransferTimeout,
    open_transfer,
)
from grpc_kv.bulk import ACK_PREFIX, MAGIC, PREFIX
from grpc_kv.codec import Codec, compress
from grpc_kv.faultproxy import FaultProxy, Flip
from grpc_kv.protocol import pb
from tests.grpc_kv.kvtest import (
    INSECURE,
    RawClient,
    chunk_checksum,
    make_header,
    receiver,
    run,
    tensor_bytes,
)
from tests.grpc_kv.test_faults import MARKER, marked_chunks
from tests.support import connections_to

BULK = LinkOptions(
    chunk_size_bytes=512 * 1024, compression="none", data_path="bulk", timeout_ms=20_000
)
BULK_RX = ReceiverOptions(bulk=True)  # receivers offer the bulk path only when told to


def tls_for(pki, name, **kw):
    files = pki[name]
    return TLSConfig(
        ca_file=files.ca_file, cert_file=files.cert_file, key_file=files.key_file, **kw
    )


async def send(target, data_by_layer, options=BULK, tls=INSECURE, server=None):
    """Send layers; with ``server``, also consume them there. (summary, received layers)."""
    header = make_header({k: len(v) for k, v in data_by_layer.items()})
    consumer = None
    if server is not None:
        consumer = asyncio.create_task(server.open(header.transfer_id, 20.0))
    async with open_transfer(target, header, options, tls) as tx:
        for name, data in data_by_layer.items():
            await tx.send_layer(name, data)
        summary = await tx.finish()
    received: dict[str, bytearray] = {}
    if consumer is not None:
        async with await consumer as reader:
            async for seg in reader:
                buf = received.setdefault(seg.layer, bytearray())
                assert seg.offset == len(buf)
                buf += seg.data
    return summary, {k: bytes(v) for k, v in received.items()}


@pytest.fixture(params=["loop", "thread"])
def writer(request, monkeypatch):
    """Both plaintext writers: the event loop's (default) and a writer thread per data
    connection (PDBRIDGE_KV_BULK_THREAD_SEND=1)."""
    monkeypatch.setattr(grpc_kv.bulk, "_THREAD_SEND", request.param == "thread")
    return request.param


async def proxied_bulk(server):
    """A fault proxy in front of the receiver's data port, advertised in Begin instead."""
    proxy = FaultProxy(upstream=f"127.0.0.1:{server.bulk.port}")
    server.bulk.advertised_port = await proxy.start()
    return proxy


@pytest.mark.parametrize("compression", ["none", "zstd", "zstd-byteplane", "auto"])
def test_tensors_round_trip_exactly_over_bulk_under_every_codec(compression):
    tensors = {
        "bf16": tensor_bytes(torch.bfloat16, 700_001, seed=1),  # chunks past the thread size
        "fp16": tensor_bytes(torch.float16, 3, seed=2),
        "fp32": tensor_bytes(torch.float32, 50_000, seed=3),
        "int8": tensor_bytes(torch.int8, 99_999, seed=4),
        "empty": b"",
    }
    options = BULK.replace(compression=compression, link_rate_bps=200e6)

    async def scenario():
        async with receiver(BULK_RX) as (server, target):
            summary, got = await send(target, tensors, options, server=server)
            await asyncio.sleep(0.05)  # the sender closes its data connections on the loop
            open_conns = len(server.bulk.connections) + connections_to(server.bulk.port)
            return summary, got, server.memory_in_use, open_conns

    summary, got, memory, open_conns = run(scenario())

    assert got == tensors
    assert summary.data_path == "bulk"
    assert summary.retransmits == 0
    assert summary.bytes_raw == sum(map(len, tensors.values()))
    assert memory == 0
    assert open_conns == 0


def test_a_receiver_without_bulk_gets_grpc_chunks():
    data = {"kv": os.urandom(3 << 20)}

    async def scenario():
        async with receiver(ReceiverOptions(bulk=False)) as (server, target):
            return await send(target, data, server=server)

    summary, got = run(scenario())

    assert got == data
    assert summary.data_path == "grpc"


def test_mutual_tls_bulk_transfer_with_an_allowed_peer(pki):
    data = {"kv": os.urandom(5 << 20)}

    async def scenario():
        server_tls = tls_for(pki, "site-b", allowed_peers=["site-a"])
        async with receiver(BULK_RX, tls=server_tls) as (server, target):
            client = tls_for(pki, "site-a", server_name="site-b")
            return await send(target, data, tls=client, server=server)

    summary, got = run(scenario())

    assert got == data
    assert summary.data_path == "bulk"


def test_hundred_chunks_corrupted_on_the_data_port_are_detected_resent_and_never_delivered(
    writer,
):
    chunk = 64 * 1024
    data = {"kv": b"".join(marked_chunks(150, chunk))}
    options = BULK.replace(chunk_size_bytes=chunk, window=8)

    async def scenario():
        async with receiver(BULK_RX) as (server, target):
            proxy = await proxied_bulk(server)
            flip = proxy.add(Flip(direction="upstream", pattern=MARKER, context=8, limit=100))
            summary, got = await send(target, data, options, server=server)
            failures = server.metrics.value("pdbridge_kv_checksum_failures_total", role="receiver")
            await proxy.stop()
            return flip.flipped, failures, summary, got

    flipped, failures, summary, got = run(scenario())

    assert flipped == 100
    assert failures == 100
    assert summary.checksum_failures == 100
    assert summary.retransmits == 100
    assert summary.data_path == "bulk"
    assert got == data


def test_data_connections_cut_mid_transfer_resume_resending_at_most_the_window(writer):
    chunk, window = 256 * 1024, 4
    data = {"kv": os.urandom(24 << 20)}
    options = BULK.replace(chunk_size_bytes=chunk, window=window, timeout_ms=15_000)

    async def scenario():
        async with receiver(BULK_RX) as (server, target):
            proxy = await proxied_bulk(server)
            from grpc_kv.faultproxy import Bandwidth

            proxy.add(Bandwidth(direction="upstream", bytes_per_s=20e6))

            async def cut_midway():
                while (
                    server.metrics.value("pdbridge_kv_bytes_raw_total", role="receiver")
                    < len(data["kv"]) / 3
                ):
                    await asyncio.sleep(0.01)
                proxy.cut("reset")
                await asyncio.sleep(0.5)
                proxy.restore()

            fds_before = len(os.listdir("/proc/self/fd"))
            cutter = asyncio.create_task(cut_midway())
            summary, got = await send(target, data, options, server=server)
            await cutter
            resets = proxy.stats.resets
            await asyncio.sleep(0.05)
            open_conns = len(server.bulk.connections) + connections_to(proxy.port)
            # The sender's sockets (and their duplicates for worker-thread writes) and the
            # proxy's upstream ones are closed too: no descriptor outlives the transfer.
            fds_after = len(os.listdir("/proc/self/fd"))
            await proxy.stop()
            return summary, got, resets, open_conns, fds_after - fds_before

    summary, got, resets, open_conns, fd_growth = run(scenario())

    assert resets >= 1
    assert got == data
    assert summary.resumes >= 1
    assert summary.resent_bytes <= window * chunk
    assert open_conns == 0
    assert fd_growth <= 0


# -- the data port's own defences --------------------------------------------------------
class RawBulk:
    """A hand-driven data connection: blocking socket in a worker thread."""

    def __init__(self, port, tls_context=None, server_hostname=None):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=5)
        if tls_context is not None:
            self.sock = tls_context.wrap_socket(self.sock, server_hostname=server_hostname)

    def send(self, data):
        self.sock.sendall(data)

    def frame(self, head, payload=b"", declared=None):
        length = len(payload) if declared is None else declared
        self.send(PREFIX.pack(len(head), length) + head + payload)

    def next_ack(self):
        """The next ack other than READY (socket timeout: 5 s)."""
        while True:
            (n,) = ACK_PREFIX.unpack(self._exactly(ACK_PREFIX.size))
            ack = pb.Ack.FromString(self._exactly(n))
            if ack.status != pb.ACK_READY:
                return ack

    def _exactly(self, n):
        buf = b""
        while len(buf) < n:
            data = self.sock.recv(n - len(buf))
            if not data:
                raise ConnectionError("the receiver closed the data connection")
            buf += data
        return buf

    def acks(self):
        """Every ack until the receiver closes the connection, less the READY that answers
        an accepted hello."""
        out, buf = [], b""
        while True:
            try:
                data = self.sock.recv(65536)
            except (ConnectionResetError, ssl.SSLError):
                break
            if not data:
                break
            buf += data
        while len(buf) >= ACK_PREFIX.size:
            (n,) = ACK_PREFIX.unpack_from(buf)
            ack = pb.Ack.FromString(buf[4 : 4 + n])
            if ack.status != pb.ACK_READY:
                out.append(ack)
            buf = buf[4 + n :]
        self.sock.close()
        return out


def hello(transfer_id, session="s1"):
    return pb.BulkHello(
        protocol_version=1, transfer_id=transfer_id, session=session
    ).SerializeToString()


def head(header, seq, layer, data, **kw):
    """A chunk head of ``header``'s transfer (or of a bare transfer id), with the checksum a
    correct sender states (header-bound) unless ``checksum`` is given."""
    fields = {
        "transfer_id": getattr(header, "transfer_id", header),
        "seq": seq,
        "layer": layer,
        "offset": 0,
        "raw_length": len(data),
    }
    fields.update(kw)
    fields.setdefault(
        "checksum",
        chunk_checksum(
            header,
            seq,
            layer,
            fields["offset"],
            data,
            final=fields.get("layer_final", False),
            raw_length=fields["raw_length"],
        ),
    )
    return pb.Chunk(**fields).SerializeToString()


def bad_sessions(header):
    """(name, function writing a bad connection) -> each must be refused."""
    tid = header.transfer_id
    ok = b"x" * 1000
    return {
        "bad magic": lambda c: c.send(b"GET / HTTP/1.1\r\n\r\n"),
        "oversize head": lambda c: (c.send(MAGIC), c.send(PREFIX.pack(1 << 30, 0))),
        "garbage head": lambda c: (c.send(MAGIC), c.frame(hello(tid)), c.frame(b"\xff" * 20)),
        "wrong session": lambda c: (c.send(MAGIC), c.frame(hello(tid, session="other"))),
        "unknown transfer": lambda c: (c.send(MAGIC), c.frame(hello("t-nope"))),
        "payload longer than declared": lambda c: (
            c.send(MAGIC),
            c.frame(hello(tid)),
            c.frame(head(header, 0, "kv", ok), ok + b"extra"),
        ),
        "oversize chunk": lambda c: (
            c.send(MAGIC),
            c.frame(hello(tid)),
            c.frame(head(header, 0, "kv", b"", raw_length=200 << 20), b"", declared=200 << 20),
        ),
        "unknown layer": lambda c: (
            c.send(MAGIC),
            c.frame(hello(tid)),
            c.frame(head(header, 0, "nope", ok), ok),
        ),
        "other transfer in a chunk": lambda c: (
            c.send(MAGIC),
            c.frame(hello(tid)),
            c.frame(head("t-other", 0, "kv", ok), ok),
        ),
    }


EXPECTED_CODE = {
    "wrong session": grpc.StatusCode.PERMISSION_DENIED,
    "unknown transfer": grpc.StatusCode.NOT_FOUND,
}


async def begin_bulk(raw, header):
    """Begin ``header``'s transfer by hand (session ``s1``), asking for the bulk data path."""
    request = pb.BeginRequest(
        protocol_version=1,
        header=header.to_pb(),
        session="s1",
        deadline_ms=20_000,
        want_bulk=True,
        header_digest=header.digest(),
    )
    return await raw._method("Begin", pb.BeginReply)(request.SerializeToString(), timeout=5)


def test_malformed_frames_on_the_data_port_are_refused_and_the_server_keeps_serving():
    async def scenario():
        async with receiver(BULK_RX) as (server, target):
            raw = RawClient(target)
            header = make_header({"kv": 4096})
            reply = await begin_bulk(raw, header)
            port = reply.bulk_port
            outcomes = {}
            for name, write in bad_sessions(header).items():

                def exchange(write=write):
                    conn = RawBulk(port)
                    write(conn)
                    return conn.acks()

                acks = await asyncio.to_thread(exchange)
                outcomes[name] = [(a.status, a.code) for a in acks]
            await raw.close()
            invalid = server.metrics.value("pdbridge_kv_invalid_frames_total", role="receiver")
            # The server still serves: a real bulk transfer completes after all of that.
            summary, got = await send(target, {"kv": b"fine" * 100_000}, server=server)
            return port, outcomes, invalid, summary, got, server

    port, outcomes, invalid, summary, got, server = run(scenario())

    for name, acks in outcomes.items():
        code = EXPECTED_CODE.get(name, grpc.StatusCode.INVALID_ARGUMENT)
        assert acks == [(pb.ACK_REFUSED, code.value[0])], name
    assert invalid == len(outcomes) - len(EXPECTED_CODE)
    assert got == {"kv": b"fine" * 100_000}
    assert summary.data_path == "bulk"
    assert server.memory_in_use == 0
    assert not server.bulk.connections
    assert connections_to(port) == 0


def test_corrupt_chunk_on_the_data_port_is_answered_resend_and_never_stored():
    async def scenario():
        async with receiver(BULK_RX) as (server, target):
            raw = RawClient(target)
            header = make_header({"kv": 1000})
            reply = await begin_bulk(raw, header)
            tid, data = header.transfer_id, os.urandom(1000)

            def exchange():
                conn = RawBulk(reply.bulk_port)
                conn.send(MAGIC)
                conn.frame(hello(tid))
                conn.frame(
                    head(
                        header, 0, "kv", data, checksum=chunk_checksum(header, 0, "kv", 0, data) ^ 1
                    ),
                    data,
                )
                conn.frame(head(header, 0, "kv", data), data)
                conn.frame(head(header, 0, "kv", data), data)  # a duplicate: acknowledged again
                conn.send(PREFIX.pack(0, 0))
                return conn.acks()

            acks = await asyncio.to_thread(exchange)
            await raw.close()
            return [(a.seq, a.status, a.contiguous) for a in acks], server.memory_in_use

    acks, held = run(scenario())

    assert acks == [(0, pb.ACK_CORRUPT, 0), (0, pb.ACK_OK, 1), (0, pb.ACK_OK, 1)]
    assert held == 1000  # the good copy, once


def test_kept_chunks_land_in_buffers_of_their_own_that_the_connection_never_reuses():
    """An uncompressed chunk that a consumer will read is received straight into a buffer
    the store keeps (no copy after the kernel's). The connection must never receive into
    that buffer again, not even a compressed chunk that would fit in it, while the consumer
    still holds the first segment."""

    async def scenario():
        async with receiver(BULK_RX) as (server, target):
            raw = RawClient(target)
            plain, packed, last = os.urandom(64 * 1024), b"kv" * 16 * 1024, os.urandom(1000)
            header = make_header({"kv": len(plain) + len(packed) + len(last)})
            reply = await begin_bulk(raw, header)
            tid = header.transfer_id
            reader = await server.open(tid, 20.0)

            def exchange():
                conn = RawBulk(reply.bulk_port)
                conn.send(MAGIC)
                conn.frame(hello(tid))
                conn.frame(head(header, 0, "kv", plain), plain)
                zipped = compress(Codec.ZSTD, packed)
                second = head(header, 1, "kv", packed, offset=len(plain), codec=pb.CODEC_ZSTD)
                conn.frame(second, zipped)
                end = len(plain) + len(packed)
                conn.frame(head(header, 2, "kv", last, offset=end, layer_final=True), last)
                conn.send(PREFIX.pack(0, 0))
                return conn.acks()

            acks = await asyncio.to_thread(exchange)
            async with reader:
                segments = [await anext(aiter(reader)) for _ in range(3)]  # held, not copied
            await raw.close()
            return acks, segments, [plain, packed, last]

    acks, segments, sent = run(scenario())

    assert [(a.seq, a.status) for a in acks] == [(seq, pb.ACK_OK) for seq in range(3)]
    assert [bytes(s.data) for s in segments] == sent
    assert isinstance(segments[0].data, memoryview)  # the kernel's copy was the only one


def test_a_trickled_payload_is_read_per_megabyte_and_the_frames_after_it_at_once(monkeypatch):
    """Plaintext data connections move SO_RCVLOWAT with the frame: a payload arriving in
    64 KiB pieces is read in a few large reads, not one per piece; its remainder (not a
    multiple of the mark) still completes it; and the small frame after it is read at once,
    so the mark is back at one byte (a mark left above it would stall the connection)."""
    reads = []
    original = grpc_kv.bulk_server._BulkConnection.buffer_updated

    def counting(self, nbytes):
        if self.state == "payload":
            reads.append(nbytes)
        original(self, nbytes)

    monkeypatch.setattr(grpc_kv.bulk_server._BulkConnection, "buffer_updated", counting)
    big, small = os.urandom(3 * grpc_kv.bulk_server.RCVLOWAT + 12_345), os.urandom(1000)

    async def scenario():
        async with receiver(BULK_RX) as (server, target):
            raw = RawClient(target)
            header = make_header({"kv": len(big) + len(small)})
            reply = await begin_bulk(raw, header)
            tid = header.transfer_id

            def exchange():
                conn = RawBulk(reply.bulk_port)
                conn.send(MAGIC)
                conn.frame(hello(tid))
                first = head(header, 0, "kv", big)
                conn.send(PREFIX.pack(len(first), len(big)) + first)
                for start in range(0, len(big), 64 * 1024):
                    conn.send(big[start : start + 64 * 1024])
                    time.sleep(0.002)
                acks = [conn.next_ack()]
                conn.frame(head(header, 1, "kv", small, offset=len(big), layer_final=True), small)
                acks.append(conn.next_ack())
                conn.send(PREFIX.pack(0, 0))
                conn.acks()
                return acks

            acks = await asyncio.to_thread(exchange)
            await raw.close()
            return [(a.seq, a.status, a.contiguous) for a in acks], server.memory_in_use

    acks, held = run(scenario())

    assert acks == [(0, pb.ACK_OK, 1), (1, pb.ACK_OK, 2)]
    assert held == len(big) + len(small)
    assert sum(reads) == len(big) + len(small)
    # 3 MiB + a remainder in 49 pieces: 4 reads of at least the mark each and the remainder
    # (a few more allowed: the kernel may wake early under memory pressure); the small
    # chunk is one read.
    assert len(reads) <= 8, reads  # (the mark is followed on Linux >= 4.18 only)


@pytest.mark.parametrize(
    ("platform_name", "release", "follows"),
    [
        ("linux", "6.18.44-fc-v857", True),
        ("linux", "4.18.0-553.el8_10.x86_64", True),
        ("linux", "4.17.19", False),
        ("linux", "3.10.0-1160.el7.x86_64", False),  # RHEL 7: the mark could never be reached
        ("linux", "unknown", False),
        ("darwin", "23.4.0", False),
    ],
)
def test_the_receive_mark_is_followed_only_where_the_kernel_grows_the_buffer_for_it(
    monkeypatch, platform_name, release, follows
):
    monkeypatch.setattr(grpc_kv.bulk_server.sys, "platform", platform_name)
    monkeypatch.setattr(grpc_kv.bulk_server.platform, "release", lambda: release)
    assert grpc_kv.bulk_server._kernel_grows_rcvbuf_for_lowat() is follows


def test_data_port_refuses_no_certificate_another_ca_and_peers_off_the_allowlist(pki):
    async def scenario():
        server_tls = tls_for(pki, "site-b", allowed_peers=["site-a"])
        async with receiver(BULK_RX, tls=server_tls) as (server, target):
            port = server.bulk.port

            def attempt(name):
                ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
                ctx.load_verify_locations(cafile=pki["ca"].ca_file)
                if name is not None:
                    files = pki[name]
                    ctx.load_cert_chain(files.cert_file, files.key_file)
                    if name == "foreign":
                        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
                        ctx.check_hostname = False
                        ctx.verify_mode = ssl.CERT_NONE
                        ctx.load_cert_chain(files.cert_file, files.key_file)
                try:
                    conn = RawBulk(port, ctx, server_hostname="site-b")
                    conn.send(MAGIC)
                    conn.frame(hello("t-whatever"))
                    acks = conn.acks()
                except (ssl.SSLError, ConnectionResetError, BrokenPipeError) as exc:
                    return type(exc).__name__
                return [(a.status, a.code) for a in acks]

            results = {
                n: await asyncio.to_thread(attempt, n) for n in (None, "foreign", "intruder")
            }
            handshake = server.metrics.value(
                "pdbridge_kv_rejected_peers_total", role="receiver", reason="tls_handshake"
            )
            not_allowed = server.metrics.value(
                "pdbridge_kv_rejected_peers_total", role="receiver", reason="not_allowed"
            )
            # An allowed peer still gets through afterwards.
            client = tls_for(pki, "site-a", server_name="site-b")
            summary, got = await send(target, {"kv": b"ok" * 1000}, tls=client, server=server)
            return results, handshake, not_allowed, summary, got, len(server.bulk.connections)

    results, handshake, not_allowed, summary, got, open_conns = run(scenario())

    assert results["intruder"] == [(pb.ACK_REFUSED, grpc.StatusCode.PERMISSION_DENIED.value[0])]
    # The handshake failed: not a single ack came back (TLS 1.3 clients learn it on read).
    assert results[None] == [] or isinstance(results[None], str)
    assert results["foreign"] == [] or isinstance(results["foreign"], str)
    assert handshake == 2
    assert not_allowed == 1
    assert got == {"kv": b"ok" * 1000}
    assert summary.data_path == "bulk"
    assert open_conns == 0


def test_a_refused_data_connection_fails_the_transfer_with_the_receivers_code():
    async def scenario():
        async with receiver(BULK_RX) as (server, target):
            proxy = await proxied_bulk(server)
            # A byte flipped inside the hello's session (into invalid UTF-8): a malformed
            # hello, refused; the sender gives up at once instead of retrying to its deadline.
            proxy.add(Flip(direction="upstream", offsets=[len(MAGIC) + PREFIX.size + 30]))
            from grpc_kv.api import TransferRefused

            with pytest.raises(TransferRefused) as err:
                await send(target, {"kv": os.urandom(1 << 20)}, BULK.replace(timeout_ms=5000))
            invalid = server.metrics.value("pdbridge_kv_invalid_frames_total", role="receiver")
            await asyncio.sleep(0.05)
            open_conns = len(server.bulk.connections) + connections_to(proxy.port)
            await proxy.stop()
            return err.value.code, open_conns, server.memory_in_use, invalid

    code, open_conns, memory, invalid = run(scenario())

    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert invalid >= 1
    assert open_conns == 0
    assert memory == 0


def test_options_name_the_bad_field():
    with pytest.raises(ValueError, match="data_path"):
        LinkOptions(data_path="rdma")
    with pytest.raises(ValueError, match="bulk_port"):
        ReceiverOptions(bulk_port=70000)


def test_data_path_black_holed_past_the_deadline_fails_both_sides_in_time_and_frees_all():
    deadline_ms = 2000
    options = BULK.replace(chunk_size_bytes=64 * 1024, timeout_ms=deadline_ms, rpc_timeout_ms=500)

    async def scenario():
        async with receiver(BULK_RX) as (server, target):
            proxy = await proxied_bulk(server)
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
                async with open_transfer(target, header, options, INSECURE) as tx:
                    await tx.send_layer("kv", os.urandom(1 << 20), final=False)
                    while not server.metrics.value("pdbridge_kv_chunks_total", role="receiver"):
                        await asyncio.sleep(0.01)
                    proxy.cut("blackhole")  # connections stay up, bytes vanish
                    await tx.send_layer("kv", os.urandom(4 << 20), final=True)
                    await tx.finish()

            consumer = asyncio.create_task(consume())
            with pytest.raises(TransferTimeout):
                await doomed_transfer()
            times["sender"] = time.monotonic() - start
            await consumer
            proxy.restore()
            await asyncio.sleep(0.1)
            open_conns = connections_to(proxy.port) + len(server.bulk.connections)
            await proxy.stop()
            return times, server.memory_in_use, server.active_transfers, open_conns

    times, memory, active, open_conns = run(scenario())

    assert times["sender"] <= deadline_ms / 1000 + 1.0
    assert times["receiver"] <= deadline_ms / 1000 + 1.0
    assert memory == 0
    assert active == 0
    assert open_conns == 0


def test_an_abandoned_bulk_transfer_is_cancelled_on_both_sides_and_closes_its_connections():
    async def scenario():
        async with receiver(BULK_RX) as (server, target):
            header = make_header({"kv": 0})

            async def abandoned():
                async with open_transfer(target, header, BULK, INSECURE) as tx:
                    await tx.send_layer("kv", os.urandom(2 << 20), final=False)
                    while not server.metrics.value("pdbridge_kv_chunks_total", role="receiver"):
                        await asyncio.sleep(0.01)
                    raise RuntimeError("producer gave up")

            with pytest.raises(RuntimeError, match="producer gave up"):
                await abandoned()
            for _ in range(100):  # the receiver sees the connections close on its loop
                if not server.bulk.connections and not connections_to(server.bulk.port):
                    break
                await asyncio.sleep(0.01)
            return (
                len(server.bulk.connections) + connections_to(server.bulk.port),
                server.memory_in_use,
                server.active_transfers,
            )

    open_conns, memory, active = run(scenario())

    assert open_conns == 0
    assert memory == 0
    assert active == 0

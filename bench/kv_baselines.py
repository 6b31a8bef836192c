"""The loopback benchmark's reference methods: plain TCP, checked TCP (plain TCP plus a
verified xxh3 and an acknowledgement per 4 MiB slice) and bare grpcio, each moving the same
bytes as the KV link with the CPU seconds of both sides; and the CPU clocks they read."""

from __future__ import annotations

import asyncio
import os
import socket
import struct
import subprocess
import sys
import threading
import time
from typing import Any

import xxhash

from bench.kv_peers import MIB, RUNNER
from grpc_kv.alloc import tune_allocator
from grpc_kv.bulk import unsent


def cpu_self() -> float:
    """CPU seconds of this process so far (every thread)."""
    return time.process_time()


def cpu_of(pid: int) -> float:
    """CPU seconds (user + system, every thread) of another process so far; Linux /proc."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def tcp_baseline(
    total: int, connections: int, data: bytes, checked: bool = False
) -> tuple[float, dict[str, float]]:
    """MB/s of plain TCP sockets over loopback: a sink thread per connection (here a child
    process, like the KV receiver) reading into one reused buffer, and ``connections``
    sending threads writing ``data`` (the very buffer the KV link sends, again and again)
    in 4 MiB slices, like the link's chunks; and the CPU seconds each side spent (the sink
    reports its own, from its first accept).

    ``checked``: plain TCP plus what any verified link does per chunk, with nothing else (no
    protocol, window, event loop or Python on the byte path): the sender computes the slice's
    xxh3 and writes it with the length in a 16-byte prefix, the sink verifies it and answers
    an 8-byte acknowledgement, which a reader thread per connection collects. The reference
    for what verification alone costs on this machine (not a proven floor: acknowledgements
    could be coalesced, for one)."""
    sink = subprocess.Popen(
        [sys.executable, "-c", SINK, str(connections), "checked" if checked else "plain"],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert sink.stdout is not None
    port = int(sink.stdout.readline())
    view = memoryview(data)
    per = total // connections
    failures: list[BaseException] = []

    def push() -> None:
        with socket.create_connection(("127.0.0.1", port)) as sock:
            slices = [
                view[start : start + SLICE]
                for start in (sent % len(view) for sent in range(0, per, SLICE))
            ]
            reader = None
            if checked:
                reader = threading.Thread(target=collect_acks, args=(sock, len(slices)))
                reader.start()
            for block in slices:
                if checked:
                    parts = [
                        CHECKED_PREFIX.pack(len(block), xxhash.xxh3_64_intdigest(block)),
                        block,
                    ]
                    for rest in unsent(parts, sock.sendmsg(parts)):
                        sock.sendall(rest)
                else:
                    sock.sendall(block)
            if reader is not None:
                reader.join()

    def collect_acks(sock: socket.socket, count: int) -> None:
        try:
            got = b""
            while count:
                data = sock.recv(65536)
                if not data:
                    raise RuntimeError("checked TCP sink closed before acknowledging")
                got += data
                whole = len(got) // 8 * 8
                for (value,) in struct.iter_unpack("<q", got[:whole]):
                    if value < 0:
                        raise RuntimeError("checked TCP sink found a corrupt slice")
                    count -= 1
                got = got[whole:]
        except BaseException as exc:  # re-raised by the caller
            failures.append(exc)

    start = time.perf_counter()
    cpu = cpu_self()
    threads = [threading.Thread(target=push) for _ in range(connections)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    sender_cpu = cpu_self() - cpu
    receiver_cpu = float(sink.stdout.readline())
    sink.wait(timeout=60)
    if failures:
        raise failures[0]
    rate = total / (time.perf_counter() - start) / 1e6
    return rate, {"sender": sender_cpu, "receiver": receiver_cpu}


SLICE = 4 * MIB
CHECKED_PREFIX = struct.Struct("<QQ")  # slice length, xxh3-64
SINK = """
import socket, struct, sys, threading, time, xxhash
n, checked = int(sys.argv[1]), sys.argv[2] == "checked"
srv = socket.socket(); srv.bind(("127.0.0.1", 0)); srv.listen(n)
print(srv.getsockname()[1], flush=True)
def fill(c, view):
    got = 0
    while got < len(view):
        k = c.recv_into(view[got:])
        if not k:
            return got
        got += k
    return got
def drain(c):
    buf = bytearray(4 << 20)
    if not checked:
        while c.recv_into(buf):
            pass
        return
    prefix, view, seq = bytearray(16), memoryview(buf), 0
    while fill(c, memoryview(prefix)) == 16:
        length, digest = struct.unpack("<QQ", prefix)
        fill(c, view[:length])
        ok = xxhash.xxh3_64_intdigest(view[:length]) == digest
        c.sendall(struct.pack("<q", seq if ok else -1))
        seq += 1
threads = []
cpu = None
for _ in range(n):
    c, _ = srv.accept(); cpu = cpu if cpu is not None else time.process_time()
    t = threading.Thread(target=drain, args=(c,)); t.start(); threads.append(t)
for t in threads: t.join()
print(time.process_time() - cpu, flush=True)
"""


GRPC_SINK = """
import asyncio, sys, time, grpc
cpu = []
async def main():
    async def sink(requests, context):
        cpu.append(time.process_time())
        n = 0
        async for message in requests:
            n += len(message)
        cpu.append(time.process_time())
        return n.to_bytes(8, "little")
    opts = [("grpc.max_receive_message_length", 64 << 20), ("grpc.use_local_subchannel_pool", 1)]
    server = grpc.aio.server(options=opts)
    handler = grpc.stream_unary_rpc_method_handler(sink)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("b.B", {"Sink": handler}),))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    print(max(cpu) - min(cpu), flush=True)  # first call's start to last call's end
    await server.stop(0)
asyncio.run(main())
"""


def grpcio_baseline(total: int, connections: int) -> tuple[float, dict[str, float]]:
    """MB/s of bare grpcio over loopback, the ceiling of any link built on it: one
    stream-unary call per connection writing 4 MiB bytes messages to a receiver (a child
    process) that only counts them. No framing, checksums, acks or window. Also the CPU
    seconds of each side (the sink's from its first call's start to its last call's end)."""
    # The allocator tuning the KV link applies to itself (grpc_kv/alloc.py), given to the
    # baseline too: without it bare grpcio page-faults every message buffer.
    env = {
        **os.environ,
        "MALLOC_MMAP_THRESHOLD_": str(32 * MIB),
        "MALLOC_TRIM_THRESHOLD_": str(256 * MIB),
    }
    sink = subprocess.Popen(
        [sys.executable, "-c", GRPC_SINK],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert sink.stdout is not None
    assert sink.stdin is not None
    port = int(sink.stdout.readline())
    block = os.urandom(4 * MIB)
    per = total // connections

    async def run() -> float:
        import grpc

        opts = [("grpc.max_send_message_length", 64 << 20), ("grpc.use_local_subchannel_pool", 1)]
        channels = [
            grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=opts) for _ in range(connections)
        ]

        async def one(channel: Any) -> None:
            call = channel.stream_unary("/b.B/Sink")()
            sent = 0
            while sent < per:
                await call.write(block)
                sent += len(block)
            await call.done_writing()
            await call

        start = time.perf_counter()
        cpu = cpu_self()
        await asyncio.gather(*(one(c) for c in channels))
        seconds = time.perf_counter() - start
        sender_cpu = cpu_self() - cpu
        await asyncio.gather(*(c.close() for c in channels))
        return total / seconds / 1e6, sender_cpu

    tune_allocator()  # this process: the KV sender's tuning, whichever runs first
    try:
        rate, sender_cpu = RUNNER.run(run())
    finally:
        sink.stdin.close()
    receiver_cpu = float(sink.stdout.readline())
    sink.wait(timeout=20)
    return rate, {"sender": sender_cpu, "receiver": receiver_cpu}

"""The KV link's ends as ``bench.kv`` runs them, and what they share.

* :func:`send` / ``python -m bench.kv sender``: the sending side (run as a child process
  inside a namespace for the shaped rows);
* ``python -m bench.kv receiver``: a receiver offering the bulk path with a consumer in its own
  process (the kept loopback rows), :func:`receiver_main`;
* ``python -m bench.kv consumer SOCKET``: an engine reading through a ``kv serve
  --local-socket`` sidecar, :func:`consumer_main`;
* the transfer's data (:func:`payload`), the model fingerprint, and the one event loop the
  benchmark process runs its transfers on (:data:`RUNNER`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from grpc_kv.api import (
    Fingerprint,
    LayerSpec,
    LinkOptions,
    ReceiverOptions,
    ReceiverServer,
    TLSConfig,
    TransferHeader,
    consume,
    open_transfer,
)

FP = Fingerprint("bench" * 8, "bench")
#: The one event loop this process's transfers run on (``RUNNER.run(coro)``). With a new loop
#: per transfer (``asyncio.run``), grpc.aio's completion-queue poller now and then posted to
#: a loop that had just closed and printed "Event loop is closed" (grpc/grpc#25364).
RUNNER = asyncio.Runner()
INSECURE = TLSConfig(insecure=True)
MIB = 1 << 20


def bf16_normal(nbytes: int, seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    values = rng.standard_normal(nbytes // 2, dtype=np.float32)
    return (values.view(np.uint32) >> 16).astype(np.uint16).tobytes()


def payload(kind: str, nbytes: int) -> bytes:
    return bf16_normal(nbytes) if kind == "bf16" else os.urandom(nbytes)


# -- sending side (also run as a child process inside a namespace) -----------------------
async def send(
    target: str,
    total: int,
    layers: int,
    options: LinkOptions,
    data_kind: str,
    discard: bool,
    transfer_id: str | None = None,
    data: bytes | None = None,
    tls: TLSConfig = INSECURE,
) -> dict[str, Any]:
    per_layer = total // layers
    if data is None:
        data = payload(data_kind, per_layer)  # every layer carries the same bytes
    header = TransferHeader(
        transfer_id=transfer_id or f"bench-{uuid.uuid4().hex[:10]}",
        fingerprint=FP,
        layers=tuple(LayerSpec(f"layer{i}", length=per_layer) for i in range(layers)),
        attrs={"pdbridge.loopback": "discard"} if discard else {},
    )
    opened = time.time()
    async with open_transfer(target, header, options, tls) as tx:
        for i in range(layers):
            await tx.send_layer(f"layer{i}", data)
        summary = await tx.finish()
    return {
        "opened_at": opened,
        "bytes_raw": summary.bytes_raw,
        "bytes_wire": summary.bytes_wire,
        "seconds": summary.seconds,
        "goodput_mbit_s": summary.goodput_mbit_s,
        "codecs": summary.codecs,
        "retransmits": summary.retransmits,
        "data_path": summary.data_path,
    }


def sender_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="bench.kv sender")
    parser.add_argument("--to", required=True)
    parser.add_argument("--mb", type=int, default=64)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--chunk-mb", type=float, default=4)
    parser.add_argument("--compression", default="none")
    parser.add_argument("--connections", type=int, default=2)
    parser.add_argument("--link-rate-mbit", type=float, default=0.0)
    parser.add_argument("--data", default="bf16")
    parser.add_argument("--keep", action="store_true", help="a consumer reads it (no discard)")
    parser.add_argument("--transfer-id")
    parser.add_argument("--data-path", choices=("grpc", "bulk"), default="grpc")
    args = parser.parse_args(argv)
    options = LinkOptions(
        chunk_size_bytes=int(args.chunk_mb * MIB),
        compression=args.compression,
        connections=args.connections,
        link_rate_bps=args.link_rate_mbit * 1e6,
        utilisation_ceiling=1.0,
        timeout_ms=600_000,
        data_path=args.data_path,
    )
    result = asyncio.run(
        send(
            args.to, args.mb * MIB, args.layers, options, args.data, not args.keep, args.transfer_id
        )
    )
    print(json.dumps(result))
    return 0


async def byte_count(reader: Any) -> int:
    """Read a transfer's segments to the end, keeping none: how many bytes they held."""
    return sum([len(segment.data) async for segment in reader])


def bench_child(*args: str) -> subprocess.Popen[str]:
    """``python -m bench.kv ARGS`` with stdin and stdout piped (text): a ``receiver`` or a
    ``consumer``, which read the transfer ids written to their stdin."""
    return subprocess.Popen(
        [sys.executable, "-m", "bench.kv", *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


async def read_announced(read_all: Callable[[str], Awaitable[int]]) -> None:
    """For each transfer id read from stdin, ``read_all`` of it (its byte count) in a task of
    its own, answered ``{"transfer_id": ..., "bytes": N}`` on stdout, or ``{"transfer_id":
    ..., "error": ...}`` when reading failed (the benchmark waits for an answer either way);
    returns at the end of stdin. The consumers of the kept loopback rows (see
    :func:`measured_send`)."""
    loop = asyncio.get_running_loop()
    readers: set[asyncio.Task[None]] = set()

    async def answer(transfer_id: str) -> None:
        try:
            result: dict[str, Any] = {"bytes": await read_all(transfer_id)}
        except Exception as exc:  # TransferFailed, a broken local socket: said, not hung on
            result = {"error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps({"transfer_id": transfer_id, **result}), flush=True)

    while line := await loop.run_in_executor(None, sys.stdin.readline):
        task = asyncio.create_task(answer(line.strip()))
        readers.add(task)
        task.add_done_callback(readers.discard)


def receiver_main() -> int:
    """``python -m bench.kv receiver``: a plaintext receiver offering the bulk path on an
    ephemeral loopback port (``{"port": N}`` on stdout, like ``kv serve``) with a consumer in
    its own process, as an engine that embeds it has: it reads every announced transfer
    (:func:`read_announced`), keeping nothing past each segment."""

    async def serve() -> None:
        server = ReceiverServer("127.0.0.1:0", ReceiverOptions(bulk=True), INSECURE)
        print(json.dumps({"port": await server.start()}), flush=True)

        async def read_all(transfer_id: str) -> int:
            async with await server.open(transfer_id, 600.0) as reader:
                return await byte_count(reader)

        await read_announced(read_all)
        await server.stop(1)

    asyncio.run(serve())
    return 0


def consumer_main(argv: list[str]) -> int:
    """``python -m bench.kv consumer SOCKET``: an engine in another process than its receiver
    sidecar (``kv serve --local-socket SOCKET``), reading every announced transfer through
    the local socket (:func:`read_announced`)."""
    (socket_path,) = argv

    async def read_all(transfer_id: str) -> int:
        async with consume(socket_path, transfer_id, 600.0) as reader:
            return await byte_count(reader)

    asyncio.run(read_announced(read_all))
    return 0

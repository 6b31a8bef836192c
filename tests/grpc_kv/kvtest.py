"""Helpers of the KV-link tests (not fixtures): headers, tensors, a raw gRPC client that
sends hand-made frames, a receiver context.

Tests are plain functions that run one asyncio scenario with ``run`` (one event loop per
session, see there) with their own real gRPC servers on loopback.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import uuid
from collections.abc import AsyncIterator
from typing import Any

import grpc
import numpy as np
import torch

from grpc_kv.api import (
    Fingerprint,
    LayerSpec,
    ReceiverOptions,
    ReceiverServer,
    TLSConfig,
    TransferHeader,
)
from grpc_kv.codec import Checksum, checksum, chunk_seed
from grpc_kv.protocol import pb

FP = Fingerprint("a" * 64, "arch-1")
OTHER_FP = Fingerprint("b" * 64, "arch-1")
INSECURE = TLSConfig.development()


def new_id() -> str:
    return f"t-{uuid.uuid4().hex[:12]}"


def make_header(
    layers: dict[str, int] | None = None, fingerprint: Fingerprint = FP, **attrs: str
) -> TransferHeader:
    """A header with a layer -> declared byte length (0 = unknown) manifest."""
    specs = tuple(LayerSpec(name, length=length) for name, length in (layers or {}).items())
    return TransferHeader(transfer_id=new_id(), fingerprint=fingerprint, layers=specs, attrs=attrs)


def tensor_bytes(dtype: torch.dtype, numel: int, seed: int = 0) -> bytes:
    """Random tensor contents of a given dtype, as raw bytes."""
    gen = torch.Generator().manual_seed(seed)
    if dtype == torch.int8:
        values = torch.randint(-128, 128, (numel,), generator=gen, dtype=torch.int8)
    else:
        values = torch.randn(numel, generator=gen).to(dtype)
    return bytes(values.contiguous().view(torch.uint8).numpy().tobytes())


def bf16_normal(nbytes: int, seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    values = rng.standard_normal(nbytes // 2, dtype=np.float32)
    return (values.view(np.uint32) >> 16).astype(np.uint16).tobytes()


@contextlib.asynccontextmanager
async def receiver(
    options: ReceiverOptions | None = None, tls: TLSConfig = INSECURE, **kw: Any
) -> AsyncIterator[tuple[ReceiverServer, str]]:
    server = ReceiverServer("127.0.0.1:0", options, tls, **kw)
    port = await server.start()
    try:
        yield server, f"127.0.0.1:{port}"
    finally:
        await server.stop(0.2)


class RawClient:
    """Speaks the wire protocol by hand, to send what a correct sender never would."""

    def __init__(self, target: str) -> None:
        self.channel = grpc.aio.insecure_channel(
            target, options=[("grpc.max_send_message_length", 256 << 20)]
        )

    def _method(self, name: str, response: Any, kind: str = "unary_unary") -> Any:
        return getattr(self.channel, kind)(
            f"/pdbridge.kv.v1.KvLink/{name}",
            request_serializer=None,
            response_deserializer=response.FromString,
        )

    async def begin(
        self,
        header: TransferHeader,
        session: str = "s1",
        version: int = 1,
        checksum: int = pb.CHECKSUM_XXH3_64,
    ) -> Any:
        request = pb.BeginRequest(
            protocol_version=version,
            header=header.to_pb(),
            session=session,
            deadline_ms=10_000,
            checksum=checksum,
            header_digest=header.digest(),
        )
        return await self._method("Begin", pb.BeginReply)(request.SerializeToString(), timeout=5)

    async def push(self, frames: list[bytes]) -> list[Any]:
        """Send frames on one Push stream; returns the acks (raises AioRpcError on abort)."""
        call = self._method("Push", pb.Ack, "stream_stream")(timeout=10)
        acks = []
        for frame in frames:
            await call.write(frame)
            acks.append(await call.read())
        await call.done_writing()
        return acks

    async def finish(self, transfer_id: str, count: int, raw: int, digest: int) -> Any:
        trailer = pb.Trailer(
            transfer_id=transfer_id, chunk_count=count, raw_bytes=raw, digest=digest
        )
        return await self._method("Finish", pb.FinishReply)(trailer.SerializeToString(), timeout=5)

    async def close(self) -> None:
        await self.channel.close(None)


def chunk_checksum(
    header: TransferHeader | str,
    seq: int,
    layer: str,
    offset: int,
    data: bytes,
    *,
    final: bool = False,
    raw_length: int | None = None,
) -> int:
    """What a correct sender states for these bytes at this place (xxh3, header-bound); for a
    bare transfer id (a transfer never begun) the header digest is taken as 0."""
    digest = header.digest() if isinstance(header, TransferHeader) else 0
    length = len(data) if raw_length is None else raw_length
    return checksum(Checksum.XXH3, data, chunk_seed(digest, seq, layer, offset, length, final))


def chunk_frame(
    header: TransferHeader | str,
    seq: int,
    layer: str,
    offset: int,
    data: bytes,
    *,
    final: bool = False,
    codec: int = 0,
    payload: bytes | None = None,
    raw_length: int | None = None,
    corrupt: bool = False,
) -> bytes:
    """A Chunk frame as a correct sender writes it (checksum included) unless told otherwise:
    another payload, raw_length or codec than ``data`` implies, or a wrong checksum."""
    value = chunk_checksum(header, seq, layer, offset, data, final=final, raw_length=raw_length)
    value ^= 1 if corrupt else 0
    transfer_id = header.transfer_id if isinstance(header, TransferHeader) else header
    return bytes(
        pb.Chunk(
            transfer_id=transfer_id,
            seq=seq,
            layer=layer,
            offset=offset,
            layer_final=final,
            codec=codec,
            raw_length=len(data) if raw_length is None else raw_length,
            checksum=value,
            payload=data if payload is None else payload,
        ).SerializeToString()
    )


def run(coro: Any, timeout: float = 60.0) -> Any:
    """asyncio.run with a hard limit: a hang becomes a failure that shows every task's
    stack (instead of a silent stall until pytest-timeout)."""

    async def guarded() -> Any:
        task = asyncio.ensure_future(coro)
        done, _ = await asyncio.wait({task}, timeout=timeout)
        if not done:
            lines = []
            for other in asyncio.all_tasks():
                if other is not asyncio.current_task():
                    lines.append(repr(other)[:200])
                    lines += [
                        f"    {f.f_code.co_filename}:{f.f_lineno} {f.f_code.co_name}"
                        for f in other.get_stack(limit=8)
                    ]
            task.cancel()
            raise AssertionError(f"scenario hung for {timeout} s; tasks:\n" + "\n".join(lines))
        try:
            return task.result()
        finally:
            # grpc.aio objects caught in reference cycles (exceptions -> tracebacks -> calls)
            # must be freed while their loop is alive: freed later, grpc crashes the process.
            del task
            gc.collect()

    global _LOOP
    if _LOOP is None or _LOOP.is_closed():
        _LOOP = asyncio.new_event_loop()
    return _LOOP.run_until_complete(guarded())


# One event loop for every scenario of the session: grpc.aio keeps per-process state bound
# to the loop it first ran on, and switching loops between tests crashed the interpreter.
_LOOP: asyncio.AbstractEventLoop | None = None

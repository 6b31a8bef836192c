"""The consumer API over a local Unix socket, for an engine in another process than the
receiver (``pdbridge kv serve --local-socket PATH``).

Same semantics as :meth:`grpc_kv.receiver.ReceiverServer.open`: the header first, then
verified segments in order; failures raise TransferFailed / FingerprintMismatch. The socket
is plaintext: protect it with filesystem permissions (it never leaves the host).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc

from grpc_kv.link import EOF
from grpc_kv.manifest import Fingerprint, TransferHeader
from grpc_kv.protocol import PACKAGE, pb
from grpc_kv.store import FingerprintMismatch, Segment, TransferFailed


class LocalReader:
    """What :func:`consume` yields: ``header`` and ``async for segment in reader``."""

    def __init__(self, call: Any, header: TransferHeader) -> None:
        self._call = call
        self.header = header

    def __aiter__(self) -> AsyncIterator[Segment]:
        return self._segments()

    async def _segments(self) -> AsyncIterator[Segment]:
        # read() rather than ``async for``: the header was already read with read(), and
        # grpc.aio forbids mixing the two styles on one call.
        while True:
            try:
                msg: Any = await self._call.read()
            except grpc.aio.AioRpcError as exc:
                raise _failure(exc) from exc
            if msg is EOF:
                return
            yield Segment(msg.layer, msg.offset, msg.data, msg.layer_final)


def _failure(exc: grpc.aio.AioRpcError) -> TransferFailed:
    detail = exc.details() or exc.code().name
    if "fingerprint mismatch" in detail:
        return FingerprintMismatch(detail)
    return TransferFailed(detail)


@contextlib.asynccontextmanager
async def consume(
    socket_path: Path | str,
    transfer_id: str,
    deadline_s: float,
    expect_fingerprint: Fingerprint | None = None,
) -> AsyncIterator[LocalReader]:
    """Consume a transfer from the receiver listening on ``socket_path``.

    Waits up to ``deadline_s`` for the header (and bounds the whole read by it plus the
    sender's own deadline on the receiver). Raises TransferFailed / FingerprintMismatch.
    """
    request = pb.ConsumeRequest(transfer_id=transfer_id, deadline_s=deadline_s)
    if expect_fingerprint is not None:
        request.expect_fingerprint.weights_sha256 = expect_fingerprint.weights_sha256
        request.expect_fingerprint.arch_hash = expect_fingerprint.arch_hash
    max_message = 256 << 20
    async with grpc.aio.insecure_channel(
        f"unix:{socket_path}",
        options=[
            ("grpc.max_receive_message_length", max_message),
            ("grpc.max_send_message_length", max_message),
        ],
    ) as channel:
        call = channel.unary_stream(
            f"/{PACKAGE}.KvConsumer/Consume",
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=pb.Segment.FromString,
        )(request, timeout=deadline_s + 60.0)
        try:
            first: Any = await call.read()
        except grpc.aio.AioRpcError as exc:
            raise _failure(exc) from exc
        if first is EOF or not first.HasField("header"):
            raise TransferFailed(f"transfer {transfer_id!r}: receiver sent no header")
        try:
            yield LocalReader(call, TransferHeader.from_pb(first.header))
        finally:
            call.cancel()

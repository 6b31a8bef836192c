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
from google.protobuf.message import DecodeError

from grpc_kv.link import EOF
from grpc_kv.manifest import Fingerprint, TransferHeader
from grpc_kv.protocol import PACKAGE, pb
from grpc_kv.store import FingerprintMismatch, Segment, TransferFailed
from grpc_kv.wire import SEGMENT_DATA_FIELD, FrameError, split_field


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
            yield parse_segment(msg)


def parse_segment(frame: bytes) -> Segment:
    """A Consume reply's small fields parsed by protobuf and its data cut out as a view of
    the received bytes (parsing it into the message would copy it, and every read of
    ``msg.data`` again). TransferFailed when the receiver sent something malformed."""
    try:
        small, data = split_field(frame, SEGMENT_DATA_FIELD)
        msg = pb.Segment.FromString(small)
    except (FrameError, DecodeError) as exc:
        raise TransferFailed(f"local socket: malformed Segment ({exc})") from exc
    return Segment(msg.layer, msg.offset, data, msg.layer_final)


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
            # Raw bytes: segments are cut by hand (parse_segment), the header parsed here.
            response_deserializer=None,
        )(request, timeout=deadline_s + 60.0)
        try:
            raw: Any = await call.read()
        except grpc.aio.AioRpcError as exc:
            raise _failure(exc) from exc
        try:
            first = None if raw is EOF else pb.Segment.FromString(raw)
        except DecodeError as exc:
            raise TransferFailed(f"local socket: malformed header message ({exc})") from exc
        if first is None or not first.HasField("header"):
            raise TransferFailed(f"transfer {transfer_id!r}: receiver sent no header")
        try:
            yield LocalReader(call, TransferHeader.from_pb(first.header))
        finally:
            call.cancel()

"""The public API of the KV link: import from here, not from the modules behind it.

Producer (prefill engine)::

    from grpc_kv.api import LinkOptions, TLSConfig, TransferHeader, Fingerprint, open_transfer
    async with open_transfer("decode-a:7070", header, LinkOptions(), tls) as tx:
        await tx.send_layer("model.layers.0", kv_bytes, final=True)
        summary = await tx.finish()

Receiver embedded in a decode engine::

    server = ReceiverServer("0.0.0.0:7070", ReceiverOptions(), tls)
    port = await server.start()
    async with await server.open(transfer_id, deadline_s=5.0, expect_fingerprint=fp) as reader:
        header = reader.header
        async for segment in reader:            # Segment(layer, offset, data, final)
            ...
    await server.stop(grace=1.0)

An engine in another process than the receiver (``pdbridge kv serve --local-socket PATH``)
uses :func:`consume` with the same semantics. Certificates: :func:`create_ca`,
:func:`create_node_cert`; ``TLSConfig.add_port``/``channel``/``authorize`` serve any other
gRPC API (the agents' control API). Measurements: :func:`probe`, :func:`loopback`.

Stable: names here change only with a deprecation note in ``docs/kv-link.md``.
"""

from __future__ import annotations

from grpc_kv.certs import CertFiles, create_ca, create_node_cert
from grpc_kv.codec import Checksum, Codec, CodecError, CorruptChunk
from grpc_kv.link import Link
from grpc_kv.local import consume
from grpc_kv.manifest import Fingerprint, LayerKind, LayerSpec, TransferHeader
from grpc_kv.metrics import SENDER_METRICS, LinkMetrics
from grpc_kv.options import LinkOptions, ReceiverOptions
from grpc_kv.pool import LinkPool
from grpc_kv.probe import loopback, probe
from grpc_kv.receiver import ReceiverServer
from grpc_kv.results import (
    PeerRefused,
    ReceiverUnreachable,
    TransferError,
    TransferRefused,
    TransferSummary,
    TransferTimeout,
)
from grpc_kv.sender import Transfer, open_transfer
from grpc_kv.store import (
    FingerprintMismatch,
    Segment,
    SenderLost,
    TransferFailed,
    TransferReader,
)
from grpc_kv.tls import PeerRejected, TLSConfig

__all__ = [
    "SENDER_METRICS",
    "CertFiles",
    "Checksum",
    "Codec",
    "CodecError",
    "CorruptChunk",
    "Fingerprint",
    "FingerprintMismatch",
    "LayerKind",
    "LayerSpec",
    "Link",
    "LinkMetrics",
    "LinkOptions",
    "LinkPool",
    "PeerRefused",
    "PeerRejected",
    "ReceiverOptions",
    "ReceiverServer",
    "ReceiverUnreachable",
    "Segment",
    "SenderLost",
    "TLSConfig",
    "Transfer",
    "TransferError",
    "TransferFailed",
    "TransferHeader",
    "TransferReader",
    "TransferRefused",
    "TransferSummary",
    "TransferTimeout",
    "consume",
    "create_ca",
    "create_node_cert",
    "loopback",
    "open_transfer",
    "probe",
]

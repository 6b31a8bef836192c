"""Link measurements: ``probe`` (bandwidth and RTT between two sites, deployment step 2) and
``loopback`` (a real transfer of test blocks with verification, deployment step 5).

Both are coroutines that block their caller for the measurement's duration and raise
grpc.aio.AioRpcError / TransferError when the receiver is unreachable or refuses.
"""

from __future__ import annotations

import uuid
from typing import Any

import numpy as np

from grpc_kv.link import Link
from grpc_kv.manifest import Fingerprint, LayerSpec, TransferHeader
from grpc_kv.options import LinkOptions, ReceiverOptions
from grpc_kv.receiver import ReceiverServer
from grpc_kv.sender import open_transfer
from grpc_kv.tls import TLSConfig, certificate_server_name

LOOPBACK_FINGERPRINT = Fingerprint("pdbridge-loopback", "pdbridge-loopback")


async def probe(
    target: str,
    tls: TLSConfig,
    seconds: float = 3.0,
    max_bytes: int | None = None,
    connections: int = 2,
) -> dict[str, Any]:
    """Push random 1 MiB blocks for ``seconds`` (or ``max_bytes``) over ``connections``
    parallel streams; report ``mbit_s`` (receiver-timed payload rate), ``rtt_ms`` (median
    Ping), bytes and seconds."""
    options = LinkOptions(connections=connections, rpc_timeout_ms=5000)
    link = Link(target, options, tls)
    try:
        rtt = await link.ping()
        measured = await link.measure_rate(seconds, max_bytes)
    finally:
        await link.close()
    return {
        "target": target,
        "mbit_s": round(measured["bytes_per_s"] * 8 / 1e6, 2),
        "rtt_ms": round(rtt * 1000, 3),
        "bytes": measured["bytes"],
        "seconds": round(measured["seconds"], 3),
        "connections": connections,
    }


def make_test_blocks(count: int, block_bytes: int, seed: int = 0) -> list[bytes]:
    """bf16-like test blocks (normal values, truncated to 16 bits): compressible the way
    real KV is, so the loopback also exercises the codecs."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        values = rng.standard_normal(block_bytes // 2, dtype=np.float32)
        out.append((values.view(np.uint32) >> 16).astype(np.uint16).tobytes())
    return out


async def loopback(
    target: str | None,
    tls: TLSConfig,
    blocks: int = 16,
    block_bytes: int = 4 << 20,
    options: LinkOptions | None = None,
) -> dict[str, Any]:
    """Send ``blocks`` test blocks and verify them end to end (per-chunk checksums and the
    trailer digest, checked by the receiver). ``target=None`` starts a receiver in this
    process on 127.0.0.1 (the local self-test). Returns the evidence dict; ``ok`` is False
    with ``error`` set when the transfer failed."""
    server = None
    if target is None:
        # The self-test offers the bulk data path, so either data path can be tried.
        server = ReceiverServer("127.0.0.1:0", ReceiverOptions(bulk=True), tls=tls)
        target = f"127.0.0.1:{await server.start()}"
        if not tls.insecure and tls.server_name is None and tls.cert_file is not None:
            # The receiver serves this node's own certificate on 127.0.0.1, which the
            # certificate need not list (``pdbridge kv certs`` adds no loopback names): expect
            # the certificate's own name.
            tls = TLSConfig(
                ca_file=tls.ca_file,
                cert_file=tls.cert_file,
                key_file=tls.key_file,
                server_name=certificate_server_name(tls.cert_file.read_bytes()) or "localhost",
            )
    options = options or LinkOptions(chunk_size_bytes=min(block_bytes, 4 << 20), timeout_ms=60_000)
    data = make_test_blocks(blocks, block_bytes)
    header = TransferHeader(
        transfer_id=f"loopback-{uuid.uuid4().hex[:12]}",
        fingerprint=LOOPBACK_FINGERPRINT,
        layers=tuple(LayerSpec(f"block{i}", length=block_bytes) for i in range(blocks)),
        attrs={"pdbridge.loopback": "discard"},
    )
    evidence: dict[str, Any] = {"target": target, "blocks": blocks, "block_bytes": block_bytes}
    try:
        async with open_transfer(target, header, options, tls) as tx:
            for i, block in enumerate(data):
                await tx.send_layer(f"block{i}", block, final=True)
            summary = await tx.finish()
        evidence.update(
            ok=True,
            bytes_raw=summary.bytes_raw,
            bytes_wire=summary.bytes_wire,
            chunks=summary.chunks,
            retransmits=summary.retransmits,
            resent_bytes=summary.resent_bytes,
            resumes=summary.resumes,
            checksum_failures=summary.checksum_failures,
            checksum=summary.checksum,
            seconds=round(summary.seconds, 3),
            mbit_s=round(summary.goodput_mbit_s, 2),
            codecs=summary.codecs,
            data_path=summary.data_path,
        )
    except Exception as exc:  # evidence records the failure instead of raising
        evidence.update(ok=False, error=f"{type(exc).__name__}: {exc}")
    finally:
        if server is not None:
            await server.stop(0.5)
    return evidence

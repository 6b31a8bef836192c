"""The reference engine's KV transport over grpc_kv (``grpc_kv.api``): a sender that streams a
prefill's segments to a decode engine's receiver while prefill computes, and a receiver that
embeds grpc_kv's ``ReceiverServer`` in the decode engine's own process.

Who calls it: ``pdbridge engine serve`` (``--kv-listen`` on decode engines; any prefill
engine sends to a ``host:port`` ``kv_destination``). grpc_kv objects are not thread-safe, so
the compute thread's ``send`` hands each segment to the event loop and waits only until it is
queued; the network runs on the loop while the next chunk computes. Failures map onto the
engine's transport errors: a model fingerprint mismatch -> ``TransferRejected`` (checked by the
receiver before any data), a manifest that is not the decode model's layout ->
``ImportRefused`` (checked when the header arrives, before any segment is read), the deadline
-> ``TransferTimeout``, anything else (digest mismatch, cancel, expiry) ->
``TransferCorrupt``/``TransferError``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable
from contextlib import AbstractAsyncContextManager
from typing import TypeVar

from agents.engines.reference import kvstate
from agents.engines.reference.transport import (
    KvReceiver,
    KvSender,
    ManifestCheck,
    ReceivedTransfer,
    SenderFactory,
    TransferCorrupt,
    TransferError,
    TransferHeader,
    TransferLinkError,
    TransferPeerRefused,
    TransferRejected,
    TransferSummary,
    TransferTimeout,
    TransferUnreachable,
    check_manifest,
    open_spool_sender,
)
from grpc_kv import api as kv
from grpc_kv.api import LinkPool

T = TypeVar("T")
log = logging.getLogger("pdbridge.engines.grpc_link")
MANIFEST_ATTR = "pdbridge.manifest"
_KINDS = {
    kvstate.FULL: kv.LayerKind.FULL,
    kvstate.SLIDING: kv.LayerKind.SLIDING,
    kvstate.LOGITS: kv.LayerKind.UNSPECIFIED,
}


def split_fingerprint(fingerprint: str) -> kv.Fingerprint:
    weights, _, arch = fingerprint.partition(":")
    return kv.Fingerprint(weights_sha256=weights, arch_hash=arch)


def to_kv_header(header: TransferHeader) -> kv.TransferHeader:
    """The grpc_kv header: ids, fingerprint, one LayerSpec per segment, our manifest as an attr."""
    layers = []
    for spec in header.manifest.segments:
        kind = _KINDS.get(spec.kind)
        if kind is None:
            kind = kv.LayerKind.CONV_STATE if ".conv" in spec.name else kv.LayerKind.LINEAR_STATE
        layers.append(
            kv.LayerSpec(
                name=spec.name, kind=kind, dtype=spec.dtype, shape=spec.shape, length=spec.nbytes
            )
        )
    return kv.TransferHeader(
        transfer_id=header.transfer_id,
        fingerprint=split_fingerprint(header.fingerprint),
        request_id=header.request_id[:128],
        layers=tuple(layers),
        attrs={MANIFEST_ATTR: json.dumps(header.manifest.to_json(), separators=(",", ":"))},
    )


class GrpcSender(KvSender):
    """One transfer over grpc_kv. Created on the compute thread; its coroutines run on ``loop``."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        target: str,
        header: TransferHeader,
        pool: LinkPool,
    ) -> None:
        self._loop = loop
        self._t0 = time.monotonic()
        self._pool = pool
        self._left = False  # open_transfer's block was left (finished, failed or aborted)

        async def enter() -> tuple[kv.Link, AbstractAsyncContextManager[kv.Transfer], kv.Transfer]:
            link = pool.acquire(target)
            cm = kv.open_transfer(target, to_kv_header(header), pool.options, link=link)
            try:
                return link, cm, await cm.__aenter__()
            except BaseException as exc:
                await pool.release(link, failed=isinstance(exc, Exception))
                raise

        self._link, self._cm, self._tx = self._call(enter())

    def _call(self, coro: Awaitable[T]) -> T:
        try:
            return asyncio.run_coroutine_threadsafe(coro, self._loop).result()  # type: ignore[arg-type]
        except ValueError as exc:
            raise TransferRejected(f"kv_destination: {exc}") from exc
        except Exception as exc:
            raise _engine_error(exc) from exc

    def send(self, name: str, data: bytes, offset: int, final: bool) -> None:
        self._call(self._tx.send_layer(name, data, offset, final))

    async def finish(self) -> TransferSummary:
        try:
            summary = await self._tx.finish()
        except BaseException as exc:
            # Cancelled (the caller went away) or failed: the transfer must still be left and
            # its link handed back, or its streams and their connections stay behind.
            try:
                await self._leave(exc)
            except Exception as close_exc:  # never mask the cause
                log.warning("kv_close_failed", extra={"error": repr(close_exc)})
            if isinstance(exc, Exception):
                raise _engine_error(exc) from exc
            raise
        try:
            await self._leave(None)
        except Exception as exc:
            raise _engine_error(exc) from exc
        return TransferSummary(
            transfer_id=self._tx.header.transfer_id,
            segments=len(self._tx.header.layers),
            bytes=summary.bytes_raw,
            seconds=time.monotonic() - self._t0,
            extra={
                "bytes_wire": summary.bytes_wire,
                "chunks": summary.chunks,
                "retransmits": summary.retransmits,
                "resumes": summary.resumes,
                "checksum_failures": summary.checksum_failures,
                "checksum": summary.checksum,
                "codecs": dict(summary.codecs),
            },
        )

    async def abort(self, reason: str) -> None:
        err = TransferError(reason)
        try:
            await self._leave(err)
        except Exception as exc:  # the transfer is being abandoned: log, never mask the cause
            log.warning("kv_abort_failed", extra={"error": repr(exc)})

    async def _leave(self, exc: BaseException | None) -> None:
        """Leave ``open_transfer`` once: cancels the transfer unless it finished, then hands
        the link back to the pool. Shielded, so a cancelled caller still lets go of it."""
        if self._left:
            return
        self._left = True
        try:
            if exc is None:
                await asyncio.shield(self._cm.__aexit__(None, None, None))
            else:
                await asyncio.shield(self._cm.__aexit__(type(exc), exc, exc.__traceback__))
        finally:
            failed = exc is not None and not isinstance(exc, asyncio.CancelledError)
            await asyncio.shield(self._pool.release(self._link, failed=failed))


def _engine_error(exc: Exception) -> TransferError:
    """A grpc_kv failure as the engine's transport error; grpc_kv should classify every
    failure, anything else still must not become a 500."""
    if isinstance(exc, (kv.TransferError, kv.TransferFailed)):
        return _map_error(exc)
    return TransferLinkError(f"{type(exc).__name__}: {exc}")


def _map_error(exc: BaseException) -> TransferError:
    text = str(exc)
    if isinstance(exc, kv.FingerprintMismatch) or "fingerprint" in text:
        return TransferRejected(text)
    if isinstance(exc, kv.PeerRefused):
        return TransferPeerRefused(text)
    if isinstance(exc, (kv.ReceiverUnreachable, kv.SenderLost)):
        return TransferUnreachable(text)
    if isinstance(exc, kv.TransferTimeout) or "deadline" in text:
        return TransferTimeout(text)
    if isinstance(exc, kv.TransferRefused):
        return TransferRejected(text)
    return TransferCorrupt(text)


def sender_factory(loop: asyncio.AbstractEventLoop, pool: LinkPool) -> SenderFactory:
    """``kv_destination`` -> sender: ``spool:/dir`` stays local, ``host:port`` uses grpc_kv
    over the pool's link to that destination."""

    def open_sender(destination: str, header: TransferHeader) -> KvSender:
        if destination.startswith("spool:"):
            return open_spool_sender(destination, header)
        host, _, port = destination.rpartition(":")
        if not host or not port.isdigit():
            raise TransferRejected(
                f"kv_destination: {destination!r} is neither host:port nor spool:/path"
            )
        return GrpcSender(loop, destination, header, pool)

    return open_sender


class GrpcReceiver(KvReceiver):
    """A grpc_kv ``ReceiverServer`` embedded in the decode engine's event loop."""

    def __init__(self, server: kv.ReceiverServer, host: str) -> None:
        self.server = server
        self.address = f"{host}:{server.port}"

    @classmethod
    async def start(
        cls, bind: str, tls: kv.TLSConfig, options: kv.ReceiverOptions | None = None
    ) -> GrpcReceiver:
        # The process-wide link metrics (role="receiver" beside its senders' role="sender"),
        # which the engine's /metrics serves.
        server = kv.ReceiverServer(
            bind, options or kv.ReceiverOptions(), tls, metrics=kv.SENDER_METRICS
        )
        await server.start()
        return cls(server, bind.rpartition(":")[0])

    async def receive(
        self,
        transfer_id: str,
        fingerprint: str,
        deadline_s: float,
        accept: ManifestCheck | None = None,
    ) -> ReceivedTransfer:
        t0 = time.monotonic()
        try:
            reader = await self.server.open(
                transfer_id, deadline_s, expect_fingerprint=split_fingerprint(fingerprint)
            )
            async with reader:
                header = reader.header
                if header is None:
                    raise TransferRejected("header: missing")
                try:
                    manifest = kvstate.Manifest.from_json(json.loads(header.attrs[MANIFEST_ATTR]))
                except (KeyError, ValueError, kvstate.KvLayoutError) as exc:
                    raise TransferRejected(f"header: no valid {MANIFEST_ATTR} ({exc})") from exc
                # Leaving the reader here cancels the transfer: no segment is read or kept.
                check_manifest(accept, manifest)
                buffers: dict[str, bytearray] = {
                    s.name: bytearray(s.nbytes) for s in manifest.segments
                }
                filled: dict[str, int] = dict.fromkeys(buffers, 0)
                async for segment in reader:
                    buf = buffers.get(segment.layer)
                    end = segment.offset + len(segment.data)
                    if buf is None or end > len(buf):
                        raise TransferCorrupt(f"segment {segment.layer!r}: outside the manifest")
                    buf[segment.offset : end] = segment.data
                    filled[segment.layer] += len(segment.data)
        except (kv.TransferFailed, kv.TransferError) as exc:
            raise _map_error(exc) from exc
        short = [name for name, buf in buffers.items() if filled[name] != len(buf)]
        if short:
            raise TransferCorrupt(f"segments incomplete: {', '.join(short)}")
        wrapped = TransferHeader(transfer_id, header.request_id, fingerprint, manifest)
        return ReceivedTransfer(
            wrapped, {k: bytes(v) for k, v in buffers.items()}, time.monotonic() - t0
        )

    async def close(self) -> None:
        await self.server.stop(1.0)


def tls_from_args(
    ca: str | None,
    cert: str | None,
    key: str | None,
    insecure: bool,
    allowed: list[str] | None = None,
) -> kv.TLSConfig:
    """The link's TLS: mTLS from PEM files, or plaintext only when ``insecure`` is explicit.
    Raises ``ValueError`` naming the missing file option."""
    if insecure:
        return kv.TLSConfig.development()
    if not (ca and cert and key):
        raise ValueError(
            "--kv-tls-ca, --kv-tls-cert, --kv-tls-key: required for the KV link unless --kv-insecure"
        )
    return kv.TLSConfig(ca_file=ca, cert_file=cert, key_file=key, allowed_peers=allowed or None)  # type: ignore[arg-type]

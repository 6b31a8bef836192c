"""The engine side of KV transport: a small interface the reference engine codes against, and
the ``spool`` implementation (a shared directory: one host, or a test).

A prefill engine opens a ``KvSender`` per transfer once the first chunk ran (the manifest is
known then) and calls ``send`` from its compute thread as segments become ready: full
attention KV appended after each chunk, the rest when final. A decode engine awaits
``KvReceiver.receive`` with a deadline; it checks the model fingerprint in the header
**before** using any byte and checks each segment's sha256 before returning.

Failures surface as exceptions: ``TransferTimeout`` (nothing complete before the deadline),
``TransferRejected`` (fingerprint mismatch, malformed header), ``ImportRefused`` (a manifest
that is not the model's layout, refused when the header arrives), ``TransferCorrupt`` (a
segment whose size or digest is wrong). The grpc_kv link implements the same interface.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agents.engines.reference.kvstate import KvLayoutError, Manifest, ManifestMismatch
from pdproto.kv import (
    KV_CORRUPT,
    KV_IMPORT_REFUSED,
    KV_LINK_ERROR,
    KV_PEER_REFUSED,
    KV_REJECTED,
    KV_TIMEOUT,
    KV_TRANSFER_FAILED,
    KV_UNREACHABLE,
)


class TransferError(Exception):
    """Base of KV transfer failures; ``reason`` is a short machine-readable code."""

    reason = KV_TRANSFER_FAILED


class TransferTimeout(TransferError):
    reason = KV_TIMEOUT


class TransferRejected(TransferError):
    reason = KV_REJECTED


class TransferPeerRefused(TransferRejected):
    """The KV receiver and this sender do not accept each other (TLS or allowlist)."""

    reason = KV_PEER_REFUSED


class TransferUnreachable(TransferError):
    """The KV receiver could not be reached at all (down, or the path to it cut)."""

    reason = KV_UNREACHABLE


class TransferCorrupt(TransferError):
    reason = KV_CORRUPT


class ImportRefused(TransferError):
    """The transfer's manifest differs from the decode engine's model (layer kinds, a layer's
    state missing, a segment's shape or dtype): refused before any byte is imported."""

    reason = KV_IMPORT_REFUSED


#: Checks a transfer's manifest when its header arrives, before any segment is read; raises
#: ``kvstate.ManifestMismatch`` to refuse it (``ModelLayout.check``).
ManifestCheck = Callable[[Manifest], None]


def check_manifest(accept: ManifestCheck | None, manifest: Manifest) -> None:
    """Run a receiver's ``accept`` hook; a mismatch becomes ``ImportRefused``."""
    if accept is None:
        return
    try:
        accept(manifest)
    except ManifestMismatch as exc:
        raise ImportRefused(f"manifest: {exc}") from exc


class TransferLinkError(TransferError):
    """The link itself failed in a way its library did not classify (an RPC or socket error)."""

    reason = KV_LINK_ERROR


@dataclass
class TransferHeader:
    """Sent before any segment: identifies the transfer and the model that produced it."""

    transfer_id: str
    request_id: str
    fingerprint: str
    manifest: Manifest

    def to_json(self) -> dict[str, Any]:
        return {
            "transfer_id": self.transfer_id,
            "request_id": self.request_id,
            "fingerprint": self.fingerprint,
            "manifest": self.manifest.to_json(),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> TransferHeader:
        try:
            return cls(
                transfer_id=str(data["transfer_id"]),
                request_id=str(data["request_id"]),
                fingerprint=str(data["fingerprint"]),
                manifest=Manifest.from_json(data["manifest"]),
            )
        except (KeyError, TypeError, KvLayoutError) as exc:
            raise TransferRejected(f"header: malformed ({exc})") from exc


@dataclass
class TransferSummary:
    """What a finished send reports (returned in the prefill response's kv_transfer_params)."""

    transfer_id: str
    segments: int
    bytes: int
    seconds: float
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class ReceivedTransfer:
    header: TransferHeader
    segments: dict[str, bytes]
    wait_seconds: float


class KvSender(ABC):
    """Producer side of one transfer. ``send`` is blocking and called from the engine's compute
    thread (it returns once the bytes are queued, so the network overlaps the next chunk's
    compute); ``finish`` and ``abort`` are coroutines awaited on the event loop."""

    @abstractmethod
    def send(self, name: str, data: bytes, offset: int, final: bool) -> None:
        """Append ``data`` at byte ``offset`` of segment ``name``; ``final`` closes the segment."""

    @abstractmethod
    async def finish(self) -> TransferSummary:
        """Close the transfer (trailer), wait for the receiver's acknowledgement, report."""

    @abstractmethod
    async def abort(self, reason: str) -> None:
        """Give up; the receiver sees no complete transfer."""


SenderFactory = Callable[[str, TransferHeader], KvSender]


class KvReceiver(ABC):
    """Decode side. ``receive`` is a coroutine; it never blocks the event loop."""

    @abstractmethod
    async def receive(
        self,
        transfer_id: str,
        fingerprint: str,
        deadline_s: float,
        accept: ManifestCheck | None = None,
    ) -> ReceivedTransfer:
        """Wait for a complete, verified transfer; raise a ``TransferError`` otherwise.
        ``accept`` sees the manifest once the header arrived and the fingerprint matched,
        before any segment is read (``check_manifest``: ``ImportRefused``)."""

    async def close(self) -> None:  # noqa: B027 - optional hook, most receivers hold nothing
        """Release resources (servers, sockets)."""


def _safe_id(transfer_id: str) -> str:
    if (
        not transfer_id
        or len(transfer_id) > 128
        or not all(c.isalnum() or c in "-_." for c in transfer_id)
    ):
        raise TransferRejected("transfer_id: 1-128 characters of [A-Za-z0-9._-] expected")
    if transfer_id.startswith("."):
        raise TransferRejected("transfer_id: must not start with '.'")
    return transfer_id


class SpoolSender(KvSender):
    """Writes a transfer into ``<spool>/<id>.part/`` and renames it to ``<spool>/<id>/`` when
    finished, so a reader never sees a half-written transfer."""

    def __init__(self, spool: Path, header: TransferHeader) -> None:
        self._final = spool / _safe_id(header.transfer_id)
        self._dir = spool / f"{header.transfer_id}.part"
        shutil.rmtree(self._dir, ignore_errors=True)
        self._dir.mkdir(parents=True)
        (self._dir / "header.json").write_text(json.dumps(header.to_json()))
        self._digests: dict[str, Any] = {}
        self._bytes = 0
        self._t0 = time.monotonic()
        self._transfer_id = header.transfer_id

    def send(self, name: str, data: bytes, offset: int, final: bool) -> None:
        digest = self._digests.setdefault(name, hashlib.sha256())
        path = self._dir / f"seg.{name}"
        with path.open("r+b" if path.exists() else "wb") as handle:
            handle.seek(offset)
            handle.write(data)
        # Segments are written in order, so a running digest covers the final bytes.
        digest.update(data)
        self._bytes += len(data)

    async def finish(self) -> TransferSummary:
        trailer = {name: d.hexdigest() for name, d in self._digests.items()}
        (self._dir / "trailer.json").write_text(json.dumps(trailer))
        shutil.rmtree(self._final, ignore_errors=True)
        os.replace(self._dir, self._final)
        return TransferSummary(
            self._transfer_id, len(trailer), self._bytes, time.monotonic() - self._t0
        )

    async def abort(self, reason: str) -> None:
        shutil.rmtree(self._dir, ignore_errors=True)


class SpoolReceiver(KvReceiver):
    """Polls ``<spool>/<id>/`` until the deadline; consumes (deletes) the transfer it returns."""

    poll_s = 0.005

    def __init__(self, spool: Path, *, verify_digests: bool = True) -> None:
        self.spool = spool
        self.verify_digests = verify_digests
        spool.mkdir(parents=True, exist_ok=True)

    async def receive(
        self,
        transfer_id: str,
        fingerprint: str,
        deadline_s: float,
        accept: ManifestCheck | None = None,
    ) -> ReceivedTransfer:
        directory = self.spool / _safe_id(transfer_id)
        t0 = time.monotonic()
        while not (directory / "trailer.json").exists():
            if time.monotonic() - t0 >= deadline_s:
                raise TransferTimeout(
                    f"transfer {transfer_id} not complete after {deadline_s:.3f} s"
                )
            await asyncio.sleep(self.poll_s)
        waited = time.monotonic() - t0
        try:
            return await asyncio.to_thread(self._load, directory, fingerprint, waited, accept)
        finally:
            await asyncio.to_thread(shutil.rmtree, directory, True)

    def _load(
        self, directory: Path, fingerprint: str, waited: float, accept: ManifestCheck | None
    ) -> ReceivedTransfer:
        header = TransferHeader.from_json(json.loads((directory / "header.json").read_text()))
        # The fingerprint is checked before any segment is read.
        if header.fingerprint != fingerprint:
            raise TransferRejected(
                f"fingerprint: transfer from model {header.fingerprint[:16]}..., "
                f"this engine serves {fingerprint[:16]}..."
            )
        check_manifest(accept, header.manifest)
        trailer = json.loads((directory / "trailer.json").read_text())
        segments: dict[str, bytes] = {}
        for spec in header.manifest.segments:
            path = directory / f"seg.{spec.name}"
            if not path.exists():
                raise TransferCorrupt(f"segment {spec.name!r} missing")
            data = path.read_bytes()
            if len(data) != spec.nbytes:
                raise TransferCorrupt(
                    f"segment {spec.name!r}: {len(data)} bytes, expected {spec.nbytes}"
                )
            if self.verify_digests and hashlib.sha256(data).hexdigest() != trailer.get(spec.name):
                raise TransferCorrupt(f"segment {spec.name!r}: digest mismatch")
            segments[spec.name] = data
        return ReceivedTransfer(header, segments, waited)


def open_spool_sender(destination: str, header: TransferHeader) -> KvSender:
    """Open a sender for ``kv_destination`` ``spool:/dir`` (blocking; compute thread)."""
    if destination.startswith("spool:"):
        return SpoolSender(Path(destination.removeprefix("spool:")), header)
    raise TransferRejected(f"kv_destination: {destination!r} unsupported (expected spool:/path)")

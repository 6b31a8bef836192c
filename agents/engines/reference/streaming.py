"""Streaming a prefill's cache to a decoder while it computes.

Who calls it: the reference engine's request handler for a prefill leg (``do_remote_decode``).
``on_chunk`` runs on the compute thread after every prefill chunk (blocking only until the
bytes are queued by the sender); ``finish``/``abort`` are awaited on the event loop. Transport
failures surface as ``TransferError`` subclasses from the sender.
"""

from __future__ import annotations

from typing import Any

from agents.engines.reference import kvstate
from agents.engines.reference.transport import (
    KvSender,
    SenderFactory,
    TransferHeader,
    TransferRejected,
    TransferSummary,
)


class PrefillStreamer:
    """Streams a prefill's cache to a ``KvSender`` while it computes: the full-attention KV of
    each chunk right after that chunk, the rest when final. Runs on the compute thread."""

    def __init__(self, sess: Any, destination: str, open_sender: SenderFactory) -> None:
        self.sess = sess
        self.destination = destination
        self.open_sender = open_sender
        self.sender: KvSender | None = None
        self.manifest: kvstate.Manifest | None = None
        self.offsets: dict[str, int] = {}
        self.summary: TransferSummary | None = None

    def on_chunk(self, cache: Any, start: int, end: int, logits: Any) -> None:
        total = len(self.sess.prompt_ids)
        kv = self.sess.req.kv
        if kv is None:
            raise RuntimeError("prefill streamer without kv_transfer_params")
        if self.sender is None:
            self.manifest = kvstate.build_manifest(cache, total, logits)
            self.manifest.prompt_digest = kvstate.prompt_digest(self.sess.prompt_ids)
            header = TransferHeader(
                kv.transfer_id, self.sess.req.request_id, self.sess.lm.fingerprint, self.manifest
            )
            self.sender = self.open_sender(self.destination, header)
        final = end == total
        for name, data in kvstate.full_kv_slice(cache, start, end).items():
            offset = self.offsets.get(name, 0)
            self.sender.send(name, data, offset, final)
            self.offsets[name] = offset + len(data)
        if final and self.manifest is not None:
            for name, data in kvstate.final_segments(cache, self.manifest, logits).items():
                self.sender.send(name, data, 0, True)

    async def finish(self) -> TransferSummary:
        if self.sender is None:
            raise TransferRejected("prefill ended before its transfer opened")
        self.summary = await self.sender.finish()
        return self.summary

    async def abort(self, reason: str) -> None:
        if self.sender is not None and self.summary is None:
            await self.sender.abort(reason)

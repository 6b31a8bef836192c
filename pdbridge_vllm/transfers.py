"""One request's KV on the link, from the worker's side, vLLM- and torch-free: the prefill
rank's :class:`Outgoing` (one grpc_kv transfer per decode rank that needs a part of its
shard) and the decode rank's :class:`Incoming` (every part its shard is made of).

The worker thread hands pages over and polls ``done``; everything else runs on the
:class:`~pdbridge_vllm.runtime.Runtime`'s loop thread.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections.abc import Callable
from typing import Any

from grpc_kv import api as kv
from pdbridge_vllm.layout import LAYOUT_ATTR, KvLayout
from pdbridge_vllm.runtime import LayoutRefused, Runtime, Stats, failure_cause, log
from pdbridge_vllm.shards import Plan, ShardError, part_id, sources

_FINISH = object()
#: ``cut(pages, tensor name, plan) -> bytes``: the part of a batch of pages a plan selects.
Cut = Callable[[Any, str, Plan], bytes]


@dataclasses.dataclass(frozen=True)
class Request:
    """What every part's header says of the request."""

    transfer_id: str
    request_id: str
    fingerprint: kv.Fingerprint
    n_tokens: int
    #: ``shard_missing`` / ``shard_wrong_rank``: the TP mutation faults (config.FAULTS).
    fault: str | None = None


class Outgoing:
    """One request's KV from this prefill rank to a decode engine: pages queued from the
    forward thread (:meth:`send`, returns at once), cut into one part per decode rank that
    holds any of them and sent on the loop, finished or cancelled once. ``done`` is set when
    every part ended, either way; ``error`` (a cause, see :func:`failure_cause`) and
    ``detail`` say why it failed. A part that fails cancels the others: the decode engine
    cannot use a request's KV with a rank's part missing."""

    def __init__(
        self, runtime: Runtime, destination: str, request: Request, layout: KvLayout, cut: Cut
    ) -> None:
        self.runtime = runtime
        self.destination = destination
        self.request = request
        self.layout = layout
        self._cut = cut
        self.done = threading.Event()
        self.summary = kv.TransferSummary(request.transfer_id)
        self.error: str | None = None
        self.detail = ""
        self.parts = 0
        self._t0 = time.monotonic()
        # Bound to the loop on first use (Python >= 3.10), so made here without a round trip.
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self._ended = False
        self._cancelled: str | None = None
        runtime.spawn(self._run())

    def send(self, name: str, pages: Any, final: bool) -> None:
        """Queue a batch of pages of tensor ``name`` (the next positions; ``final``: its last)."""
        if self._ended or self.done.is_set():
            return  # failed already: nothing more to send, the result is on record
        self.runtime.loop.call_soon_threadsafe(self._queue.put_nowait, (name, pages, final))

    def finish(self) -> None:
        if not self._ended:
            self._ended = True
            self.runtime.loop.call_soon_threadsafe(self._queue.put_nowait, _FINISH)

    def cancel(self, reason: str) -> None:
        if not self._ended:
            self._ended = True
            # Read by the loop before its next batch too: the pages queued before the cancel
            # are not sent (on a slow link that is seconds of bytes nobody will read).
            self._cancelled = reason
            self.runtime.loop.call_soon_threadsafe(self._queue.put_nowait, reason)

    @property
    def finished(self) -> bool:
        """finish() was called: every page of the request is queued."""
        return self._ended and self._cancelled is None

    # ---------------------------------------------------------------------- the loop side

    async def _parts(self) -> list[tuple[Plan, str, kv.TransferHeader]]:
        """(plan, address, header) of each part, from what the decode engine says of its
        ranks (one round trip the first time a destination is seen, then cached)."""
        addresses = await self.runtime.peer(self.destination)
        layout, request = self.layout, self.request
        tp = len(addresses)
        parts = []
        for plan in (layout.plan_to(r, tp) for r in range(tp)):
            if plan.empty:
                continue
            dst_rank = plan.dst[0]
            k = _sources(layout, dst_rank, tp).index(layout.rank)
            if request.fault == "shard_missing" and (
                layout.rank == layout.tp - 1 and dst_rank == tp - 1
            ):
                log.warning("pdbridge_kv_fault fault=shard_missing part=%d rank=%d", k, dst_rank)
                continue
            label = plan
            if request.fault == "shard_wrong_rank" and tp == 1 and layout.tp > 1:
                label = dataclasses.replace(plan, src=((layout.rank + 1) % layout.tp, layout.tp))
            header = kv.TransferHeader(
                transfer_id=part_id(request.transfer_id, k),
                fingerprint=request.fingerprint,
                request_id=request.request_id,
                layers=layout.manifest(request.n_tokens, plan),
                attrs={LAYOUT_ATTR: layout.to_attr(request.n_tokens, label, k)},
            )
            parts.append((plan, addresses[dst_rank], header))
        if request.fault == "shard_wrong_rank" and tp > 1 and len(parts) > 1:
            # Each decode rank gets the pages cut for the next one: wrong heads, right
            # headers -- only the output can tell (the verification's mutation case).
            plans = [p for p, _, _ in parts]
            parts = [
                (plans[(i + 1) % len(plans)], address, header)
                for i, (_, address, header) in enumerate(parts)
            ]
        return parts

    async def _run(self) -> None:
        queues: list[asyncio.Queue[Any]] = []
        tasks: list[asyncio.Task[kv.TransferSummary]] = []
        try:
            parts = await self._parts()
            self.parts = len(parts)
            for _plan, address, header in parts:
                queue: asyncio.Queue[Any] = asyncio.Queue()
                queues.append(queue)
                tasks.append(asyncio.ensure_future(self._part(address, header, queue)))
            while True:
                item = await self._next(tasks)
                if self._cancelled is not None:
                    item = self._cancelled
                if item is _FINISH or isinstance(item, str):
                    for queue in queues:
                        queue.put_nowait(item)
                    break
                name, pages, final = item
                for (plan, _, _), queue in zip(parts, queues, strict=True):
                    if name in plan.tensors:
                        queue.put_nowait((name, self._cut(pages, name, plan), final))
            for summary in await asyncio.gather(*tasks):
                self._add(summary)
            if self._cancelled is not None:
                raise kv.TransferError(f"cancelled: {self._cancelled}")
        except Exception as exc:
            self.error = failure_cause(exc)
            self.detail = f"{type(exc).__name__}: {exc}"
            if self.error == "kv_import_refused" or isinstance(exc, kv.TransferRefused):
                self.runtime.forget_peer(self.destination)
            for queue in queues:
                queue.put_nowait("another part of the request failed")
            await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            self._record()
            self.done.set()
            self.runtime.ended()

    async def _next(self, tasks: list[asyncio.Task[kv.TransferSummary]]) -> Any:
        """The next queued item; raises the first failure of a part as soon as it happens
        (a rank with nothing to send has no parts: it only waits for finish or cancel)."""
        get = asyncio.ensure_future(self._queue.get())
        running = [t for t in tasks if not t.done()]
        failed = _failed(tasks)
        if not failed and running:
            await asyncio.wait({get, *running}, return_when=asyncio.FIRST_COMPLETED)
            failed = _failed(tasks)
        if failed and not get.done():
            get.cancel()
            raise failed[0].exception()  # type: ignore[misc]
        return await get

    async def _part(
        self, address: str, header: kv.TransferHeader, queue: asyncio.Queue[Any]
    ) -> kv.TransferSummary:
        pool = self.runtime.pool
        link = pool.acquire(address)
        failed = True
        try:
            async with kv.open_transfer(address, header, self.runtime.options, link=link) as tx:
                while True:
                    item = await queue.get()
                    if item is _FINISH:
                        summary = await tx.finish()
                        failed = False
                        return summary
                    if isinstance(item, str):
                        raise kv.TransferError(f"cancelled: {item}")
                    name, data, final = item
                    await tx.send_layer(name, data, final=final)
        finally:
            await pool.release(link, failed=failed)

    def _add(self, part: kv.TransferSummary) -> None:
        s = self.summary
        s.bytes_raw += part.bytes_raw
        s.bytes_wire += part.bytes_wire
        s.chunks += part.chunks
        s.retransmits += part.retransmits
        s.resumes += part.resumes
        s.checksum_failures += part.checksum_failures

    def _record(self) -> None:
        seconds = time.monotonic() - self._t0
        summary, error = self.summary, self.error

        def update(stats: Stats) -> None:
            if error is None:
                stats.transfers += 1
                stats.bytes_raw += summary.bytes_raw
                stats.bytes_wire += summary.bytes_wire
                stats.retransmits += summary.retransmits
                stats.resumes += summary.resumes
                stats.checksum_failures += summary.checksum_failures
                stats.transfer_seconds.append(seconds)
            else:
                stats.transfers_failed += 1
                stats.failures[error] = stats.failures.get(error, 0) + 1

        self.runtime.record(update)
        request = self.request
        if error is None:
            log.info(
                "pdbridge_kv_sent transfer_id=%s request_id=%s parts=%d rank=%d/%d "
                "bytes_raw=%d bytes_wire=%d seconds=%.3f retransmits=%d resumes=%d",
                request.transfer_id,
                request.request_id,
                self.parts,
                self.layout.rank,
                self.layout.tp,
                summary.bytes_raw,
                summary.bytes_wire,
                seconds,
                summary.retransmits,
                summary.resumes,
            )
        else:
            log.warning(
                "pdbridge_kv_send_failed transfer_id=%s request_id=%s destination=%s "
                "rank=%d/%d cause=%s %s",
                request.transfer_id,
                request.request_id,
                self.destination,
                self.layout.rank,
                self.layout.tp,
                error,
                self.detail,
            )


def _failed(tasks: list[asyncio.Task[Any]]) -> list[asyncio.Task[Any]]:
    return [t for t in tasks if t.done() and not t.cancelled() and t.exception() is not None]


def _sources(layout: KvLayout, dst_rank: int, dst_tp: int) -> list[int]:
    """The prefill ranks that send decode rank ``dst_rank`` of ``dst_tp`` a part."""
    return sources(layout.specs(dst_tp), dst_rank, dst_tp, layout.tp)


class Incoming:
    """One request's load on a decode rank: waits for every part of its shard (the first
    part's header says which prefill ranks send the others; fingerprints checked by the
    receiver at Begin), lets ``check`` refuse each header before any of its bytes is
    written, hands every verified segment to the writer ``writer(header)`` makes for its
    part (on the loop thread), all within ``deadline_s``."""

    def __init__(
        self,
        runtime: Runtime,
        transfer_id: str,
        deadline_s: float,
        fingerprint: kv.Fingerprint,
        layout: KvLayout,
        n_tokens: int,
        writer: Callable[[kv.TransferHeader], Callable[[kv.Segment], None]],
        request_id: str = "",
    ) -> None:
        self.runtime = runtime
        self.transfer_id = transfer_id
        self.request_id = request_id
        self.deadline_s = deadline_s
        self.layout = layout
        self.n_tokens = n_tokens
        self.done = threading.Event()
        self.error: str | None = None
        self.detail = ""
        self.bytes = 0
        self.parts = 0
        self._fingerprint = fingerprint
        self._writer = writer
        self._waiting: dict[int, str] = {}  # part -> what it waits for (named at a timeout)
        self._t0 = time.monotonic()
        self._task: asyncio.Task[None] | None = None
        self._future = runtime.spawn(self._run())

    def cancel(self) -> None:
        """End the load now (its request was aborted); it is reported failed."""

        def cancel() -> None:
            if self._task is not None:
                self._task.cancel()

        self.runtime.loop.call_soon_threadsafe(cancel)

    async def _run(self) -> None:
        self._task = asyncio.ensure_future(asyncio.wait_for(self._load(), self.deadline_s))
        try:
            await self._task
        except asyncio.CancelledError:
            self.error = "kv_cancelled"
            self.detail = "the request was aborted"
        except TimeoutError:
            self.error = "kv_timeout"
            self.detail = f"deadline of {self.deadline_s:g} s passed; " + (
                "; ".join(self._waiting[k] for k in sorted(self._waiting)) or "waiting"
            )
        except Exception as exc:
            self.error = failure_cause(exc)
            self.detail = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        finally:
            self._record()
            self.done.set()
            self.runtime.ended()

    async def _load(self) -> None:
        first = await self._open(0, None)
        async with first:
            header = self._header(first, 0)
            src_rank, src_tp = self.layout.source(header.attrs.get(LAYOUT_ATTR))
            try:
                sources = self.layout.sources(src_tp)
            except ShardError as exc:
                raise LayoutRefused(f"header: {exc}") from exc
            self.parts = len(sources)
            rest = [asyncio.ensure_future(self._other(k, sources[k])) for k in range(1, self.parts)]
            try:
                await asyncio.gather(self._drain(0, first, src_rank), *rest)
            finally:
                for task in rest:
                    task.cancel()
                await asyncio.gather(*rest, return_exceptions=True)

    async def _open(self, k: int, src_rank: int | None) -> Any:
        receiver = self.runtime.receiver
        if receiver is None:
            raise kv.TransferRefused("this engine has no KV receiver (kv_role kv_consumer)")
        tid = part_id(self.transfer_id, k)
        self._waiting[k] = (
            f"part {k} ({tid}) from prefill rank {src_rank} never began"
            if src_rank is not None
            else f"the transfer {tid} never began"
        )
        return await receiver.open(tid, self.deadline_s, expect_fingerprint=self._fingerprint)

    async def _other(self, k: int, src_rank: int) -> None:
        reader = await self._open(k, src_rank)
        async with reader:
            await self._drain(k, reader, src_rank)

    def _header(self, reader: Any, k: int) -> kv.TransferHeader:
        header = reader.header
        if header is None:
            raise LayoutRefused("header: missing")
        reason = self.layout.check_attr(header.attrs.get(LAYOUT_ATTR), self.n_tokens, k)
        if reason is not None:
            raise LayoutRefused(reason)
        return header

    async def _drain(self, k: int, reader: Any, src_rank: int | None) -> None:
        header = self._header(reader, k)
        self._waiting[k] = (
            f"part {k} ({header.transfer_id}) from prefill rank {src_rank} began and did not "
            "complete"
        )
        write = self._writer(header)
        async for segment in reader:
            write(segment)
            self.bytes += len(segment.data)
        del self._waiting[k]

    def _record(self) -> None:
        seconds = time.monotonic() - self._t0
        error = self.error

        def update(stats: Stats) -> None:
            stats.load_wait_seconds.append(seconds)
            if error is None:
                stats.loads += 1
            else:
                stats.loads_failed += 1
                stats.failures[error] = stats.failures.get(error, 0) + 1

        self.runtime.record(update)
        if error is None:
            log.info(
                "pdbridge_kv_loaded transfer_id=%s request_id=%s parts=%d rank=%d/%d bytes=%d "
                "seconds=%.3f",
                self.transfer_id,
                self.request_id,
                self.parts,
                self.layout.rank,
                self.layout.tp,
                self.bytes,
                seconds,
            )
        else:
            log.warning(
                "pdbridge_kv_load_failed transfer_id=%s request_id=%s rank=%d/%d cause=%s "
                "seconds=%.3f %s",
                self.transfer_id,
                self.request_id,
                self.layout.rank,
                self.layout.tp,
                error,
                seconds,
                self.detail,
            )

"""The connector's network side, vLLM-free: one asyncio loop in a daemon thread of the vLLM
worker process, holding grpc_kv's long-lived links (prefill role) and an embedded receiver
(decode role).

vLLM calls the connector from its model-runner thread in the middle of forward passes; nothing
here may block it on the network. The forward thread hands bytes to :meth:`Outgoing.send`
(queued, returns at once) and polls finished transfers; the loop does the I/O, so the link
streams a layer while later layers compute. grpc.aio objects belong to the loop that made them,
hence one loop for the process.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, TypeVar

from grpc_kv import api as kv
from pdproto.kv import KV_IMPORT_REFUSED, KV_PEER_REFUSED, KV_TIMEOUT, KV_UNREACHABLE

log = logging.getLogger("vllm.pdbridge")  # under vLLM's logger: its handler and format
T = TypeVar("T")

_FINISH = object()


@dataclass
class Stats:
    """Counters since the last :meth:`Runtime.take_stats` (vLLM aggregates and exports them)."""

    transfers: int = 0
    transfers_failed: int = 0
    bytes_raw: int = 0
    bytes_wire: int = 0
    retransmits: int = 0
    resumes: int = 0
    checksum_failures: int = 0
    transfer_seconds: list[float] = field(default_factory=list)
    loads: int = 0
    loads_failed: int = 0
    load_wait_seconds: list[float] = field(default_factory=list)
    failures: dict[str, int] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "transfers": self.transfers,
            "transfers_failed": self.transfers_failed,
            "bytes_raw": self.bytes_raw,
            "bytes_wire": self.bytes_wire,
            "retransmits": self.retransmits,
            "resumes": self.resumes,
            "checksum_failures": self.checksum_failures,
            "transfer_seconds": list(self.transfer_seconds),
            "loads": self.loads,
            "loads_failed": self.loads_failed,
            "load_wait_seconds": list(self.load_wait_seconds),
            "failures": dict(self.failures),
        }


def failure_cause(exc: BaseException) -> str:
    """A short, stable cause for logs, metrics and ``kv_transfer_params``."""
    if isinstance(exc, kv.PeerRefused):
        return KV_PEER_REFUSED
    if isinstance(exc, kv.ReceiverUnreachable):
        return KV_UNREACHABLE
    if isinstance(exc, kv.FingerprintMismatch) or (
        isinstance(exc, kv.TransferRefused) and "fingerprint" in str(exc)
    ):
        return "kv_fingerprint_mismatch"
    if isinstance(exc, (kv.TransferTimeout, TimeoutError)):
        return KV_TIMEOUT
    if isinstance(exc, LayoutRefused):
        return KV_IMPORT_REFUSED
    if isinstance(exc, kv.TransferRefused):
        return "kv_refused"
    return "kv_transfer_error"


class LayoutRefused(Exception):
    """The header's layout is not this engine's: refused before any block is written."""


def _name_native_thread(name: bytes) -> None:
    """Give the calling thread its OS name (Python 3.11 names only its own Thread objects), so
    ``top -H`` and /proc/<pid>/task/*/comm show the link's CPU apart from vLLM's threads."""
    # Not Linux (no prctl): the name is a convenience, the link works without it.
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(15, name[:15], 0, 0, 0)  # 15: PR_SET_NAME


def _widen_affinity(cpus: tuple[int, ...] | None) -> None:
    """Let the calling thread (and the grpc threads it starts, which inherit its mask) run on
    ``cpus``, default every CPU: vLLM's CPU worker binds itself to its compute cores before
    the connector starts, and a link thread sharing that core with the forward pass and its
    spinning OpenMP threads sent KV at a fraction of the link's rate. The kernel keeps the
    mask inside the process's cpuset; one that leaves no CPU is refused with a warning."""
    if not hasattr(os, "sched_setaffinity"):
        return
    wanted = set(cpus) if cpus is not None else set(range(os.cpu_count() or 1))
    try:
        os.sched_setaffinity(0, wanted)
    except OSError as exc:
        log.warning("pdbridge_kv_link_cpus_refused cpus=%s error=%s", sorted(wanted), exc)
    else:
        log.info("pdbridge_kv_link_cpus cpus=%s", sorted(os.sched_getaffinity(0)))


class Runtime:
    """The loop thread, the link pool and (decode role) the receiver."""

    def __init__(
        self, options: kv.LinkOptions, tls: kv.TLSConfig, cpus: tuple[int, ...] | None = None
    ) -> None:
        self.options = options
        self.tls = tls
        self._cpus = cpus
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="pdbridge-kv", daemon=True)
        self._thread.start()
        self.pool: kv.LinkPool = self.call(self._make_pool())
        self.receiver: kv.ReceiverServer | None = None
        self._lock = threading.Lock()
        self._stats = Stats()

    def _run(self) -> None:
        _name_native_thread(b"pdbridge-kv")
        _widen_affinity(self._cpus)
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    async def _make_pool(self) -> kv.LinkPool:
        return kv.LinkPool(self.options, self.tls)

    def call(self, coro: Any, timeout: float | None = 30.0) -> Any:
        """Run ``coro`` on the loop and wait for it (start-up and shut-down only)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def spawn(self, coro: Any) -> Future[Any]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def listen(self, bind: str, options: kv.ReceiverOptions) -> int:
        async def start() -> int:
            server = kv.ReceiverServer(bind, options, self.tls, metrics=kv.SENDER_METRICS)
            port = await server.start()
            self.receiver = server
            return port

        port: int = self.call(start())
        return port

    def record(self, update: Callable[[Stats], None]) -> None:
        with self._lock:
            update(self._stats)

    def take_stats(self) -> Stats | None:
        with self._lock:
            stats, self._stats = self._stats, Stats()
        empty = not (stats.transfers or stats.transfers_failed or stats.loads or stats.loads_failed)
        return None if empty else stats

    def close(self) -> None:
        async def stop() -> None:
            await self.pool.close()
            if self.receiver is not None:
                await self.receiver.stop(1.0)

        try:
            self.call(stop(), timeout=10.0)
        except Exception as exc:  # shutting down: log, never raise into vLLM's teardown
            log.warning("pdbridge_kv_close_failed: %r", exc)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5.0)


class Outgoing:
    """One request's transfer to a decode site: bytes queued from the forward thread, sent on
    the loop in order, finished or cancelled once. ``done`` is set when it ended either way;
    ``error`` (a cause, see :func:`failure_cause`) and ``detail`` say why it failed."""

    def __init__(self, runtime: Runtime, destination: str, header: kv.TransferHeader) -> None:
        self.runtime = runtime
        self.destination = destination
        self.header = header
        self.done = threading.Event()
        self.summary: kv.TransferSummary | None = None
        self.error: str | None = None
        self.detail = ""
        self.queued_bytes = 0
        self._t0 = time.monotonic()
        # Bound to the loop on first use (Python >= 3.10), so made here without a round trip.
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self._ended = False
        self._cancelled: str | None = None
        runtime.spawn(self._run())

    def send(self, name: str, data: bytes, final: bool) -> None:
        if self._ended or self.done.is_set():
            return  # failed already: nothing more to send, the result is on record
        self.queued_bytes += len(data)
        self.runtime.loop.call_soon_threadsafe(self._queue.put_nowait, (name, data, final))

    def finish(self) -> None:
        if not self._ended:
            self._ended = True
            self.runtime.loop.call_soon_threadsafe(self._queue.put_nowait, _FINISH)

    def cancel(self, reason: str) -> None:
        if not self._ended:
            self._ended = True
            # Read by the loop before its next layer too: the pages queued before the cancel
            # are not sent (on a slow link that is seconds of bytes nobody will read).
            self._cancelled = reason
            self.runtime.loop.call_soon_threadsafe(self._queue.put_nowait, reason)

    async def _run(self) -> None:
        pool = self.runtime.pool
        link = pool.acquire(self.destination)
        failed = True
        try:
            async with kv.open_transfer(
                self.destination, self.header, self.runtime.options, link=link
            ) as tx:
                while True:
                    item = await self._queue.get()
                    if self._cancelled is not None:
                        item = self._cancelled
                    if item is _FINISH:
                        self.summary = await tx.finish()
                        break
                    if isinstance(item, str):
                        raise kv.TransferError(f"cancelled: {item}")
                    name, data, final = item
                    await tx.send_layer(name, data, final=final)
            failed = False
        except Exception as exc:
            self.error = failure_cause(exc)
            self.detail = f"{type(exc).__name__}: {exc}"
        finally:
            await pool.release(link, failed=failed)
            self._record()
            self.done.set()

    def _record(self) -> None:
        seconds = time.monotonic() - self._t0
        summary, error = self.summary, self.error

        def update(stats: Stats) -> None:
            if error is None and summary is not None:
                stats.transfers += 1
                stats.bytes_raw += summary.bytes_raw
                stats.bytes_wire += summary.bytes_wire
                stats.retransmits += summary.retransmits
                stats.resumes += summary.resumes
                stats.checksum_failures += summary.checksum_failures
                stats.transfer_seconds.append(seconds)
            else:
                stats.transfers_failed += 1
                cause = error or "kv_transfer_error"
                stats.failures[cause] = stats.failures.get(cause, 0) + 1

        self.runtime.record(update)
        if error is None and summary is not None:
            log.info(
                "pdbridge_kv_sent transfer_id=%s request_id=%s bytes_raw=%d bytes_wire=%d "
                "seconds=%.3f retransmits=%d resumes=%d",
                self.header.transfer_id,
                self.header.request_id,
                summary.bytes_raw,
                summary.bytes_wire,
                seconds,
                summary.retransmits,
                summary.resumes,
            )
        else:
            log.warning(
                "pdbridge_kv_send_failed transfer_id=%s request_id=%s destination=%s cause=%s %s",
                self.header.transfer_id,
                self.header.request_id,
                self.destination,
                error,
                self.detail,
            )


class Incoming:
    """One request's load on the decode side: waits for the transfer (fingerprint checked by
    the receiver at Begin), lets ``check`` refuse its header before any byte is written, hands
    every verified segment to ``write`` (on the loop thread), all within ``deadline_s``."""

    def __init__(
        self,
        runtime: Runtime,
        transfer_id: str,
        deadline_s: float,
        fingerprint: kv.Fingerprint,
        check: Callable[[kv.TransferHeader], str | None],
        write: Callable[[kv.Segment], None],
        request_id: str = "",
    ) -> None:
        self.runtime = runtime
        self.transfer_id = transfer_id
        self.request_id = request_id
        self.deadline_s = deadline_s
        self.done = threading.Event()
        self.error: str | None = None
        self.detail = ""
        self.bytes = 0
        self._fingerprint = fingerprint
        self._check = check
        self._write = write
        self._t0 = time.monotonic()
        self._future = runtime.spawn(self._run())
        self._task: asyncio.Task[None] | None = None

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
        except Exception as exc:
            self.error = failure_cause(exc)
            self.detail = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        finally:
            self._record()
            self.done.set()

    async def _load(self) -> None:
        receiver = self.runtime.receiver
        if receiver is None:
            raise kv.TransferRefused("this engine has no KV receiver (kv_role kv_consumer)")
        reader = await receiver.open(
            self.transfer_id, self.deadline_s, expect_fingerprint=self._fingerprint
        )
        async with reader:
            header = reader.header
            if header is None:
                raise LayoutRefused("header: missing")
            reason = self._check(header)
            if reason is not None:
                raise LayoutRefused(reason)
            async for segment in reader:
                self._write(segment)
                self.bytes += len(segment.data)

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
                "pdbridge_kv_loaded transfer_id=%s request_id=%s bytes=%d seconds=%.3f",
                self.transfer_id,
                self.request_id,
                self.bytes,
                seconds,
            )
        else:
            log.warning(
                "pdbridge_kv_load_failed transfer_id=%s request_id=%s cause=%s seconds=%.3f %s",
                self.transfer_id,
                self.request_id,
                error,
                seconds,
                self.detail,
            )

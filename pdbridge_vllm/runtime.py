"""The connector's network side, vLLM-free: one asyncio loop in a daemon thread of the vLLM
worker process, holding grpc_kv's long-lived links (prefill role) and an embedded receiver
(decode role). One request's transfers are in :mod:`pdbridge_vllm.transfers`.

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
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, TypeVar

from grpc_kv import api as kv
from grpc_kv import link as kv_link
from pdbridge_vllm.layout import KvLayout
from pdproto.kv import KV_IMPORT_REFUSED, KV_PEER_REFUSED, KV_TIMEOUT, KV_UNREACHABLE

log = logging.getLogger("vllm.pdbridge")  # under vLLM's logger: its handler and format
T = TypeVar("T")

#: The key of a decode rank's ``ReceiverServer.describe`` (answered in every Ping):
#: ``{"tp": tensor-parallel size, "rank": this rank}``, JSON.
PEER_ATTR = "pdbridge.vllm.consumer"
#: How long a prefill rank trusts what a decode engine said of its ranks (a failed transfer
#: to it forgets it at once: the engine may have restarted at another size).
PEER_TTL_S = 60.0


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
    if isinstance(exc, (kv.ReceiverUnreachable, kv.SenderLost)):
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


def peer_addresses(destination: str, attr: str | None) -> list[str]:
    """Every rank's receiver address from rank ``destination``'s ``PEER_ATTR`` (see
    :meth:`Runtime.peer`); a malformed one counts as a single rank."""
    try:
        said = json.loads(attr) if attr else {}
        tp, rank = int(said["tp"]), int(said["rank"])
    except (ValueError, TypeError, KeyError):
        return [destination]
    if not 0 <= rank < tp <= 1024:
        return [destination]
    host, _, port = destination.rpartition(":")
    base = int(port) - rank
    return [f"{host}:{base + r}" for r in range(tp)]


@dataclass(frozen=True)
class Worker:
    """What one worker's sending and loading sides share: the link runtime, this rank's
    layout and registered caches (layer -> tensors), the model's fingerprint, and each
    KV-cache group's speculative state blocks (vLLM's ``num_speculative_blocks``)."""

    runtime: Runtime
    layout: KvLayout
    caches: dict[str, list[Any]]
    fingerprint: kv.Fingerprint
    spec_blocks: list[int]


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
        self._peers: dict[str, tuple[float, list[str]]] = {}
        #: Called (on the loop) whenever a transfer or load ends: the worker's doorbell
        #: (pdbridge_vllm.idle), so an idle engine core steps at once to collect it.
        self.on_end: Callable[[], None] | None = None

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

    async def peer(self, destination: str) -> list[str]:
        """The addresses of a decode engine's ranks, rank 0 first, from what the receiver at
        ``destination`` says of itself (its ``PEER_ATTR``; rank ``r`` listens on rank 0's
        port + ``r``). One address when it says nothing (a decode engine at TP 1 with an
        older connector). Asked again after a failure to reach it, for as long as the link
        lets an unreachable receiver be (``unreachable_ms``; ``timeout_ms`` when 0): then
        ReceiverUnreachable, the same cause a transfer would end with."""
        cached = self._peers.get(destination)
        if cached is not None and time.monotonic() - cached[0] < PEER_TTL_S:
            return cached[1]
        options = self.options
        patience = (options.unreachable_ms or options.timeout_ms) / 1000
        give_up, attempt = time.monotonic() + patience, 0
        while True:
            link = self.pool.acquire(destination)
            failed = True
            try:
                attrs = await link.describe()
                failed = False
                break
            except kv_link.CONNECTION_ERRORS as exc:
                if time.monotonic() >= give_up:
                    raise kv.ReceiverUnreachable(
                        f"{destination}: no answer to describe for {patience:g} s "
                        f"({kv_link.describe_error(exc)})"
                    ) from exc
            finally:
                await self.pool.release(link, failed=failed)
            attempt += 1
            await asyncio.sleep(min(options.backoff_ms / 1000 * 2 ** min(attempt, 6), 1.0))
        addresses = peer_addresses(destination, attrs.get(PEER_ATTR))
        self._peers[destination] = (time.monotonic(), addresses)
        if len(addresses) > 1:
            log.info("pdbridge_kv_peer destination=%s ranks=%s", destination, addresses)
        return addresses

    def forget_peer(self, destination: str) -> None:
        self._peers.pop(destination, None)

    def record(self, update: Callable[[Stats], None]) -> None:
        with self._lock:
            update(self._stats)

    def ended(self) -> None:
        if self.on_end is not None:
            self.on_end()

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

"""Waiting for KV costs (almost) nothing.

vLLM keeps an engine stepping while any request waits for remote KV (decode) or holds blocks
for a transfer in flight (prefill): the engine core sleeps 1 ms between empty steps, and
every step wakes the workers, whose shared-memory readers then spin (``sched_yield``) for a
second after each message. A decode engine with one request waiting for its KV burnt about
1.3 cores doing nothing, and its spinning worker held the GIL against the connector's own
link thread in the same process (Begin answers seconds late on a 2-core host).

Two pieces stop that without touching vLLM's sources:

* :class:`Doorbell`: when a step has nothing to compute and the connector is only waiting
  for transfers, the scheduler side waits (``idle_poll_ms`` at most) for a worker to ring:
  a worker rings the moment one of its loads or sends ends, so a finished transfer is seen
  at once, and nothing steps in between. An abstract Unix datagram socket named after the
  engine core's process (workers are its children).
* :func:`quiet_spinning`: a worker's shared-memory readers spin only ``worker_spin_ms`` after
  a message (vLLM: 1 s), then sleep on their notify socket; back-to-back steps under load
  still find them spinning.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import select
import socket

log = logging.getLogger("vllm.pdbridge")

_LOCAL: Doorbell | None = None  # the doorbell of this process's scheduler side, if any


def _address(pid: int) -> bytes:
    return b"\0pdbridge-kv-doorbell-" + str(pid).encode()


class Doorbell:
    """The scheduler side's end (in the engine core process)."""

    def __init__(self) -> None:
        global _LOCAL
        self._sock: socket.socket | None = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            self._sock.bind(_address(os.getpid()))
            self._sock.setblocking(False)
        except OSError as exc:  # another engine core of this pid? never: log and poll
            log.warning("pdbridge_kv_doorbell_unavailable error=%s", exc)
            self._sock.close()
            self._sock = None
        _LOCAL = self

    def wait(self, timeout_s: float) -> bool:
        """Until a worker rings or ``timeout_s`` passes; returns whether one rang."""
        if self._sock is None:
            return False
        ready, _, _ = select.select([self._sock], [], [], timeout_s)
        if not ready:
            return False
        with contextlib.suppress(BlockingIOError):
            while self._sock.recv(64):
                pass
        return True

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


class Bell:
    """A worker's end: :meth:`ring` from any thread, never blocks, never raises."""

    def __init__(self) -> None:
        # The worker's parent is the engine core (multiprocessing executor); an in-process
        # worker (uniprocess executor) rings its own process's doorbell.
        pid = os.getpid() if _LOCAL is not None else os.getppid()
        self._address = _address(pid)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.setblocking(False)

    def ring(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.sendto(b"!", self._address)

    def close(self) -> None:
        self._sock.close()


def quiet_spinning(spin_s: float) -> int:
    """Make this process's vLLM shared-memory readers spin at most ``spin_s`` after a
    message (existing ones, found once, and any made later); returns how many were found."""
    try:
        from vllm.distributed.device_communicators.shm_broadcast import SpinCondition
    except ImportError:
        return 0
    found = 0
    for obj in gc.get_objects():
        if isinstance(obj, SpinCondition) and getattr(obj, "is_reader", False):
            obj.busy_loop_s = min(obj.busy_loop_s, spin_s)
            found += 1
    init = SpinCondition.__init__
    if not getattr(init, "_pdbridge_quiet", False):

        def quiet_init(self: SpinCondition, *args: object, **kwargs: object) -> None:
            init(self, *args, **kwargs)
            if self.is_reader:
                self.busy_loop_s = min(self.busy_loop_s, spin_s)

        quiet_init._pdbridge_quiet = True  # type: ignore[attr-defined]
        SpinCondition.__init__ = quiet_init
    return found

"""Waiting for KV costs (almost) nothing.

vLLM keeps an engine stepping while any request waits for remote KV (decode) or holds blocks
for a transfer in flight (prefill): the engine core sleeps 1 ms between empty steps, and
every step wakes the workers, whose shared-memory readers then spin (``sched_yield``) for a
second after each message. A decode engine with one request waiting for its KV burnt about
1.3 cores doing nothing, and its spinning worker held the GIL against the connector's own
link thread in the same process (Begin answers seconds late on a 2-core host).

Two pieces stop that without touching vLLM's sources:

* :class:`Doorbell`: when a step has nothing to compute and the connector is only waiting
  for transfers, the scheduler side waits (``idle_poll_ms`` at most) for a worker to ring or
  a request to arrive: a worker rings the moment one of its loads or sends ends (an abstract
  Unix datagram socket named after the engine core's process; workers are its children), so
  a finished transfer is seen at once, a new request is scheduled at once, and nothing steps
  in between.
* :func:`quiet_spinning`: a worker's shared-memory readers spin only ``worker_spin_ms`` after
  a message (vLLM: 1 s), then sleep on their notify socket; back-to-back steps under load
  still find them spinning.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import queue
import socket
import threading
import time
from typing import Any

log = logging.getLogger("vllm.pdbridge")

_LOCAL: Doorbell | None = None  # the doorbell of this process's scheduler side, if any


def _address(pid: int) -> bytes:
    return b"\0pdbridge-kv-doorbell-" + str(pid).encode()


class Doorbell:
    """The scheduler side's end (in the engine core process).

    :meth:`wait` returns when a worker rings (a listener thread takes the datagram), when a
    new request or an abort reaches the engine core (its input queue, found once in this
    process: the wait is on that queue's own condition, so nothing that arrives waits for
    the timeout), or after ``timeout_s``."""

    def __init__(self) -> None:
        global _LOCAL
        self._rang = False
        # Found once, at start (the connector is built inside the engine core's __init__,
        # after its input queue): not on a request's path.
        self._queue = _engine_input_queue()
        self._cond = self._queue.not_empty if self._queue is not None else threading.Condition()
        self._sock: socket.socket | None = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            self._sock.bind(_address(os.getpid()))
        except OSError as exc:  # another engine core of this pid? never: log and poll
            log.warning("pdbridge_kv_doorbell_unavailable error=%s", exc)
            self._sock.close()
            self._sock = None
        else:
            threading.Thread(target=self._listen, name="pdbridge-bell", daemon=True).start()
        _LOCAL = self
        log.info(
            "pdbridge_kv_idle_wait doorbell=%s wakes_on_requests=%s",
            self._sock is not None,
            self._queue is not None,
        )

    def _listen(self) -> None:
        sock = self._sock
        while sock is not None:
            try:
                sock.recv(64)
            except OSError:
                return  # closed
            with self._cond:
                self._rang = True
                self._cond.notify_all()

    def wait(self, timeout_s: float) -> bool:
        """Until a worker rings, a request arrives or ``timeout_s`` passes; returns whether
        a worker rang."""
        if self._sock is None:
            time.sleep(timeout_s)
            return False
        with self._cond:  # the queue's own mutex: _qsize(), not qsize(), which takes it again
            if not self._rang and not (self._queue is not None and self._queue._qsize()):
                self._cond.wait(timeout_s)
            rang, self._rang = self._rang, False
        return rang

    def close(self) -> None:
        if self._sock is not None:
            sock, self._sock = self._sock, None
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()


def _engine_input_queue() -> queue.Queue[Any] | None:
    """The engine core's input queue (``EngineCoreProc.input_queue``: requests and aborts
    from the API server), or None in a process without one."""
    try:
        from vllm.v1.engine.core import EngineCore
    except ImportError:
        return None
    for obj in gc.get_objects():
        if isinstance(obj, EngineCore):
            found = getattr(obj, "input_queue", None)
            if isinstance(found, queue.Queue):
                return found
    return None


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

"""Allocator tuning for processes that move KV chunks: keep freed chunk buffers for reuse.

Every chunk passes through several multi-megabyte buffers (the frame, grpc's copy of it,
the received message). glibc serves such sizes with fresh ``mmap`` pages and gives them
back on free, so each buffer is page-faulted and zeroed by the kernel anew: measured on
loopback, that doubled the CPU per byte of both ends (docs/kv-link.md, "Performance").
Raising the mmap and trim thresholds makes malloc reuse freed heap memory instead; the
price is that a process keeps up to ``TRIM_BYTES`` of freed memory rather than returning
it to the kernel at once.

:func:`owned_buffer` gives the receiver a fresh, uninitialised buffer for a payload that a
consumer will keep.

Called by :class:`grpc_kv.link.Link` and :class:`grpc_kv.receiver.ReceiverServer`;
process-wide, idempotent, non-blocking. A no-op off glibc or when the environment sets
``PDBRIDGE_KV_MALLOC_TUNING=0`` (for an embedding process that tunes malloc itself).
"""

from __future__ import annotations

import ctypes
import logging
import os

import numpy as np

log = logging.getLogger("grpc_kv.alloc")

#: Allocations up to this size come from the heap (glibc's ceiling for the knob is 32 MiB
#: on 64-bit): covers the default 4 MiB chunks and their frames.
MMAP_THRESHOLD_BYTES = 32 << 20
#: Freed memory at the top of the heap kept for reuse before it is returned to the kernel.
TRIM_BYTES = 256 << 20
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_applied: bool | None = None


def tune_allocator() -> bool:
    """Apply the thresholds once per process; True when glibc accepted them."""
    global _applied
    if _applied is not None:
        return _applied
    _applied = False
    if os.environ.get("PDBRIDGE_KV_MALLOC_TUNING", "1") == "0":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc: nothing to tune
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    _applied = bool(
        mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) and mallopt(_M_TRIM_THRESHOLD, TRIM_BYTES)
    )
    log.debug("allocator_tuned applied=%s", _applied)
    return _applied


def owned_buffer(nbytes: int) -> memoryview:
    """A new writable buffer of ``nbytes`` whose contents are undefined until written: for
    a payload received straight into the buffer a consumer keeps. numpy's allocation is
    neither zeroed nor page-faulted 4 KiB at a time (it advises huge pages for large
    arrays); a ``bytearray`` of the same size, zeroed, cost the receiver more than the copy
    it saved (docs/kv-link.md, "Kept chunks")."""
    return np.empty(nbytes, dtype=np.uint8).data

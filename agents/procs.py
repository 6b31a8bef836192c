"""Process-group plumbing for supervised children: no orphans, ever.

Two layers make sure a child never outlives the agent that started it:

* ``PR_SET_PDEATHSIG(SIGKILL)`` armed in the child before it execs the real command: the
  kernel kills the child when the agent dies, even by ``kill -9`` (:func:`with_death_signal`).
* A record of every child's process group (``children.json`` in the state directory); a
  restarted agent kills whatever is left of those groups (grandchildren that do not inherit
  the death signal) before it does anything else (:func:`reap_recorded_groups`).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
from pathlib import Path

log = logging.getLogger("pdbridge.agent.procs")

# Runs as ``python -c`` in the child, then execs the real command (same pid). A pre-exec hook
# in the agent itself is not an option: gRPC's fork handlers abort a child that runs Python
# between fork and exec. Arms the death signal, then checks that the agent did not die before
# it was armed (the kernel would not have sent it).
_SHIM = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    os._exit(70)\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)


def with_death_signal(argv: list[str]) -> list[str]:
    """``argv`` wrapped so that the process gets SIGKILL when the agent dies (even by
    ``kill -9``): ``PR_SET_PDEATHSIG`` set by a tiny shim that then execs ``argv``."""
    return [sys.executable, "-c", _SHIM, str(os.getpid()), *argv]


def start_time(pid: int) -> int | None:
    """Process start time in clock ticks since boot (``/proc/PID/stat`` field 22), or None."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name may contain spaces and parentheses: split after the last ')'.
    fields = raw[raw.rfind(")") + 2 :].split()
    return int(fields[19])


def _group_of(pid: int) -> tuple[int, int] | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rfind(")") + 2 :].split()
    return int(fields[2]), int(fields[19])


def kill_group(pgid: int, sig: int) -> bool:
    """Send ``sig`` to a process group; False if the group no longer exists."""
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        return False
    except PermissionError:
        log.warning("agent.killpg_denied", extra={"pgid": pgid})
        return False
    return True


class GroupRecord:
    """The on-disk list of live child process groups (``{pgid: start_time}``).

    Called by the supervisor on every spawn and exit (a small atomic file write).
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.groups: dict[int, int] = {}

    def add(self, pgid: int, started: int) -> None:
        self.groups[pgid] = started
        self._save()

    def remove(self, pgid: int) -> None:
        if self.groups.pop(pgid, None) is not None:
            self._save()

    def _save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({str(k): v for k, v in self.groups.items()}))
        os.replace(tmp, self.path)


def reap_recorded_groups(path: Path) -> int:
    """Kill every process left in the groups a previous agent recorded; returns the count.

    A process is killed only if it is in a recorded group and started no earlier than that
    group's leader did, so a recycled pgid of an unrelated older process is never touched.
    Called once at agent start, before the control API opens (blocking, scans /proc).
    """
    try:
        recorded = {int(k): int(v) for k, v in json.loads(path.read_text()).items()}
    except (OSError, ValueError):
        return 0
    killed = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        info = _group_of(int(entry.name))
        if info is None:
            continue
        pgid, started = info
        if pgid in recorded and started >= recorded[pgid] and int(entry.name) != os.getpid():
            try:
                os.kill(int(entry.name), signal.SIGKILL)
                killed += 1
            except ProcessLookupError:
                pass
    path.unlink(missing_ok=True)
    if killed:
        log.warning("agent.reaped_leftover_children", extra={"count": killed})
    return killed

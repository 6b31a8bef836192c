"""Process-group plumbing for supervised children: no orphans, ever.

Two layers make sure a child never outlives the agent that started it:

* Every command runs under a keeper process (:mod:`agents.keeper`, :func:`keeper_argv`)
  that leads the command's process group and holds ``PR_SET_PDEATHSIG``: when the agent dies,
  even by ``kill -9``, the keeper kills the whole group. (A pre-exec hook in the agent is not
  an option: gRPC's fork handlers abort a child that runs Python between fork and exec.)
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

KEEPER = Path(__file__).with_name("keeper.py")


def keeper_argv(argv: list[str], limits: dict[str, int] | None = None) -> list[str]:
    """``argv`` run under the keeper (:mod:`agents.keeper`), which takes the command's whole
    process group down when the agent dies, even by ``kill -9``, and applies ``limits``
    (``nofile``, ``nproc``, ``as_mb``; 0 or absent: inherited) to the command."""
    # -I -S: the keeper needs only the standard library; skipping site-packages and the
    # environment's PYTHON* settings makes it start faster and independent of the venv.
    options = [f"{name}={value}" for name, value in sorted((limits or {}).items()) if value]
    return [sys.executable, "-I", "-S", str(KEEPER), str(os.getpid()), *options, "--", *argv]


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

"""Child processes of ``pdbridge run`` and ``pdbridge soak``, each in its own process group so
that shutdown reaches every descendant (engines started by agents, gunicorn workers).

Used by ``pdbridge.testbed``; blocking. Failures surface as ``RuntimeError`` naming the process
and the tail of its log.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path


def free_port(host: str = "127.0.0.1") -> int:
    """An ephemeral port the kernel hands out now (for servers we start ourselves)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


_taken: set[int] = set()


def pinned_port(host: str = "127.0.0.1") -> int:
    """A free port below the kernel's ephemeral range, probed: ports written into a deployment's
    settings must not collide with the source port of a long-lived outgoing connection."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for _ in range(500):
        port = secrets.choice(range(max(1024, low - 12000), low))
        if port in _taken:
            continue
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
        _taken.add(port)
        return port
    raise RuntimeError("no free port below the ephemeral range")


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


@dataclass
class Child:
    """One started process (the leader of its own process group) and its log."""

    name: str
    proc: subprocess.Popen[bytes]
    log: Path
    argv: list[str] = field(default_factory=list)
    extra_env: dict[str, str] = field(default_factory=dict)
    #: Times it was started again after it exited (:meth:`ProcessGroups.restart`).
    restarts: int = 0

    def tail(self, chars: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def alive(self) -> bool:
        return self.proc.poll() is None


@dataclass
class ProcessGroups:
    """Starts children in new sessions and stops them group by group, in reverse start order:
    SIGTERM to the group, a grace period, then SIGKILL to whatever of the group is left."""

    log_dir: Path
    env: dict[str, str]
    cwd: Path | None = None  # Celery's filesystem transport writes control files to its cwd
    children: list[Child] = field(default_factory=list)

    def start(self, name: str, argv: list[str], extra_env: dict[str, str] | None = None) -> Child:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = self.log_dir / f"{name}.log"
        with log.open("ab") as out:
            proc = subprocess.Popen(  # noqa: S603 - our own interpreter and arguments
                argv,
                env={**self.env, **(extra_env or {})},
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                cwd=self.cwd,
            )
        child = Child(name, proc, log, list(argv), dict(extra_env or {}))
        self.children.append(child)
        return child

    def restart(self, child: Child) -> Child:
        """Start an exited child again with its argv and environment, in its place in the
        stop order (what systemd's ``Restart=always`` does for a unit); whatever of its old
        process group is left is killed first."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.proc.pid, signal.SIGKILL)
        index = self.children.index(child)
        self.children.remove(child)
        again = self.start(child.name, child.argv, child.extra_env)
        self.children.remove(again)
        again.restarts = child.restarts + 1
        self.children.insert(index, again)
        return again

    def wait_until(
        self, child: Child, ready: Callable[[], bool], timeout: float, what: str
    ) -> None:
        """Poll ``ready`` until true; raise when the child exits or the time runs out."""
        deadline = time.monotonic() + timeout
        while not ready():
            if not child.alive():
                raise RuntimeError(f"{child.name} exited ({what}): {child.tail()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{child.name}: {what} not reached in {timeout:.0f} s")
            time.sleep(0.2)

    def find(self, name: str) -> Child:
        return next(c for c in self.children if c.name == name)

    def stop_one(self, child: Child, grace: float = 15.0) -> None:
        pgid = child.proc.pid
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.proc.wait(grace)
        # Descendants may outlive the leader (an engine whose agent was killed): finish them.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.proc.wait(5)

    def stop_all(self, grace: float = 15.0) -> None:
        for child in reversed(self.children):
            self.stop_one(child, grace)

    def reap_descendants(self) -> list[tuple[int, str]]:
        """SIGKILL every process still descending from this one (with ``become_subreaper``,
        orphans of our children are ours); returns their pids and command lines. The last line
        of shutdown."""
        left = descendants(os.getpid())
        # Zombies (orphans that already exited, re-parented to us) are only reaped.
        found = [(pid, cmdline(pid)) for pid in left if _state(pid) not in {"Z", ""}]
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for pid in left:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
        return found


def terminate_session(proc: subprocess.Popen[bytes], grace: float = 120.0) -> bool:
    """SIGTERM a process started with ``start_new_session`` (the testbed) and wait; SIGKILL its
    whole group when it overruns ``grace``. True when it stopped by itself in time."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return False
    return True


def become_subreaper() -> None:
    """Orphaned descendants (an engine whose agent died) are re-parented to this process
    instead of init, so shutdown can still find them. Linux only; silently skipped elsewhere."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER


def cmdline(pid: int) -> str:
    try:
        return (
            Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        )
    except OSError:
        return ""


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return ""


def _ppid(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[1])


def descendants(root: int) -> list[int]:
    """Live descendants of ``root`` (children first, then theirs), from /proc."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            ppid = _ppid(int(entry.name))
            if ppid is not None:
                parents[int(entry.name)] = ppid
    out: list[int] = []
    frontier = [root]
    while frontier:
        frontier = [pid for pid, ppid in parents.items() if ppid in frontier]
        out += frontier
    return out

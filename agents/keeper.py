"""The keeper: a tiny parent between the agent and each supervised command, so that nothing
the command started outlives the agent.

Run by the supervisor as ``python keeper.py AGENT_PID [NAME=LIMIT ...] -- COMMAND...`` (limits:
``nofile``, ``nproc``, ``as_mb``; applied to the command) in a new process group
(the keeper leads it; the command and its own children inherit it). This file imports
nothing from pdbridge: it runs by path, before any import path is known.

* The keeper arms ``PR_SET_PDEATHSIG(SIGTERM)``: when the agent dies, even by ``kill -9``, the
  kernel signals the keeper, which SIGKILLs its whole process group (command, workers,
  grandchildren) and itself.
* The command gets ``PR_SET_PDEATHSIG(SIGKILL)`` toward the keeper, so a killed keeper takes
  the command with it.
* A SIGTERM while the agent is alive is the agent's graceful stop (sent to the whole group):
  the keeper waits for the command and exits the way it did (exit code or signal), which is
  what the agent reports as ``last_exit``.
"""

from __future__ import annotations

import ctypes
import os
import resource
import signal
import subprocess
import sys

PR_SET_PDEATHSIG = 1
_libc = ctypes.CDLL(None, use_errno=True)


LIMITS = {
    "nofile": (resource.RLIMIT_NOFILE, 1),
    "nproc": (resource.RLIMIT_NPROC, 1),
    "as_mb": (resource.RLIMIT_AS, 1024 * 1024),
}


def _command_setup(limits: list[tuple[int, int]]) -> None:
    # Runs in the forked command before exec; the keeper is single-threaded, so this is safe.
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    for which, value in limits:
        resource.setrlimit(which, (value, value))


def main() -> None:
    agent_pid = int(sys.argv[1])
    if "--" not in sys.argv[2:] or sys.argv[-1] == "--":
        sys.exit("usage: keeper.py AGENT_PID [NAME=LIMIT ...] -- COMMAND...")
    split = sys.argv.index("--", 2)
    limits = []
    for item in sys.argv[2:split]:
        name, _, value = item.partition("=")
        which, unit = LIMITS[name]
        limits.append((which, int(value) * unit))
    argv = sys.argv[split + 1 :]
    _libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != agent_pid:  # the agent died before the death signal was armed
        sys.exit(70)

    def on_term(signum: int, frame: object) -> None:
        if os.getppid() != agent_pid:
            os.killpg(0, signal.SIGKILL)  # the agent is gone: take the whole group down

    signal.signal(signal.SIGTERM, on_term)
    command = subprocess.Popen(argv, preexec_fn=lambda: _command_setup(limits))  # noqa: S603
    # After the fork: an ignored signal would be inherited by the command.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    code = command.wait()
    sys.stdout.flush()
    if code < 0:  # die the same way, so the agent reports "signal N"
        if -code not in (signal.SIGKILL, signal.SIGSTOP):
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)


if __name__ == "__main__":
    main()

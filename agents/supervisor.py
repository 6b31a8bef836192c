"""Supervision of the agent's children: start, readiness, health, restart with backoff,
crash-loop limit, graceful stop, log capture.

Everything runs on the agent's asyncio loop. Each :class:`Child` owns one monitor task that
drives its life cycle::

    starting --healthy--> running --exit / health lost--> backoff --delay--> starting
        \\-- crash-loop limit reached --> failed          stop() --> stopping --> stopped
    hold() (engine_kill fault) --> held --release()--> starting
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from agents import procs
from agents.config import SupervisionConfig
from agents.launch import ChildSpec, LaunchPlan
from agents.logs import RotatingLog

log = logging.getLogger("pdbridge.agent.supervisor")

STATES = ("starting", "running", "backoff", "stopping", "stopped", "failed", "held")


@dataclass
class ChildEvents:
    """Callbacks the agent registers to count restarts and state changes (metrics)."""

    on_restart: Callable[[str], None] = lambda name: None
    on_state: Callable[[str, str], None] = lambda name, state: None


class Child:
    """One supervised child process (and its process group).

    Created by :class:`agents.service.AgentService` on Launch. Public coroutines are called
    from gRPC handlers; none blocks the loop for long. Failures surface as ``state`` /
    ``last_exit`` and in the log, never as exceptions out of the monitor task.
    """

    def __init__(
        self,
        spec: ChildSpec,
        plan: LaunchPlan,
        config: SupervisionConfig,
        log_dir: Path,
        groups: procs.GroupRecord,
        http: aiohttp.ClientSession,
        events: ChildEvents,
        log: RotatingLog | None = None,
    ) -> None:
        self.spec = spec
        self.plan = plan
        self.config = config
        self.groups = groups
        self.http = http
        self.events = events
        # A rolled child continues its predecessor's log stream (one writer per file).
        self.log = log or RotatingLog(
            log_dir / f"{spec.name}.log", config.log_max_bytes, config.log_backups
        )
        self.owns_log = log is None  # a rolled child takes it over once it is kept
        self.state = "starting"
        self.healthy = False
        self.restarts = 0
        self.last_exit = ""
        self.process: asyncio.subprocess.Process | None = None
        self.started_at = 0.0
        self._crashes: deque[float] = deque()
        self._settled = asyncio.Event()  # set when the child is running, failed or stopped
        self._wake = asyncio.Event()  # interrupts a backoff or a hold
        self._stopping = False
        self._held = False
        self._quick_restart = False
        self._task: asyncio.Task[None] | None = None
        self._pump: asyncio.Task[None] | None = None

    # ---- public API -------------------------------------------------------------------
    def start(self) -> None:
        """Start supervising (non-blocking); await :meth:`wait_settled` for readiness."""
        self._task = asyncio.create_task(self._run(), name=f"child-{self.spec.name}")

    async def wait_settled(self, timeout: float) -> bool:
        """Wait until running / failed / stopped; False on timeout."""
        try:
            await asyncio.wait_for(self._settled.wait(), timeout)
        except TimeoutError:
            return False
        return True

    @property
    def pid(self) -> int:
        if self.process is not None and self.process.returncode is None:
            return self.process.pid
        return 0

    @property
    def uptime_s(self) -> float:
        return time.monotonic() - self.started_at if self.pid and self.started_at else 0.0

    async def stop(self, grace: float | None = None) -> None:
        """Stop for good: SIGTERM to the group, ``stop_grace_s``, then SIGKILL. Idempotent."""
        self._stopping = True
        self._set_state("stopping")
        self._wake.set()
        await self._terminate(self.config.stop_grace_s if grace is None else grace)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._set_state("stopped")
        self._settled.set()
        if self.owns_log:
            self.log.close()

    async def restart(self) -> None:
        """Restart now with the same plan (also revives a failed child)."""
        if self._task is not None and not self._task.done():
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self._terminate(self.config.stop_grace_s)
        self._crashes.clear()
        self._held = False
        self._settled.clear()
        self.restarts += 1
        self.events.on_restart(self.spec.name)
        self._set_state("starting")
        self.start()

    async def kill(self, hold: bool) -> None:
        """Fault injection: SIGKILL the group; with ``hold`` keep it down until :meth:`release`,
        otherwise restart it at once (without counting a crash)."""
        self._held = hold
        self._quick_restart = not hold
        self._wake.set()  # a child waiting out a backoff: act now
        if self.process is not None and self.process.returncode is None:
            procs.kill_group(self.process.pid, signal.SIGKILL)

    def release(self) -> None:
        """End a hold: the monitor starts the child again."""
        self._held = False
        self._wake.set()

    # ---- life cycle -------------------------------------------------------------------
    def _set_state(self, state: str) -> None:
        if state != self.state:
            log.info(
                "agent.child_state",
                extra={"child": self.spec.name, "from": self.state, "to": state},
            )
            self.state = state
            self.events.on_state(self.spec.name, state)

    async def _run(self) -> None:
        first = True
        while not self._stopping:
            if self._held:  # engine_kill: stay down (also when it struck during a backoff)
                self._set_state("held")
                while self._held and not self._stopping:
                    self._wake.clear()
                    await self._wake.wait()
                if self._stopping:
                    return
            if not first:
                self.restarts += 1
                self.events.on_restart(self.spec.name)
            first = False
            self._set_state("starting")
            self._quick_restart = False  # set by a kill that strikes this process
            await self._spawn()
            ready = await self._wait_ready()
            if ready:
                self._set_state("running")
                self._settled.set()
                await self._watch()
            else:
                await self._terminate(self.config.stop_grace_s)
            if self._stopping:
                return
            if self._held:
                continue
            if self._quick_restart:
                self._quick_restart = False
                continue
            now = time.monotonic()
            self._crashes.append(now)
            while self._crashes and self._crashes[0] < now - self.config.crash_loop_window_s:
                self._crashes.popleft()
            if len(self._crashes) >= self.config.crash_loop_limit:
                log.error(
                    "agent.child_failed",
                    extra={"child": self.spec.name, "crashes": len(self._crashes)},
                )
                self._set_state("failed")
                self._settled.set()
                return
            delay = min(
                self.config.backoff_initial_s * 2 ** (len(self._crashes) - 1),
                self.config.backoff_max_s,
            )
            self._set_state("backoff")
            log.info(
                "agent.child_backoff",
                extra={"child": self.spec.name, "crashes": len(self._crashes), "delay_s": delay},
            )
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), delay)

    async def _spawn(self) -> None:
        plan = self.plan
        env = dict(os.environ)
        for key, value in plan.env.items():
            # Adapters remove an inherited variable by giving it an empty value.
            if value == "":
                env.pop(key, None)
            else:
                env[key] = value
        env["PDBRIDGE_CHILD_NAME"] = self.spec.name
        self.log.write(f"--- agent: starting {' '.join(plan.argv)}\n".encode())
        self.process = await asyncio.create_subprocess_exec(
            *procs.keeper_argv(
                plan.argv,
                {
                    "nofile": self.config.limit_nofile,
                    "nproc": self.config.limit_nproc,
                    "as_mb": self.config.limit_as_mb,
                },
            ),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
            env=env,
            cwd=plan.cwd,
            start_new_session=True,  # own process group: signals reach its whole tree
        )
        self.started_at = time.monotonic()
        self.healthy = False
        started = procs.start_time(self.process.pid)
        if started is not None:
            self.groups.add(self.process.pid, started)
        self._pump = asyncio.create_task(self._pump_logs(self.process))
        log.info("agent.child_spawned", extra={"child": self.spec.name, "pid": self.process.pid})

    async def _pump_logs(self, process: asyncio.subprocess.Process) -> None:
        assert process.stdout is not None  # noqa: S101  (PIPE was requested)
        while True:
            data = await process.stdout.read(65536)
            if not data:
                return
            self.log.write(data)

    async def _check_health(self) -> bool:
        try:
            async with self.http.get(
                self.plan.health_url,
                timeout=aiohttp.ClientTimeout(total=2),
                server_hostname=self.plan.tls_server_name or None,
            ) as resp:
                return resp.status == 200
        except (aiohttp.ClientError, TimeoutError, OSError):
            return False

    async def _wait_ready(self) -> bool:
        assert self.process is not None  # noqa: S101
        deadline = time.monotonic() + self.config.readiness_timeout_s
        delay = 0.05
        while time.monotonic() < deadline:
            if self.process.returncode is not None:
                await self._reaped()
                return False
            if await self._check_health():
                self.healthy = True
                return True
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.process.wait(), delay)
            delay = min(delay * 2, 0.25)
        self.last_exit = f"not ready after {self.config.readiness_timeout_s:g}s"
        log.warning("agent.child_not_ready", extra={"child": self.spec.name})
        return False

    async def _watch(self) -> None:
        """Health-check a running child until it exits or stays unhealthy."""
        assert self.process is not None  # noqa: S101
        failures = 0
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.process.wait(), self.config.health_interval_s)
            if self.process.returncode is not None:
                await self._reaped()
                return
            if await self._check_health():
                failures = 0
                self.healthy = True
                continue
            failures += 1
            self.healthy = False
            if failures >= self.config.health_failures:
                log.warning(
                    "agent.child_unhealthy", extra={"child": self.spec.name, "failures": failures}
                )
                await self._terminate(self.config.stop_grace_s)
                self.last_exit = f"unhealthy after {failures} checks ({self.last_exit})"
                return

    async def _reaped(self) -> None:
        assert self.process is not None  # noqa: S101
        code = self.process.returncode
        self.healthy = False
        self.last_exit = f"signal {-code}" if code is not None and code < 0 else f"exit {code}"
        # The group may still hold grandchildren; they go with their leader.
        procs.kill_group(self.process.pid, signal.SIGKILL)
        self.groups.remove(self.process.pid)
        if self._pump is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._pump, 2)
        log.warning("agent.child_exited", extra={"child": self.spec.name, "exit": self.last_exit})

    async def _terminate(self, grace: float) -> None:
        process = self.process
        if process is None or process.returncode is not None:
            return
        procs.kill_group(process.pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(process.wait(), grace)
        except TimeoutError:
            log.warning("agent.child_sigkill", extra={"child": self.spec.name, "grace_s": grace})
            procs.kill_group(process.pid, signal.SIGKILL)
            await process.wait()
        await self._reaped()

"""The agent's behaviour, independent of the wire: children, faults, heartbeats, metrics.

:class:`AgentService` is driven by the gRPC layer (:mod:`agents.grpc_api`) and by the daemon
(:mod:`agents.daemon`). All methods are coroutines on one asyncio loop. Bad input raises
:class:`LaunchError` / :class:`FaultError` naming the field; the gRPC layer maps them to status
codes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import ssl
import subprocess
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from agents import procs
from agents.config import AgentConfig, split_host_port
from agents.console import ConsoleClient, utc_now_iso
from agents.faults import Fault, FaultContext
from agents.faults.manager import FaultManager, Journal
from agents.launch import (
    ENGINE_KINDS,
    ChildSpec,
    LaunchError,
    pick_port,
    resolve_adapter,
    validate_spec,
)
from agents.metrics import AgentMetrics, metrics_app
from agents.supervisor import STATES, Child, ChildEvents
from agents.tlsreport import TlsReporter
from agents.weights import WeightsHasher
from grpc_kv.faultproxy import FaultProxy
from pdbridge import __version__

log = logging.getLogger("pdbridge.agent")


def host_memory_gib() -> float:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 1024 / 1024, 1)
    except OSError:
        pass
    return 0.0


def parse_nvidia_smi(text: str) -> list[dict[str, Any]]:
    """``nvidia-smi --query-gpu=name,memory.total --format=csv,noheader,nounits`` output
    (``NVIDIA H200, 143771`` per GPU, MiB) as ``[{type, count, memory_gib}]``, grouped."""
    groups: dict[tuple[str, float], int] = {}
    for line in text.splitlines():
        name, _, mem = line.rpartition(",")
        if name and mem.strip().isdigit():
            kind = name.strip().removeprefix("NVIDIA ").strip()
            key = (kind, round(int(mem) / 1024, 1))
            groups[key] = groups.get(key, 0) + 1
    return [{"type": t, "count": n, "memory_gib": m} for (t, m), n in groups.items()]


def detect_accelerators() -> list[dict[str, Any]]:
    """GPUs from nvidia-smi; empty where there is none. Blocking (runs once at agent start,
    bounded by a 10 s timeout)."""
    tool = shutil.which("nvidia-smi")
    if tool is None:
        return []
    try:
        out = subprocess.run(  # noqa: S603  (fixed argv, resolved tool path)
            [tool, "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        log.warning("agent.accelerator_detection_failed")
        return []
    return parse_nvidia_smi(out)


class StartupError(RuntimeError):
    """The agent cannot start with this config (a port taken, a directory unusable); the
    message starts with the config key."""


class AgentService:
    """One node agent. Construct, ``await start()``, serve, ``await shutdown()``."""

    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        self.state_dir = Path(config.state_dir)
        self.children: dict[str, Child] = {}
        self.metrics = AgentMetrics()
        self.console = ConsoleClient(config.console, config.node_token())
        self.proxies: dict[str, FaultProxy] = {}
        self.faults = FaultManager(
            Journal(self.state_dir / "faults.json"),
            FaultContext(config.faults, self.children, self.proxies),
            config.faults.max_duration_s,
            on_restored=self.metrics.faults_restored.inc,
        )
        self.groups = procs.GroupRecord(self.state_dir / "children.json")
        self.started = time.monotonic()
        # Detected in start(), after the journalled faults are restored (nvidia-smi can take
        # seconds on a GPU node; a cut link must not wait for it).
        self.accelerators: list[dict[str, Any]] = list(config.capacity.accelerators)
        self.metrics_port = 0
        #: The control API's bound port once it listens (reported in heartbeats: an agent
        #: restarted on another port is found there); heartbeats begin then (:meth:`listening`).
        self.control_port: int | None = None
        self._listening = asyncio.Event()
        self.weights = WeightsHasher()
        self.tls = TlsReporter(config)
        # One lock per child name: launches of different children run side by side (a vLLM
        # start takes minutes), the same name is serialized.
        self._locks: dict[str, asyncio.Lock] = {}
        self._launching: set[str] = set()
        # Launches in progress (they outlive their caller: see grpc_api.IdempotencyCache);
        # shutdown cancels them so that no child starts after the agent stopped its children.
        self._launch_tasks: set[asyncio.Task[Any]] = set()
        self._http: aiohttp.ClientSession | None = None
        self._heartbeat: asyncio.Task[None] | None = None
        self._runner: web.AppRunner | None = None
        self._background: set[asyncio.Task[None]] = set()

    @property
    def http(self) -> aiohttp.ClientSession:
        if self._http is None:
            # Children served over TLS (the gateway) present this node's certificate and
            # may require ours: trust the node CA and present the node certificate.
            connector = None
            if not self.config.insecure:
                context = ssl.create_default_context(cafile=self.config.tls.ca)
                context.load_cert_chain(self.config.tls.cert, self.config.tls.key)
                connector = aiohttp.TCPConnector(ssl=context)
            self._http = aiohttp.ClientSession(connector=connector)
        return self._http

    # ---- life cycle ------------------------------------------------------------------
    async def start(self) -> None:
        """Clean up after a previous agent (leftover child groups, journalled faults), then
        start the heartbeat loop and the metrics endpoint.

        Raises :class:`StartupError` naming the config key when a resource it names cannot be
        used (state_dir not writable, a listen address taken); the daemon prints it and exits
        instead of dying with a traceback.
        """
        try:
            (self.state_dir / "logs").mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StartupError(f"state_dir: cannot use {str(self.state_dir)!r}: {exc}") from exc
        # First of all: undo what a previous agent's faults left (a cut link), even if
        # something further down stops this start. Proxy faults died with that agent's
        # proxies and engine faults with its children, so nothing here needs them running.
        restored = await self.faults.start()
        if restored:
            log.warning("agent.restored_journalled_faults", extra={"count": restored})
        procs.reap_recorded_groups(self.groups.path)
        for site, proxy_config in self.config.faults.proxies.items():
            proxy = FaultProxy(upstream=proxy_config.upstream, listen=proxy_config.listen)
            try:
                await proxy.start()
            except OSError as exc:
                raise StartupError(
                    f"faults.proxies.{site}.listen: cannot listen on {proxy_config.listen}: {exc}"
                ) from exc
            self.proxies[site] = proxy
        self.weights.report(self.config.models, {})  # queue the held models' hashes now
        if not self.accelerators:
            self.accelerators = await asyncio.to_thread(detect_accelerators)
        if self.console.enabled:
            self._heartbeat = asyncio.create_task(
                self._beat_once_listening(),
                name="heartbeat",
            )
        if self.config.metrics_listen:
            host, port = split_host_port(self.config.metrics_listen, "metrics_listen")
            app = metrics_app(
                self.metrics, self.refresh_metrics, self._child_metrics_url, self.http
            )
            self._runner = web.AppRunner(app, access_log=None)
            await self._runner.setup()
            tcp_site = web.TCPSite(self._runner, host, port)
            try:
                await tcp_site.start()
            except OSError as exc:
                raise StartupError(
                    f"metrics_listen: cannot listen on {self.config.metrics_listen}: {exc}"
                ) from exc
            server = tcp_site._server
            sockets = getattr(server, "sockets", None) or []
            self.metrics_port = sockets[0].getsockname()[1] if sockets else port

    async def shutdown(self) -> None:
        """Cancel launches in progress, restore faults, stop every child gracefully, stop
        beating."""
        for task in list(self._launch_tasks):
            task.cancel()
        await asyncio.gather(*self._launch_tasks, return_exceptions=True)
        await self.faults.close()
        await asyncio.gather(
            *(child.stop() for child in self.children.values()), return_exceptions=True
        )
        self.children.clear()
        # Children of cancelled launches are stopped in the background: let them finish.
        await asyncio.gather(*self._background, return_exceptions=True)
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._heartbeat
        if self._runner is not None:
            await self._runner.cleanup()
        for proxy in self.proxies.values():
            await proxy.stop()
        await self.console.close()
        if self._http is not None:
            await self._http.close()

    # ---- children --------------------------------------------------------------------
    def _events(self) -> ChildEvents:
        return ChildEvents(
            on_restart=lambda name: self.metrics.restarts.labels(child=name).inc(),
            # The console learns of a child's new state with the next heartbeat, sent now: its
            # reconcile loop and the deployment's pages act on it.
            on_state=lambda name, state: self.console.beat_soon(),
        )

    async def _new_child(self, spec: ChildSpec, previous: Child | None) -> Child:
        snapshot = ""
        if spec.config_version:
            path = await self.console.fetch_snapshot(
                spec.deployment_id, spec.config_version, self.state_dir
            )
            snapshot = str(path)
        adapter = resolve_adapter(spec, self.config)
        port = pick_port(spec.settings.get("port"))
        plan = adapter.plan(spec, port, snapshot)
        return Child(
            spec,
            plan,
            self.config.supervision,
            self.state_dir / "logs",
            self.groups,
            self.http,
            self._events(),
            log=previous.log if previous is not None else None,
        )

    async def launch(self, spec: ChildSpec) -> tuple[Child, str]:
        """Start ``spec`` and wait for readiness. Returns the child and the action taken:
        ``started``, ``unchanged`` (same spec already there) or ``rolled`` (new spec: the new
        child is started and healthy before the old one stops). A child that cannot become
        healthy raises LaunchError (DEADLINE_EXCEEDED / ABORTED) and is not kept."""
        validate_spec(spec)
        model = self._engine_model(spec)
        if model is not None:
            # Start hashing while the engine loads, so that the first heartbeat after it is up
            # carries the digest rather than "hashing" (the lookup itself does not block).
            self.weights.report({}, {spec.name: model})
        task = asyncio.current_task()
        if task is not None:
            self._launch_tasks.add(task)
        try:
            async with self._lock_for(spec.name):
                self._launching.add(spec.name)
                try:
                    return await self._launch_locked(spec)
                finally:
                    self._launching.discard(spec.name)
        finally:
            if task is not None:
                self._launch_tasks.discard(task)

    def _lock_for(self, name: str) -> asyncio.Lock:
        return self._locks.setdefault(name, asyncio.Lock())

    async def _launch_locked(self, spec: ChildSpec) -> tuple[Child, str]:
        current = self.children.get(spec.name)
        if current is not None and current.spec.kind != spec.kind:
            raise LaunchError(
                "name", f"{spec.name!r} is already a {current.spec.kind}", "ALREADY_EXISTS"
            )
        if (
            current is not None
            and current.spec.fingerprint() == spec.fingerprint()
            and current.state != "failed"
        ):
            return current, "unchanged"
        others = len(self.children) + len(self._launching - set(self.children) - {spec.name})
        if current is None and others >= self.config.supervision.max_children:
            raise LaunchError(
                "name",
                f"supervision.max_children ({self.config.supervision.max_children}) reached",
                "RESOURCE_EXHAUSTED",
            )
        pinned = spec.settings.get("port")
        if current is not None and pinned is not None and pinned == current.plan.port:
            # Same fixed port: the old child must go first (stop, then start).
            await current.stop()
            del self.children[spec.name]
            current = None
        child = await self._new_child(spec, current)
        child.start()
        try:
            settled = await child.wait_settled(self.config.supervision.readiness_timeout_s + 5)
        except asyncio.CancelledError:
            # Only the agent's shutdown cancels a launch (a caller that goes away does not:
            # see grpc_api.IdempotencyCache). A child nobody tracks must not keep running:
            # stopped in the background; the cancellation goes on.
            self._in_background(child.stop(grace=2))
            raise
        if not settled or child.state != "running":
            tail, _ = child.log.read(-2000, 2000)
            reason = (
                "did not become healthy in time"
                if not settled
                else f"ended {child.state} ({child.last_exit})"
            )
            await child.stop(grace=2)
            raise LaunchError(
                "settings",
                f"{spec.name} {reason}; log tail: {tail.decode(errors='replace')[-800:]}",
                "DEADLINE_EXCEEDED" if not settled else "ABORTED",
            )
        self.children[spec.name] = child
        if current is not None:
            current.owns_log, child.owns_log = False, True
            # Shielded: a caller's cancellation must not leave the old child running.
            await asyncio.shield(self._in_background(current.stop()))
            return child, "rolled"
        return child, "started"

    def _in_background(self, coro: Coroutine[Any, Any, None]) -> asyncio.Task[None]:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    def child(self, name: str) -> Child:
        child = self.children.get(name)
        if child is None:
            raise LaunchError("name", f"no child named {name!r}", "NOT_FOUND")
        return child

    async def stop(self, name: str) -> Child:
        async with self._lock_for(name):
            child = self.child(name)
            await child.stop()
            del self.children[name]
            return child

    async def restart(self, name: str) -> Child:
        async with self._lock_for(name):
            child = self.child(name)
            await child.restart()
        await child.wait_settled(self.config.supervision.readiness_timeout_s + 5)
        return child

    def logs(self, name: str, offset: int, max_bytes: int) -> tuple[bytes, int, int, int]:
        """``(data, offset, next_offset, start_offset)`` of a child's log."""
        if max_bytes < 0 or max_bytes > 1024 * 1024:
            raise LaunchError("max_bytes", "between 0 and 1048576")
        child = self.child(name)
        data, first = child.log.read(offset, max_bytes or 65536)
        return data, first, first + len(data), child.log.start

    # ---- faults ----------------------------------------------------------------------
    async def inject(
        self, kind: str, target: str, duration_s: float, params: dict[str, Any]
    ) -> Fault:
        return await self.faults.inject(kind, target, duration_s, params)

    # ---- reporting -------------------------------------------------------------------
    def child_report(self, child: Child) -> dict[str, Any]:
        return {
            "name": child.spec.name,
            "kind": child.spec.kind,
            "state": child.state,
            "pid": child.pid,
            "port": child.plan.port,
            "healthy": child.healthy and child.state == "running",
            "restarts": child.restarts,
            "config_version": child.spec.config_version,
            "deployment_id": child.spec.deployment_id,
        }

    @staticmethod
    def _engine_model(spec: ChildSpec) -> tuple[str, str | None] | None:
        """An engine child's model spec and models directory (None for other children)."""
        if spec.kind not in ENGINE_KINDS or not isinstance(spec.settings.get("model"), str):
            return None
        extra = spec.settings.get("kv_connector_extra_config") or {}
        models_dir = extra.get("models_dir") if isinstance(extra, dict) else None
        return spec.settings["model"], str(models_dir) if models_dir else None

    def _engine_models(self) -> dict[str, tuple[str, str | None]]:
        """Engine children's model specs (and models directory), for the weights report."""
        out: dict[str, tuple[str, str | None]] = {}
        for name, child in self.children.items():
            model = self._engine_model(child.spec)
            if model is not None:
                out[name] = model
        return out

    def listening(self, port: int) -> None:
        """The control API listens on ``port``: heartbeats may begin (the console acts on
        them -- the reconcile loop launches what a heartbeat shows missing -- so the first
        one must say where this agent is reached)."""
        self.control_port = port
        self._listening.set()

    async def _beat_once_listening(self) -> None:
        await self._listening.wait()
        await self.console.heartbeat_loop(self.heartbeat_body, self.metrics.heartbeat_failures.inc)

    def heartbeat_body(self) -> dict[str, Any]:
        """The heartbeat JSON of the console contract (``POST /api/heartbeats/``)."""
        versions: dict[str, int] = {}
        for child in self.children.values():
            if child.spec.deployment_id:
                key = str(child.spec.deployment_id)
                versions[key] = max(versions.get(key, 0), child.spec.config_version)
        return {
            "agent_version": __version__,
            "clock": utc_now_iso(),
            "capacity": {
                "accelerators": self.accelerators,
                "memory_gib": self.config.capacity.memory_gib or host_memory_gib(),
            },
            "children": [self.child_report(c) for c in self.children.values()],
            "faults": [
                {"id": f.id, "kind": f.kind, "target": f.target, "expires_at": f.expires_at}
                for f in self.faults.active.values()
            ],
            "config_versions": versions,
            "agent_listen_host": self.config.listen.rpartition(":")[0].strip("[]"),
            "agent_port": self.control_port,
            "tls": self.tls.report(),
            "weights": self.weights.report(self.config.models, self._engine_models()),
        }

    def refresh_metrics(self) -> None:
        m = self.metrics
        for kind in ("prefill-engine", "decode-engine", "kv-link", "gateway"):
            up = sum(
                1
                for c in self.children.values()
                if c.spec.kind == kind and c.state == "running" and c.healthy
            )
            m.children_up.labels(kind=kind).set(up)
        for state in STATES:
            m.children.labels(state=state).set(
                sum(1 for c in self.children.values() if c.state == state)
            )
        for kind in ("link_cut", "link_degrade", "engine_kill", "engine_restart"):
            m.faults_active.labels(kind=kind).set(
                sum(1 for f in self.faults.active.values() if f.kind == kind)
            )

    def _child_metrics_url(self, name: str) -> tuple[str, str] | None:
        child = self.children.get(name)
        if child is None or not child.plan.metrics_url:
            return None
        return child.plan.metrics_url, child.plan.tls_server_name

    def child_metrics_urls(self) -> dict[str, str]:
        base = (
            f"http://{self.config.metrics_listen.rpartition(':')[0]}:{self.metrics_port}"
            if self.metrics_port
            else ""
        )
        return {
            name: (f"{base}/children/{name}/metrics" if base else child.plan.metrics_url)
            for name, child in self.children.items()
            if child.plan.metrics_url
        }

    @property
    def uptime_s(self) -> float:
        return time.monotonic() - self.started

    @property
    def pid(self) -> int:
        return os.getpid()

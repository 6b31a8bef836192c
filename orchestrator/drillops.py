"""What the drill workflow does outside the database: agent calls (inject, clear, status), the
gateway's Prometheus page, the background load generator and its files.

Called by ``orchestrator.workflows.drill`` steps inside a Celery worker. Every function is
blocking. Agent calls raise ``grpc.aio.AioRpcError`` (refused or unreachable) or
``orchestrator.agentops.AgentOpsError`` (missing controller TLS settings); a gateway that cannot be scraped raises
``OSError`` / ``urllib.error.URLError``.

Idempotency: fault injections carry a request id derived from the run (its id and creation
time: :func:`run_key`) and the fault's index, so
a step re-executed after its worker died sends the same request and the agent answers it from
its request-id cache instead of injecting twice. The load generator is spawned once per run: its
pid file in the run directory is written before anything else, and a re-executed step that finds
it reuses that process.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import ssl
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

from django.conf import settings

from agents.client import AgentClient
from orchestrator.agentops import controller_tls
from pdproto.http import PATH_HEADER

T = TypeVar("T")


def _call(fault: dict[str, Any], fn: Callable[[AgentClient], Awaitable[T]]) -> T:
    async def go() -> T:
        async with AgentClient(fault["agent"], controller_tls(fault["node"])) as agent:
            return await fn(agent)

    return asyncio.run(go())


def inject(fault: dict[str, Any], duration_s: float, request_id: str) -> dict[str, Any]:
    """Inject one fault (with its expiry) through the agent; returns the agent's record, with
    the agent's address (restore and clear call the same agent). An agent that cannot act on
    the target (nothing configured for that peer site, no privilege) raises
    ``grpc.aio.AioRpcError`` with ``FAILED_PRECONDITION`` (see :func:`cannot_act`)."""
    answer = _call(
        fault,
        lambda agent: agent.inject_fault(
            fault["kind"], fault["target"], duration_s, request_id=request_id
        ),
    )
    f = answer.fault
    return {
        "id": f.id,
        "kind": f.kind,
        "target": f.target,
        "node": fault["node"],
        "agent": fault["agent"],
        "mechanism": f.mechanism,
        "created_at": f.created_at,
        "expires_at": f.expires_at,
    }


def cannot_act(exc: BaseException) -> bool:
    """Whether an injection was refused because that agent has no means to act on the target
    (``FAILED_PRECONDITION``: no fault proxy or route for the peer site, no privilege), so
    the fault belongs on another agent -- as opposed to a bad request or an unreachable one."""
    import grpc

    return isinstance(exc, grpc.aio.AioRpcError) and exc.code() == (
        grpc.StatusCode.FAILED_PRECONDITION
    )


def agent_view(fault: dict[str, Any]) -> dict[str, Any]:
    """The agent's active fault ids and its children's states (by name)."""
    status = _call(fault, lambda agent: agent.status())
    return {
        "faults": [f.id for f in status.faults],
        "children": {c.name: c.state for c in status.children},
    }


def clear(fault: dict[str, Any], fault_id: str) -> None:
    """Restore a fault now (the agent would at expiry anyway); NOT_FOUND is already restored."""
    import grpc

    try:
        _call(fault, lambda agent: agent.clear_fault(fault_id))
    except grpc.aio.AioRpcError as exc:
        if exc.code() != grpc.StatusCode.NOT_FOUND:
            raise


def _ssl_context(url: str) -> ssl.SSLContext | None:
    if not url.startswith("https://"):
        return None
    context = ssl.create_default_context(cafile=settings.PDBRIDGE_CONTROLLER_TLS_CA or None)
    if settings.PDBRIDGE_CONTROLLER_TLS_CERT:
        context.load_cert_chain(
            settings.PDBRIDGE_CONTROLLER_TLS_CERT, settings.PDBRIDGE_CONTROLLER_TLS_KEY
        )
    return context


def gateway_signals(gateway_url: str, timeout_s: float = 10.0) -> dict[str, Any]:
    """What the gateway itself says, from its ``/metrics``: ``threshold`` (the effective
    remote-prefill threshold it applies now, tokens; None when it does not say),
    ``ejections`` (breaker ejections, summed), ``fallbacks`` (fallbacks for a failure --
    every cause but ``link_saturated``, which is load, not a fault) and ``failovers`` (by
    the site failed over from)."""
    from orchestrator.workflows.gateway_metrics import parse

    request = urllib.request.Request(gateway_url.rstrip("/") + "/metrics")  # noqa: S310 - http(s) only, validated
    with urllib.request.urlopen(  # noqa: S310 - scheme validated by the drill service
        request, timeout=timeout_s, context=_ssl_context(gateway_url)
    ) as response:
        page = parse(response.read().decode())
    fallbacks = page["fallbacks"]
    return {
        "threshold": page["effective_threshold"],
        "ejections": page["breaker_ejections"],
        "fallbacks": sum(n for cause, n in fallbacks.items() if cause != "link_saturated"),
        "failovers": page["failovers_from"],
    }


def breaker_ejections(gateway_url: str, timeout_s: float = 10.0) -> float:
    """Sum of ``pdbridge_gateway_breaker_ejections`` over every breaker of the gateway."""
    return float(gateway_signals(gateway_url, timeout_s)["ejections"])


def post_json(url: str, body: dict[str, Any], timeout_s: float = 120.0) -> tuple[int, str, Any]:
    """POST a JSON body; returns (status, ``x-pdbridge-path``, parsed body or error text)."""
    data = json.dumps(body).encode()
    request = urllib.request.Request(  # noqa: S310 - scheme validated by the drill service
        url, data=data, headers={"Content-Type": "application/json"}, method="POST"
    )
    try:
        with urllib.request.urlopen(  # noqa: S310 - scheme validated by the drill service
            request, timeout=timeout_s, context=_ssl_context(url)
        ) as response:
            return (
                response.status,
                response.headers.get(PATH_HEADER, ""),
                json.loads(response.read()),
            )
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers.get(PATH_HEADER, ""), exc.read().decode()[:500]


def run_key(run_id: int) -> str:
    """The run's own name on disk and in agent request ids: its id and creation time, so that
    a database started afresh (the testbed's, after a restart), whose ids begin again at 1,
    never meets an earlier run's files or an agent's cached answers."""
    from console.runs.models import WorkflowRun

    created = WorkflowRun.objects.values_list("created_at", flat=True).get(pk=run_id)
    return f"run-{run_id}-{created:%Y%m%dT%H%M%S%f}"


def run_dir(key: str) -> Path:
    """Where a run's load generator and marks live (``<VAR_DIR>/drills/<key>``, ``key``
    from :func:`run_key`), created."""
    path = Path(settings.VAR_DIR) / "drills" / key
    path.mkdir(parents=True, exist_ok=True)
    return path


def start_load(key: str, params: dict[str, Any], duration_s: float) -> dict[str, Any]:
    """Start ``pdbridge loadgen`` for the run ``key`` (:func:`run_key`) in the background
    (once per run), bounded by ``duration_s`` and stoppable by its stop file; returns where
    its files are."""
    d = run_dir(key)
    info_path = d / "loadgen.json"
    if info_path.exists():  # a re-executed step: the generator already runs (or ran)
        info: dict[str, Any] = json.loads(info_path.read_text())
        return info
    load = params["load"]
    argv = [
        sys.executable, "-m", "pdbridge.cli", "loadgen",
        "--url", params["gateway_url"], "--model", params["model"],
        "--duration-s", str(duration_s), "--concurrency", str(load["concurrency"]),
        "--mix", str(load["mix"]), "--min-prompt-tokens", str(load["min_prompt_tokens"]),
        "--max-prompt-tokens", str(load["max_prompt_tokens"]),
        "--max-tokens", str(load["max_tokens"]), "--seed", str(load["seed"]),
        "--output", str(d / "load.jsonl"), "--summary", str(d / "summary.json"),
        "--stop-file", str(d / "stop"),
    ]  # fmt: skip
    if load.get("rate"):
        argv += ["--rate", str(load["rate"])]
    if params["gateway_url"].startswith("https://") and settings.PDBRIDGE_CONTROLLER_TLS_CA:
        argv += ["--ca", settings.PDBRIDGE_CONTROLLER_TLS_CA]
        if settings.PDBRIDGE_CONTROLLER_TLS_CERT:
            argv += [
                "--cert", settings.PDBRIDGE_CONTROLLER_TLS_CERT,
                "--key", settings.PDBRIDGE_CONTROLLER_TLS_KEY,
            ]  # fmt: skip
    with (d / "loadgen.log").open("ab") as log:
        # Its own session: the generator outlives this step (and a worker restart); it stops by
        # itself at duration_s or when the stop file appears.
        proc = subprocess.Popen(  # noqa: S603 - our own CLI, argv built above
            argv, stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True
        )
    # Reaped when it exits, by this worker process (which started it): nobody else waits for
    # it, and an unwaited child stays a zombie for the worker's lifetime. A worker that dies
    # first leaves it to init (or the subreaper of ``pdbridge run``).
    threading.Thread(target=proc.wait, name=f"reap-loadgen-{proc.pid}", daemon=True).start()
    info = {
        "pid": proc.pid,
        "started_at": time.time(),
        "output": str(d / "load.jsonl"),
        "summary": str(d / "summary.json"),
        "stop_file": str(d / "stop"),
        "duration_s": duration_s,
    }
    info_path.write_text(json.dumps(info))
    return info


def stop_load(info: dict[str, Any]) -> None:
    """Ask the generator to stop (it finishes the requests in flight)."""
    Path(info["stop_file"]).touch()


def kill_load(info: dict[str, Any]) -> bool:
    """SIGTERM the generator if it is still the process we started (checked by its command
    line naming this run's stop file); True when a signal was sent."""
    pid = int(info["pid"])
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    if info["stop_file"].encode() not in cmdline:
        return False
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return False
    return True

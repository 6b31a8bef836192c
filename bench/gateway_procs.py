"""The processes the gateway benchmarks run and how they are measured: the canned SSE
upstream and the bare aiohttp proxy (``python -m bench.gateway upstream|bare-proxy``),
starting a child and reading its ready line, CPU placement (``--pin``) and CPU clocks.
Shared by ``bench.gateway`` and ``bench.gateway_profile``."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

ROOT = Path(__file__).resolve().parent.parent
MODEL = "bench"


# -- the canned upstream ---------------------------------------------------------------------
def _event(i: int) -> bytes:
    doc = {
        "id": "cmpl-bench",
        "object": "text_completion.chunk",
        "created": 0,
        "model": MODEL,
        "choices": [{"index": 0, "text": f" tok{i}", "finish_reason": None}],
    }
    return b"data: " + json.dumps(doc).encode() + b"\n\n"


_EVENTS = [_event(i) for i in range(512)]


async def _sse(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    n = int(body.get("max_tokens", 16))
    pace = float(body.get("bench_pace_ms", 0)) / 1000
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    for i in range(n):
        if pace:
            await asyncio.sleep(pace)
        await response.write(_EVENTS[i % len(_EVENTS)])
    await response.write(b"data: [DONE]\n\n")
    await response.write_eof()
    return response


async def _serve_completions(handler: Any) -> None:
    """Serve ``POST /v1/completions`` with ``handler`` on an ephemeral loopback port, print
    the ready line (``port`` and the event loop) and serve until killed."""
    app = web.Application()
    app.router.add_post("/v1/completions", handler)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0, backlog=2048).start()
    print(json.dumps({"port": runner.addresses[0][1], "loop": _loop_name()}), flush=True)
    await asyncio.Event().wait()


async def _upstream_main() -> None:
    await _serve_completions(_sse)


def _loop_name() -> str:
    return type(asyncio.get_running_loop()).__module__.split(".")[0]


def _run(main: Any, loop: str) -> Any:
    """Run a coroutine on ``loop`` (``auto``: uvloop when installed, as the gateway does)."""
    from agents.gateway.cli import loop_factory

    with asyncio.Runner(loop_factory=loop_factory(loop)) as runner:
        return runner.run(main)


async def _bare_proxy_main(upstream: str) -> None:
    """Reference point: the barest aiohttp pass-through proxy (no parsing, routing, metrics
    or logs), to show what the machine allows for any proxy at the time of the run."""
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))

    async def handle(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        async with session.post(
            upstream + "/v1/completions", data=body, headers={"Content-Type": "application/json"}
        ) as up:
            response = web.StreamResponse(status=up.status)
            response.content_type = up.content_type
            await response.prepare(request)
            async for chunk in up.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            return response

    await _serve_completions(handle)


def _spawn(args: list[str], ready: str) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    """Start a child; returns it and its ready line (``port``, and ``loop`` for json)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
    proc = subprocess.Popen(
        [sys.executable, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
        cwd=ROOT,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if ready == "json":
        return proc, json.loads(line)
    return proc, {"port": int(line.strip().rsplit(":", 1)[1])}


# -- placement -------------------------------------------------------------------------------
def placement(mode: str) -> dict[str, Any]:
    """Which CPUs the harness (load generator + upstream) and the serving process get.
    ``auto`` splits the usable CPUs in two halves when there are at least two; ``off`` (or
    one CPU, or no ``sched_setaffinity``) leaves the scheduler free."""
    if not hasattr(os, "sched_getaffinity"):
        return {"pinned": False, "cpus": None, "harness": None, "serving": None}
    cpus = sorted(os.sched_getaffinity(0))
    if mode == "off" or len(cpus) < 2:
        return {"pinned": False, "cpus": cpus, "harness": cpus, "serving": cpus}
    half = len(cpus) // 2
    return {"pinned": True, "cpus": cpus, "harness": cpus[:half], "serving": cpus[half:]}


def _pin(pid: int, cpus: list[int] | None) -> list[int] | None:
    """Set the affinity of every thread of ``pid`` (affinity is per thread on Linux; threads
    created later inherit it). Returns the affinity read back."""
    if cpus is None or not hasattr(os, "sched_setaffinity"):
        return None
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        tids = [pid]
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cpus)
        except OSError:
            continue  # a thread that ended meanwhile
    return sorted(os.sched_getaffinity(pid))


def _cpu_s(pid: int) -> float | None:
    """User + system CPU seconds of a process so far (Linux ``/proc``; None elsewhere)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

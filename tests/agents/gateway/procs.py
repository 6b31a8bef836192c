"""Real processes for the gateway's pool and failover tests: engine doubles
(:mod:`tests.agents.gateway.engine_proc`) and ``pdbridge gateway`` itself, on loopback, each
started and waited for by its ready line, killed or stopped by its own pid; and the HTTP
helpers those tests drive them with (load, polling with generous deadlines, metrics)."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from tests.support import TIME_SCALE, deadline_in, subprocess_env


@dataclass
class Proc:
    """A child process and the base URL it serves."""

    proc: subprocess.Popen[str]
    url: str
    log: Path

    def kill(self) -> None:
        """SIGKILL, as a crash: no goodbye to the connections it had."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15 * TIME_SCALE)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _ready_line(proc: subprocess.Popen[str], log: Path, timeout_s: float) -> str:
    box: dict[str, str] = {}

    def read() -> None:
        assert proc.stdout is not None
        box["line"] = proc.stdout.readline()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout_s * TIME_SCALE)
    line = box.get("line", "")
    if not line:
        proc.kill()
        proc.wait()
        raise RuntimeError(f"{proc.args!r} did not start: {log.read_text()[-2000:]}")
    return line


def start_double(name: str, kv_dir: Path, logs: Path, port: int = 0, **options: Any) -> Proc:
    """An engine double process (``port``: a fixed one, to come back where it was)."""
    log = logs / f"{name}.log"
    args = ["--name", name, "--kv-dir", str(kv_dir), "--port", str(port)]
    for key, value in options.items():
        args += [f"--{key.replace('_', '-')}", str(value)]
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.agents.gateway.engine_proc", *args],
        stdout=subprocess.PIPE,
        stderr=log.open("a"),
        text=True,
        env=subprocess_env(),
    )
    ready = json.loads(_ready_line(proc, log, 60))
    return Proc(proc, f"http://127.0.0.1:{ready['port']}", log)


def start_gateway(
    snapshot: dict[str, Any],
    settings: dict[str, Any],
    workdir: Path,
    env: dict[str, str] | None = None,
) -> Proc:
    """``pdbridge gateway --config`` serving ``snapshot`` with ``settings`` (YAML knobs);
    ``env``: extra environment variables (secrets such as the debug token)."""
    config = workdir / "snapshot.json"
    config.write_text(json.dumps(snapshot))
    settings_file = workdir / "gateway.yaml"
    settings_file.write_text(yaml.safe_dump(settings))
    log = workdir / "gateway.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdbridge.cli", "gateway", "--config", str(config),
         "--settings", str(settings_file), "--insecure", "--port", "0",
         "--state-dir", str(workdir / "state")],
        stdout=subprocess.PIPE, stderr=log.open("a"), text=True, env=subprocess_env(**(env or {})),
    )  # fmt: skip
    line = _ready_line(proc, log, 60)
    if not line.startswith("pdbridge gateway listening on"):
        proc.kill()
        raise RuntimeError(f"unexpected gateway output {line!r}: {log.read_text()[-2000:]}")
    port = int(line.strip().rsplit(":", 1)[1])
    return Proc(proc, f"http://127.0.0.1:{port}", log)


async def load(
    url: str,
    n: int,
    concurrency: int,
    prompt: str = "hello",
    elapsed: list[float] | None = None,
    stream_every: int = 3,
) -> list[tuple[int, str | None]]:
    """``n`` completions (every ``stream_every``-th streamed) at ``concurrency``: (status,
    path) each; a stream that did not end with ``[DONE]`` counts as status 598. ``elapsed``
    gets each request's seconds, sent to last byte."""
    sem = asyncio.Semaphore(concurrency)
    results: list[tuple[int, str | None]] = []
    timeout = aiohttp.ClientTimeout(total=60 * TIME_SCALE)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def one(i: int) -> None:
            stream = i % stream_every == 0
            body = {"model": "tiny", "prompt": f"{prompt} {i}", "max_tokens": 4, "stream": stream}
            async with sem:
                started = time.monotonic()
                async with session.post(url + "/v1/completions", json=body) as r:
                    raw = await r.read()
                    status = r.status
                if elapsed is not None:
                    elapsed.append(time.monotonic() - started)
                if status == 200 and stream and not raw.endswith(b"data: [DONE]\n\n"):
                    status = 598
                results.append((status, r.headers.get("x-pdbridge-path")))

        await asyncio.gather(*(one(i) for i in range(n)))
    return results


async def get_json(url: str) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as session, session.get(url) as r:
        text = await r.text()
        return r.status, json.loads(text) if r.content_type == "application/json" else text


async def until(url: str, check: Callable[[int, Any], bool], timeout_s: float = 30) -> Any:
    """GET ``url`` until ``check(status, body)`` holds (a generous, scaled deadline)."""
    deadline = deadline_in(timeout_s)
    while True:
        status, body = await get_json(url)
        if check(status, body):
            return body
        if time.monotonic() > deadline:
            raise AssertionError(f"{url} never satisfied the check; last: {status} {body}")
        await asyncio.sleep(0.1)


def metric(text: str, name: str, **labels: str) -> float:
    """The sum of the samples of ``name`` whose labels include ``labels``."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith((name + "{", name + " ")):  # labelled, or a family without
            continue
        head, value = line.rsplit(" ", 1)
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(value)
    return total

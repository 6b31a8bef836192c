"""Real processes for the gateway's pool tests: engine doubles
(:mod:`tests.agents.gateway.engine_proc`) and ``pdbridge gateway`` itself, on loopback, each
started and waited for by its ready line, killed or stopped by its own pid."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tests.support import subprocess_env

#: Scales every deadline of these tests (a loaded machine: PDBRIDGE_TEST_TIME_SCALE=3).
TIME_SCALE = float(os.environ.get("PDBRIDGE_TEST_TIME_SCALE", "1") or 1)


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


def start_gateway(snapshot: dict[str, Any], settings: dict[str, Any], workdir: Path) -> Proc:
    """``pdbridge gateway --config`` serving ``snapshot`` with ``settings`` (YAML knobs)."""
    config = workdir / "snapshot.json"
    config.write_text(json.dumps(snapshot))
    settings_file = workdir / "gateway.yaml"
    settings_file.write_text(yaml.safe_dump(settings))
    log = workdir / "gateway.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdbridge.cli", "gateway", "--config", str(config),
         "--settings", str(settings_file), "--insecure", "--port", "0",
         "--state-dir", str(workdir / "state")],
        stdout=subprocess.PIPE, stderr=log.open("a"), text=True, env=subprocess_env(),
    )  # fmt: skip
    line = _ready_line(proc, log, 60)
    if not line.startswith("pdbridge gateway listening on"):
        proc.kill()
        raise RuntimeError(f"unexpected gateway output {line!r}: {log.read_text()[-2000:]}")
    port = int(line.strip().rsplit(":", 1)[1])
    return Proc(proc, f"http://127.0.0.1:{port}", log)

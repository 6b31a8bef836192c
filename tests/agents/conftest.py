"""Fixtures of the agent tests: certificates, a small console stand-in, real agent processes."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml

from agents.proto.api import pb_grpc
from tests.agents.pki import Pki, make_pki
from tests.support import deadline_in, subprocess_env

PY = sys.executable
HEALTHSERVER = ["{python}", "-m", "tests.agents.healthserver", "--port", "{port}"]


@pytest.fixture(scope="session")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@dataclass
class FakeConsole:
    """A real HTTP server speaking the console's heartbeat and config-snapshot contracts
    (a stand-in until the console branch lands; it is an HTTP peer, not a mock of the agent)."""

    url: str
    heartbeats: list[dict[str, Any]] = field(default_factory=list)
    auth: list[str] = field(default_factory=list)
    heartbeat_status: int = 200
    interval_s: float = 0.3
    versions: dict[int, set[int]] = field(default_factory=lambda: {1: {3}})


@pytest.fixture(scope="module")
def console() -> Iterator[FakeConsole]:
    state = FakeConsole(url="")

    class Handler(BaseHTTPRequestHandler):
        def _send(self, status: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length", 0))
            body = json.loads(self.rfile.read(length))
            state.auth.append(self.headers.get("Authorization", ""))
            if self.path != "/api/heartbeats/":
                self._send(404, {"detail": "not found"})
                return
            state.heartbeats.append(body)
            if state.heartbeat_status != 200:
                self._send(state.heartbeat_status, {"detail": "console says no"})
                return
            self._send(
                200,
                {
                    "node": 7,
                    "status": "online",
                    "clock_skew_ms": 1.0,
                    "interval_s": state.interval_s,
                },
            )

        def do_GET(self) -> None:
            path, _, query = self.path.partition("?")
            parts = path.strip("/").split("/")
            version = int(query.partition("version=")[2] or 0)
            if len(parts) == 4 and parts[:2] == ["api", "deployments"] and parts[3] == "config":
                deployment = int(parts[2])
                if version in state.versions.get(deployment, set()):
                    self._send(
                        200,
                        {
                            "deployment": {"id": deployment},
                            "version": version,
                            "model": {"name": "tiny"},
                        },
                    )
                    return
            self._send(404, {"detail": "not found"})

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    state.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield state
    server.shutdown()
    server.server_close()


@dataclass
class AgentProc:
    """A real ``pdbridge agent`` process started by a test."""

    process: subprocess.Popen[bytes]
    state_dir: Path
    config_path: Path
    port: int
    metrics_port: int
    log_path: Path
    host: str = "127.0.0.1"  # where it listens (a namespace site's address, see start_agent)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def kill9(self) -> None:
        self.process.kill()
        self.process.wait(10)

    def terminate(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        return self.process.returncode


def agent_config(tmp: Path, pki: Pki | None, **overrides: Any) -> dict[str, Any]:
    config: dict[str, Any] = {
        "node": {"name": "dec-1", "site": "local"},
        "listen": "127.0.0.1:0",
        "state_dir": str(tmp / "state"),
        "metrics_listen": "127.0.0.1:0",
        "supervision": {
            "readiness_timeout_s": 20,
            "health_interval_s": 0.3,
            "health_failures": 2,
            "stop_grace_s": 2,
            "backoff_initial_s": 0.2,
            "backoff_max_s": 1,
            "crash_loop_limit": 3,
            "crash_loop_window_s": 60,
        },
        "engines": {
            "healthy": {"argv": [*HEALTHSERVER, "--tag", "{settings.tag}"]},
            "plain": {"argv": HEALTHSERVER},
            "slow": {"argv": [*HEALTHSERVER, "--start-delay", "30"]},
            "unhurried": {"argv": [*HEALTHSERVER, "--start-delay", "1.5"]},
            "sickly": {"argv": [*HEALTHSERVER, "--unhealthy-after", "1"]},
            "stubborn": {"argv": [*HEALTHSERVER, "--ignore-term"]},
            "crasher": {"argv": [*HEALTHSERVER, "--exit-after", "0.6"]},
            "deadborn": {"argv": ["{python}", "-c", "raise SystemExit(7)"]},
            "family": {"argv": [*HEALTHSERVER, "--grandchild", "{settings.pidfile}"]},
        },
    }
    if pki is None:
        config["insecure"] = True
    else:
        config["tls"] = {
            "ca": str(pki.ca),
            "cert": str(pki.agent_cert),
            "key": str(pki.agent_key),
            "allowed_identities": ["orchestrator"],
        }
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(config.get(key), dict):
            config[key] = {**config[key], **value}
        else:
            config[key] = value
    return config


def start_agent(
    tmp: Path,
    config: dict[str, Any],
    timeout: float = 120,
    wrap: Callable[[list[str]], list[str]] | None = None,
    host: str = "127.0.0.1",
) -> AgentProc:
    """Write agent.yaml, start ``python -m pdbridge.cli agent`` and wait for agent.json
    (``timeout`` is generous: an agent that exits fails at once, a slow start on a loaded
    machine is not a failure).
    ``wrap``: turns the argv into one run elsewhere (``ip netns exec``, which keeps the pid);
    ``host``: the address the agent listens on there."""
    tmp.mkdir(parents=True, exist_ok=True)
    config_path = tmp / "agent.yaml"
    config_path.write_text(yaml.safe_dump(config))
    state_dir = Path(config["state_dir"])
    info_path = state_dir / "agent.json"
    info_path.unlink(missing_ok=True)
    log_path = tmp / f"agent-{time.monotonic_ns()}.log"
    with log_path.open("wb") as log:
        argv = [PY, "-m", "pdbridge.cli", "agent", "--config", str(config_path)]
        process = subprocess.Popen(
            wrap(argv) if wrap else argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=subprocess_env(),
        )
    deadline = deadline_in(timeout)
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise AssertionError(
                f"agent exited {process.returncode}: {log_path.read_text()[-3000:]}"
            )
        if info_path.exists():
            info = json.loads(info_path.read_text())
            if info["pid"] == process.pid:
                return AgentProc(
                    process, state_dir, config_path, info["port"], info["metrics_port"], log_path,
                    host,
                )  # fmt: skip
        time.sleep(0.05)
    process.kill()
    raise AssertionError(f"agent did not start: {log_path.read_text()[-3000:]}")


@pytest.fixture
def agent_factory(tmp_path: Path) -> Iterator[Callable[..., AgentProc]]:
    started: list[AgentProc] = []

    def factory(config: dict[str, Any], subdir: str = "agent") -> AgentProc:
        agent = start_agent(tmp_path / subdir, config)
        started.append(agent)
        return agent

    yield factory
    for agent in started:
        agent.terminate()


def stub(
    agent: AgentProc, pki: Pki | None, client: str = "orchestrator"
) -> pb_grpc.AgentControlStub:
    """A blocking stub to ``agent`` authenticated as ``client`` (a Pki identity)."""
    if pki is None:
        channel = grpc.insecure_channel(agent.address)
    else:
        cert, key = pki.client(client)
        creds = grpc.ssl_channel_credentials(
            pki.ca.read_bytes(), key.read_bytes(), cert.read_bytes()
        )
        channel = grpc.secure_channel(
            agent.address, creds, options=[("grpc.ssl_target_name_override", "dec-1")]
        )
    return pb_grpc.AgentControlStub(channel)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purposes.
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (OSError, IndexError):
        return False


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def command_pids(keeper_pid: int) -> list[int]:
    """Children of a keeper process: the supervised command itself."""
    path = Path(f"/proc/{keeper_pid}/task/{keeper_pid}/children")
    return [int(p) for p in path.read_text().split()]

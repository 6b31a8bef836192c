"""The console served by a real ``pdbridge serve`` process, the way the testbed serves it (TLS
on loopback: :func:`pdbridge.console_server.testbed_config`), for the tests that need the real
server in front of it: slow clients, a stalled console, the console's pages through it."""

from __future__ import annotations

import dataclasses
import os
import signal
import ssl
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from django.db import connection

from bench.slowclients import probe
from grpc_kv.certs import create_ca, create_node_cert
from pdbridge.console_server import ServerConfig, command, testbed_config
from pdbridge.procgroup import free_port
from tests.support import deadline_in, subprocess_env


def test_database_url() -> str:
    """The URL of the test run's database (a transactional test's rows are visible there)."""
    cfg = connection.settings_dict
    if cfg["ENGINE"].endswith("sqlite3"):
        return f"sqlite:///{cfg['NAME']}"
    user, host = cfg["USER"] or "postgres", cfg["HOST"] or "127.0.0.1"
    return f"postgres://{user}@{host}:{cfg['PORT'] or 5432}/{cfg['NAME']}"


test_database_url.__test__ = False  # type: ignore[attr-defined]  # not a test


class ConsoleProcess:
    """``pdbridge serve`` in its own process on ``127.0.0.1``: :attr:`url` (https), :attr:`ca`.
    ``database_url``: where the console's rows are (default: an empty SQLite file, enough for
    ``/healthz``); ``changes``: to the testbed's server configuration; ``env``: more environment
    (console settings); ``server``: its command line from the configuration (default: the
    testbed's, :func:`pdbridge.console_server.command`)."""

    def __init__(
        self,
        tmp: Path,
        *,
        database_url: str = "",
        changes: dict[str, Any] | None = None,
        env: dict[str, str] | None = None,
        server: Callable[[ServerConfig], list[str]] = command,
    ) -> None:
        tmp.mkdir(parents=True, exist_ok=True)
        ca = create_ca(tmp / "ca")
        node = create_node_cert(ca, tmp / "nodes", "localhost", loopback=True)
        self.ca = ca.ca_file
        self.cert, self.key = node.cert_file, node.key_file
        self.port = free_port("127.0.0.1")
        self.url = f"https://127.0.0.1:{self.port}"
        self.log = tmp / f"console-{self.port}.log"
        config = testbed_config([f"127.0.0.1:{self.port}"], self.cert, self.key)
        self.argv = server(dataclasses.replace(config, **(changes or {})))
        child_env = subprocess_env(
            DJANGO_SETTINGS_MODULE="console.settings",
            PDBRIDGE_ENV="test",
            PDBRIDGE_VAR_DIR=str(tmp / "var"),
            DATABASE_URL=database_url or f"sqlite:///{tmp / 'var' / 'console.sqlite3'}",
            ALLOWED_HOSTS="localhost,127.0.0.1",
            **(env or {}),
        )
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                self.argv, env=child_env, stdout=out, stderr=subprocess.STDOUT,
            )  # fmt: skip
        deadline = deadline_in(90)
        while not probe(f"{self.url}/healthz", self.ssl_context(), 2.0).answered:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"console did not start: {self.log_text()[-3000:]}")
            time.sleep(0.1)

    def ssl_context(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=str(self.ca))

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")

    def pause(self) -> None:
        """Stall the console: SIGSTOP (the kernel still accepts connections; nobody answers)."""
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.resume()
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

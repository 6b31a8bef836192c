"""A real Celery worker process for orchestrator tests, sharing the test database and broker."""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from django.conf import settings
from django.db import connection

from tests.support import deadline_in, subprocess_env

EXTRA_WORKFLOWS = ",".join(
    f"{name}=tests.orchestrator.wf_{name}" for name in ("flaky", "slow", "gated")
)


def _database_url() -> str:
    cfg = connection.settings_dict
    if cfg["ENGINE"].endswith("sqlite3"):
        return f"sqlite:///{cfg['NAME']}"
    return f"postgres://{cfg['USER'] or 'postgres'}@{cfg['HOST'] or '127.0.0.1'}:{cfg['PORT'] or 5432}/{cfg['NAME']}"


class Worker:
    def __init__(self, proc: subprocess.Popen[bytes], log: Path) -> None:
        self.proc, self.log = proc, log

    def kill9(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.kill9()


@pytest.fixture
def start_worker(tmp_path: Path) -> Iterator[Callable[..., Worker]]:
    """Start ``celery worker -P solo`` processes; all are stopped at the end of the test."""
    workers: list[Worker] = []

    def start(
        *, broker_url: str | None = None, var_dir: Path | None = None, stale_s: int = 3
    ) -> Worker:
        log = tmp_path / f"worker-{len(workers)}.log"
        env = subprocess_env(
            DJANGO_SETTINGS_MODULE="console.settings",
            PDBRIDGE_ENV="test",
            DATABASE_URL=_database_url(),
            CELERY_BROKER_URL=broker_url or settings.CELERY_BROKER_URL,
            PDBRIDGE_EXTRA_WORKFLOWS=EXTRA_WORKFLOWS,
            PDBRIDGE_STEP_STALE_S=str(stale_s),
            PDBRIDGE_VAR_DIR=str(var_dir or tmp_path / "var"),
        )
        argv = [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "orchestrator.celery",
            "worker",
            "-P",
            "solo",
            "--without-heartbeat",
            "--without-gossip",
            "--without-mingle",
            "-l",
            "INFO",
            "-n",
            f"test{len(workers)}@%h",
            *(["--purge"] if not workers else []),
        ]
        with open(log, "wb") as out:
            proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)
        worker = Worker(proc, log)
        workers.append(worker)
        deadline = deadline_in(60)
        while b"ready." not in log.read_bytes():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"worker did not start:\n{log.read_text()[-3000:]}")
            time.sleep(0.1)
        return worker

    yield start
    for worker in workers:
        worker.stop()

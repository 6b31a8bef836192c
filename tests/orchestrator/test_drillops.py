"""The drill's background load generator: started once per run (a re-executed step reuses it),
bounded by itself, stopped by its stop file; only our own process is ever signalled."""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path

from django.test import override_settings

from agents.loadgen import read_records
from console.drills.services import LOAD_DEFAULTS
from orchestrator import drillops
from tests.support import deadline_in


def _params() -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"  # nothing listens: every request fails
    return {"gateway_url": url, "model": "tiny", "load": {**LOAD_DEFAULTS, "concurrency": 1}}


def _wait(path: Path, timeout: float = 60) -> None:
    deadline = deadline_in(timeout)
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.1)


def test_load_starts_once_per_run_and_stops_at_its_bound(tmp_path: Path):
    with override_settings(VAR_DIR=tmp_path):
        first = drillops.start_load("run-41", _params(), duration_s=1.5)
        again = drillops.start_load("run-41", _params(), duration_s=99)

    assert again == first
    assert Path(first["output"]).parent == tmp_path / "drills" / "run-41"
    _wait(Path(first["summary"]))
    summary = json.loads(Path(first["summary"]).read_text())
    assert summary["requests"] == len(read_records(Path(first["output"]))) > 0
    assert summary["by_outcome"] == {"client_error": summary["requests"]}


def _state(pid: int) -> str | None:
    """The process's state letter (``Z``: a zombie), None once it is gone (reaped)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def test_the_generator_is_reaped_when_it_ends_and_leaves_no_zombie(tmp_path: Path):
    """The worker that started it waits for it: once it exits its pid is gone, not a
    zombie beside the worker (#19: each drill left one)."""
    with override_settings(VAR_DIR=tmp_path):
        info = drillops.start_load("run-44", _params(), duration_s=1.0)
    _wait(Path(info["summary"]))

    deadline = deadline_in(30)
    while _state(info["pid"]) is not None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _state(info["pid"]) is None


def test_stop_file_ends_the_load_early(tmp_path: Path):
    with override_settings(VAR_DIR=tmp_path):
        info = drillops.start_load("run-42", _params(), duration_s=120)
    _wait(Path(info["output"]))
    started = time.monotonic()

    drillops.stop_load(info)

    _wait(Path(info["summary"]), timeout=30)
    assert time.monotonic() - started < 30


def test_kill_load_signals_only_the_generator_it_started(tmp_path: Path):
    mine = {"pid": os.getpid(), "stop_file": str(tmp_path / "drills" / "run-43" / "stop")}
    gone = {"pid": 2**22 + 7, "stop_file": mine["stop_file"]}

    assert drillops.kill_load(mine) is False  # this test process does not name the stop file
    assert drillops.kill_load(gone) is False


def test_a_run_whose_id_an_earlier_database_used_gets_its_own_directory(db, tmp_path: Path):
    """The testbed starts each time from an empty database, so run ids begin again at 1 while
    the drills' directories stay: a new run must not meet an earlier run's load generator,
    injection time or agent request ids (#44: a drill stopped after 6 s, "fault ... active")."""
    from console.runs.models import WorkflowRun

    with override_settings(VAR_DIR=tmp_path):
        first = WorkflowRun.objects.create(
            pk=7, kind="drill_link_cut", target_type="drill", target_id="1"
        )
        old_key = drillops.run_key(7)
        (drillops.run_dir(old_key) / "loadgen.json").write_text("{}")
        first.delete()
        WorkflowRun.objects.create(pk=7, kind="drill_link_cut", target_type="drill", target_id="1")
        new_key = drillops.run_key(7)

    assert old_key.startswith("run-7-")
    assert new_key.startswith("run-7-")
    assert new_key != old_key
    assert not (tmp_path / "drills" / new_key / "loadgen.json").exists()

"""The soak's resource accounting on a real process tree, and its pass/fail rules."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid

import pytest

from pdbridge import soak
from pdbridge.procgroup import descendants
from tests.support import deadline_in, subprocess_env


@pytest.fixture
def tree():
    """A child that holds a few extra files open and starts a grandchild (a fake 'gateway'
    by its command line: the role comes from the command line only)."""
    code = (
        "import subprocess, sys, time\n"
        "files = [open('/dev/null') for _ in range(20)]\n"
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)', "
        "'pdbridge.cli gateway'])\n"
        "time.sleep(60)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code, "engine serve --role prefill"])
    deadline = deadline_in(20)
    while len(descendants(proc.pid)) < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    yield proc
    for pid in descendants(proc.pid):
        subprocess.run(["kill", "-9", str(pid)], check=False)
    proc.kill()
    proc.wait()


def test_sample_sums_rss_and_fds_per_role_over_the_tree(tree):
    time.sleep(0.5)  # the child has opened its files

    sampled = soak.sample(tree.pid)

    assert set(sampled) == {"engine-prefill", "gateway"}
    engine, gateway = sampled["engine-prefill"], sampled["gateway"]
    assert engine["processes"] == gateway["processes"] == 1
    assert engine["fds"] >= gateway["fds"] + 20  # the twenty extra open files
    assert engine["rss_kib"] > 1000
    assert gateway["rss_kib"] > 1000


def test_settled_sample_reads_the_floor_of_descriptors_that_swing_with_traffic():
    """Descriptors held only while a request is in flight are not a leak: the settled sample
    takes the fewest seen over its readings, a single reading may catch the swing."""
    code = (
        "import time\n"
        "while True:\n"
        "    files = [open('/dev/null') for _ in range(40)]\n"
        "    time.sleep(0.25)\n"
        "    for f in files: f.close()\n"
        "    time.sleep(0.15)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code, "engine serve --role decode"])
    try:
        time.sleep(0.5)
        readings = []
        for _ in range(16):  # 0.8 s: two open/close cycles
            readings.append(soak.sample(proc.pid)["engine-decode"]["fds"])
            time.sleep(0.05)
        settled = soak.settled_sample(proc.pid, readings=6, interval_s=0.17)["engine-decode"]
    finally:
        proc.kill()
        proc.wait()

    assert max(readings) >= min(readings) + 40  # the swing is real
    assert settled["fds"] == min(readings)
    assert settled["processes"] == 1


def test_growth_over_the_limit_fails_and_a_vanished_role_is_named():
    start = {
        "console": {"rss_kib": 100_000, "fds": 50, "processes": 2},
        "gateway": {"rss_kib": 80_000, "fds": 20, "processes": 1},
        "beat": {"rss_kib": 50_000, "fds": 10, "processes": 1},
    }
    end = {
        "console": {"rss_kib": 109_000, "fds": 55, "processes": 2},  # +9 %, +10 %: fine
        "gateway": {"rss_kib": 80_000, "fds": 23, "processes": 1},  # +15 % fds
    }

    problems = soak.growth(start, end, 0.10)

    assert problems == ["beat: gone at the end", "gateway: fds 20 -> 23"]
    # A few descriptors more on a small base are within the slack.
    assert soak.growth(start, end, 0.10, fd_slack=5) == ["beat: gone at the end"]


def test_roles_from_command_lines():
    assert (
        soak.role_of("python -m pdbridge.cli engine serve --role decode --model x")
        == "engine-decode"
    )
    assert (
        soak.role_of("python -m pdbridge.cli agent --config /v/sites/remote/agent.json")
        == "agent-remote"
    )
    assert soak.role_of("python -m celery -A orchestrator.celery worker -P threads") == "worker"
    assert soak.role_of("python -m gunicorn console.wsgi:application") == "console"
    assert soak.role_of("bash") == "other"
    keeper = "python -I -S agents/keeper.py 12 -- python -m pdbridge.cli engine serve --role decode"
    assert soak.role_of(keeper) == "keeper"


def test_bad_options_are_refused_naming_the_option(capsys):
    with pytest.raises(SystemExit):
        soak.main(["--duration-s", "0"])
    assert "--duration-s" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        soak.main(["--duration-s", "100", "--warmup-s", "50"])
    assert "--warmup-s" in capsys.readouterr().err


def test_recovery_counts_from_the_fault_clearing_to_the_first_remote_answer():
    def rec(start: float, path: str, outcome: str = "ok", ttft: float = 0.1) -> dict:
        return {"start": start, "path": path, "outcome": outcome, "ttft_s": ttft, "total_s": 0.5}

    records = [rec(99.0, "remote"), rec(100.5, "fallback"), rec(104.0, "fallback"),
               rec(105.0, "remote", "error"), rec(107.5, "remote"), rec(108.0, "remote")]  # fmt: skip
    cut = soak.recovery(records, {"kind": "link_cut", "at_epoch": 100.0, "duration_s": 5.0})
    assert cut == {"detect_s": 0.6, "recover_s": 2.5, "until_remote_failed": 1,
                   "until_remote_by_path": {"fallback": 2, "remote": 1}}  # fmt: skip
    never = soak.recovery(records[:3], {"kind": "engine_restart", "at_epoch": 100.0})
    assert never["recover_s"] is None
    assert never["until_remote_by_path"] == {"fallback": 2}


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_short_soak_passes_with_both_faults_and_leaves_nothing_behind(tmp_path):
    from tests.test_testbed import FOREIGN, marked_processes

    mark = uuid.uuid4().hex
    env = {k: v for k, v in subprocess_env(PDBRIDGE_SMOKE_MARK=mark).items() if k not in FOREIGN}

    result = subprocess.run(
        [sys.executable, "-m", "pdbridge.cli", "soak", "--duration-s", "45", "--warmup-s", "5",
         "--cut-s", "6", "--var-dir", str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=1100, check=False,
    )  # fmt: skip

    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert [f["kind"] for f in report["faults"]] == ["engine_restart", "link_cut"]
    assert report["requests"]["failed"] == 0
    assert report["requests"]["by_path"].get("remote", 0) > 0
    assert report["requests"]["by_path"].get("local", 0) > 0
    cut = report["faults"][1]
    assert cut["recover_s"] is not None, cut  # remote serving came back after the cut
    assert cut["until_remote_failed"] == 0
    for sample in ("start", "end"):
        roles = report["processes"][sample]
        assert {"console", "worker", "beat", "agent-local", "agent-remote", "engine-prefill",
                "engine-decode", "kv-link", "gateway", "wan-shaper"} <= set(roles)  # fmt: skip
    assert "[pdbridge soak] passed" in result.stdout
    assert marked_processes(mark) == []

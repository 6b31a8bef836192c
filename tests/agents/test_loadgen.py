"""``pdbridge loadgen`` against a real reference engine process: bounded by count and by time,
open- and closed-loop, records per request, failures recorded (never raised), seeded mix."""

from __future__ import annotations

import itertools
import json
import math
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

from agents.loadgen import Component, LengthSampler, main, parse_mix, read_records, summarize
from tests.agents.engines.conftest import EngineProc, start_engine
from tests.support import deadline_in, subprocess_env

MODEL = "qwen3-next"


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory):
    models_dir = tmp_path_factory.mktemp("models")
    subprocess.run(
        [sys.executable, "-m", "pdbridge.cli", "engine", "build", MODEL, "--models-dir", str(models_dir)],
        check=True, env=subprocess_env(), capture_output=True, timeout=180,
    )  # fmt: skip
    proc = start_engine(
        ["--model", f"tiny={MODEL}", "--models-dir", str(models_dir), "--threads", "1",
         "--max-num-seqs", "8", "--role", "both"],
        tmp_path_factory.mktemp("logs") / "engine.log",
    )  # fmt: skip
    yield proc
    proc.stop()


def _loadgen(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pdbridge.cli", "loadgen", *args],
        capture_output=True, text=True, env=subprocess_env(), timeout=120, check=False,
    )  # fmt: skip


def test_sampler_is_seeded_truncated_and_log_normal():
    mix = (Component(1.0, 200, 0.5),)
    draws = [LengthSampler(mix, 16, 4096, seed=7).draw() for _ in range(3)]
    many = LengthSampler(mix, 16, 4096, seed=7)
    values = [many.draw() for _ in range(4000)]

    assert draws == [values[0]] * 3  # same seed, same first draw
    assert values[:50] != [LengthSampler(mix, 16, 4096, seed=8).draw() for _ in range(50)]
    assert min(values) >= 16
    assert max(values) <= 4096
    logs = [math.log(v) for v in values]
    assert abs(statistics.median(values) - 200) < 15
    assert abs(statistics.pstdev(logs) - 0.5) < 0.05


def test_sampler_mix_weights_and_bounds_redraw():
    mix = parse_mix("0.75:50:0.1,0.25:1000:0.1")
    sampler = LengthSampler(mix, 16, 2000, seed=1)
    values = [sampler.draw() for _ in range(2000)]
    short = sum(1 for v in values if v < 300) / len(values)
    assert 0.70 < short < 0.80
    clipped = LengthSampler(mix, 16, 600, seed=1)
    assert max(clipped.draw() for _ in range(500)) <= 600


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--url", "http://x", "--model", "m"], "--requests or --duration-s"),
        (["--url", "http://x", "--model", "m", "--requests", "0"], "--requests"),
        (["--url", "http://x", "--model", "m", "--requests", "1", "--mix", "1:2"], "--mix"),
        (["--url", "x", "--model", "m", "--requests", "1"], "--url"),
        (["--url", "http://x", "--model", "m", "--duration-s", "1", "--rate", "-1"], "--rate"),
        (
            [
                "--url",
                "http://x",
                "--model",
                "m",
                "--requests",
                "1",
                "--min-prompt-tokens",
                "9",
                "--max-prompt-tokens",
                "3",
            ],
            "--min-prompt-tokens",
        ),
    ],
)
def test_bad_arguments_exit_2_naming_the_option(args, named, capsys):
    assert main(args) == 2
    assert named in capsys.readouterr().err


def test_bounded_count_closed_loop_records_every_request(engine: EngineProc, tmp_path: Path):
    out = tmp_path / "load.jsonl"
    result = _loadgen(
        "--url", engine.url, "--model", "tiny", "--requests", "6", "--concurrency", "3",
        "--mix", "1:40:0.3", "--max-prompt-tokens", "120", "--max-tokens", "4",
        "--output", str(out), "--summary", str(tmp_path / "summary.json"),
    )  # fmt: skip

    assert result.returncode == 0, result.stderr
    records = read_records(out)
    assert sorted(r["index"] for r in records) == [0, 1, 2, 3, 4, 5]
    for r in records:
        assert (r["status"], r["outcome"], r["error"]) == (200, "ok", "")
        assert 16 <= r["prompt_tokens"] <= 120
        assert 0 < r["ttft_s"] <= r["total_s"]
        assert 1 <= r["completion_tokens"] <= 4
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["requests"] == 6
    assert summary["failed"] == 0
    assert summary["by_outcome"] == {"ok": 6}
    assert summary == summarize(records)


def test_bounded_duration_open_loop_keeps_the_arrival_rate(engine: EngineProc, tmp_path: Path):
    out = tmp_path / "load.jsonl"
    result = _loadgen(
        "--url", engine.url, "--model", "tiny", "--duration-s", "2", "--rate", "3",
        "--concurrency", "4", "--mix", "1:30:0.2", "--max-tokens", "2", "--no-stream",
        "--output", str(out),
    )  # fmt: skip

    assert result.returncode == 0, result.stderr
    records = sorted(read_records(out), key=lambda r: r["index"])
    assert [r["index"] for r in records] == list(range(len(records)))
    assert 5 <= len(records) <= 6  # due at 0, 1/3, ... < 2 s
    gaps = [b["start"] - a["start"] for a, b in itertools.pairwise(records)]
    assert min(gaps) > 0.15  # spaced by the schedule, not sent in a burst


def test_failed_requests_are_recorded_and_exit_1(tmp_path: Path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    out = tmp_path / "load.jsonl"

    result = _loadgen("--url", dead, "--model", "tiny", "--requests", "3", "--output", str(out))

    assert result.returncode == 1
    records = read_records(out)
    assert [r["outcome"] for r in records] == ["client_error"] * 3
    assert all("ClientConnectorError" in r["error"] for r in records)
    assert json.loads(result.stdout)["failed"] == 3


def test_http_errors_are_recorded_with_status(engine: EngineProc, tmp_path: Path):
    out = tmp_path / "load.jsonl"

    result = _loadgen(
        "--url", engine.url, "--model", "no-such-model", "--requests", "2", "--output", str(out)
    )

    assert result.returncode == 1
    assert {(r["status"], r["outcome"]) for r in read_records(out)} == {(400, "http_error")}


def test_stop_file_ends_the_run_and_in_flight_requests_are_recorded(
    engine: EngineProc, tmp_path: Path
):
    out, stop = tmp_path / "load.jsonl", tmp_path / "stop"
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdbridge.cli", "loadgen", "--url", engine.url, "--model", "tiny",
         "--duration-s", "60", "--concurrency", "2", "--mix", "1:30:0.2", "--max-tokens", "2",
         "--output", str(out), "--stop-file", str(stop)],
        env=subprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    deadline = deadline_in(60)
    while len(read_records(out)) < 2:
        assert time.monotonic() < deadline, "no records"
        time.sleep(0.1)

    stop.touch()
    stopped_at = time.monotonic()
    stdout, _ = proc.communicate(timeout=30)

    assert proc.returncode == 0
    assert time.monotonic() - stopped_at < 20  # well before the 60 s bound
    records = read_records(out)
    assert json.loads(stdout)["requests"] == len(records)
    assert sorted(r["index"] for r in records) == list(range(len(records)))

"""Shared fixtures of the engine tests: generated zoo weights and long-lived engine processes
(process start is ~5 s, so they are session-scoped and every test reuses them)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support import subprocess_env

ARCHS = ("qwen3-next", "gemma3", "kimi-linear", "dense")
#: Prefill chunk used by the test engines: small, so prompts span several chunks.
CHUNK = 64
#: Every zoo architecture in fp32 and bf16, served by each test engine.
MODEL_SPECS = [f"{a}={a}" for a in ARCHS] + [f"{a}-bf16={a}@bfloat16" for a in ARCHS]


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


@dataclass
class EngineProc:
    """A running ``pdbridge engine serve`` child process."""

    proc: subprocess.Popen[str]
    url: str
    ready: dict
    log: Path

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_engine(args: list[str], log: Path, timeout: float = 120.0) -> EngineProc:
    """Start an engine and wait for its ready line (which carries the ephemeral port)."""
    stderr = log.open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdbridge.cli", "engine", "serve", *args],
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        env=subprocess_env(),
    )
    box: dict[str, str] = {}

    def read() -> None:
        assert proc.stdout is not None
        box["line"] = proc.stdout.readline()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout)
    line = box.get("line", "")
    if not line:
        proc.kill()
        raise RuntimeError(f"engine did not start: {log.read_text()[-2000:]}")
    ready = json.loads(line)
    return EngineProc(proc, f"http://127.0.0.1:{ready['port']}", ready, log)


def serve_expecting_exit(*args: str) -> subprocess.CompletedProcess[str]:
    """Run ``pdbridge engine serve`` with options that must make it refuse to start."""
    return subprocess.run(
        [sys.executable, "-m", "pdbridge.cli", "engine", "serve", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=subprocess_env(),
        check=False,
    )


def engine_args(models_dir: Path, specs: list[str] = MODEL_SPECS) -> list[str]:
    """Options every test engine shares: the models, their weights, chunk and thread count."""
    models = [a for spec in specs for a in ("--model", spec)]
    return [
        *models,
        "--models-dir",
        str(models_dir),
        "--chunked-prefill-tokens",
        str(CHUNK),
        "--threads",
        "1",
    ]


@pytest.fixture(scope="session")
def spool(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("spool")


@pytest.fixture(scope="session")
def kv_certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[str]]:
    """mTLS material for the KV link: a CA and one certificate per engine, as CLI options."""
    from grpc_kv.api import create_ca, create_node_cert

    root = tmp_path_factory.mktemp("certs")
    ca = create_ca(root / "ca")
    out = {}
    for name in ("prefill-a", "decode-b"):
        node = create_node_cert(ca, root / name, name, loopback=True)
        out[name] = [
            "--kv-tls-ca",
            str(node.ca_file),
            "--kv-tls-cert",
            str(node.cert_file),
            "--kv-tls-key",
            str(node.key_file),
        ]
    return out


@pytest.fixture(scope="session")
def engine_pair(
    models_dir: Path,
    spool: Path,
    kv_certs: dict[str, list[str]],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[EngineProc, EngineProc]]:
    """A prefill-side engine (role both, mTLS client of the KV link) and a decode engine
    receiving KV from ``spool``, both serving every zoo model in fp32 and bf16 with the same
    chunk and thread count."""
    logs = tmp_path_factory.mktemp("logs")
    common = engine_args(models_dir)
    # Build the weights once before two processes race to write them.
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pdbridge.cli",
            "engine",
            "build",
            *ARCHS,
            "--models-dir",
            str(models_dir),
        ],
        check=True,
        env=subprocess_env(),
        capture_output=True,
        timeout=180,
    )
    prefill = start_engine(
        [*common, "--role", "both", *kv_certs["prefill-a"]], logs / "prefill.log"
    )
    try:
        decode = start_engine(
            [*common, "--role", "decode", "--kv-spool", str(spool)], logs / "decode.log"
        )
    except BaseException:
        prefill.stop()
        raise
    yield prefill, decode
    prefill.stop()
    decode.stop()


@pytest.fixture(scope="session")
def grpc_decode(
    engine_pair, models_dir: Path, kv_certs, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EngineProc]:
    """A decode engine embedding a grpc_kv receiver (mTLS) on an ephemeral port."""
    logs = tmp_path_factory.mktemp("logs-grpc")
    engine = start_engine(
        [
            *engine_args(models_dir),
            "--role",
            "decode",
            "--kv-listen",
            "127.0.0.1:0",
            *kv_certs["decode-b"],
        ],
        logs / "decode-grpc.log",
    )
    yield engine
    engine.stop()

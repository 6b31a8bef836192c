"""Console server benchmark: probes answered beside slow clients, old servers against the new
one, side by side in one run. ``make bench-console_server`` (``python -m bench.console_server``).

Each server serves the console (embedded SQLite in a temporary directory; ``/healthz`` reads
it) on loopback, and for each pressure (:mod:`bench.slowclients`) 10 probes ``GET /healthz``
are sent one after another on fresh connections, each with a 2 s deadline, after the slow
clients have all connected:

* servers: ``old-testbed`` (gunicorn, 1 worker x 8 threads, TLS in the threads: the testbed
  before #44), ``old-k8s`` (gunicorn, 4 sync workers, plain HTTP: deploy/k8s before #44),
  ``new`` (``pdbridge serve`` as the testbed runs it, TLS) and ``new-plain`` (the same, plain HTTP:
  behind a TLS terminator);
* pressures: ``issue`` (12 idle TCP connections + 8 trickling TLS ones, what the operator saw),
  ``uploads`` (8 bodies trickled), ``readers`` (8 clients not reading large responses).

Also the unloaded cost: requests per second and p50 latency of ``GET /healthz`` over 4 keep-alive
connections for a few seconds. ``--url URL --ca CA`` measures a running console instead
(pressures only). Writes ``var/bench/console_server.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import http.client
import os
import platform
import ssl
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from bench import write_json
from bench.slowclients import SlowClients, probe, probe_many

OUTPUT = Path("var/bench/console_server.json")
PRESSURES: dict[str, dict[str, int]] = {
    "issue": {"idle": 12, "handshake": 4, "headers": 4},
    "uploads": {"body": 8},
    "readers": {"reader": 8},
}


def old_testbed_command(bind: str, certfile: str, keyfile: str) -> list[str]:
    """The testbed's console before #44: gunicorn, one worker of 8 threads doing TLS itself."""
    return [sys.executable, "-m", "gunicorn", "console.wsgi:application", "--bind", bind,
            "--workers", "1", "--threads", "8", "--certfile", certfile, "--keyfile", keyfile,
            "--graceful-timeout", "5"]  # fmt: skip


def old_k8s_command(bind: str) -> list[str]:
    """deploy/k8s/console.yaml before #44: gunicorn, 4 sync workers, plain HTTP, nothing in front."""
    return [sys.executable, "-m", "gunicorn", "console.wsgi:application", "--bind", bind,
            "--workers", "4"]  # fmt: skip


def new_command(bind: str, certfile: str = "", keyfile: str = "") -> list[str]:
    from pdbridge.console_server import ServerConfig, command, testbed_config

    if certfile:
        return command(testbed_config([bind], certfile, keyfile))
    return command(ServerConfig(bind=[bind], graceful_timeout=5.0))


def _serve(argv: list[str], url: str, context: ssl.SSLContext | None, var: Path) -> Any:
    env = dict(os.environ)
    env.update(
        PYTHONPATH=os.pathsep.join(filter(None, [os.getcwd(), env.get("PYTHONPATH", "")])),
        DJANGO_SETTINGS_MODULE="console.settings",
        PDBRIDGE_ENV="test",
        PDBRIDGE_VAR_DIR=str(var),
        DATABASE_URL=f"sqlite:///{var / 'bench.sqlite3'}",
    )
    log = (var / "server.log").open("wb")
    proc = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 90
    while not probe(f"{url}/healthz", context, 2.0).answered:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"server did not start: {(var / 'server.log').read_text()[-2000:]}")
        time.sleep(0.2)
    return proc


def under_pressure(
    url: str, context: ssl.SSLContext | None, counts: dict[str, int]
) -> dict[str, Any]:
    """10 probes of ``url``/healthz beside the ``counts`` slow clients."""
    parts = urlsplit(url)
    with SlowClients(parts.hostname or "127.0.0.1", parts.port or 443, counts,
                     tls=parts.scheme == "https") as slow:  # fmt: skip
        slow.wait_connected(30)
        # Let every slow client get its grip (a handshake or head under way) before probing.
        time.sleep(1.0)
        results = probe_many(f"{url}/healthz", context, count=10, timeout=2.0)
    answered = [r for r in results if r.answered]
    return {
        "answered": len(answered),
        "of": len(results),
        "max_s": round(max(r.seconds for r in results), 3),
        "p50_answered_s": round(statistics.median(r.seconds for r in answered), 4)
        if answered
        else None,
        "errors": sorted({r.error.split(":")[0] for r in results if r.error}),
    }


def throughput(
    url: str, context: ssl.SSLContext | None, seconds: float = 3.0, clients: int = 4
) -> dict[str, Any]:
    """Requests per second and p50 latency of GET /healthz over ``clients`` keep-alive connections."""
    parts = urlsplit(url)
    latencies: list[float] = []
    lock = threading.Lock()
    stop_at = time.monotonic() + seconds

    def client() -> None:
        mine: list[float] = []
        conn: http.client.HTTPConnection
        if parts.scheme == "https":
            conn = http.client.HTTPSConnection(
                parts.hostname or "", parts.port, context=context, timeout=5
            )
        else:
            conn = http.client.HTTPConnection(parts.hostname or "", parts.port, timeout=5)
        while time.monotonic() < stop_at:
            start = time.monotonic()
            conn.request("GET", "/healthz")
            conn.getresponse().read()
            mine.append(time.monotonic() - start)
        conn.close()
        with lock:
            latencies.extend(mine)

    threads = [threading.Thread(target=client) for _ in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return {
        "requests_per_s": round(len(latencies) / seconds, 1),
        "p50_ms": round(statistics.median(latencies) * 1000, 2) if latencies else None,
    }


def run_local(pressures: list[str]) -> dict[str, Any]:
    from grpc_kv.certs import create_ca, create_node_cert
    from pdbridge.procgroup import free_port

    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        ca = create_ca(root / "ca")
        node = create_node_cert(ca, root / "nodes", "localhost", loopback=True)
        cert, key = str(node.cert_file), str(node.key_file)
        context = ssl.create_default_context(cafile=str(ca.ca_file))
        servers: dict[str, tuple[Callable[[str], list[str]], bool]] = {
            "old-testbed": (lambda b: old_testbed_command(b, cert, key), True),
            "old-k8s": (old_k8s_command, False),
            "new": (lambda b: new_command(b, cert, key), True),
            "new-plain": (new_command, False),
        }
        for name, (build, tls) in servers.items():
            port = free_port("127.0.0.1")
            url = f"{'https' if tls else 'http'}://127.0.0.1:{port}"
            ctx = context if tls else None
            var = root / name
            var.mkdir()
            proc = _serve(build(f"127.0.0.1:{port}"), url, ctx, var)
            try:
                row: dict[str, Any] = {"unloaded": throughput(url, ctx)}
                for pressure in pressures:
                    row[pressure] = under_pressure(url, ctx, PRESSURES[pressure])
                    print(
                        f"  {name:12s} {pressure:8s} answered {row[pressure]['answered']}/10",
                        flush=True,
                    )
            finally:
                proc.terminate()
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    proc.kill()
            results[name] = row
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.console_server", description=__doc__)
    parser.add_argument("--pressures", default=",".join(PRESSURES), help="comma-separated")
    parser.add_argument("--url", default="", help="measure this running console instead")
    parser.add_argument("--ca", default="", help="CA bundle that verifies --url")
    parser.add_argument("--output", default=str(OUTPUT))
    args = parser.parse_args(argv)
    pressures = [p for p in args.pressures.split(",") if p]
    if args.url:
        context = ssl.create_default_context(cafile=args.ca or None)
        ctx = context if args.url.startswith("https") else None
        results = {
            args.url: {
                p: under_pressure(args.url.rstrip("/"), ctx, PRESSURES[p]) for p in pressures
            }
        }
    else:
        results = run_local(pressures)
    report = {
        "benchmark": "console_server",
        "machine": {"python": platform.python_version(), "cpus": os.cpu_count()},
        "probe": "GET /healthz, 10 in a row, fresh connection each, 2 s deadline each",
        "pressures": {p: PRESSURES[p] for p in pressures},
        "results": results,
    }
    write_json(Path(args.output), report)
    print(
        f"{'server':14s} {'unloaded req/s':>14s} {'p50 ms':>7s} "
        + " ".join(f"{p:>9s}" for p in pressures)
    )
    for name, row in results.items():
        unloaded = row.get("unloaded", {})
        cells = " ".join(f"{row[p]['answered']:>6d}/10" for p in pressures)
        print(
            f"{name:14s} {unloaded.get('requests_per_s', ''):>14} {unloaded.get('p50_ms', ''):>7} {cells}"
        )
    print(f"written: {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Node agent benchmarks (``make bench-agent``; JSON in ``var/bench/agent.json``).

Side by side in one run, alternating so that machine noise hits both sides:

1. Control-API latency: ``Status`` round trips to a real agent over mTLS and over plaintext
   (p50 / p99, ms).
2. Launch overhead: a small HTTP server launched through the agent (``Launch`` returns once
   it is healthy) against the same server started directly and polled until healthy.
3. Recovery: ``kill -9`` of the supervised server until the agent reports it healthy again.
4. Fault expiry: a 1 s ``link_cut`` through the userspace fault proxy; how long after the
   expiry TCP traffic flows again without any call.

Run: ``python -m bench.agent [--rounds N]``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from agents.proto.api import pb
from bench import write_json
from tests.agents.conftest import agent_config, command_pids, free_port, start_agent, stub
from tests.agents.pki import make_pki
from tests.support import subprocess_env, wait_for

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "var" / "bench" / "agent.json"


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3)


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as resp:  # noqa: S310  (loopback http)
            return bool(resp.status == 200)
    except OSError:
        return False


def _direct_start() -> float:
    port = free_port()
    started = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.agents.healthserver", "--port", str(port)],
        env=subprocess_env(),
        stdout=subprocess.DEVNULL,
    )
    try:
        wait_for(lambda: _healthy(f"http://127.0.0.1:{port}/health"), 30, interval=0.05)
        return time.monotonic() - started
    finally:
        proc.kill()
        proc.wait()


def _echo_server() -> int:
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)

    def serve() -> None:
        while True:
            conn, _ = server.accept()
            with conn:
                conn.sendall(conn.recv(1024))

    threading.Thread(target=serve, daemon=True).start()
    port: int = server.getsockname()[1]
    return port


def _flows(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
            sock.sendall(b"x")
            return sock.recv(1) == b"x"
    except OSError:
        return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.agent")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="bench-agent-"))
    pki = make_pki(tmp / "pki")
    echo = _echo_server()
    proxy_port = free_port()
    proxies = {"remote": {"listen": f"127.0.0.1:{proxy_port}", "upstream": f"127.0.0.1:{echo}"}}
    secure = start_agent(tmp / "secure", agent_config(tmp / "secure", pki))
    plain = start_agent(
        tmp / "plain", agent_config(tmp / "plain", None, faults={"proxies": proxies})
    )
    result: dict[str, Any] = {"rounds": args.rounds, "calls_per_round": args.calls}
    try:
        latency: dict[str, list[float]] = {"mtls": [], "plaintext": []}
        stubs = {"mtls": stub(secure, pki), "plaintext": stub(plain, None)}
        for _ in range(args.rounds):
            for name, api in stubs.items():
                for _ in range(args.calls):
                    started = time.perf_counter()
                    api.Status(pb.StatusRequest(), timeout=10)
                    latency[name].append((time.perf_counter() - started) * 1000)
        result["status_rpc_ms"] = {
            name: {"p50": _pct(v, 0.5), "p99": _pct(v, 0.99)} for name, v in latency.items()
        }

        direct: list[float] = []
        through: list[float] = []
        recovery: list[float] = []
        api = stubs["plaintext"]
        for i in range(args.rounds):
            direct.append(_direct_start())
            started = time.monotonic()
            request = pb.LaunchRequest(
                request_id=f"b{i}", name=f"b{i}", kind="decode-engine", engine="plain"
            )
            child = api.Launch(request, timeout=60).child
            through.append(time.monotonic() - started)
            (command,) = command_pids(child.pid)
            killed = time.monotonic()
            os.kill(command, signal.SIGKILL)
            wait_for(
                lambda n=f"b{i}", old=child.pid: (
                    (c := api.Status(pb.StatusRequest(name=n), timeout=10).children[0]).healthy
                    and c.state == "running"
                    and c.pid not in {0, old}
                ),
                30,
                interval=0.02,
            )
            recovery.append(time.monotonic() - killed)
            api.Stop(pb.StopRequest(request_id=f"s{i}", name=f"b{i}"), timeout=60)
        result["launch_s"] = {
            "direct_p50": round(statistics.median(direct), 3),
            "through_agent_p50": round(statistics.median(through), 3),
            "ratio": round(statistics.median(through) / statistics.median(direct), 2),
        }
        result["kill9_to_healthy_s"] = {
            "p50": round(statistics.median(recovery), 3),
            "max": round(max(recovery), 3),
        }

        overshoot: list[float] = []
        for i in range(args.rounds):
            request = pb.InjectFaultRequest(
                request_id=f"f{i}", kind="link_cut", target="remote", duration_s=1
            )
            fault = api.InjectFault(request, timeout=10).fault
            assert not _flows(proxy_port)
            expires = _epoch(fault.expires_at)
            wait_for(lambda: _flows(proxy_port), 10, interval=0.01)
            overshoot.append(max(0.0, time.time() - expires))
        result["link_cut_restore_after_expiry_s"] = {
            "p50": round(statistics.median(overshoot), 3),
            "max": round(max(overshoot), 3),
        }
    finally:
        secure.terminate()
        plain.terminate()
    write_json(OUT, result)
    print(json.dumps(result, indent=2))
    return 0


def _epoch(iso: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(iso.replace("Z", "+00:00")).timestamp()


if __name__ == "__main__":
    sys.exit(main())

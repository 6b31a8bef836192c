"""Where a gateway process spends its time under the paced load
(``python -m bench.gateway_profile``; JSON in ``var/bench/gateway_profile.json``).

The same load as ``bench.gateway``'s paced phase (200 streams at 40 tokens/s, canned upstream,
everything below the threshold: the local pass-through path), against two real gateway
processes in turn:

1. **syscalls**: the gateway under ``strace -c -f`` (when strace is installed and may attach):
   reads and writes per relayed SSE event and per request;
2. **profile**: the gateway under ``cProfile``: own time by area (gateway code, aiohttp,
   asyncio/uvloop, other) and the top functions.

Both tools slow the process down, so latencies of these phases are not overhead figures
(``bench.gateway`` measures those); counts and shares are what this reports. Placement as in
``bench.gateway`` (``--pin auto``: harness and gateway on separate halves of the CPUs).
"""

from __future__ import annotations

import argparse
import json
import os
import pstats
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import write_json
from bench.gateway import _snapshot, paced
from bench.gateway_procs import ROOT, _cpu_s, _pin, _run, _spawn, placement

OUT = ROOT / "var" / "bench" / "gateway_profile.json"

#: Own-time areas of the profile, by the file a function lives in (first match wins).
AREAS = (
    ("gateway", "agents/gateway/"),
    ("aiohttp", "/aiohttp/"),
    ("prometheus_client", "/prometheus_client/"),
    ("asyncio", "/asyncio/"),
    ("uvloop", "/uvloop/"),
)


def _gateway_args(config: Path, settings: Path) -> list[str]:
    return ["-m", "pdbridge.cli", "gateway", "--config", str(config), "--settings",
            str(settings), "--insecure", "--port", "0", "--log-level", "WARNING"]  # fmt: skip


def _stop(proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGTERM)  # graceful: cProfile writes its file on exit
    proc.wait(timeout=30)


def parse_strace_summary(text: str) -> dict[str, int]:
    """Calls per syscall from ``strace -c`` output (the summary table)."""
    calls: dict[str, int] = {}
    for line in text.splitlines():
        fields = line.split()
        # % time, seconds, usecs/call, calls, [errors,] syscall
        if len(fields) in (5, 6) and fields[-1] != "total" and fields[3].isdigit():
            try:
                float(fields[0])
            except ValueError:
                continue
            calls[fields[-1]] = int(fields[3])
    return calls


def area_of(filename: str) -> str:
    for area, marker in AREAS:
        if marker in filename:
            return area
    return "other"


def summarize_profile(path: Path, top: int) -> dict[str, Any]:
    """Own time by area and the ``top`` functions by own time. The event loop's own entry
    (``run`` of the runner: uvloop's C loop, epoll and the socket syscalls) is an area of its
    own: ``event_loop_c``."""
    stats = pstats.Stats(str(path)).stats  # type: ignore[attr-defined]
    total = sum(row[2] for row in stats.values()) or 1.0
    areas: dict[str, float] = {}
    rows = []
    for (filename, line, name), (_cc, calls, own, _cum, _callers) in stats.items():
        area = area_of(filename)
        if filename.endswith("asyncio/runners.py") and name == "run":
            area = "event_loop_c"
        areas[area] = areas.get(area, 0.0) + own
        rows.append((own, calls, f"{Path(filename).name}:{line}({name})", area))
    rows.sort(reverse=True)
    return {
        "own_s_total": total,
        "own_share_by_area": {k: round(v / total, 4) for k, v in sorted(areas.items())},
        "top_own_time": [
            {"function": f, "area": a, "calls": c, "own_s": round(o, 4), "share": round(o / total, 4)}
            for o, c, f, a in rows[:top]
        ],
    }  # fmt: skip


def _phase(
    args: argparse.Namespace, wrap: str, tmp: Path, up_url: str, place: dict[str, Any]
) -> dict[str, Any]:
    """One paced phase against a fresh gateway, wrapped by ``strace`` or ``cProfile``."""
    config, settings = tmp / "snapshot.json", tmp / "settings.yaml"
    prof = tmp / "gateway.prof"
    prefix = ["-m", "cProfile", "-o", str(prof)] if wrap == "profile" else []
    gateway, ready = _spawn([*prefix, *_gateway_args(config, settings)], "text")
    _pin(gateway.pid, place["serving"])
    tracer = None
    trace_out = tmp / "strace.txt"
    if wrap == "syscalls":
        tracer = subprocess.Popen(
            ["strace", "-c", "-f", "-p", str(gateway.pid), "-o", str(trace_out)],
            stderr=subprocess.DEVNULL,
        )
        time.sleep(1.0)  # attached to every thread before the load starts
    url = f"http://127.0.0.1:{ready['port']}"
    try:
        before = _cpu_s(gateway.pid)
        result = _run(
            paced(url, args.streams, args.tokens, 1000 / args.tok_s, args.per_client),
            args.harness_loop,
        )
        after = _cpu_s(gateway.pid)
    finally:
        if tracer is not None:
            tracer.send_signal(signal.SIGINT)
            tracer.wait(timeout=30)
        _stop(gateway)
    requests = args.streams * args.per_client
    events = requests * (args.tokens + 1)  # token events and [DONE]
    phase: dict[str, Any] = {"paced_under_tool": result, "requests": requests, "events": events}
    if before is not None and after is not None:
        phase["cpu_ms_per_stream_under_tool"] = (after - before) * 1000 / requests
    if wrap == "syscalls":
        calls = parse_strace_summary(trace_out.read_text() if trace_out.exists() else "")
        phase["syscalls"] = calls
        phase["per_event"] = {k: round(calls.get(k, 0) / events, 3) for k in ("read", "write")}
        phase["per_request"] = {k: round(v / requests, 2) for k, v in sorted(calls.items())}
    else:
        phase.update(summarize_profile(prof, args.top))
    return phase


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gateway_profile")
    p.add_argument("--streams", type=int, default=200)
    p.add_argument("--tok-s", type=float, default=40)
    p.add_argument("--tokens", type=int, default=40)
    p.add_argument("--per-client", type=int, default=4)
    p.add_argument("--top", type=int, default=15, help="functions listed by own time")
    p.add_argument("--pin", default="auto", choices=["auto", "off"])
    p.add_argument("--harness-loop", default="asyncio", choices=["auto", "uvloop", "asyncio"])
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)
    place = placement(args.pin)
    _pin(os.getpid(), place["harness"])
    upstream, up = _spawn(["-m", "bench.gateway", "upstream", "--harness-loop", args.harness_loop],
                          "json")  # fmt: skip
    up_url = f"http://127.0.0.1:{up['port']}"
    result: dict[str, Any] = {"placement": place, "settings": {
        k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}}  # fmt: skip
    try:
        with tempfile.TemporaryDirectory() as tmp_name:
            tmp = Path(tmp_name)
            (tmp / "snapshot.json").write_text(json.dumps(_snapshot(up_url)))
            (tmp / "settings.yaml").write_text(f"scrape_interval_s: 0\nstate_dir: {tmp}\n")
            if shutil.which("strace"):
                result["syscalls"] = _phase(args, "syscalls", tmp, up_url, place)
            else:
                result["syscalls"] = None
                print("strace not installed: syscall counts skipped")
            result["profile"] = _phase(args, "profile", tmp, up_url, place)
    finally:
        upstream.terminate()
        upstream.wait(timeout=10)
    sc = result["syscalls"]
    if sc is not None and sc.get("syscalls"):
        print(
            f"syscalls per relayed event: read {sc['per_event']['read']:.2f}, write "
            f"{sc['per_event']['write']:.2f}; per request: "
            + ", ".join(f"{k} {v}" for k, v in sc["per_request"].items() if v >= 0.5)
        )
    elif sc is not None:
        print("strace could not attach (ptrace not permitted?): no syscall counts")
    prof = result["profile"]
    print(
        "own time by area: "
        + ", ".join(f"{k} {v:.0%}" for k, v in prof["own_share_by_area"].items())
    )
    for row in prof["top_own_time"]:
        print(f"  {row['share']:6.1%}  {row['calls']:>8}  {row['function']}")
    write_json(args.out, result)
    print(f"written {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

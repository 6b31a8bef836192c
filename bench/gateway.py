"""Gateway benchmarks (``make bench-gateway``; JSON in ``var/bench/gateway.json``).

1. Decision cost: routing decisions per second on one core (the router with two remote sites,
   random keys and lengths, half of them past the threshold). Target >= 20,000.
2. Overhead against a minimal canned-SSE upstream, side by side in one run — the same load
   straight to the upstream and through a real ``pdbridge gateway`` process (static config,
   everything below the threshold: the local pass-through path with routing, metrics, logs):
   * paced: 200 concurrent streams at 40 tokens/s; added TTFT p50 <= 2 ms, p99 <= 10 ms,
     added inter-token delay p99 <= 5 ms;
   * saturation: a fixed number of concurrent clients as fast as they go; requests/s through
     the gateway >= 0.8 x direct.
   Direct and gateway runs alternate (``--rounds``, the order rotating each round) so that
   machine noise hits both. A second direct run in each round is the **null control**: its
   "added" figures against the first direct run show what the load generator and the machine
   alone make of the comparison (ideally ~0).

Placement (``--pin auto``, with >= 2 usable CPUs): the load generator (this process) and the
canned upstream run on one half of the CPUs, the serving process under test (gateway or bare
proxy) on the other half, in every leg alike, so that the relay does not compete with the load
it is measured under; the saturation phases run unpinned (what the whole machine takes). The
placement and each process's event loop are recorded in the JSON.

Run: ``python -m bench.gateway [--quick]``; ``python -m bench.gateway upstream`` runs only the
canned upstream (prints its port and event loop).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web

from bench import write_json
from bench.gateway_procs import (
    MODEL,
    ROOT,
    _bare_proxy_main,
    _cpu_s,
    _loop_name,
    _pin,
    _run,
    _spawn,
    _sse,
    _upstream_main,
    placement,
)

OUT = ROOT / "var" / "bench" / "gateway.json"


def _snapshot(upstream_url: str) -> dict[str, Any]:
    return {
        "deployment": {"id": 1, "name": "bench", "state": "active"},
        "version": 1,
        "model": {"name": MODEL, "engine_settings": {}},
        "routing": {
            "remote_prefill_threshold_tokens": 1_000_000,
            "remote_share_percent": 100,
            "kill_switch": False,
            "fallback_to_local_prefill": True,
            "link_utilization_ceiling": 0.7,
        },
        "circuit_breaker": {"error_rate_limit": 0.05, "latency_p99_limit_ms": 2500},
        "kv_transfer": {"timeout_ms": 4000},
        "pools": {
            "decode": {"site": "local", "nodes": [{"hostname": "up", "engine_url": upstream_url}]},
            "prefill": [{"site": "remote", "nodes": [{"hostname": "pre", "engine_url": "http://127.0.0.1:9"}]}],
        },
        "links": [{"from_site": "remote", "to_site": "local", "provisioned_mbit_s": 10000}],
    }  # fmt: skip


# -- load ------------------------------------------------------------------------------------
async def _stream(
    session: aiohttp.ClientSession, url: str, tokens: int, pace_ms: float
) -> tuple[float, list[float]]:
    """One streamed request: (TTFT, gaps between data events), client-side."""
    body = {"model": MODEL, "prompt": "hello", "max_tokens": tokens, "stream": True,
            "bench_pace_ms": pace_ms}  # fmt: skip
    start = time.perf_counter()
    ttft = -1.0
    gaps: list[float] = []
    last = start
    async with session.post(url + "/v1/completions", json=body) as response:
        if response.status != 200:
            raise RuntimeError(f"status {response.status}")
        async for chunk in response.content.iter_any():
            now = time.perf_counter()
            events = chunk.count(b"data: {")
            if not events:
                continue
            if ttft < 0:
                ttft = now - start
            else:
                gaps.append(now - last)
            last = now
    return ttft, gaps


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


async def paced(
    url: str, streams: int, tokens: int, pace_ms: float, per_client: int
) -> dict[str, float]:
    """``streams`` concurrent clients, each running ``per_client`` paced streams back to back
    (steady state: kept-alive connections). The first stream of each client warms its
    connections and is left out of the figures. ``loadgen_cpu_share``: this process's CPU
    time over the wall time of the phase; near 1 the load generator itself is saturated and
    its timestamps run late (check the null control)."""
    connector = aiohttp.TCPConnector(limit=0)
    cpu0, wall0 = time.process_time(), time.perf_counter()
    async with aiohttp.ClientSession(connector=connector) as session:

        async def client(i: int) -> list[tuple[float, list[float]]]:
            # Spread starts over one token interval, as real arrivals are.
            await asyncio.sleep(pace_ms / 1000 * i / streams)
            return [await _stream(session, url, tokens, pace_ms) for _ in range(per_client)]

        results = [
            r for rs in await asyncio.gather(*(client(i) for i in range(streams))) for r in rs[1:]
        ]
    loadgen_cpu_share = (time.process_time() - cpu0) / (time.perf_counter() - wall0)
    ttfts = [r[0] for r in results]
    gaps = [g for r in results for g in r[1]]
    return {
        "streams_measured": len(results),
        "ttft_p50_ms": _pct(ttfts, 0.5) * 1000,
        "ttft_p99_ms": _pct(ttfts, 0.99) * 1000,
        "itl_p50_ms": _pct(gaps, 0.5) * 1000,
        "itl_p99_ms": _pct(gaps, 0.99) * 1000,
        "loadgen_cpu_share": loadgen_cpu_share,
    }


async def saturate(url: str, clients: int, seconds: float, tokens: int) -> float:
    connector = aiohttp.TCPConnector(limit=0)
    done = 0
    async with aiohttp.ClientSession(connector=connector) as session:
        stop = time.perf_counter() + seconds

        async def client() -> None:
            nonlocal done
            while time.perf_counter() < stop:
                await _stream(session, url, tokens, 0)
                done += 1

        start = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(clients)))
        elapsed = time.perf_counter() - start
    return done / elapsed


async def in_process(requests: int, tokens: int, pace_ms: float) -> dict[str, float]:
    """Upstream, gateway and client in one event loop, one request at a time, alternating
    direct and through the gateway: the gateway's own CPU cost on the TTFT and inter-token
    path, without the scheduling delays between processes that dominate on a busy machine.
    Events are paced (``pace_ms``) so that each arrives on its own and gaps can be measured."""
    from agents.gateway.app import Gateway
    from agents.gateway.config import GatewaySettings, parse_snapshot
    from agents.gateway.server import start

    app = web.Application()
    app.router.add_post("/v1/completions", _sse)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    direct = f"http://127.0.0.1:{runner.addresses[0][1]}"
    gateway = Gateway(GatewaySettings(port=0, scrape_interval_s=0))
    gateway.apply(parse_snapshot(_snapshot(direct)))
    running = await start(gateway)
    through = f"http://127.0.0.1:{running.port}"
    ttft: dict[str, list[float]] = {"direct": [], "gateway": []}
    gaps: dict[str, list[float]] = {"direct": [], "gateway": []}
    try:
        async with aiohttp.ClientSession() as session:
            for i in range(requests + 20):
                for name, url in (("direct", direct), ("gateway", through)):
                    first, between = await _stream(session, url, tokens, pace_ms)
                    if i >= 20:  # warm-up: connections, code paths
                        ttft[name].append(first)
                        gaps[name] += between
    finally:
        await running.stop()
        await runner.cleanup()

    def ms(values: list[float], q: float) -> float:
        return _pct(values, q) * 1000

    return {
        "requests": requests,
        "direct_ttft_p50_ms": ms(ttft["direct"], 0.5),
        "added_ttft_p50_ms": ms(ttft["gateway"], 0.5) - ms(ttft["direct"], 0.5),
        "added_ttft_p99_ms": ms(ttft["gateway"], 0.99) - ms(ttft["direct"], 0.99),
        "added_itl_p99_ms": ms(gaps["gateway"], 0.99) - ms(gaps["direct"], 0.99),
    }


# -- decision cost ---------------------------------------------------------------------------
def decisions_per_second(n: int) -> float:
    from agents.gateway.config import GatewaySettings, parse_snapshot
    from agents.gateway.state import Router

    snap = _snapshot("http://127.0.0.1:9")
    snap["routing"]["remote_prefill_threshold_tokens"] = 4096
    snap["routing"]["remote_share_percent"] = 50
    snap["pools"]["prefill"].append(
        {"site": "remote-b", "nodes": [{"hostname": "b", "engine_url": "http://127.0.0.1:11"}]}
    )
    router = Router(GatewaySettings())
    router.apply(parse_snapshot(snap))
    config = router.config
    assert config is not None
    rng = random.Random(7)
    keys = [f"user-{rng.randrange(1_000_000)}" for _ in range(4096)]
    lengths = [rng.randrange(0, 8192) for _ in range(4096)]
    remote = 0
    start = time.perf_counter()
    for i in range(n):
        decision = router.decide(config, keys[i & 4095], lengths[i & 4095])
        if decision.path == "remote":
            remote += 1
            router.note_remote_tokens(decision.site or "", decision.incremental_tokens)
    elapsed = time.perf_counter() - start
    assert remote > 0
    return n / elapsed


# -- orchestration ---------------------------------------------------------------------------
#: The legs of each round: ``direct_null`` is the null control (the same upstream again).
LEGS = ("direct", "bare_proxy", "gateway", "direct_null")


async def _overhead(
    args: argparse.Namespace,
    urls: dict[str, str],
    pids: dict[str, int],
    pin: Callable[[bool], None] = lambda _: None,
) -> dict[str, Any]:
    """The legs, round after round. ``pin(True)`` applies the placement for the paced phases;
    ``pin(False)`` lifts it for the saturation phases, which measure what the whole machine
    takes (pinned, the relay would get half the CPUs and the direct leg the other half)."""
    rounds: list[dict[str, Any]] = []
    for k in range(args.rounds):
        row: dict[str, Any] = {}
        # Rotated order: no leg always runs first (cold) or last (after the others' load).
        order = [*LEGS[k % len(LEGS) :], *LEGS[: k % len(LEGS)]]
        row["order"] = order
        for name in order:
            url = urls[name]
            pin(True)
            before = _cpu_s(pids[name])
            result = await paced(url, args.streams, args.tokens, 1000 / args.tok_s, args.per_client)
            after = _cpu_s(pids[name])
            if before is not None and after is not None:
                # CPU of the serving process per paced stream: unlike latency, barely moved by
                # other load on the machine, so the gateway/bare-proxy ratio reads true anywhere.
                result["cpu_ms_per_stream"] = (
                    (after - before) * 1000 / (args.streams * args.per_client)
                )
            pin(False)
            row[name] = {
                "paced": result,
                "saturation_rps": await saturate(url, args.clients, args.seconds, 64),
            }
        rounds.append(row)

    def med(path: str, key: str) -> float:
        values = [r[path]["paced"][key] for r in rounds]
        return statistics.median(values)

    def added(path: str) -> dict[str, float]:
        """``path`` against the direct leg: medians over rounds, then the difference."""
        return {
            "added_ttft_p50_ms": med(path, "ttft_p50_ms") - med("direct", "ttft_p50_ms"),
            "added_ttft_p99_ms": med(path, "ttft_p99_ms") - med("direct", "ttft_p99_ms"),
            "added_itl_p99_ms": med(path, "itl_p99_ms") - med("direct", "itl_p99_ms"),
            "rps_ratio": rps[path] / rps["direct"],
        }

    rps = {name: statistics.median(r[name]["saturation_rps"] for r in rounds) for name in LEGS}
    cpu = {
        name: statistics.median(
            r[name]["paced"].get("cpu_ms_per_stream", float("nan")) for r in rounds
        )
        for name in LEGS
    }
    gateway, bare, null = added("gateway"), added("bare_proxy"), added("direct_null")
    return {
        "loadgen_loop": _loop_name(),
        "paced_cpu_ms_per_stream": cpu,
        "loadgen_cpu_share": {name: med(name, "loadgen_cpu_share") for name in LEGS},
        "null_control": null,
        "bare_proxy": bare,
        "bare_proxy_rps": rps["bare_proxy"],
        "bare_proxy_ratio": bare["rps_ratio"],
        "bare_proxy_added_ttft_p50_ms": bare["added_ttft_p50_ms"],
        "bare_proxy_added_ttft_p99_ms": bare["added_ttft_p99_ms"],
        "bare_proxy_added_itl_p99_ms": bare["added_itl_p99_ms"],
        "rounds": rounds,
        "added_ttft_p50_ms": gateway["added_ttft_p50_ms"],
        "added_ttft_p99_ms": gateway["added_ttft_p99_ms"],
        "added_itl_p99_ms": gateway["added_itl_p99_ms"],
        "direct_rps": rps["direct"],
        "gateway_rps": rps["gateway"],
        "saturation_ratio": gateway["rps_ratio"],
    }


def _figures(label: str, fig: dict[str, float]) -> str:
    return (
        f"{label}: added TTFT p50/p99 {fig['added_ttft_p50_ms']:.2f}/"
        f"{fig['added_ttft_p99_ms']:.2f} ms, added ITL p99 {fig['added_itl_p99_ms']:.2f} ms, "
        f"saturation ratio {fig['rps_ratio']:.2f}"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gateway")
    p.add_argument("mode", nargs="?", default="all", choices=["all", "upstream", "bare-proxy"])
    p.add_argument("--upstream", help="upstream URL (bare-proxy mode)")
    p.add_argument("--quick", action="store_true", help="smaller load (smoke run)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--streams", type=int, default=200)
    p.add_argument("--tok-s", type=float, default=40)
    p.add_argument("--tokens", type=int, default=40)
    p.add_argument("--per-client", type=int, default=4, help="paced streams per client")
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--seconds", type=float, default=4)
    p.add_argument("--decisions", type=int, default=200_000)
    p.add_argument("--inprocess-requests", type=int, default=500)
    p.add_argument(
        "--event-loop", default="auto", choices=["auto", "uvloop", "asyncio"],
        help="the gateway process's settings.event_loop",
    )  # fmt: skip
    p.add_argument(
        "--fast-server", default="on", choices=["on", "off"],
        help="the gateway process's settings.fast_server (off: aiohttp's server only)",
    )  # fmt: skip
    p.add_argument(
        "--harness-loop", default="asyncio", choices=["auto", "uvloop", "asyncio"],
        help="event loop of the load generator, the canned upstream and the bare proxy "
        "(asyncio: the setup the saturation target was set with; a uvloop harness makes the "
        "direct leg faster, a stricter saturation ratio)",
    )  # fmt: skip
    p.add_argument(
        "--pin", default="auto", choices=["auto", "off"],
        help="auto: harness and serving process on separate halves of the CPUs (>= 2 CPUs)",
    )  # fmt: skip
    p.add_argument("--out", type=Path, default=OUT, help="JSON result file")
    args = p.parse_args(argv)
    if args.mode == "upstream":
        _run(_upstream_main(), args.harness_loop)
        return 0
    if args.mode == "bare-proxy":
        _run(_bare_proxy_main(args.upstream), args.harness_loop)
        return 0
    if args.quick:
        args.rounds, args.streams, args.tokens, args.seconds = 1, 50, 10, 1
        args.per_client, args.decisions, args.inprocess_requests = 2, 20_000, 50
    rate = decisions_per_second(args.decisions)
    print(f"decisions/s (one core): {rate:,.0f}  (target >= 20,000)")
    single = asyncio.run(in_process(args.inprocess_requests, 8, 2.0))
    print(
        "in one process (gateway CPU cost): added TTFT p50 "
        f"{single['added_ttft_p50_ms']:.2f} ms, p99 {single['added_ttft_p99_ms']:.2f} ms, "
        f"added ITL p99 {single['added_itl_p99_ms']:.2f} ms"
    )
    place = placement(args.pin)
    # This process is the load generator; the upstream inherits its CPUs.
    loadgen_cpus = _pin(os.getpid(), place["harness"])
    loop_arg = ["--harness-loop", args.harness_loop]
    upstream, up = _spawn(["-m", "bench.gateway", "upstream", *loop_arg], "json")
    up_url = f"http://127.0.0.1:{up['port']}"
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "snapshot.json"
        config.write_text(json.dumps(_snapshot(up_url)))
        settings = Path(tmp) / "settings.yaml"
        settings.write_text(
            f"scrape_interval_s: 0\nstate_dir: {tmp}\nevent_loop: {args.event_loop}\n"
            f"fast_server: {'true' if args.fast_server == 'on' else 'false'}\n"
        )
        bare, bare_ready = _spawn(
            ["-m", "bench.gateway", "bare-proxy", "--upstream", up_url, *loop_arg], "json"
        )
        gateway, gw_ready = _spawn(
            ["-m", "pdbridge.cli", "gateway", "--config", str(config), "--settings", str(settings),
             "--insecure", "--port", "0", "--log-level", "WARNING"],
            "text",
        )  # fmt: skip
        place["processes"] = {
            "loadgen": loadgen_cpus,
            "upstream": _pin(upstream.pid, place["harness"]),
            "bare_proxy": _pin(bare.pid, place["serving"]),
            "gateway": _pin(gateway.pid, place["serving"]),
        }
        place["saturation"] = "not pinned"
        sides = {os.getpid(): "harness", upstream.pid: "harness", bare.pid: "serving",
                 gateway.pid: "serving"}  # fmt: skip

        def pin(paced: bool) -> None:
            for pid, side in sides.items():
                _pin(pid, place[side] if paced else place["cpus"])

        try:
            overhead = _run(
                _overhead(
                    args,
                    {
                        "direct": up_url,
                        "direct_null": up_url,
                        "bare_proxy": f"http://127.0.0.1:{bare_ready['port']}",
                        "gateway": f"http://127.0.0.1:{gw_ready['port']}",
                    },
                    {"direct": upstream.pid, "direct_null": upstream.pid, "bare_proxy": bare.pid,
                     "gateway": gateway.pid},
                    pin,
                ),
                args.harness_loop,
            )  # fmt: skip
        finally:
            for proc in (gateway, bare, upstream):
                proc.terminate()
                proc.wait(timeout=10)
    result = {
        "decisions_per_s": rate,
        "in_process": single,
        **overhead,
        "targets": {
            "decisions_per_s": 20_000,
            "added_ttft_p50_ms": 2,
            "added_ttft_p99_ms": 10,
            "added_itl_p99_ms": 5,
            "saturation_ratio": 0.8,
        },
        # The gateway process's loop (settings.event_loop: auto).
        "gateway_event_loop": (
            "uvloop"
            if args.event_loop != "asyncio" and importlib.util.find_spec("uvloop")
            else "asyncio"
        ),
        "event_loops": {
            "loadgen": overhead.pop("loadgen_loop"),
            "upstream": up["loop"],
            "bare_proxy": bare_ready["loop"],
        },
        "placement": place,
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "cpus": os.cpu_count(),
        "loadavg_end": os.getloadavg() if hasattr(os, "getloadavg") else None,
    }
    checks = {
        "decisions_per_s": rate >= 20_000,
        "added_ttft_p50_ms": overhead["added_ttft_p50_ms"] <= 2,
        "added_ttft_p99_ms": overhead["added_ttft_p99_ms"] <= 10,
        "added_itl_p99_ms": overhead["added_itl_p99_ms"] <= 5,
        "saturation_ratio": overhead["saturation_ratio"] >= 0.8,
    }
    result["pass"] = checks
    for key in ("added_ttft_p50_ms", "added_ttft_p99_ms", "added_itl_p99_ms"):
        print(f"{key}: {overhead[key]:.2f}  {'ok' if checks[key] else 'OVER TARGET'}")
    print(
        f"saturation: direct {overhead['direct_rps']:.0f} req/s, gateway "
        f"{overhead['gateway_rps']:.0f} req/s, ratio {overhead['saturation_ratio']:.2f}  "
        f"{'ok' if checks['saturation_ratio'] else 'UNDER TARGET'}"
    )
    print(_figures("reference, bare aiohttp proxy in the same run", overhead["bare_proxy"]))
    print(_figures("null control, direct against direct again", overhead["null_control"]))
    cpu = overhead["paced_cpu_ms_per_stream"]
    print(
        f"paced CPU per stream: upstream {cpu['direct']:.2f} ms, bare proxy "
        f"{cpu['bare_proxy']:.2f} ms, gateway {cpu['gateway']:.2f} ms; load generator CPU "
        f"share (direct leg) {overhead['loadgen_cpu_share']['direct']:.2f}"
    )
    print(
        f"event loops: gateway {result['gateway_event_loop']} (fast server "
        f"{args.fast_server}), bare proxy "
        f"{bare_ready['loop']}, upstream {up['loop']}; placement: "
        + (
            f"harness on CPUs {place['harness']}, serving process on CPUs {place['serving']}"
            if place["pinned"]
            else "not pinned"
        )
    )
    write_json(args.out, result)
    print(f"written {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

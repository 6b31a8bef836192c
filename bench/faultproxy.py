"""Fault proxy benchmark (``make bench-faultproxy``; JSON in ``var/bench/faultproxy.json``).

The agent's userspace fault proxy sits on the KV path wherever the agent has no root, so what
it holds per connection is the agent's memory. Side by side in one run, alternating: the
proxy's per-direction bound as shipped (``PIPE_BYTES``) against the earlier 256 reads
(``PIPE_BYTES_DELAYED``, still used under a latency toxic), each streaming to a next hop that
reads as fast as it can and to one that reads at 25 MiB/s (about the testbed's 200 Mbit/s WAN
shaper). Reports throughput (MiB/s) and the most bytes one direction held
(``ProxyStats.buffered_peak``).

Run: ``python -m bench.faultproxy [--rounds N] [--mib N]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path
from typing import Any

import grpc_kv.faultproxy as faultproxy
from bench import write_json

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "var" / "bench" / "faultproxy.json"
SLOW_BYTES_PER_S = 25 << 20
BOUNDS = {"shipped": faultproxy.PIPE_BYTES, "256 reads": faultproxy.PIPE_BYTES_DELAYED}


async def stream(mib: int, slow: bool) -> tuple[float, int]:
    """``mib`` MiB through a fresh proxy to a sink; (MiB/s, the proxy's buffered peak)."""
    done = asyncio.Event()

    async def sink(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(1 << 20):
            if slow:
                await asyncio.sleep(len(data) / SLOW_BYTES_PER_S)
        done.set()
        writer.close()

    server = await asyncio.start_server(sink, "127.0.0.1", 0)
    proxy = faultproxy.FaultProxy(upstream=f"127.0.0.1:{server.sockets[0].getsockname()[1]}")
    port = await proxy.start()
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        block, started = bytes(1 << 20), time.monotonic()
        for _ in range(mib):
            writer.write(block)
            await writer.drain()
        writer.write_eof()
        await done.wait()
        elapsed = time.monotonic() - started
        writer.close()
        return mib / elapsed, proxy.stats.buffered_peak
    finally:
        await proxy.stop()
        server.close()


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.faultproxy")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--mib", type=int, default=512, help="MiB per fast run (slow: 1/4)")
    args = parser.parse_args()
    runs: dict[str, dict[str, list[tuple[float, int]]]] = {}
    for _ in range(args.rounds):
        for next_hop in ("fast", "slow"):
            for label, bound in BOUNDS.items():
                faultproxy.PIPE_BYTES = bound  # what _read_side reads at each put
                mib = args.mib // 4 if next_hop == "slow" else args.mib
                runs.setdefault(next_hop, {}).setdefault(label, []).append(
                    asyncio.run(stream(mib, next_hop == "slow"))
                )
    faultproxy.PIPE_BYTES = BOUNDS["shipped"]
    result: dict[str, Any] = {"rounds": args.rounds, "bounds_bytes": BOUNDS}
    for next_hop, by_bound in runs.items():
        result[next_hop] = {
            label: {
                "mib_per_s_median": round(statistics.median(r for r, _ in taken), 1),
                "buffered_peak_mib": round(max(p for _, p in taken) / 2**20, 2),
            }
            for label, taken in by_bound.items()
        }
        shipped, before = (result[next_hop][k]["mib_per_s_median"] for k in BOUNDS)
        result[next_hop]["throughput_ratio"] = round(shipped / before, 3)
    write_json(OUT, result)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

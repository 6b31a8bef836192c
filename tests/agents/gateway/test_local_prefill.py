"""The local prefill pool: a prefill pool at the decode site is never scored as a remote site;
the local path sends its prefill leg there. Against engine test doubles on loopback (a real
gateway app and server) and, for an instance that dies, real processes: a ``pdbridge gateway``
process before engine-double processes."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.agents.gateway.engine_double import EngineDouble, KvStore, tokens_for
from tests.agents.gateway.harness import FAST, LONG, completion, serving, sse_text
from tests.agents.gateway.procs import (
    Proc,
    get_json,
    load,
    metric,
    start_double,
    start_gateway,
    until,
)
from tests.agents.gateway.snapshots import snapshot
from tests.support import deadline_in

SHORT = "a short prompt"  # ~4 tokens; the threshold is 100


def _with_local_pool(
    decode: str, local: tuple[str, ...], remote: dict[str, tuple[str, ...]], remote_mbit_s: float
) -> dict[str, Any]:
    """A snapshot whose prefill pools are ``remote``'s sites and a pool at the decode site
    ("local"), as the console lists them (no link from the decode site to itself)."""
    data = snapshot(decode_urls=(decode,), prefill_sites={**remote, "local": local})
    data["links"] = [link for link in data["links"] if link["from_site"] != "local"]
    for link in data["links"]:
        link["provisioned_mbit_s"] = remote_mbit_s
    return data


async def _post(client, url: str, body: dict[str, Any]) -> tuple[int, Any, bytes]:
    async with client.post(url + "/v1/completions", json=body) as r:
        return r.status, r.headers.copy(), await r.read()


def _text(body: dict[str, Any], raw: bytes) -> str:
    return sse_text(raw) if body.get("stream") else json.loads(raw)["choices"][0]["text"]


def _prefill_legs(double: EngineDouble) -> list[dict[str, Any]]:
    return [
        b for b in double.requests if (b.get("kv_transfer_params") or {}).get("do_remote_decode")
    ]


def test_long_prompts_go_remote_and_short_ones_through_the_local_prefill_instance():
    """The remote site is slower and has 10 Mbit/s -- the notional 1,000 Mbit/s an unlinked
    pool used to score at would have won -- yet every long prompt goes there."""

    async def scenario() -> tuple[Any, ...]:
        kv = KvStore()
        decode = await EngineDouble("decode", kv).start()
        remote = await EngineDouble("remote", kv).start()
        local = await EngineDouble("local", kv).start()
        remote.prefill_delay_s = 0.2
        data = _with_local_pool(decode.url, (local.url,), {"remote": (remote.url,)}, 10)
        bodies = [completion(f"{LONG} {i}", stream=i % 2 == 0) for i in range(6)]
        bodies += [completion(f"{SHORT} {i}", stream=i % 2 == 0) for i in range(6)]
        try:
            async with serving(data) as (running, client, url):
                answers = [await _post(client, url, b) for b in bodies]
                async with client.get(url + "/debug/routing") as r:
                    routing = await r.json()
                async with client.get(url + "/metrics") as r:
                    metrics = await r.text()
                traces = [t.to_json() for t in running.gateway.traces.recent(12)]
            return answers, bodies, routing, metrics, traces, decode, remote, local
        finally:
            for double in (decode, remote, local):
                await double.stop()

    answers, bodies, routing, metrics, traces, decode, remote, local = asyncio.run(scenario())

    routes = [(s, h["x-pdbridge-path"], h.get("x-pdbridge-prefill-site")) for s, h, _ in answers]
    assert routes == [(200, "remote", "remote")] * 6 + [(200, "local", None)] * 6
    # Tokens as a plain local run's (the double's output is a function of the prompt).
    for body, (_, _, raw) in zip(bodies, answers, strict=True):
        assert _text(body, raw) == "".join(tokens_for(body["prompt"], 5))
    assert [b["prompt"] for b in _prefill_legs(remote)] == [b["prompt"] for b in bodies[:6]]
    local_legs = _prefill_legs(local)
    assert [b["prompt"] for b in local_legs] == [b["prompt"] for b in bodies[6:]]
    kv_params = [b["kv_transfer_params"] for b in local_legs]
    assert {p["kv_destination"] for p in kv_params} == {"127.0.0.1:7100"}
    # Each short prompt's decode leg got its KV from the local instance's transfer.
    decode_ids = [
        (b.get("kv_transfer_params") or {}).get("transfer_id")
        for b in decode.requests
        if b["prompt"].startswith(SHORT)
    ]
    assert decode_ids == [p["transfer_id"] for p in kv_params]
    assert [s["site"] for s in routing["sites"]] == ["remote"]
    assert routing["local_prefill"]["site"] == "local"
    assert routing["local_prefill"]["available"] is True
    [inst] = routing["local_prefill"]["instances"]
    assert (inst["name"], inst["url"], inst["breaker"]["state"]) == (
        "local-pre-0",
        local.url,
        "closed",
    )
    assert metric(metrics, "pdbridge_gateway_local_prefill_served_total") == 6
    assert metric(metrics, "pdbridge_gateway_local_prefill_skipped_total") == 0
    assert metric(metrics, "pdbridge_gateway_remote_served_total", site="remote") == 6
    assert metric(metrics, "pdbridge_gateway_remote_served_total", site="local") == 0
    assert 'site="local"' not in "".join(
        line for line in metrics.splitlines() if line.startswith("pdbridge_gateway_site_")
    )
    assert metric(metrics, "pdbridge_gateway_fallbacks_total") == 0
    assert metric(metrics, "pdbridge_gateway_requests_total", path="local", outcome="ok") == 6
    short_traces = [t for t in traces if t["path"] == "local"]
    assert len(short_traces) == 6
    for trace in short_traces:
        [prefill_leg] = [leg for leg in trace["legs"] if leg["leg"] == "prefill"]
        assert (prefill_leg["site"], prefill_leg["instance"]) == ("local", "local-pre-0")
        assert (trace["local_prefill"], trace["site"], trace["attempts"]) == ("served", None, [])
        assert trace["transfer_id"] in {p["transfer_id"] for p in kv_params}


@pytest.mark.parametrize("routing", [{"kill_switch": True}, {"remote_share_percent": 0}])
def test_kill_switch_and_share_keep_long_prompts_local_through_the_local_prefill_pool(routing):
    """The kill switch means no remote: local PD is still the local path."""

    async def scenario() -> tuple[Any, ...]:
        kv = KvStore()
        decode = await EngineDouble("decode", kv).start()
        remote = await EngineDouble("remote", kv).start()
        local = await EngineDouble("local", kv).start()
        data = _with_local_pool(decode.url, (local.url,), {"remote": (remote.url,)}, 10)
        data["routing"].update(routing)
        try:
            async with serving(data) as (_, client, url):
                answer = await _post(client, url, completion(LONG))
            return answer, len(_prefill_legs(remote)), len(_prefill_legs(local))
        finally:
            for double in (decode, remote, local):
                await double.stop()

    (status, headers, _), remote_legs, local_legs = asyncio.run(scenario())

    assert (status, headers["x-pdbridge-path"]) == (200, "local")
    assert (remote_legs, local_legs) == (0, 1)


def test_only_a_local_prefill_pool_means_no_remote_site():
    async def scenario() -> tuple[Any, ...]:
        kv = KvStore()
        decode = await EngineDouble("decode", kv).start()
        local = await EngineDouble("local", kv).start()
        data = _with_local_pool(decode.url, (local.url,), {}, 10)
        try:
            async with serving(data) as (running, client, url):
                config = running.gateway.router.config
                long = await _post(client, url, completion(LONG))
                short = await _post(client, url, completion(SHORT))
                async with client.get(url + "/debug/routing") as r:
                    routing = await r.json()
                async with client.get(url + "/metrics") as r:
                    metrics = await r.text()
            return config, long, short, routing, metrics, local
        finally:
            await decode.stop()
            await local.stop()

    config, long, short, routing, metrics, local = asyncio.run(scenario())

    assert (config.prefill, config.local_prefill.name) == ((), "local")
    assert (long[0], long[1]["x-pdbridge-path"]) == (200, "fallback")
    assert (short[0], short[1]["x-pdbridge-path"]) == (200, "local")
    assert routing["sites"] == []
    assert routing["local_prefill"]["site"] == "local"
    assert metric(metrics, "pdbridge_gateway_decisions_total", reason="no_remote_site") == 1
    assert metric(metrics, "pdbridge_gateway_fallbacks_total", cause="no_remote_site") == 1
    # A fallback is the decode engine's own prefill, as before; the short prompt went local PD.
    assert [b["prompt"] for b in _prefill_legs(local)] == [SHORT]
    assert metric(metrics, "pdbridge_gateway_local_prefill_served_total") == 1


def test_a_local_prefill_leg_failing_is_served_by_the_decode_engine_and_counted():
    """The local prefill engine answers 503: the decode engine prefills the request itself,
    without the fallback budget (a budget of none here), the trace naming the failed leg."""
    settings = dataclasses.replace(
        FAST, fallback_rate_per_s=0.001, fallback_burst=1, fallback_max_wait_s=0
    )

    async def scenario() -> tuple[Any, ...]:
        kv = KvStore()
        decode = await EngineDouble("decode", kv).start()
        local = await EngineDouble("local", kv).start()
        local.fail_status = 503
        data = _with_local_pool(decode.url, (local.url,), {}, 10)
        try:
            async with serving(data, settings) as (running, client, url):
                answers = [await _post(client, url, completion(f"{SHORT} {i}")) for i in range(8)]
                async with client.get(url + "/metrics") as r:
                    metrics = await r.text()
                async with client.get(url + "/debug/routing") as r:
                    routing = await r.json()
                traces = [t.to_json() for t in running.gateway.traces.recent(8)]
            return answers, metrics, routing, traces, decode
        finally:
            await decode.stop()
            await local.stop()

    answers, metrics, routing, traces, decode = asyncio.run(scenario())

    assert [(s, h["x-pdbridge-path"]) for s, h, _ in answers] == [(200, "local")] * 8
    # Each answered by one plain leg at the decode engine after its KV-waiting leg was closed.
    plain = [b for b in decode.requests if "kv_transfer_params" not in b]
    assert len(plain) == 8
    # breaker_consecutive_failures=3 opens the instance's breaker: the rest find none.
    assert (
        metric(metrics, "pdbridge_gateway_local_prefill_skipped_total", cause="prefill_error") == 3
    )
    assert (
        metric(
            metrics,
            "pdbridge_gateway_local_prefill_skipped_total",
            cause="local_prefill_unavailable",
        )
        == 5
    )
    assert metric(metrics, "pdbridge_gateway_local_prefill_served_total") == 0
    assert metric(metrics, "pdbridge_gateway_fallbacks_total") == 0
    assert metric(metrics, "pdbridge_gateway_fallback_budget_rejections_total") == 0
    assert routing["local_prefill"]["available"] is False
    assert routing["local_prefill"]["instances"][0]["breaker"]["state"] == "open"
    causes = Counter(t["local_prefill"] for t in traces)
    assert causes == {"prefill_error": 3, "local_prefill_unavailable": 5}
    failed = [t for t in traces if t["local_prefill"] == "prefill_error"]
    for trace in failed:
        [attempt] = trace["attempts"]
        assert (attempt["site"], attempt["instance"], attempt["cause"]) == (
            "local",
            "local-pre-0",
            "prefill_error",
        )
        assert [leg["leg"] for leg in trace["legs"]] == ["queue", "decode", "first_token"]


def test_a_drained_local_prefill_pool_is_as_if_there_were_none():
    async def scenario() -> tuple[Any, ...]:
        kv = KvStore()
        decode = await EngineDouble("decode", kv).start()
        local = await EngineDouble("local", kv).start()
        data = _with_local_pool(decode.url, (local.url,), {}, 10)
        data["pools"]["prefill"][0]["nodes"][0]["drained"] = True
        try:
            async with serving(data) as (_, client, url):
                answer = await _post(client, url, completion(SHORT))
                async with client.get(url + "/metrics") as r:
                    metrics = await r.text()
            return answer, metrics, local.requests
        finally:
            await decode.stop()
            await local.stop()

    (status, headers, _), metrics, local_requests = asyncio.run(scenario())

    assert (status, headers["x-pdbridge-path"]) == (200, "local")
    assert local_requests == []
    assert metric(metrics, "pdbridge_gateway_local_prefill_skipped_total") == 0


# -- real processes -------------------------------------------------------------------------
PROC_SETTINGS: dict[str, Any] = {
    "scrape_interval_s": 0,
    "retune_interval_s": 3600,
    "health_check_interval_s": 0.5,
    "health_check_timeout_s": 0.5,
    "breaker_ejection_base_s": 1.0,
    # No fallback budget to speak of: a local request must never need one.
    "fallback_rate_per_s": 0.001,
    "fallback_burst": 1,
    "fallback_max_wait_s": 0,
}


@pytest.fixture
def procs() -> Iterator[list[Proc]]:
    """Every process a test starts, stopped at its end."""
    started: list[Proc] = []
    yield started
    for proc in started:
        proc.stop()


def _local_pool(health: dict[str, Any]) -> dict[str, Any]:
    return next(p for p in health["pools"] if (p["role"], p["site"]) == ("prefill", "local"))


async def _legs(journal: Path) -> Counter[str]:
    """The decode double's completed legs by kind, once all 36 are written (a double notes a
    leg as its handler ends, just after the client got the answer)."""
    deadline = deadline_in(10)
    while True:
        lines = journal.read_text().splitlines() if journal.exists() else []
        legs = Counter(d["leg"] for d in map(json.loads, lines) if d["outcome"] == "completed")
        if sum(legs.values()) >= 36 or time.monotonic() > deadline:
            return legs
        await asyncio.sleep(0.05)


@pytest.mark.slow
def test_a_killed_local_prefill_instance_costs_no_request_and_is_counted(tmp_path, procs):
    kv = tmp_path / "kv"
    kv.mkdir()
    journal = tmp_path / "decode.jsonl"
    decode = start_double("decode", kv, tmp_path, journal=journal)
    remote = start_double("remote", kv, tmp_path)
    local = start_double("local", kv, tmp_path)
    procs += [decode, remote, local]
    local_port = int(local.url.rsplit(":", 1)[1])
    data = _with_local_pool(decode.url, (local.url,), {"remote": (remote.url,)}, 10)
    gateway = start_gateway(data, PROC_SETTINGS, tmp_path)
    procs.append(gateway)

    async def scenario() -> tuple[Any, ...]:
        await until(gateway.url + "/health", lambda s, h: s == 200 and h["status"] == "ok")
        before = await load(gateway.url, n=6, concurrency=2, prompt=SHORT)
        local.kill()
        down = await load(gateway.url, n=20, concurrency=4, prompt=SHORT)
        degraded = await until(gateway.url + "/health", lambda s, h: _local_pool(h)["healthy"] == 0)
        _, mid = await get_json(gateway.url + "/metrics")
        unavailable = await load(gateway.url, n=5, concurrency=1, prompt=SHORT)
        _, metrics = await get_json(gateway.url + "/metrics")
        procs.append(start_double("local", kv, tmp_path, port=local_port))
        await until(
            gateway.url + "/debug/routing", lambda s, d: d["local_prefill"]["available"] is True
        )
        back = await load(gateway.url, n=5, concurrency=1, prompt=SHORT)
        _, after = await get_json(gateway.url + "/metrics")
        return before, down, degraded, mid, unavailable, metrics, back, after, await _legs(journal)

    before, down, degraded, mid, unavailable, metrics, back, after, legs = asyncio.run(scenario())

    for results in (before, down, unavailable, back):
        assert Counter(results) == {(200, "local"): len(results)}
    assert degraded["status"] == "degraded"
    served, skipped = (
        "pdbridge_gateway_local_prefill_served_total",
        "pdbridge_gateway_local_prefill_skipped_total",
    )
    assert metric(mid, served) == 6
    # Every request while it was down was counted, by why the decode engine prefilled it.
    assert metric(mid, skipped) == 20
    causes = {
        line.split('cause="')[1].split('"')[0]
        for line in mid.splitlines()
        if line.startswith(skipped) and not line.endswith(" 0.0")
    }
    assert causes <= {"prefill_error", "local_prefill_unavailable"}
    assert (
        metric(metrics, skipped, cause="local_prefill_unavailable")
        == metric(mid, skipped, cause="local_prefill_unavailable") + 5
    )
    assert metric(metrics, served) == 6
    assert metric(after, served) == 11
    # Never a fallback, never the budget (of one token).
    assert metric(after, "pdbridge_gateway_fallbacks_total") == 0
    assert metric(after, "pdbridge_gateway_requests_total", path="local", outcome="ok") == 36
    # The decode engine prefilled the 25 itself; the 11 others' KV came from the local pool.
    assert legs == {"local": 25, "decode": 11}


def test_in_pull_mode_the_local_prefill_leg_goes_first_and_its_answer_feeds_the_decode_leg():
    async def scenario() -> tuple[Any, ...]:
        kv = KvStore()
        decode = await EngineDouble("decode", kv).start()
        local = await EngineDouble("local", kv).start()
        data = _with_local_pool(decode.url, (local.url,), {}, 10)
        data["kv_transfer"]["mode"] = "pull"
        try:
            async with serving(data) as (_, client, url):
                answer = await _post(client, url, completion(SHORT, stream=True))
            return answer, local.requests, decode.requests
        finally:
            await decode.stop()
            await local.stop()

    (status, headers, raw), local_requests, decode_requests = asyncio.run(scenario())

    assert (status, headers["x-pdbridge-path"]) == (200, "local")
    assert sse_text(raw) == "".join(tokens_for(SHORT, 5))
    [prefill_leg] = local_requests
    assert prefill_leg["kv_transfer_params"]["do_remote_decode"] is True
    [decode_leg] = decode_requests
    assert decode_leg["kv_transfer_params"]["remote_engine_id"] == "local"

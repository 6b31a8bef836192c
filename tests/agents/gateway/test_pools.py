"""Pool health with real processes on loopback: a ``pdbridge gateway`` process in front of
engine-double processes, one of which is killed (SIGKILL) or black-holed. No client request
fails; ``/health`` says which pool is short and recovers when the instance returns; the
remote site's breaker stays closed while one of its instances is out."""

from __future__ import annotations

import asyncio
import socket
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest

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

pytestmark = pytest.mark.slow

SETTINGS: dict[str, Any] = {
    "scrape_interval_s": 0,
    "retune_interval_s": 3600,
    "health_check_interval_s": 0.5,
    "health_check_timeout_s": 0.5,
    "outlier_consecutive_failures": 3,
    "outlier_base_ejection_s": 5.0,
    "fallback_rate_per_s": 1000,
    "fallback_burst": 1000,
}
LONG = "word " * 200  # ~250 tokens by the 4-characters estimate; the threshold is 100


@pytest.fixture
def procs() -> Iterator[list[Proc]]:
    """Every process a test starts, stopped at its end."""
    started: list[Proc] = []
    yield started
    for proc in started:
        proc.stop()


def _pool(health: dict[str, Any], role: str) -> dict[str, Any]:
    return next(p for p in health["pools"] if p["role"] == role)


def test_a_killed_decode_instance_costs_no_request_and_health_follows_it(tmp_path, procs):
    kv = tmp_path / "kv"
    kv.mkdir()
    a = start_double("decode-a", kv, tmp_path)
    b = start_double("decode-b", kv, tmp_path)
    prefill = start_double("prefill", kv, tmp_path)
    procs += [a, b, prefill]
    data = snapshot(decode_urls=(a.url, b.url), prefill_sites={"remote": (prefill.url,)})
    gateway = start_gateway(data, SETTINGS, tmp_path)
    procs.append(gateway)
    b_port = int(b.url.rsplit(":", 1)[1])

    async def scenario() -> tuple[Any, ...]:
        await until(gateway.url + "/health", lambda s, h: s == 200 and h["status"] == "ok")
        b.kill()
        results = await load(gateway.url, n=200, concurrency=10)
        degraded = await until(
            gateway.url + "/health", lambda s, h: _pool(h, "decode")["healthy"] == 1
        )
        _, metrics = await get_json(gateway.url + "/metrics")
        procs.append(start_double("decode-b", kv, tmp_path, port=b_port))
        recovered = await until(
            gateway.url + "/health", lambda s, h: s == 200 and h["status"] == "ok"
        )
        after = await load(gateway.url, n=20, concurrency=10)
        a.kill()
        procs[-1].kill()
        down = await until(gateway.url + "/health", lambda s, h: s == 503)
        return results, degraded, metrics, recovered, after, down

    results, degraded, metrics, recovered, after, down = asyncio.run(scenario())

    assert Counter(status for status, _ in results) == {200: 200}
    assert (degraded["status"], _pool(degraded, "decode")["total"]) == ("degraded", 2)
    assert metric(metrics, "pdbridge_gateway_retries_total", role="decode", cause="connect") >= 1
    assert metric(metrics, "pdbridge_gateway_instance_available", instance=b.url) == 0
    assert metric(metrics, "pdbridge_gateway_instance_available", instance=a.url) == 1
    assert metric(metrics, "pdbridge_gateway_pool_available_instances", role="decode") == 1
    assert _pool(recovered, "decode")["healthy"] == 2
    assert Counter(status for status, _ in after) == {200: 20}
    assert down["status"] == "unhealthy"
    assert _pool(down, "decode")["healthy"] == 0


def test_a_killed_prefill_instance_costs_no_request_and_leaves_the_site_breaker_closed(
    tmp_path, procs
):
    kv = tmp_path / "kv"
    kv.mkdir()
    decode = start_double("decode", kv, tmp_path)
    p1 = start_double("prefill-1", kv, tmp_path)
    p2 = start_double("prefill-2", kv, tmp_path)
    procs += [decode, p1, p2]
    data = snapshot(decode_urls=(decode.url,), prefill_sites={"remote": (p1.url, p2.url)})
    gateway = start_gateway(data, SETTINGS, tmp_path)
    procs.append(gateway)

    async def scenario() -> tuple[Any, ...]:
        await until(gateway.url + "/health", lambda s, h: h["status"] == "ok")
        p2.kill()
        results = await load(gateway.url, n=100, concurrency=10, prompt=LONG)
        degraded = await until(
            gateway.url + "/health", lambda s, h: _pool(h, "prefill")["healthy"] == 1
        )
        _, routing = await get_json(gateway.url + "/debug/routing")
        later = await load(gateway.url, n=30, concurrency=10, prompt=LONG)
        return results, degraded, routing, later

    results, degraded, routing, later = asyncio.run(scenario())

    assert Counter(status for status, _ in results) == {200: 100}
    paths = Counter(path for _, path in results)
    # Only legs sent to the dead instance before it was ejected fell back.
    assert paths["remote"] >= 90, paths
    assert set(paths) <= {"remote", "fallback"}
    assert (degraded["status"], degraded["config_version"]) == ("degraded", 3)
    [site] = routing["sites"]
    assert site["breaker"]["state"] == "closed"
    assert site["available"] is True
    assert Counter(path for _, path in later) == {"remote": 30}


FIRST_BYTE_S = 5.0


@pytest.mark.parametrize(
    ("prompt", "probes"),
    [("hello", True), (LONG, True), ("hello", False)],
    ids=["local", "remote", "local-no-probes"],
)
def test_requests_sent_to_a_black_holed_decode_instance_are_served_elsewhere_in_seconds(
    tmp_path, procs, prompt, probes
):
    """It accepts connections and never answers, from the first request on: 200 requests on
    the local or the remote path, none failed, none slower than the first-byte deadline plus
    a healthy request's time. With probes (every third request streamed), the legs waiting
    on it are abandoned once they mark it unhealthy; without (every request streamed: a
    non-streamed leg's first byte is its last, so only probes or an ejection bound it), each
    leg there hits its first-byte deadline and is retried."""
    kv = tmp_path / "kv"
    kv.mkdir()
    a = start_double("decode-a", kv, tmp_path)
    prefill = start_double("prefill", kv, tmp_path)
    procs += [a, prefill]
    hole = socket.socket()
    hole.bind(("127.0.0.1", 0))
    hole.listen(512)  # never accepted: the kernel completes handshakes, nothing answers
    hole_url = f"http://127.0.0.1:{hole.getsockname()[1]}"
    data = snapshot(decode_urls=(a.url, hole_url), prefill_sites={"remote": (prefill.url,)})
    settings = {
        **SETTINGS,
        "first_byte_timeout_s": FIRST_BYTE_S,
        "health_check_interval_s": 0.5 if probes else 0,
    }
    gateway = start_gateway(data, settings, tmp_path)
    procs.append(gateway)

    every = 3 if probes else 1

    async def scenario() -> tuple[Any, ...]:
        elapsed: list[float] = []
        results = await load(
            gateway.url, 200, 10, prompt=prompt, elapsed=elapsed, stream_every=every
        )
        healthy: list[float] = []
        await load(gateway.url, 20, 10, prompt=prompt, elapsed=healthy, stream_every=every)
        _, health = await get_json(gateway.url + "/health")
        _, metrics = await get_json(gateway.url + "/metrics")
        return results, elapsed, max(healthy), health, metrics

    try:
        results, elapsed, healthy_s, health, metrics = asyncio.run(scenario())
    finally:
        hole.close()

    assert Counter(status for status, _ in results) == {200: 200}
    # Half a second for the event loops of a busy machine (the retry's own connect, ...).
    assert max(elapsed) <= FIRST_BYTE_S + healthy_s + 0.5, (max(elapsed), healthy_s)
    assert metric(metrics, "pdbridge_gateway_instance_in_flight", instance=hole_url) == 0
    if probes:
        assert health["status"] == "degraded"
        assert _pool(health, "decode")["healthy"] == 1
        probes_failed = metric(
            metrics, "pdbridge_gateway_health_probes_total", instance=hole_url, result="failed"
        )
        assert probes_failed >= 2
    if prompt == LONG:
        # The decode leg that failed at the hole is served by local prefill elsewhere.
        assert {path for _, path in results} <= {"remote", "fallback"}
    else:
        assert {path for _, path in results} == {"local"}
        retried = sum(
            metric(metrics, "pdbridge_gateway_retries_total", role="decode", cause=cause)
            for cause in ("instance_down", "first_byte_timeout")
        )
        assert retried >= 1

"""End to end through the gateway with real reference engine processes (a prefill-side engine
and a decode engine receiving the KV through the engines' spool transport): remote, local and
fallback outputs are token- and logits-identical; a prefill engine restarted under load
costs zero failed requests; the fallback budget answers 503 with retry-after."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from agents.engines.verify import compare, make_prompt
from tests.agents.engines.conftest import EngineProc, start_engine
from tests.agents.gateway.harness import FAST, serving
from tests.agents.gateway.procs import metric
from tests.agents.gateway.snapshots import snapshot
from tests.support import deadline_in, subprocess_env

pytestmark = pytest.mark.slow

MODEL = "qwen3-next"
SETTINGS = replace(
    FAST,
    chars_per_token=1.0,  # the reference engine's byte tokenizer: one token per byte
    prefill_timeout_s=60,
    breaker_consecutive_failures=2,
    breaker_ejection_base_s=0.5,
    breaker_ejection_cap_s=2.0,
    breaker_close_after_successes=1,
)


def _engine_args(models_dir: Path, *extra: str) -> list[str]:
    return [
        "--model", f"tiny={MODEL}", "--models-dir", str(models_dir),
        "--chunked-prefill-tokens", "64", "--threads", "1", "--max-num-seqs", "16", *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory):
    """(prefill engine, decode engine, spool dir, models dir), alive for the module."""
    models_dir = tmp_path_factory.mktemp("models")
    spool = tmp_path_factory.mktemp("spool")
    logs = tmp_path_factory.mktemp("logs")
    subprocess.run(
        [sys.executable, "-m", "pdbridge.cli", "engine", "build", MODEL, "--models-dir", str(models_dir)],
        check=True, env=subprocess_env(), capture_output=True, timeout=180,
    )  # fmt: skip
    prefill = start_engine(_engine_args(models_dir, "--role", "both"), logs / "prefill.log")
    try:
        decode = start_engine(
            _engine_args(models_dir, "--role", "decode", "--kv-spool", str(spool)),
            logs / "decode.log",
        )
    except BaseException:
        prefill.stop()
        raise
    yield prefill, decode, spool, models_dir
    prefill.stop()
    decode.stop()


def _dead_url() -> str:
    """A loopback URL nothing listens on (connection refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def _snapshot(decode: EngineProc, prefill_url: str, spool: Path, **routing: Any) -> dict[str, Any]:
    data = snapshot(
        decode_urls=(decode.url,),
        prefill_sites={"remote": (prefill_url,)},
        remote_prefill_threshold_tokens=64,
        **routing,
    )
    data["model"]["engine_settings"] = {}
    data["pools"]["decode"]["nodes"][0]["kv_address"] = f"spool:{spool}"
    data["kv_transfer"]["timeout_ms"] = 3000
    return data


async def _completion(client, url: str, body: dict[str, Any]) -> tuple[int, str, dict[str, Any]]:
    """POST through the gateway; streams are folded into one completion-shaped document with
    all token ids and logits digests (what ``verify.compare`` reads)."""
    async with client.post(url + "/v1/completions", json=body) as r:
        path = r.headers.get("x-pdbridge-path", "")
        raw = await r.read()
    if r.status != 200:
        return r.status, path, {"raw": raw.decode()}
    if not body.get("stream"):
        return 200, path, json.loads(raw)
    ids: list[int] = []
    digests: list[str] = []
    done = False
    for event in raw.decode().split("\n\n"):
        if event == "data: [DONE]":
            done = True
        elif event.startswith("data: "):
            doc = json.loads(event[6:])
            if "error" in doc:
                return 599, path, doc
            for choice in doc.get("choices", []):
                ids += choice.get("token_ids") or []
                digests += choice.get("logits_digests") or []
    if not done:
        return 598, path, {"raw": raw.decode()}
    prompt_len = len(body["prompt"])
    return (
        200,
        path,
        {
            "choices": [{"token_ids": ids, "logits_digests": digests}],
            "usage": {"prompt_tokens": prompt_len},
        },
    )


async def _steady_load(client, url, stop: asyncio.Event, results: list, clients: int = 3) -> None:
    """``clients`` callers streaming long prompts back to back until ``stop``; each result is
    (finish time, status — 598/599 for a truncated or errored stream —, path)."""

    async def caller(i: int) -> None:
        n = 0
        while not stop.is_set():
            n += 1
            body = {"model": "tiny", "prompt": make_prompt(150, seed=i * 1000 + n),
                    "max_tokens": 6, "temperature": 0, "stream": True}  # fmt: skip
            status, path, _ = await _completion(client, url, body)
            results.append((time.monotonic(), status, path))

    await asyncio.gather(*(caller(i) for i in range(clients)))


async def _until_remote_after(results: list, since: float, timeout_s: float = 30) -> None:
    deadline = deadline_in(timeout_s)
    while time.monotonic() < deadline:
        if any(t > since and p == "remote" for t, _, p in results):
            return
        await asyncio.sleep(0.05)


@pytest.mark.parametrize("stream", [False, True])
def test_remote_local_and_fallback_outputs_are_identical(engines, stream):
    prefill, decode, spool, _ = engines
    bodies = [
        {"model": "tiny", "prompt": make_prompt(n, seed=3), "max_tokens": 10,
         "temperature": 0, "ignore_eos": True, "stream": stream}
        for n in (100, 333)
    ]  # fmt: skip

    async def scenario():
        out: dict[str, list[Any]] = {}
        for name, data in (
            ("remote", _snapshot(decode, prefill.url, spool)),
            ("local", _snapshot(decode, prefill.url, spool, kill_switch=True)),
            ("fallback", _snapshot(decode, _dead_url(), spool)),
        ):
            async with serving(data, SETTINGS) as (_, client, url):
                out[name] = [await _completion(client, url, b) for b in bodies]
        return out

    out = asyncio.run(scenario())

    for name in ("remote", "local", "fallback"):
        assert [(s, p) for s, p, _ in out[name]] == [(200, name)] * 2, out[name]
    for (_, _, local), (_, _, remote), (_, _, fallback) in zip(
        out["local"], out["remote"], out["fallback"], strict=True
    ):
        assert compare(local, remote) == (True, 10, 10, None)
        assert compare(local, fallback) == (True, 10, 10, None)


@pytest.mark.parametrize("stream", [False, True])
def test_local_prefill_pool_outputs_are_identical_to_the_decode_engines_own(engines, stream):
    """The prefill engine as the deployment's local prefill pool (at the decode site): short
    prompts are prefilled there and decoded from its KV, token- and logits-identical to the
    decode engine prefilling them itself."""
    prefill, decode, spool, _ = engines
    bodies = [
        {"model": "tiny", "prompt": make_prompt(n, seed=4), "max_tokens": 10,
         "temperature": 0, "ignore_eos": True, "stream": stream}
        for n in (20, 50)
    ]  # fmt: skip
    pooled = _snapshot(decode, prefill.url, spool)
    pooled["pools"]["prefill"][0]["site"] = "local"
    pooled["links"] = []

    async def scenario():
        out = {}
        for name, data in (("plain", _snapshot(decode, prefill.url, spool)), ("pooled", pooled)):
            async with serving(data, SETTINGS) as (running, client, url):
                out[name] = [await _completion(client, url, b) for b in bodies]
                async with client.get(url + "/metrics") as r:
                    out[name + "_metrics"] = await r.text()
                out[name + "_traces"] = [t.to_json() for t in running.gateway.traces.recent(2)]
        return out

    out = asyncio.run(scenario())

    assert [(s, p) for s, p, _ in out["plain"] + out["pooled"]] == [(200, "local")] * 4
    for (_, _, plain), (_, _, pooled_doc) in zip(out["plain"], out["pooled"], strict=True):
        assert compare(plain, pooled_doc) == (True, 10, 10, None)
    assert metric(out["pooled_metrics"], "pdbridge_gateway_local_prefill_served_total") == 2
    assert metric(out["plain_metrics"], "pdbridge_gateway_local_prefill_served_total") == 0
    assert [t["local_prefill"] for t in out["pooled_traces"]] == ["served"] * 2
    assert [t["local_prefill"] for t in out["plain_traces"]] == [None] * 2


def test_short_prompt_stays_local_with_real_engines(engines):
    prefill, decode, spool, _ = engines
    body = {"model": "tiny", "prompt": make_prompt(30), "max_tokens": 4, "temperature": 0}

    async def scenario():
        async with serving(_snapshot(decode, prefill.url, spool), SETTINGS) as (_, client, url):
            return await _completion(client, url, body)

    status, path, _ = asyncio.run(scenario())

    assert (status, path) == (200, "local")


def test_prefill_engine_restart_under_load_fails_no_request(engines, tmp_path):
    _, decode, spool, models_dir = engines
    own = start_engine(_engine_args(models_dir, "--role", "both"), tmp_path / "prefill.log")
    port = own.url.rsplit(":", 1)[1]
    data = _snapshot(decode, own.url, spool)
    results: list[tuple[float, int, str]] = []
    marks: dict[str, float] = {}

    async def scenario():
        async with serving(data, SETTINGS) as (_, client, url):
            stop = asyncio.Event()

            async def chaos() -> None:
                nonlocal own
                await asyncio.sleep(1.5)
                own.proc.kill()
                own.proc.wait()
                marks["killed"] = time.monotonic()
                await asyncio.sleep(1.5)
                own = await asyncio.to_thread(
                    start_engine,
                    _engine_args(models_dir, "--role", "both", "--port", port),
                    tmp_path / "prefill2.log",
                )
                marks["restarted"] = time.monotonic()
                await _until_remote_after(results, marks["restarted"])
                stop.set()

            await asyncio.gather(chaos(), _steady_load(client, url, stop, results))

    try:
        asyncio.run(scenario())
    finally:
        own.stop()

    assert results
    assert [r for r in results if r[1] != 200] == []
    paths_before = {p for t, _, p in results if t < marks["killed"]}
    paths_down = {p for t, _, p in results if marks["killed"] < t < marks["restarted"]}
    back = [t for t, _, p in results if t > marks["restarted"] and p == "remote"]
    assert "remote" in paths_before
    assert "fallback" in paths_down
    assert back, "traffic did not return to the remote path after the restart"
    recovery_s = back[0] - marks["restarted"]
    print(f"\nprefill restart: {len(results)} requests, 0 failed, recovery {recovery_s:.2f} s")
    assert recovery_s < 15


def test_fallback_budget_with_remote_down_gives_503_and_retry_after(engines):
    _, decode, spool, _ = engines
    settings = replace(SETTINGS, fallback_rate_per_s=1, fallback_burst=2, fallback_max_wait_s=0.3)
    body = {"model": "tiny", "prompt": make_prompt(200), "max_tokens": 3, "temperature": 0}

    async def scenario():
        async with serving(_snapshot(decode, _dead_url(), spool), settings) as (_, client, url):
            started = time.monotonic()

            async def one():
                async with client.post(url + "/v1/completions", json=body) as r:
                    return r.status, r.headers.copy(), await r.read()

            results = await asyncio.gather(*(one() for _ in range(10)))
            return results, time.monotonic() - started

    results, elapsed = asyncio.run(scenario())

    served = [r for r in results if r[0] == 200]
    refused = [r for r in results if r[0] == 503]
    assert len(served) + len(refused) == 10
    # The decode engine prefilled at most the budget: the burst plus what accrued meanwhile.
    assert 2 <= len(served) <= 2 + int(elapsed * 1) + 1
    for _, headers, raw in refused:
        assert int(headers["retry-after"]) >= 1
        assert json.loads(raw)["error"]["code"] == "fallback_budget_exhausted"
    for _, headers, _ in served:
        assert headers["x-pdbridge-path"] == "fallback"


@pytest.mark.parametrize("mode", ["blackhole", "reset"])
def test_link_cut_during_load_fails_no_request_and_traffic_returns(engines, mode):
    """The WAN path to the remote site goes through a userspace fault proxy (grpc_kv's); it is
    cut mid-traffic (``blackhole``: a dead link, legs hang until their timeout; ``reset``:
    connections torn down), then restored. With the engines' spool transport only the
    prefill leg crosses the proxy, which is the leg the gateway sees fail on a cut."""
    from grpc_kv.faultproxy import FaultProxy

    prefill, decode, spool, _ = engines
    settings = replace(SETTINGS, prefill_timeout_s=1.5)
    results: list[tuple[float, int, str]] = []
    marks: dict[str, Any] = {}

    async def scenario():
        proxy = FaultProxy(upstream=prefill.url.removeprefix("http://"))
        port = await proxy.start()
        data = _snapshot(decode, f"http://127.0.0.1:{port}", spool)
        try:
            async with serving(data, settings) as (running, client, url):
                stop = asyncio.Event()

                async def chaos() -> None:
                    await asyncio.sleep(1.5)
                    proxy.cut(mode)
                    marks["cut"] = time.monotonic()
                    await asyncio.sleep(3.0)
                    marks["breaker"] = running.gateway.router.site_breakers[
                        "remote"
                    ].total_ejections
                    proxy.restore()
                    marks["restored"] = time.monotonic()
                    await _until_remote_after(results, marks["restored"], 20)
                    stop.set()

                await asyncio.gather(chaos(), _steady_load(client, url, stop, results))
        finally:
            await proxy.stop()

    asyncio.run(scenario())

    assert [r for r in results if r[1] != 200] == []
    assert "remote" in {p for t, _, p in results if t < marks["cut"]}
    assert "fallback" in {p for t, _, p in results if marks["cut"] < t < marks["restored"]}
    assert marks["breaker"] >= 1
    back = [t for t, _, p in results if t > marks["restored"] and p == "remote"]
    assert back, "traffic did not return to the remote path after the link came back"
    print(
        f"\nlink cut ({mode}): {len(results)} requests, 0 failed, "
        f"back to remote {back[0] - marks['restored']:.2f} s after restore"
    )


def test_kill_switch_from_console_within_one_poll_in_flight_finishes(engines, tmp_path):
    from agents.gateway.app import Gateway
    from agents.gateway.poller import ConfigPoller
    from agents.gateway.server import start
    from tests.agents.gateway.console_double import ConsoleDouble

    prefill, decode, spool, _ = engines
    settings = replace(SETTINGS, state_dir=str(tmp_path))
    long_stream = {"model": "tiny", "prompt": make_prompt(200, seed=5), "max_tokens": 40,
                   "temperature": 0, "ignore_eos": True, "stream": True}  # fmt: skip

    async def scenario():
        console = await ConsoleDouble(_snapshot(decode, prefill.url, spool)).start()
        gateway = Gateway(settings)
        poller = ConfigPoller(
            console_url=console.url, deployment_id=1, token="node-token",
            interval_s=settings.poll_interval_s, state_dir=tmp_path, apply=gateway.apply,
        )  # fmt: skip
        running = await start(gateway, poller=poller)
        url = f"http://127.0.0.1:{running.port}"
        try:
            import aiohttp

            async with aiohttp.ClientSession() as client:
                in_flight = await client.post(url + "/v1/completions", json=long_stream)
                first = await in_flight.content.readany()
                console.update(kill_switch=True)
                flipped = time.monotonic()
                while gateway.router.config.version != 4:
                    await asyncio.sleep(0.01)
                applied_after = time.monotonic() - flipped
                after = await _completion(client, url, {**long_stream, "max_tokens": 2})
                rest = await in_flight.read()
                return in_flight.headers["x-pdbridge-path"], first + rest, after[:2], applied_after
        finally:
            await running.stop()
            await console.stop()

    path, stream, (status, new_path), applied_after = asyncio.run(scenario())

    assert path == "remote"
    assert stream.endswith(b"data: [DONE]\n\n")
    assert b'"error"' not in stream
    assert (status, new_path) == (200, "local")
    assert applied_after <= SETTINGS.poll_interval_s + 0.5


@pytest.mark.netns
def test_link_cut_between_namespaces_fails_no_request_and_traffic_returns(engines, tmp_path):
    """Two sites: the remote prefill engine in its own network namespace, the decode engine
    (with an embedded grpc_kv receiver) and the gateway in the root namespace, joined by a
    veth pair that carries both the prefill leg and the KV. Remote answers match local ones
    token for token; the link is set down mid-traffic and up again."""
    from tests.agents.gateway.netns import remote_site, start_engine_in

    _, _, _, models_dir = engines
    settings = replace(SETTINGS, prefill_timeout_s=1.5, connect_timeout_s=0.5)
    results: list[tuple[float, int, str]] = []
    marks: dict[str, Any] = {}
    with remote_site() as site:
        decode = start_engine(
            _engine_args(models_dir, "--role", "decode", "--host", site.local_ip, "--insecure",
                         "--kv-listen", f"{site.local_ip}:0", "--kv-insecure"),
            tmp_path / "decode.log",
        )  # fmt: skip
        # start_engine assumes loopback; this one listens on the local end of the link.
        decode.url = f"http://{site.local_ip}:{decode.ready['port']}"
        try:
            remote = start_engine_in(
                site,
                _engine_args(models_dir, "--role", "both", "--kv-insecure"),
                tmp_path / "p.log",
            )
        except BaseException:
            decode.stop()
            raise
        data = _snapshot(decode, remote.url, Path("unused"))
        data["pools"]["decode"]["nodes"][0]["kv_address"] = decode.ready["kv_listen"]
        check = {"model": "tiny", "prompt": make_prompt(300, seed=11), "max_tokens": 8,
                 "temperature": 0, "ignore_eos": True}  # fmt: skip
        try:

            async def scenario():
                async with serving(data, settings) as (_, client, url):
                    marks["remote"] = await _completion(client, url, check)
                    async with client.post(decode.url + "/v1/completions", json=check) as r:
                        marks["local"] = await r.json()
                    stop = asyncio.Event()

                    async def chaos() -> None:
                        await asyncio.sleep(1.5)
                        await asyncio.to_thread(site.cut)
                        marks["cut"] = time.monotonic()
                        await asyncio.sleep(3.0)
                        await asyncio.to_thread(site.restore)
                        marks["restored"] = time.monotonic()
                        await _until_remote_after(results, marks["restored"], 20)
                        stop.set()

                    await asyncio.gather(chaos(), _steady_load(client, url, stop, results))

            asyncio.run(scenario())
        finally:
            remote.stop()
            decode.stop()

    status, path, remote_doc = marks["remote"]
    assert (status, path) == (200, "remote")
    assert compare(marks["local"], remote_doc) == (True, 8, 8, None)
    assert [r for r in results if r[1] != 200] == []
    assert "remote" in {p for t, _, p in results if t < marks["cut"]}
    assert "fallback" in {p for t, _, p in results if marks["cut"] < t < marks["restored"]}
    back = [t for t, _, p in results if t > marks["restored"] and p == "remote"]
    assert back, "traffic did not return to the remote path after the link came back"
    print(
        f"\nlink cut (veth down, KV over grpc_kv): {len(results)} requests, 0 failed, "
        f"back to remote {back[0] - marks['restored']:.2f} s after restore"
    )

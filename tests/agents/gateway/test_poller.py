"""Config polling against a console test double: ETag polling, atomic apply, kill switch
within one poll with in-flight requests finishing, last good config on disk."""

import asyncio
import json

from tests.agents.gateway.console_double import ConsoleDouble
from tests.agents.gateway.engine_double import EngineDouble, KvStore
from tests.agents.gateway.harness import FAST, LONG, completion, gateway_env, sse_text
from tests.agents.gateway.snapshots import snapshot


def run(coro):
    return asyncio.run(coro)


async def _console_for_doubles():
    """Doubles first (their URLs go into the console's snapshot)."""
    kv = KvStore()
    decode = await EngineDouble("decode", kv).start()
    prefill = await EngineDouble("prefill", kv).start()
    console = await ConsoleDouble(
        snapshot(decode_urls=(decode.url,), prefill_sites={"remote": (prefill.url,)})
    ).start()
    return console, decode, prefill


def test_polls_with_etag_and_applies_new_versions(tmp_path):
    async def scenario():
        console, decode, prefill = await _console_for_doubles()
        try:
            async with gateway_env(console_url=console.url, state_dir=str(tmp_path)) as env:
                await asyncio.sleep(0.5)
                console.update(remote_share_percent=50)
                await asyncio.sleep(0.5)
                debug = env.gateway.router.debug()["config"]
                metrics = await env.metrics()
        finally:
            await console.stop()
            await decode.stop()
            await prefill.stop()
        return console.polls, debug, metrics

    polls, debug, metrics = run(scenario())

    assert polls[0] == (None, 200)
    assert (('"3"', 304)) in polls
    assert ('"3"', 200) in polls  # the changed snapshot, fetched with the old ETag
    assert polls[-1] == ('"4"', 304)
    assert (debug["version"], debug["remote_share_percent"]) == (4, 50)
    assert "pdbridge_gateway_config_version 4.0" in metrics
    assert 'pdbridge_gateway_config_polls_total{result="unchanged"}' in metrics


def test_kill_switch_applies_within_one_poll_and_in_flight_stream_finishes(tmp_path):
    async def scenario():
        console, decode, prefill = await _console_for_doubles()
        decode.token_delay_s = 0.05
        try:
            async with gateway_env(console_url=console.url, state_dir=str(tmp_path)) as env:
                body = completion(LONG, stream=True, max_tokens=30)
                in_flight = await env.client.post(env.url + "/v1/completions", json=body)
                first = await in_flight.content.readany()
                console.update(kill_switch=True)
                await asyncio.sleep(FAST.poll_interval_s * 1.5)
                _, after, _ = await env.post(completion(LONG))
                rest = await in_flight.read()
                result = (
                    in_flight.headers["x-pdbridge-path"],
                    after["x-pdbridge-path"],
                    first + rest,
                )
                in_flight.close()
        finally:
            await console.stop()
            await decode.stop()
            await prefill.stop()
        return result

    in_flight_path, new_path, stream = run(scenario())

    assert in_flight_path == "remote"
    assert new_path == "local"
    assert stream.endswith(b"data: [DONE]\n\n")
    assert len(sse_text(stream).split()) == 30


def test_invalid_snapshot_is_not_applied(tmp_path):
    async def scenario():
        console, decode, prefill = await _console_for_doubles()
        try:
            async with gateway_env(console_url=console.url, state_dir=str(tmp_path)) as env:
                console.snapshot["routing"]["remote_share_percent"] = 400
                console.snapshot["version"] += 1
                await asyncio.sleep(0.5)
                status, _, _ = await env.post(completion("hi"))
                version = env.gateway.router.config.version
                metrics = await env.metrics()
        finally:
            await console.stop()
            await decode.stop()
            await prefill.stop()
        return status, version, metrics

    status, version, metrics = run(scenario())

    assert status == 200
    assert version == 3
    assert 'pdbridge_gateway_config_polls_total{result="invalid"}' in metrics


def test_console_down_keeps_serving_and_restart_uses_last_good_copy(tmp_path):
    async def scenario():
        console, decode, prefill = await _console_for_doubles()
        try:
            async with gateway_env(console_url=console.url, state_dir=str(tmp_path)) as env:
                console.fail_status = 502
                await asyncio.sleep(0.5)
                still = await env.post(completion("hi"))
            saved = json.loads((tmp_path / "deployment-1.json").read_text())
            url = console.url
            await console.stop()
            # A new gateway process: the console is unreachable now.
            async with gateway_env(console_url=url, state_dir=str(tmp_path)) as env:
                async with env.client.get(env.url + "/health") as r:
                    health = await r.json()
                restarted = await env.post(completion("hi"))
        finally:
            await decode.stop()
            await prefill.stop()
        return still[0], saved, health, restarted[0]

    still, saved, health, restarted = run(scenario())

    assert still == 200
    assert saved["etag"] == '"3"'
    assert saved["snapshot"]["version"] == 3
    assert (health["status"], health["config_version"]) == ("ok", 3)
    assert restarted == 200


def test_no_console_and_no_last_good_answers_503(tmp_path):
    async def scenario():
        async with gateway_env(console_url="http://127.0.0.1:9", state_dir=str(tmp_path)) as env:
            async with env.client.get(env.url + "/health") as r:
                health = r.status
            return health, await env.post(completion("hi"))

    health, (status, _, body) = run(scenario())

    assert health == 503
    assert status == 503
    assert json.loads(body)["error"]["type"] == "service_unavailable"


def test_bad_token_is_an_error_result_not_a_crash(tmp_path):
    async def scenario():
        console, decode, prefill = await _console_for_doubles()
        console.token = "other"
        try:
            async with gateway_env(console_url=console.url, state_dir=str(tmp_path)) as env:
                return await env.metrics()
        finally:
            await console.stop()
            await decode.stop()
            await prefill.stop()

    metrics = run(scenario())

    assert 'pdbridge_gateway_config_polls_total{result="error"} 1.0' in metrics

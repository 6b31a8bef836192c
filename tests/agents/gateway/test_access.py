"""Client API keys at the gateway (a real gateway on loopback, engine and console test doubles):
401 in OpenAI's shape without a valid key, on both servers; the key's name in the request's
log lines and metrics; a key revoked at the console refused after the next poll; keys from the
environment and a secret file (re-read when it changes); the engines' own key sent on both
legs and the client's never forwarded."""

from __future__ import annotations

import asyncio
import dataclasses
import io
import json
import logging
import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from agents.gateway.access import (
    AccessPoller,
    ClientKeys,
    KeysFile,
    engine_api_key,
    key_hash,
    parse_key_lines,
)
from agents.gateway.app import Gateway
from agents.gateway.config import ConfigError
from agents.gateway.logs import JsonFormatter
from agents.gateway.poller import ConfigPoller
from agents.gateway.server import start
from tests.agents.gateway.console_double import ConsoleDouble
from tests.agents.gateway.engine_double import EngineDouble, KvStore
from tests.agents.gateway.harness import FAST, LONG, completion, gateway_env
from tests.agents.gateway.snapshots import snapshot
from tests.support import deadline_in

KEY_A = "pdbk_alpha-0123456789abcdefghijklmnopqrstuv"  # test keys, not secrets
KEY_B = "pdbk_bravo-0123456789abcdefghijklmnopqrstuv"
KEYS = {key_hash(KEY_A): "team-a", key_hash(KEY_B): "team-b"}

INVALID_KEY = {
    "error": {
        "message": "Incorrect API key provided.",
        "type": "invalid_request_error",
        "param": None,
        "code": "invalid_api_key",
    }
}


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def until(check: Callable[[], bool], timeout_s: float = 10.0) -> None:
    """Wait for ``check()`` to be true, within a generous deadline."""
    deadline = deadline_in(timeout_s)
    while time.monotonic() < deadline:
        if check():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("condition not met within the deadline")


@contextmanager
def gateway_log_lines() -> Iterator[io.StringIO]:
    """The gateway's log lines (JSON, as the CLI writes them) at DEBUG while inside."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger("pdbridge.gateway")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield stream
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


@pytest.mark.parametrize("fast_server", [True, False], ids=["fast_path", "aiohttp"])
def test_a_request_without_a_valid_key_gets_401_in_openai_shape(fast_server):
    settings = dataclasses.replace(FAST, require_client_keys=True, fast_server=fast_server)

    async def scenario():
        async with gateway_env(settings) as env:
            env.gateway.keys.set_console(required=False, keys=KEYS)
            missing = await env.post(completion())
            wrong = await env.post(completion(), **bearer("pdbk_not-a-key"))
            basic = await env.post(completion(), Authorization="Basic dGVhbS1hOmtleQ==")
            chat = await env.post(
                {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]},
                "/v1/chat/completions",
                **bearer("wrong"),
            )
            async with env.client.get(env.url + "/v1/models") as r:
                models = r.status, await r.json()
            async with env.client.get(env.url + "/health") as r:
                health = r.status
            metrics = await env.metrics()
            engine_requests = len(env.decode.requests) + len(env.prefill.requests)
        return missing, wrong, basic, chat, models, health, metrics, engine_requests

    missing, wrong, basic, chat, models, health, metrics, engine_requests = run(scenario())

    status, headers, body = missing
    assert status == 401
    assert headers["WWW-Authenticate"] == "Bearer"
    assert json.loads(body)["error"]["code"] == "invalid_api_key"
    assert json.loads(body)["error"]["type"] == "invalid_request_error"
    assert json.loads(body)["error"]["param"] is None
    assert json.loads(body)["error"]["message"].startswith("You didn't provide an API key.")
    assert (wrong[0], json.loads(wrong[2])) == (401, INVALID_KEY)
    assert (basic[0], json.loads(basic[2])) == (401, INVALID_KEY)
    assert (chat[0], json.loads(chat[2])) == (401, INVALID_KEY)
    assert (models[0], models[1]["error"]["code"]) == (401, "invalid_api_key")
    assert health == 200  # health and metrics stay open
    assert 'pdbridge_gateway_client_key_refusals_total{reason="missing"} 2.0' in metrics
    assert 'pdbridge_gateway_client_key_refusals_total{reason="invalid"} 3.0' in metrics
    assert engine_requests == 0


def test_a_valid_key_is_served_and_named_in_logs_and_metrics():
    settings = dataclasses.replace(FAST, require_client_keys=True)

    async def scenario():
        with gateway_log_lines() as lines:
            async with gateway_env(settings) as env:
                env.gateway.keys.set_console(required=False, keys=KEYS)
                local = await env.post(completion(), **bearer(KEY_A))
                remote = await env.post(completion(LONG), **bearer(KEY_A))
                other = await env.post(completion(), **bearer(KEY_B), **{"x-request-id": "r-b"})
                metrics = await env.metrics()
                decode_auth = [h.get("Authorization") for h in env.decode.headers]
                prefill_auth = [h.get("Authorization") for h in env.prefill.headers]
        return local, remote, other, metrics, lines.getvalue(), decode_auth, prefill_auth

    local, remote, other, metrics, logs, decode_auth, prefill_auth = run(scenario())

    assert [local[0], remote[0], other[0]] == [200, 200, 200]
    assert remote[1]["x-pdbridge-path"] == "remote"
    assert 'pdbridge_gateway_client_requests_total{key="team-a"} 2.0' in metrics
    assert 'pdbridge_gateway_client_requests_total{key="team-b"} 1.0' in metrics
    done = [json.loads(line) for line in logs.splitlines() if "gateway.request_done" in line]
    assert [(d["client_key"], d["outcome"]) for d in done] == [
        ("team-a", "ok"),
        ("team-a", "ok"),
        ("team-b", "ok"),
    ]
    assert done[2]["request_id"] == "r-b"
    assert KEY_A not in logs
    assert KEY_B not in logs
    # The client's Authorization never reaches an engine (no engine key is configured).
    assert decode_auth == [None, None, None]
    assert prefill_auth == [None]


def test_without_keys_required_every_request_is_served_and_counted():
    async def scenario():
        async with gateway_env() as env:
            env.gateway.keys.set_console(required=False, keys=KEYS)
            plain = await env.post(completion())
            placeholder = await env.post(completion(), **bearer("EMPTY"))  # vLLM's habit
            named = await env.post(completion(), **bearer(KEY_B))
            return plain[0], placeholder[0], named[0], await env.metrics()

    plain, placeholder, named, metrics = run(scenario())

    assert (plain, placeholder, named) == (200, 200, 200)
    assert 'pdbridge_gateway_client_requests_total{key="anonymous"} 2.0' in metrics
    assert 'pdbridge_gateway_client_requests_total{key="team-b"} 1.0' in metrics


def test_a_revoked_key_is_refused_after_the_next_poll(tmp_path):
    async def scenario():
        kv = KvStore()
        decode = await EngineDouble("decode", kv).start()
        prefill = await EngineDouble("prefill", kv).start()
        console = ConsoleDouble(
            snapshot(decode_urls=(decode.url,), prefill_sites={"remote": (prefill.url,)})
        )
        console.access = {
            "deployment": 1,
            "require_client_keys": True,
            "keys": [
                {"name": "team-a", "sha256": key_hash(KEY_A), "prefix": KEY_A[:12]},
                {"name": "team-b", "sha256": key_hash(KEY_B), "prefix": KEY_B[:12]},
            ],
        }
        await console.start()
        gateway = Gateway(dataclasses.replace(FAST, state_dir=str(tmp_path)))
        common = {
            "console_url": console.url,
            "deployment_id": 1,
            "token": "node-token",
            "interval_s": FAST.poll_interval_s,
            "state_dir": tmp_path,
        }
        poller = ConfigPoller(**common, apply=gateway.apply)
        access = AccessPoller(**common, keys=gateway.keys)
        running = await start(gateway, poller=poller, access=access)
        url = f"http://127.0.0.1:{running.port}/v1/completions"
        client = aiohttp.ClientSession()

        async def status(key: str | None) -> int:
            async with client.post(url, json=completion(), headers=bearer(key) if key else {}) as r:
                await r.read()
                return r.status

        try:
            before = (await status(KEY_A), await status(KEY_B), await status(None))
            console.access["keys"] = console.access["keys"][1:]  # team-a revoked
            polls_at_revoke = len(console.access_polls)
            # The next full poll after the change (a poll may have been in flight).
            await until(lambda: len(console.access_polls) > polls_at_revoke + 1)
            after = (await status(KEY_A), await status(KEY_B))
        finally:
            await client.close()
            await running.stop()
            await console.stop()
            await decode.stop()
            await prefill.stop()
        saved = json.loads((tmp_path / "gateway-access-1.json").read_text())
        return before, after, console.access_polls, saved

    before, after, polls, saved = run(scenario())

    assert before == (200, 200, 401)
    assert after == (401, 200)
    assert polls[0] == (None, 200)
    assert any(status == 304 for _, status in polls)  # unchanged polls cost a 304
    # The last good key set on disk holds hashes and names only.
    assert [k["name"] for k in saved["keys"]] == ["team-b"]
    assert KEY_B not in json.dumps(saved)


def test_console_failures_keep_the_keys_in_place(tmp_path):
    """An unreachable console or an invalid document never loosens the check; at start the
    last good key set from disk applies."""

    async def scenario():
        console = ConsoleDouble(snapshot())
        console.access = {"require_client_keys": True, "keys": []}
        await console.start()
        keys = ClientKeys()
        access = AccessPoller(
            console_url=console.url, deployment_id=1, token="node-token", interval_s=1,
            state_dir=tmp_path, keys=keys,
        )  # fmt: skip
        async with aiohttp.ClientSession() as session:
            first = await access.poll_once(session)
            console.access = {"require_client_keys": "yes"}
            invalid = await access.poll_once(session)
            console.fail_status = None
            console.access = None
            gone = await access.poll_once(session)
            required_after_errors = keys.required
            await console.stop()
            restarted = ClientKeys()
            fresh = AccessPoller(
                console_url=console.url, deployment_id=1, token="node-token", interval_s=1,
                state_dir=tmp_path, keys=restarted,
            )  # fmt: skip
            from_disk = await fresh.start(session)
        return first, invalid, gone, required_after_errors, from_disk, restarted.required

    first, invalid, gone, required_after_errors, from_disk, restarted = run(scenario())

    assert (first, invalid, gone) == ("applied", "invalid", "error")
    assert required_after_errors is True
    assert (from_disk, restarted) == (True, True)


def test_keys_from_the_environment_and_a_secret_file_reloaded_on_change(tmp_path):
    keys_file = tmp_path / "client-keys"
    keys_file.write_text(f"# gateway client keys\nteam-a:{key_hash(KEY_A)}\n")
    environ = {
        "PDBRIDGE_GATEWAY_CLIENT_KEYS": f"ops:{key_hash(KEY_B)}",
        "PDBRIDGE_GATEWAY_CLIENT_KEYS_FILE": str(keys_file),
    }
    keys = ClientKeys.from_environ(environ, require=True)

    assert keys.admit(f"Bearer {KEY_A}") == "team-a"
    assert keys.admit(f"bearer  {KEY_B} ") == "ops"

    keys_file.write_text(f"team-c:{key_hash(KEY_A)}\n\n")  # rotated: same key, new name
    os.utime(keys_file, (time.time() + 5, time.time() + 5))

    assert keys.reload_file() is True
    assert keys.admit(f"Bearer {KEY_A}") == "team-c"
    assert keys.reload_file() is False  # unchanged since


def test_bad_key_sources_are_refused_by_name(tmp_path):
    with pytest.raises(ConfigError, match="PDBRIDGE_GATEWAY_CLIENT_KEYS: item 1: expected"):
        ClientKeys.from_environ({"PDBRIDGE_GATEWAY_CLIENT_KEYS": f"a:{KEY_A}"}, require=True)
    with pytest.raises(ConfigError, match="item 2: the name must be"):
        parse_key_lines(f"a:{key_hash(KEY_A)}\nbad name:{key_hash(KEY_B)}", "f")
    with pytest.raises(ConfigError, match=r"PDBRIDGE_GATEWAY_CLIENT_KEYS_FILE: .*missing"):
        KeysFile(tmp_path / "missing").load()
    with pytest.raises(ConfigError, match="set one, not both"):
        engine_api_key({"PDBRIDGE_ENGINE_API_KEY": "a", "PDBRIDGE_ENGINE_API_KEY_FILE": "/x"})
    with pytest.raises(ConfigError, match="PDBRIDGE_ENGINE_API_KEY: must be one non-empty"):
        engine_api_key({"PDBRIDGE_ENGINE_API_KEY": "a\r\nX-Injected: 1"})


def test_the_engine_key_comes_from_the_environment_or_a_file(tmp_path):
    secret = tmp_path / "engine-key"
    secret.write_text("engine-secret-1\n")

    assert engine_api_key({}) is None
    assert engine_api_key({"PDBRIDGE_ENGINE_API_KEY": "engine-secret-0"}) == "engine-secret-0"
    assert engine_api_key({"PDBRIDGE_ENGINE_API_KEY_FILE": str(secret)}) == "engine-secret-1"


def test_the_engine_key_goes_upstream_on_both_legs_and_the_clients_does_not():
    async def scenario():
        async with gateway_env() as env:
            env.gateway.upstream = type(env.gateway.upstream)(
                FAST.connect_timeout_s, None, "engine-secret"
            )
            remote = await env.post(completion(LONG, stream=True), **bearer(KEY_A))
            local = await env.post(completion(), **bearer(KEY_A))
            await env.gateway.upstream.close()
            return remote, local, env.prefill.headers, env.decode.headers

    remote, local, prefill_headers, decode_headers = run(scenario())

    assert (remote[0], remote[1]["x-pdbridge-path"]) == (200, "remote")
    assert (local[0], local[1]["x-pdbridge-path"]) == (200, "local")
    assert [h.getall("Authorization") for h in prefill_headers] == [["Bearer engine-secret"]]
    assert [h.getall("Authorization") for h in decode_headers] == [
        ["Bearer engine-secret"],
        ["Bearer engine-secret"],
    ]


def test_state_file_name_is_per_deployment(tmp_path: Path):
    access = AccessPoller(
        console_url="http://console.invalid/", deployment_id=7, token=None, interval_s=1,
        state_dir=tmp_path, keys=ClientKeys(),
    )  # fmt: skip

    assert access.url == "http://console.invalid/api/deployments/7/gateway-access/"
    assert access.state_path == tmp_path / "gateway-access-7.json"

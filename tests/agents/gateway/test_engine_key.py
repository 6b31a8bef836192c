"""An engine started with an API key (the reference engine, as vLLM's ``--api-key``) served
through the gateway: the engine refuses a request without its key; a gateway that has the
key (``PDBRIDGE_ENGINE_API_KEY``) is served, one without it answers 502 (the engine's 401 is
the gateway's misconfiguration, never relayed as the client's); the client's own key is not
what reaches the engine."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import subprocess
import sys

import aiohttp
import pytest

from agents.gateway.access import ClientKeys, key_hash
from agents.gateway.app import Gateway
from agents.gateway.config import parse_snapshot
from agents.gateway.server import start
from tests.agents.engines.conftest import start_engine
from tests.agents.gateway.harness import FAST
from tests.agents.gateway.snapshots import snapshot
from tests.support import subprocess_env

pytestmark = pytest.mark.slow

MODEL = "dense"
ENGINE_KEY = "engine-key-for-tests-0123456789"  # a test key, not a secret
CLIENT_KEY = "pdbk_client-key-for-tests-0123456789"


@pytest.fixture(scope="module")
def keyed_engine(tmp_path_factory: pytest.TempPathFactory):
    """A reference engine (role both) started with ``--api-key``."""
    models_dir = tmp_path_factory.mktemp("models")
    logs = tmp_path_factory.mktemp("logs")
    subprocess.run(
        [sys.executable, "-m", "pdbridge.cli", "engine", "build", MODEL, "--models-dir", str(models_dir)],
        check=True, env=subprocess_env(), capture_output=True, timeout=180,
    )  # fmt: skip
    engine = start_engine(
        [
            "--model", f"tiny={MODEL}", "--models-dir", str(models_dir), "--threads", "1",
            "--api-key", ENGINE_KEY,
        ],
        logs / "engine.log",
    )  # fmt: skip
    yield engine
    engine.stop()


BODY = {"model": "tiny", "prompt": "hello there", "max_tokens": 4, "temperature": 0}


async def _through_gateway(engine_url: str, engine_key: str | None) -> list[tuple[int, dict]]:
    data = snapshot(
        decode_urls=(engine_url,), prefill_sites={}, remote_prefill_threshold_tokens=10**6
    )
    data["model"]["engine_settings"] = {}
    keys = ClientKeys(require=True, local={key_hash(CLIENT_KEY): "tests"})
    settings = dataclasses.replace(FAST, chars_per_token=1.0)
    gateway = Gateway(settings, keys=keys, engine_api_key=engine_key)
    gateway.apply(parse_snapshot(data))
    running = await start(gateway)
    url = f"http://127.0.0.1:{running.port}"
    out = []
    try:
        async with aiohttp.ClientSession() as client:
            for body in (BODY, {**BODY, "stream": True}):
                headers = {"Authorization": f"Bearer {CLIENT_KEY}"}
                async with client.post(url + "/v1/completions", json=body, headers=headers) as r:
                    raw = await r.read()
                    doc = json.loads(raw) if not body.get("stream") or r.status != 200 else {}
                    out.append((r.status, doc, raw))
    finally:
        await running.stop()
    return out


def test_the_engine_refuses_requests_without_its_key(keyed_engine):
    async def scenario():
        async with aiohttp.ClientSession() as client:
            async with client.post(keyed_engine.url + "/v1/completions", json=BODY) as r:
                without = r.status, await r.json()
            wrong = {"Authorization": f"Bearer {CLIENT_KEY}"}
            async with client.post(
                keyed_engine.url + "/v1/completions", json=BODY, headers=wrong
            ) as r:
                with_client_key = r.status
            async with client.get(keyed_engine.url + "/health") as r:
                health = r.status
            async with client.get(keyed_engine.url + "/metrics") as r:
                metrics = r.status
        return without, with_client_key, health, metrics

    without, with_client_key, health, metrics = asyncio.run(scenario())

    assert without == (401, {"error": "Unauthorized"})
    assert with_client_key == 401
    assert (health, metrics) == (200, 200)  # probes and scrapers need no key, as in vLLM


def test_an_engine_started_with_an_api_key_is_served_through_the_gateway(keyed_engine):
    results = asyncio.run(_through_gateway(keyed_engine.url, ENGINE_KEY))

    (status, doc, _), (stream_status, _, raw) = results
    assert status == 200
    assert len(doc["choices"][0]["token_ids"]) == 4
    assert stream_status == 200
    assert raw.rstrip().endswith(b"data: [DONE]")


def test_a_gateway_without_the_engine_key_gets_refused_and_says_so(keyed_engine):
    results = asyncio.run(_through_gateway(keyed_engine.url, None))

    for status, doc, _ in results[:1]:
        assert status == 502
        assert doc["error"]["code"] == "upstream_error"
        assert doc["error"]["message"] == "the decode engine failed: status 401"
    assert results[1][0] == 502

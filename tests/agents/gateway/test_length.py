"""Prompt length against the model's context, through a real gateway and engine doubles on
loopback: a prompt the gateway can count exactly and that does not fit is refused with a 400
naming the client's numbers before any leg; a prompt the engine refuses gives the link's
utilisation back, so it does not switch the remote path off for the requests that follow."""

import asyncio
import json

from agents.gateway.length import capped, context_error, needs_count
from tests.agents.gateway.engine_double import EngineDouble, KvStore
from tests.agents.gateway.harness import FAST, LONG, completion, gateway_env, serving
from tests.agents.gateway.snapshots import snapshot


def run(coro):
    return asyncio.run(coro)


def test_a_text_prompt_estimated_over_the_context_is_counted_and_refused_before_any_leg():
    async def scenario():
        async with gateway_env() as env:
            answer = await env.post(completion("w " * 20000))
            return answer, env.decode.requests, env.prefill.requests, await env.metrics()

    (status, headers, body), decode_legs, prefill_legs, metrics = run(scenario())

    assert status == 400
    assert "x-pdbridge-path" not in headers
    assert json.loads(body)["error"] == {
        "message": "the prompt is 20000 tokens and max_tokens asks for 5 more: 20005 tokens, "
        "over this model's context of 8192 tokens",
        "type": "invalid_request_error",
        "param": "prompt",
        "code": "context_length_exceeded",
    }
    assert (decode_legs, prefill_legs) == ([], [])
    assert 'pdbridge_gateway_requests_total{outcome="client_error",path="local"} 1.0' in metrics


def test_token_ids_that_leave_no_room_for_max_tokens_are_refused():
    async def scenario():
        async with gateway_env() as env:
            fits = await env.post({"model": "tiny", "prompt": [1] * 8187, "max_tokens": 5})
            over = await env.post({"model": "tiny", "prompt": [1] * 8190, "max_tokens": 5})
            return fits[0], over, env.prefill.requests

    fits, (status, _, body), prefill_legs = run(scenario())

    assert fits == 200
    assert status == 400
    assert "8195 tokens, over this model's context of 8192" in json.loads(body)["error"]["message"]
    assert len(prefill_legs) == 1  # only the prompt that fits went remote


def test_a_prompt_the_engine_refuses_gives_its_link_share_back():
    async def scenario():
        kv = KvStore()
        decode = await EngineDouble("decode", kv).start()
        prefill = await EngineDouble("prefill", kv).start()
        data = snapshot(decode_urls=(decode.url,), prefill_sites={"remote": (prefill.url,)})
        # 2 Mbit/s at a 0.7 ceiling: 7,750 tokens x 140 B in the 5 s window would be 0.87.
        data["links"][0]["provisioned_mbit_s"] = 2
        try:
            async with serving(data, FAST) as (running, client, url):
                # Estimated at 7,750 tokens (under the context), refused by the prefill engine.
                async with client.post(url + "/v1/completions", json=completion("w" * 31000)) as r:
                    refused = (r.status, r.headers["x-pdbridge-path"])
                utilization = running.gateway.router.debug()["sites"][0]["link_utilization"]
                async with client.post(url + "/v1/completions", json=completion(LONG)) as r:
                    after = (r.status, r.headers["x-pdbridge-path"])
        finally:
            await decode.stop()
            await prefill.stop()
        return refused, utilization, after

    refused, utilization, after = run(scenario())

    assert refused == (400, "remote")
    assert utilization == 0.0
    assert after == (200, "remote")


def test_length_rules():
    assert needs_count(10_000, 5, 100, 8192, tokenize_near_threshold=False)
    assert not needs_count(8000, 5, 100, 8192, tokenize_near_threshold=False)
    assert needs_count(120, None, 100, 8192, tokenize_near_threshold=True)
    assert not needs_count(10_000, None, 100, None, tokenize_near_threshold=False)
    assert capped(50_000, 8192) == 8192
    assert capped(50_000, None) == 50_000
    assert context_error("chat", 8192, None, 8192) is not None
    assert context_error("chat", 8191, None, 8192) is None
    error = context_error("chat", 9000, None, 8192)
    assert error is not None
    assert (error.param, error.message) == (
        "messages",
        "the prompt is 9000 tokens; this model's context is 8192 tokens, which leaves no room "
        "for any output",
    )

"""The gateway's background loops: engine-metrics scraping and threshold re-tuning."""

import asyncio
from dataclasses import replace

from agents.gateway.server import parse_queue_depth
from tests.agents.gateway.harness import FAST, LONG, completion, gateway_env


def test_parse_queue_depth_sums_samples_and_ignores_lookalikes():
    text = (
        "# HELP vllm:num_requests_waiting waiting\n"
        "# TYPE vllm:num_requests_waiting gauge\n"
        'vllm:num_requests_waiting{model_name="a",engine="0"} 3.0\n'
        'vllm:num_requests_waiting{model_name="b",engine="0"} 2\n'
        "vllm:num_requests_waiting_total 100\n"
        "vllm:num_requests_running 7\n"
    )

    assert parse_queue_depth(text) == 5.0
    assert parse_queue_depth("vllm:num_requests_running 1\n") is None


def test_scraped_queue_raises_threshold_then_it_comes_back_down():
    settings = replace(FAST, scrape_interval_s=0.05, retune_interval_s=0.05, queue_high_water=4)

    async def settle(env, factor):
        """The debug document once the factor reached ``factor`` (or after 10 s)."""
        for _ in range(200):
            async with env.client.get(env.url + "/debug/routing") as r:
                doc = await r.json()
            if doc["threshold_factor"] == factor:
                break
            await asyncio.sleep(0.05)
        return doc

    async def scenario():
        async with gateway_env(settings) as env:
            env.prefill.waiting = 10
            raised = await settle(env, 4.0)
            pressured = (await env.post(completion("x" * 500)))[1]["x-pdbridge-path"]
            env.prefill.waiting = 0
            relaxed = await settle(env, 1.0)
            after = (await env.post(completion(LONG)))[1]["x-pdbridge-path"]
            return raised, pressured, relaxed, after, await env.metrics()

    raised, pressured, relaxed, after, metrics = asyncio.run(scenario())

    assert raised["sites"][0]["queue_depth"] == 10
    assert raised["threshold_factor"] == 4.0  # the cap (retune_max_factor)
    assert raised["effective_threshold_tokens"] == 400
    assert pressured == "local"  # 125 tokens: remote at 100, not at 400
    assert relaxed["threshold_factor"] == 1.0
    assert after == "remote"
    assert 'pdbridge_gateway_threshold_changes_total{direction="up"}' in metrics
    assert 'pdbridge_gateway_threshold_changes_total{direction="down"}' in metrics

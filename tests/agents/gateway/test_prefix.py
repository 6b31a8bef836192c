import asyncio
from dataclasses import replace

from agents.gateway.prefix import PrefixIndex
from tests.agents.gateway.harness import FAST, LONG, completion, gateway_env


def test_counts_leading_blocks_seen_before():
    index = PrefixIndex(block=4, capacity=100)
    index.remember("abcdefghij")  # blocks abcd, efgh (ij incomplete)

    assert index.cached_units("abcdefghXYZW") == 8
    assert index.cached_units("abcdXXXXefgh") == 4  # chained: efgh after XXXX is new
    assert index.cached_units("Xbcdefgh") == 0
    assert index.cached_units("abc") == 0


def test_token_id_prompts():
    index = PrefixIndex(block=2, capacity=100)
    index.remember([1, 2, 3, 4, 5])

    assert index.cached_units([1, 2, 3, 4, 9, 9]) == 4
    assert index.cached_units([2, 1]) == 0


def test_capacity_evicts_least_recent():
    index = PrefixIndex(block=1, capacity=3)
    index.remember("abc")
    index.cached_units("a")  # touches a
    index.remember("xy")  # chain keys of x, xy: evicts the two oldest (ab, abc chain keys)

    assert index.cached_units("a") == 1
    assert index.cached_units("ab") == 1


def test_repeated_long_prompt_routes_on_uncached_remainder():
    settings = replace(FAST, prefix_cache_estimate=True)

    async def scenario():
        async with gateway_env(settings) as env:
            first = await env.post(completion(LONG))
            again = await env.post(completion(LONG + "and a short new question"))
            other = await env.post(completion("other " * 200))
            return [r[1]["x-pdbridge-path"] for r in (first, again, other)], await env.metrics()

    paths, metrics = asyncio.run(scenario())

    assert paths == ["remote", "local", "remote"]
    assert 'pdbridge_gateway_decisions_total{path="local",reason="below_threshold"} 1.0' in metrics


def test_estimate_off_by_default():
    async def scenario():
        async with gateway_env() as env:
            await env.post(completion(LONG))
            return (await env.post(completion(LONG)))[1]["x-pdbridge-path"]

    assert asyncio.run(scenario()) == "remote"

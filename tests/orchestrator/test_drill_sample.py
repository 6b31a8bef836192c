"""The drill's verification sample against a real gateway (in-process, engine test doubles on
loopback) whose re-tuner has raised its threshold to 4x the configured one: the sample is sized
from the threshold the gateway applies when it is sent, so it still goes remote; a sample of
twice the configured threshold (the earlier sizing) goes local and proves nothing."""

from __future__ import annotations

import asyncio
import dataclasses

from orchestrator.workflows import drill
from tests.agents.gateway.harness import FAST, gateway_env

SETTINGS = dataclasses.replace(
    FAST, scrape_interval_s=0.05, retune_interval_s=0.05, chars_per_token=1.0
)


def test_a_sample_is_sized_above_the_threshold_the_gateway_applies_now():
    async def scenario():
        async with gateway_env(SETTINGS) as env:
            env.prefill.waiting = 100  # the remote site's queue: pressure raises the threshold
            async with asyncio.timeout(60):
                while env.gateway.router.tuner.effective(100) < 400:
                    await asyncio.sleep(0.05)
            p = {
                "gateway_url": env.url,
                "decode_url": env.decode.url,
                "model": "tiny",
                "sample": {"chars_per_token": 1, "max_model_len": 8192},
            }
            sized = await asyncio.to_thread(drill.verification_sample, p, 200, 1)
            old = await asyncio.to_thread(drill._sample, p, 200, 2)
            return sized, old

    sized, old = asyncio.run(scenario())

    assert sized["threshold"] == 400
    assert sized["length"] == 400 * 5 // 4 + 16
    assert sized["path"] == "remote"
    assert old["path"] == "local"


def test_sample_length_keeps_the_margin_within_the_context_and_never_shrinks():
    p = {"sample": {"chars_per_token": 4.0, "max_model_len": 1024}}

    assert drill.sample_length(p, 100, None) == 100
    assert drill.sample_length(p, 100, 256.0) == (320 + 16) * 4
    assert drill.sample_length(p, 100, 4096.0) == (1024 - 16) * 4
    assert drill.sample_length(p, 9000, 256.0) == 9000
    # Lengths an operator chose are sent as given.
    assert drill.sample_length({"sample": None}, 100, 256.0) == 100


def test_a_verdict_that_fails_says_why_in_words():
    from orchestrator.workflows.drill_figures import verification_verdict

    local = {"length": 200, "path": "local", "match": True, "threshold": 256.0}
    during = {"length": 200, "path": "local", "match": True, "threshold": 256.0}

    verdict = verification_verdict([local], during)

    assert verdict["ok"] is False
    assert verdict["reason"] == (
        "no verification sample went remote (200 chars local; the gateway's threshold then: "
        "256 tokens): the remote path was not verified; the sample sent during the fault was "
        "served local, not by the fallback (the gateway's threshold then: 256 tokens)"
    )

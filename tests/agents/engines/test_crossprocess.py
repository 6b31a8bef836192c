"""Prefill in one engine process, decode in another from the shipped cache: per-step logits and
greedy tokens must be bit-identical to a local run, for every zoo architecture in fp32 and
bf16, at lengths below and above the sliding window (32) and not multiples of the chunk (64)."""

from __future__ import annotations

import uuid

import pytest

from agents.engines.verify import compare, make_prompt
from tests.agents.engines.client import decode_leg, post, prefill_leg
from tests.agents.engines.conftest import ARCHS

LENGTHS = (20, 100, 333)
MODELS = [*ARCHS, *(f"{a}-bf16" for a in ARCHS)]


@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("model", MODELS)
def test_remote_prefill_matches_local_run_bit_for_bit(engine_pair, spool, model, length):
    prefill, decode = engine_pair
    body = {
        "model": model,
        "prompt": make_prompt(length, seed=7),
        "max_tokens": 12,
        "temperature": 0,
        "ignore_eos": True,
    }
    tid = f"t-{uuid.uuid4().hex}"

    s1, _, pre = prefill_leg(prefill.url, body, tid, f"spool:{spool}")
    s2, headers, remote = decode_leg(decode.url, body, tid, 60)
    s3, _, local = post(f"{decode.url}/v1/completions", body)
    s4, _, local_other = post(f"{prefill.url}/v1/completions", body)

    assert (s1, s2, s3, s4) == (200, 200, 200, 200)
    assert local["usage"]["prompt_tokens"] == length
    assert headers["x-pdbridge-path"] == "remote"
    assert pre["kv_transfer_params"]["transfer_id"] == tid
    assert pre["choices"][0]["token_ids"] == local["choices"][0]["token_ids"][:1]
    assert compare(local, remote) == (True, 12, 12, None)
    assert compare(local, local_other) == (True, 12, 12, None)


def test_local_reference_must_use_the_same_chunk_boundaries(engine_pair, spool):
    """Why verification pins the local run's chunking: other boundaries change the logits."""
    prefill, decode = engine_pair
    body = {
        "model": "qwen3-next",
        "prompt": make_prompt(333, seed=2),
        "max_tokens": 6,
        "temperature": 0,
        "ignore_eos": True,
    }
    tid = f"t-{uuid.uuid4().hex}"
    prefill_leg(prefill.url, body, tid, f"spool:{spool}")
    _, _, remote = decode_leg(decode.url, body, tid, 60)

    _, _, same = post(f"{decode.url}/v1/completions", {**body, "chunked_prefill_tokens": 64})
    _, _, other = post(f"{decode.url}/v1/completions", {**body, "chunked_prefill_tokens": 100})

    assert same["pdbridge"]["chunked_prefill_tokens"] == 64
    assert compare(same, remote) == (True, 6, 6, None)
    assert compare(other, remote)[0] is False

"""pdbridge's connector on hybrid models between two real vLLM processes: Gemma-3 (five
sliding-window layers of 64 tokens and one full-attention layer: only the blocks inside the
window travel) and Qwen3-Next (three Gated DeltaNet layers, whose conv and recurrent state
slots travel, and one full-attention layer; bf16). Token ids and top-5 logprobs equal a local
run at lengths that are and are not multiples of the block size, and a zeroed layer or state
slot is caught as a mismatch."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.vllm.conftest import (
    Pair,
    logprob_drift,
    metric_sum,
    metrics,
    prompt_of,
    start_pair,
    tokens_and_top5,
)

# Gemma-3's CPU block is 128 tokens. Qwen3-Next's full-attention block is 384, and it prefills
# N-1 tokens remotely (decode computes the last on top of h(N-1)). Its recurrent state is bf16
# and the Gated DeltaNet kernels accumulate differently per chunk, so remote equals local *bit
# for bit* only when both compute the same chunks: both engines get a 192-token step budget and
# the prompts are k * 192 + 1 tokens (the local run then splits as 192 ... 192 | 1, as the
# remote path does). 193 and 577 tokens put N-1 off the 384-token block, 385 on it. With other
# lengths the first tokens agree and bf16-level drift follows (docs/vllm.md, "Limits").
# Gemma-3 (fp32) is bit-exact at every length on AVX2 hosts; on AVX-512 hosts vLLM's CPU
# kernels round a partial block's step differently: the same tokens, top-5 logprobs up to 0.015
# apart at 301 tokens (measured), so off a block boundary it gets GEMMA_OFF_BLOCK_DRIFT.
# A zeroed layer or state slot changes the tokens themselves.
BLOCK = {"gemma3": 128}
GEMMA_OFF_BLOCK_DRIFT = 0.05
AVX512 = "avx512f" in Path("/proc/cpuinfo").read_text().split()
CASES: dict[str, dict[str, Any]] = {
    "gemma3": {"lengths": [256, 301, 700], "mutation": "zero_layer", "args": ()},
    "qwen3-next": {
        "lengths": [193, 385, 577],
        "mutation": "zero_state",
        "args": ("--max-num-batched-tokens", "192"),
    },
}


@pytest.fixture(scope="module", params=sorted(CASES))
def hybrid(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, Pair]]:
    arch = request.param
    started = start_pair(
        arch, tmp_path_factory.mktemp(f"vllm-{arch}"), extra_args=CASES[arch]["args"]
    )
    try:
        yield arch, started
    finally:
        started.producer.stop()
        started.consumer.stop()


def _external(pair: Pair) -> float:
    return metric_sum(
        metrics(pair.consumer.url),
        "vllm:prompt_tokens_by_source_total",
        source="external_kv_transfer",
    )


@pytest.mark.slow
def test_hybrid_remote_prefill_equals_local_and_a_mutation_is_caught(
    hybrid: tuple[str, Pair],
) -> None:
    arch, pair = hybrid
    for tokens in CASES[arch]["lengths"]:
        prompt = prompt_of(tokens)
        local = pair.local(prompt)
        n = local["usage"]["prompt_tokens"]
        before = _external(pair)
        remote, prefill, _ = pair.remote(prompt)
        assert prefill is not None
        assert prefill[0] == 200, prefill
        if AVX512 and arch in BLOCK and n % BLOCK[arch]:
            assert logprob_drift(remote, local) <= GEMMA_OFF_BLOCK_DRIFT, (
                arch, n, logprob_drift(remote, local), tokens_and_top5(remote),
                tokens_and_top5(local),
            )  # fmt: skip
        else:
            assert tokens_and_top5(remote) == tokens_and_top5(local), (arch, n)
        loaded = _external(pair) - before
        expected = n - 1 if arch == "qwen3-next" else n
        assert loaded == expected, (arch, n, loaded)
    prompt = prompt_of(CASES[arch]["lengths"][-1])
    local = pair.local(prompt)
    damaged, _, _ = pair.remote(prompt, fault=CASES[arch]["mutation"])
    assert tokens_and_top5(damaged) != tokens_and_top5(local), arch
    assert logprob_drift(damaged, local) > GEMMA_OFF_BLOCK_DRIFT, (
        arch,
        logprob_drift(damaged, local),
    )

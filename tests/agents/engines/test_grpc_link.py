"""Prefill in one engine, KV streamed over the real grpc_kv link (mTLS, loopback) into a decode
engine that embeds the receiver: bit-identical to a local run; wrong model refused before any
byte is used; ``pdbridge verify`` reports the match as JSON."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid

import pytest

from agents.engines.verify import compare, make_prompt
from tests.agents.engines.client import decode_leg, post, prefill_leg
from tests.agents.engines.conftest import ARCHS
from tests.support import subprocess_env


@pytest.mark.parametrize("length", [100, 333])
@pytest.mark.parametrize("model", [*ARCHS, *(f"{a}-bf16" for a in ARCHS)])
def test_remote_prefill_over_grpc_kv_matches_local(engine_pair, grpc_decode, model, length):
    """Every architecture in fp32 and bf16, prompts over the sliding window and not multiples
    of the chunk (several full-attention chunks streamed while prefill computes)."""
    prefill, _ = engine_pair
    body = {
        "model": model,
        "prompt": make_prompt(length, seed=3),
        "max_tokens": 10,
        "temperature": 0,
        "ignore_eos": True,
    }
    tid = f"g-{uuid.uuid4().hex}"

    s1, _, pre = prefill_leg(prefill.url, body, tid, grpc_decode.ready["kv_listen"])
    s2, headers, remote = decode_leg(grpc_decode.url, body, tid, 30)
    _, _, local = post(f"{grpc_decode.url}/v1/completions", body)

    assert (s1, s2) == (200, 200), (pre, remote)
    assert local["usage"]["prompt_tokens"] == length
    assert headers["x-pdbridge-path"] == "remote"
    assert pre["kv_transfer_params"]["bytes"] > 0
    assert pre["kv_transfer_params"]["chunks"] >= 1
    assert pre["kv_transfer_params"]["checksum"] == "xxh3"  # checksums on unless told off
    assert grpc_decode.ready["kv_checksum"] == "xxh3"
    assert compare(local, remote) == (True, 10, 10, None)


def test_fingerprint_mismatch_over_grpc_is_refused(engine_pair, grpc_decode):
    prefill, _ = engine_pair
    body = {"model": "gemma3", "prompt": "x" * 50, "max_tokens": 3, "temperature": 0}
    tid = f"g-{uuid.uuid4().hex}"

    prefill_leg(prefill.url, body, tid, grpc_decode.ready["kv_listen"])
    status, _, data = decode_leg(grpc_decode.url, {**body, "model": "gemma3-bf16"}, tid, 10)

    assert status == 503
    assert data["error"]["code"] == "kv_rejected"
    assert "fingerprint" in data["error"]["message"]


def test_verify_cli_reports_match_as_json(engine_pair, grpc_decode, tmp_path):
    prefill, _ = engine_pair
    out = tmp_path / "report.json"

    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pdbridge.cli",
            "verify",
            "--prefill",
            prefill.url,
            "--decode",
            grpc_decode.url,
            "--model",
            "qwen3-next",
            "--kv-destination",
            grpc_decode.ready["kv_listen"],
            "--lengths",
            "40,200,700",
            "--max-tokens",
            "8",
            "--output",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=subprocess_env(),
        check=False,
    )

    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    assert report["ok"] is True
    assert report["chunk_aligned"] is True
    assert report["local_chunked_prefill_tokens"] == 64
    assert report["fingerprints_equal"] is True
    assert [p["prompt_tokens"] for p in report["prompts"]] == [40, 200, 700]
    assert all(
        p["match"] and p["tokens_compared"] == 8 and p["logits_compared"] == 8
        for p in report["prompts"]
    )
    assert all(
        p["remote_path"] == "remote" and p["first_divergence"] is None for p in report["prompts"]
    )

"""Prefill in one engine, KV streamed over the real grpc_kv link (mTLS, loopback) into a decode
engine that embeds the receiver: bit-identical to a local run; wrong model refused before any
byte is used; ``pdbridge verify`` reports the match as JSON."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import uuid

import pytest

from agents.engines.verify import compare, make_prompt
from tests.agents.engines.client import decode_leg, get, metric, post, prefill_leg
from tests.agents.engines.conftest import ARCHS, engine_args, start_engine
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


@pytest.fixture(scope="module")
def allowlisted_decode(engine_pair, models_dir, kv_certs, tmp_path_factory):
    """A decode engine whose KV listener admits only ``prefill-z``: the prefill engine's
    certificate (``prefill-a``, same CA) is not on its allowlist."""
    logs = tmp_path_factory.mktemp("logs-allowlist")
    engine = start_engine(
        [
            *engine_args(models_dir, ["gemma3"]),
            "--role",
            "decode",
            "--kv-listen",
            "127.0.0.1:0",
            *kv_certs["decode-b"],
            "--kv-allowed-peer",
            "prefill-z",
        ],
        logs / "decode-allowlist.log",
    )
    yield engine
    engine.stop()


def test_a_prefill_engine_off_the_receivers_allowlist_is_told_at_once_and_why(
    engine_pair, allowlisted_decode
):
    """Refused by the receiver, the prefill engine answers 503 ``kv_peer_refused`` naming
    its certificate within its link's first round trip -- not ``kv_timeout`` after the
    link's deadline -- and counts it; the receiver logs the refused subject."""
    prefill, _ = engine_pair
    body = {"model": "gemma3", "prompt": "x" * 50, "max_tokens": 3, "temperature": 0}
    tid = f"g-{uuid.uuid4().hex}"

    started = time.monotonic()
    status, _, data = prefill_leg(prefill.url, body, tid, allowlisted_decode.ready["kv_listen"])
    elapsed = time.monotonic() - started
    _, metrics = get(f"{prefill.url}/metrics")

    assert status == 503
    assert data["error"]["code"] == "kv_peer_refused"
    assert "'prefill-a' is not on the allowlist" in data["error"]["message"]
    assert elapsed < 4.0  # the link's deadline (4 s): refused, not timed out
    _, decode_metrics = get(f"{allowlisted_decode.url}/metrics")
    sent = metric(
        metrics, "pdbridge:kv_transfers_total", direction="send", outcome="kv_peer_refused"
    )
    assert sent >= 1
    assert metric(metrics, "pdbridge_kv_rejected_peers_total", role="sender") >= 1
    refused = metric(
        decode_metrics, "pdbridge_kv_rejected_peers_total", role="receiver", reason="not_allowed"
    )
    assert refused >= 1  # the engine's own /metrics counts whom its listener refused
    assert "prefill-a" in allowlisted_decode.log.read_text()


def test_a_kv_receiver_out_of_reach_is_kv_unreachable_before_the_deadline(engine_pair):
    """Nothing listens at the decode site's KV address (receiver down, path cut): the prefill
    engine answers 503 ``kv_unreachable`` once the link's ``unreachable_ms`` (3 s) has passed,
    before its 4 s deadline would say ``kv_timeout``, and counts it by that name."""
    prefill, _ = engine_pair
    with socket.socket() as hold:
        hold.bind(("127.0.0.1", 0))
        nowhere = f"127.0.0.1:{hold.getsockname()[1]}"
    body = {"model": "gemma3", "prompt": "x" * 50, "max_tokens": 3, "temperature": 0}

    started = time.monotonic()
    status, _, data = prefill_leg(prefill.url, body, f"u-{uuid.uuid4().hex}", nowhere)
    elapsed = time.monotonic() - started
    _, metrics = get(f"{prefill.url}/metrics")

    assert status == 503
    assert data["error"]["type"] == "kv_transfer_error"
    assert data["error"]["code"] == "kv_unreachable", data
    assert f"receiver {nowhere} unreachable for 3000 ms" in data["error"]["message"]
    assert elapsed >= 3.0 * 0.9
    sent = metric(
        metrics, "pdbridge:kv_transfers_total", direction="send", outcome="kv_unreachable"
    )
    assert sent >= 1


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

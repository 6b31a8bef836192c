"""A deployment's KV link settings observed in the prefill engine's behaviour (#19): the
deadline (``--kv-timeout-ms``, from ``kv_transfer.timeout_ms``) decides whether a slow
transfer gets through, and a missed one is answered as a deadline (``kv_timeout``) on both
legs, never as corrupt KV; the chunk size (``--kv-chunk-size-mb``) is the size the link cuts
the KV into; the retries (``--kv-retry``) reach the link's options (the engine reports
them; grpc_kv's own tests cover what a retry does)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from agents.engines.verify import compare, make_prompt
from tests.agents.engines.client import decode_leg, post, prefill_leg
from tests.agents.engines.conftest import CHUNK, EngineProc, start_engine

MODEL = "qwen3-next"
#: Tokens of the slow prompt (the issue's): ~1.5 MB of KV, seconds of prefill on one thread.
TOKENS = 6000
#: The short engine's deadline: half the fastest send of that prompt seen on these hosts
#: (0.97 s, a full-suite run), so the slow transfer misses it even on an idle machine.
SHORT_DEADLINE_MS = 500


def _prefill_engine(models_dir: Path, kv_certs, log: Path, *link: str) -> EngineProc:
    return start_engine(
        [
            "--model", f"{MODEL}={MODEL}", "--models-dir", str(models_dir),
            "--chunked-prefill-tokens", str(CHUNK), "--threads", "1",
            "--role", "prefill", *kv_certs["prefill-a"], *link,
        ],
        log,
    )  # fmt: skip


@pytest.fixture(scope="module")
def engines(
    engine_pair, grpc_decode, models_dir: Path, kv_certs, tmp_path_factory
) -> Iterator[tuple[EngineProc, EngineProc]]:
    """(a prefill engine with a 0.5 s deadline, no retries and 4 KiB chunks; one with the
    testbed deployment's 15 s deadline): the same model, weights and chunking otherwise."""
    logs = tmp_path_factory.mktemp("logs-link")
    short = _prefill_engine(
        models_dir, kv_certs, logs / "short.log",
        "--kv-timeout-ms", str(SHORT_DEADLINE_MS), "--kv-retry", "0", "--kv-chunk-size-mb", "0.00390625",
    )  # fmt: skip
    try:
        long = _prefill_engine(models_dir, kv_certs, logs / "long.log", "--kv-timeout-ms", "15000")
    except BaseException:
        short.stop()
        raise
    yield short, long
    short.stop()
    long.stop()


def _body(tokens: int, seed: int) -> dict:
    return {
        "model": MODEL,
        "prompt": make_prompt(tokens, seed=seed),
        "max_tokens": 4,
        "temperature": 0,
        "ignore_eos": True,
    }


def _kv_bytes(engine: EngineProc, grpc_decode: EngineProc, body: dict) -> int:
    """Raw KV bytes of ``body``'s prompt, measured by one unshaped remote prefill."""
    tid = f"m-{uuid.uuid4().hex}"
    status, _, answer = prefill_leg(engine.url, body, tid, grpc_decode.ready["kv_listen"])
    assert status == 200, answer
    assert decode_leg(grpc_decode.url, body, tid, 60)[0] == 200
    return int(answer["kv_transfer_params"]["bytes"])


def test_the_engine_reports_the_link_settings_it_was_given(engines):
    short, long = engines

    assert short.ready["kv_link"] == {
        "timeout_ms": SHORT_DEADLINE_MS,
        "retry": 0,
        "chunk_size_bytes": 4 * 1024,
    }
    assert long.ready["kv_link"]["timeout_ms"] == 15000


def test_a_deadline_the_slow_transfer_fits_lets_it_through_and_a_short_one_is_a_deadline(
    engines, grpc_decode
):
    """The issue's case: a 6,000-token prompt, whose transfer lasts as long as its prefill
    (the sender opens after the first chunk and finishes after the last). The 15 s engine
    gets it through (remote path, the tokens of a local run); the 0.5 s engine answers 503
    ``kv_timeout`` naming the deadline, and the decode leg, waiting 15 s as the gateway asks,
    hears a deadline too (``kv_timeout``) and falls back -- neither leg says ``kv_corrupt``."""
    short, long = engines
    body = _body(TOKENS, seed=11)

    tid = f"l-{uuid.uuid4().hex}"
    s1, _, through = prefill_leg(long.url, body, tid, grpc_decode.ready["kv_listen"])
    s2, headers, remote = decode_leg(grpc_decode.url, body, tid, 15.0)
    assert (s1, s2) == (200, 200), (through, remote)
    assert headers["x-pdbridge-path"] == "remote"
    # The premise: this transfer needs longer than the short engine's deadline.
    assert through["kv_transfer_params"]["send_seconds"] > SHORT_DEADLINE_MS / 1000

    tid = f"s-{uuid.uuid4().hex}"
    t0 = time.monotonic()
    s3, _, missed = prefill_leg(short.url, body, tid, grpc_decode.ready["kv_listen"])
    took = time.monotonic() - t0
    s4, headers, fallback = decode_leg(grpc_decode.url, body, tid, 15.0, fallback="local")
    _, _, local = post(f"{grpc_decode.url}/v1/completions", body)

    assert s3 == 503
    assert missed["error"]["type"] == "kv_transfer_error"
    assert missed["error"]["code"] == "kv_timeout", missed
    assert f"deadline of {SHORT_DEADLINE_MS} ms" in missed["error"]["message"]
    assert took < 15  # the engine's own deadline ended it
    assert s4 == 200
    assert headers["x-pdbridge-path"] == "fallback"
    assert fallback["pdbridge"]["fallback_reason"] == "kv_timeout"
    assert compare(local, remote) == (True, 4, 4, None)
    assert compare(local, fallback) == (True, 4, 4, None)


def test_the_chunk_size_is_what_the_link_cuts_the_kv_into(engines, grpc_decode):
    """The same prompt, chunking and model from both engines: each prefill chunk's keys or
    values (64 tokens of the full-attention layer, 8 KiB) are one link chunk at the default
    4 MiB and two at 4 KiB."""
    short, long = engines
    body = _body(200, seed=12)
    counts = {}
    for name, engine in (("4KiB", short), ("4MiB", long)):
        tid = f"c-{uuid.uuid4().hex}"
        status, _, answer = prefill_leg(engine.url, body, tid, grpc_decode.ready["kv_listen"])
        assert status == 200, answer
        assert decode_leg(grpc_decode.url, body, tid, 60)[0] == 200
        counts[name] = answer["kv_transfer_params"]["chunks"]
        raw = answer["kv_transfer_params"]["bytes"]

    assert raw > 8 * 4 * 1024
    assert counts["4KiB"] > counts["4MiB"]
    assert counts["4KiB"] >= raw // (4 * 1024)  # no chunk above 4 KiB

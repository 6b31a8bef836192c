"""Verification can fail: a transfer corrupted in flight, with integrity checks off, is caught
as a mismatch at the first divergent step; with the digests on it is refused outright.

The corruption is injected by grpc_kv's fault proxy on the KV link (one flipped byte in a
full-attention layer's KV, checksums off), and between the prefill engine's spool and the
decode engine's, playing the part of a faulty link."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from agents.engines.verify import compare, make_prompt
from grpc_kv.faultproxy import Flip
from tests.agents.engines.client import decode_leg, post, prefill_leg
from tests.agents.engines.conftest import CHUNK, EngineProc, engine_args, start_engine
from tests.agents.engines.test_faults import ProxyThread
from tests.support import subprocess_env


@pytest.fixture(scope="module")
def unchecked_decode(models_dir, tmp_path_factory) -> EngineProc:
    """A decode engine whose spool receiver skips per-segment digests ("checksums off")."""
    spool = tmp_path_factory.mktemp("spool-unchecked")
    engine = start_engine(
        [
            *engine_args(models_dir, ["qwen3-next=qwen3-next"]),
            "--role",
            "decode",
            "--kv-spool",
            str(spool),
            "--no-verify-kv-digests",
        ],
        tmp_path_factory.mktemp("logs-unchecked") / "decode.log",
    )
    engine.spool = spool  # type: ignore[attr-defined]
    yield engine
    engine.stop()


@pytest.fixture(scope="module")
def unchecked_link(models_dir, tmp_path_factory) -> Iterator[tuple[EngineProc, EngineProc]]:
    """A prefill and a decode engine joined by a plaintext grpc_kv link with checksums off and
    raw chunks (a deployment's ``checksum: false``): over TLS a flipped byte fails the record's
    MAC and compressed chunks fail to decode, so silent corruption needs this link."""
    logs = tmp_path_factory.mktemp("logs-unchecked-link")
    common = [*engine_args(models_dir, ["qwen3-next=qwen3-next"]), "--no-verify-kv-digests"]
    decode = start_engine(
        [*common, "--role", "decode", "--kv-listen", "127.0.0.1:0", "--kv-insecure"],
        logs / "decode.log",
    )
    try:
        prefill = start_engine(
            [*common, "--role", "prefill", "--kv-insecure", "--kv-compression", "none"],
            logs / "prefill.log",
        )
    except BaseException:
        decode.stop()
        raise
    yield prefill, decode
    prefill.stop()
    decode.stop()


def _kv_bytes_of_token(models_dir: Path, prompt: str, token: int) -> bytes:
    """16 bytes of the full-attention layer's keys at prompt position ``token``, computed here
    the way the engines do (one thread, the engines' chunk): what the proxy must find on the
    wire so that its flip lands in KV data, never in framing."""
    from agents.engines.reference import kvstate, zoo
    from agents.engines.reference.runner import Runner, set_threads

    set_threads(1)
    lm = zoo.load_model(zoo.resolve_model("qwen3-next", models_dir), name="qwen3-next")
    ids = lm.tokenizer.encode(prompt)
    cache, logits = Runner(lm, CHUNK).prefill(ids)
    _, segments = kvstate.export_cache(cache, len(ids), logits)
    per_token = len(segments["L3.k"]) // len(ids)
    start = token * per_token + per_token // 4
    return segments["L3.k"][start : start + 16]


def test_verify_catches_a_byte_flipped_by_the_fault_proxy_with_checksums_off(
    unchecked_link, models_dir, tmp_path
):
    """Deployment step 7's proof that the check can fail: ``pdbridge verify`` through a KV link
    that flips one byte of KV data and verifies nothing reports a mismatch (exit 1) at the
    first step that reads the damaged KV; the engines themselves noticed nothing."""
    prefill, decode = unchecked_link
    assert prefill.ready["kv_checksum"] == "none"
    proxy = ProxyThread(decode.ready["kv_listen"])
    out = tmp_path / "report.json"
    try:
        pattern = _kv_bytes_of_token(models_dir, make_prompt(200, 0), 100)
        flip = proxy.call(proxy.proxy.add, Flip(direction="upstream", pattern=pattern, limit=1))
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "pdbridge.cli",
                "verify",
                "--prefill",
                prefill.url,
                "--decode",
                decode.url,
                "--model",
                "qwen3-next",
                "--kv-destination",
                proxy.address,
                "--lengths",
                "200",
                "--max-tokens",
                "8",
                "--deadline-s",
                "20",
                "--output",
                str(out),
            ],
            capture_output=True,
            text=True,
            timeout=120,
            env=subprocess_env(),
            check=False,
        )
        flipped = flip.flipped
    finally:
        proxy.close()

    assert flipped == 1
    assert result.returncode == 1, result.stderr
    report = json.loads(out.read_text())
    [prompt] = report["prompts"]
    assert report["ok"] is False
    assert prompt["error"] is None
    assert prompt["remote_path"] == "remote"  # imported and served: nothing on the way noticed
    assert prompt["match"] is False
    divergence = prompt["first_divergence"]
    assert divergence["step"] == 1  # step 0's logits were shipped; step 1 reads the KV
    assert divergence["position"] == 201
    assert divergence["kind"] in {"token", "logits"}


def _prefill_and_corrupt(prefill: EngineProc, staging: Path, body: dict, segment: str) -> str:
    tid = f"c-{uuid.uuid4().hex}"
    status, _, _ = prefill_leg(prefill.url, body, tid, f"spool:{staging}")
    assert status == 200
    path = staging / tid / f"seg.{segment}"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40  # one bit of one value of the middle token
    path.write_bytes(bytes(data))
    return tid


def test_corrupted_transfer_without_checksums_is_a_mismatch(
    engine_pair, unchecked_decode, tmp_path
):
    prefill, _ = engine_pair
    body = {
        "model": "qwen3-next",
        "prompt": make_prompt(200, seed=11),
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
    }
    tid = _prefill_and_corrupt(prefill, tmp_path, body, "L3.k")
    shutil.move(tmp_path / tid, unchecked_decode.spool / tid)

    status, _, remote = decode_leg(unchecked_decode.url, body, tid, 10)
    _, _, local = post(f"{unchecked_decode.url}/v1/completions", body)

    assert status == 200  # nothing on the way noticed
    match, _, _, divergence = compare(local, remote)
    assert match is False
    assert divergence is not None
    assert divergence.step == 1  # the first step that reads the corrupted KV
    assert divergence.position == 201


def test_corrupted_transfer_with_digests_is_refused(engine_pair, spool, tmp_path):
    prefill, decode = engine_pair
    body = {
        "model": "qwen3-next",
        "prompt": make_prompt(200, seed=11),
        "max_tokens": 4,
        "temperature": 0,
    }
    tid = _prefill_and_corrupt(prefill, tmp_path, body, "L0.rec0")
    shutil.move(tmp_path / tid, spool / tid)

    status, _, data = decode_leg(decode.url, body, tid, 10)

    assert status == 503
    assert data["error"]["code"] == "kv_corrupt"
    assert "digest mismatch" in data["error"]["message"]


def test_verify_cli_rejects_bad_arguments(capsys):
    from agents.engines.verify import main

    assert (
        main(
            [
                "--prefill",
                "http://x",
                "--decode",
                "http://y",
                "--model",
                "m",
                "--kv-destination",
                "d",
                "--lengths",
                "a,b",
            ]
        )
        == 2
    )
    assert "--lengths" in capsys.readouterr().err


def test_verify_cli_exit_2_when_engine_unreachable(capsys):
    from agents.engines.verify import main

    code = main(
        [
            "--prefill",
            "http://127.0.0.1:9",
            "--decode",
            "http://127.0.0.1:9",
            "--model",
            "m",
            "--kv-destination",
            "127.0.0.1:9",
            "--lengths",
            "10",
        ]
    )

    assert code == 2
    assert "pdbridge verify:" in capsys.readouterr().err


def _vllm_like(tokens: list[int], logprobs: list[float]) -> dict:
    """A response shaped like vLLM's (token ids and logprobs, no logits digests)."""
    return {
        "usage": {"prompt_tokens": 10},
        "choices": [
            {
                "token_ids": tokens,
                "logprobs": {
                    "token_logprobs": logprobs,
                    "top_logprobs": [{str(t): lp} for t, lp in zip(tokens, logprobs, strict=True)],
                },
            }
        ],
    }


def test_compare_uses_logprobs_without_digests():
    from agents.engines.verify import compare

    same = compare(
        _vllm_like([1, 2, 3], [-0.1, -0.2, -0.3]), _vllm_like([1, 2, 3], [-0.1, -0.2, -0.3])
    )
    drift = compare(
        _vllm_like([1, 2, 3], [-0.1, -0.2, -0.3]), _vllm_like([1, 2, 3], [-0.1, -0.25, -0.3])
    )
    tolerated = compare(
        _vllm_like([1, 2, 3], [-0.1, -0.2, -0.3]),
        _vllm_like([1, 2, 3], [-0.1, -0.2001, -0.3]),
        0.001,
    )

    assert same == (True, 3, 3, None)
    assert drift[0] is False
    assert drift[3].kind == "logprobs"
    assert drift[3].step == 1
    assert drift[3].position == 11
    assert drift[3].detail == "top-1 logprobs up to 0.05 apart (tolerance 0)"
    assert tolerated[0] is True


def test_a_logprob_divergence_names_other_top_tokens():
    from agents.engines.verify import compare

    local = _vllm_like([1, 2], [-0.1, -0.2])
    remote = _vllm_like([1, 2], [-0.1, -0.2])
    remote["choices"][0]["logprobs"]["top_logprobs"][1] = {"2": -0.2, "7": -3.0}

    match, _, _, divergence = compare(local, remote, 0.5)

    assert match is False
    assert divergence.detail == "top-1 tokens differ: local ['2'] remote ['2', '7']"


def test_ok_needs_the_remote_path_and_equal_fingerprints():
    from agents.engines.verify import PromptResult, verdict

    def result(match: bool = True, path: str | None = "remote") -> PromptResult:
        return PromptResult(200, 200, match, 8, 8, None, path)

    assert verdict([result()], fingerprints_equal=True) is True
    assert verdict([result(path=None)], fingerprints_equal=True) is True  # engine cannot say
    assert verdict([result(path="fallback")], fingerprints_equal=True) is False
    assert verdict([result(path="local")], fingerprints_equal=True) is False
    assert verdict([result()], fingerprints_equal=False) is False
    assert verdict([result(match=False)], fingerprints_equal=True) is False
    assert verdict([], fingerprints_equal=True) is False

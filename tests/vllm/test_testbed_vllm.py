"""``pdbridge run --engine vllm``: the testbed with real vLLM on both sites (prefill and decode
engines with pdbridge's connector over the shaped mTLS WAN path), through the same smoke check
as the reference engine's: the eight deploy steps and the canary to 100 %, step 7 comparing
token ids and top-5 logprobs of remote and local runs, a remote request with tokens, the
printed ``curl`` line, both agents' weights hashes, a clean shutdown. A link-cut drill started
through the console's REST API ends with no failed client request: the gateway serves the
cut's requests by local prefill and goes back to remote once the link is restored."""

from __future__ import annotations

import json
import sqlite3

import pytest

from tests.test_testbed import ConsoleApi, check_drill_passed, smoke

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]


def verification_evidence(ready: dict, db: sqlite3.Connection) -> dict:
    (evidence,) = db.execute(
        "SELECT evidence FROM runs_steprun WHERE run_id = ? AND name = 'verification'",
        (ready["deploy_run"],),
    ).fetchone()
    return json.loads(evidence)


def test_the_testbed_on_vllm_deploys_and_a_link_cut_costs_no_request(tmp_path):
    seen: dict[str, dict] = {}

    def while_up(ready: dict, db: sqlite3.Connection) -> None:
        seen["verification"] = verification_evidence(ready, db)
        api = ConsoleApi(ready, (tmp_path / "run.out").read_text())
        # vLLM's decode engine notices a cut at the KV deadline (15 s), not at grpc_kv's
        # unreachable_ms (docs/vllm.md, Limits): the fault outlasts it, so the drill sees
        # requests fall back and the link come back. At one fallback per deadline per
        # client the site's breaker sees too few failures in its window to open: not
        # required here.
        seen["cut"] = api.drill(ready, "link_cut", fault_s=25, criteria={
            "max_time_to_recover_s": 90, "require_breaker_open": False})  # fmt: skip

    ready, output = smoke(tmp_path, ["--engine", "vllm"], while_up)

    assert ready["served_model"] == "gemma3-tiny"
    assert "engines: vLLM with pdbridge's KV connector" in output
    [report] = seen["verification"]["reports"]
    assert report["ok"], report
    for prompt in report["prompts"]:
        assert prompt["match"], prompt
        assert prompt["tokens_compared"] == 8
        # No logits digests on vLLM: every step's top-5 logprobs were compared instead.
        assert prompt["logits_compared"] == 8
    # The second prompt (~310 tokens) is past the model's 64-token sliding window.
    assert max(p["prompt_tokens"] for p in report["prompts"]) > 64
    check_drill_passed(seen["cut"])

"""The gateway in front of real vLLM pools with pdbridge's connector (push mode, both legs at
once), as the orchestrator launches them: the decode engine with ``kv_load_failure_policy:
fail``, so that a KV that never arrives fails the decode leg and the gateway serves the request
by local prefill, saying so."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.agents.engines.client import free_port
from tests.agents.gateway.procs import Proc, start_gateway
from tests.agents.gateway.snapshots import snapshot
from tests.vllm.conftest import Pair, metric_sum, metrics, start_pair

pytestmark = pytest.mark.slow
ARCH = "qwen3"
KV_TIMEOUT_MS = 8000
SETTINGS: dict[str, Any] = {
    "scrape_interval_s": 0,
    "retune_interval_s": 3600,
    "health_check_interval_s": 1.0,
    "health_check_timeout_s": 2.0,
    "fallback_rate_per_s": 1000,
    "fallback_burst": 1000,
}
PROMPT = " ".join(f"remote prefill {i} decode" for i in range(150))


@pytest.fixture(scope="module")
def failing_pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    started = start_pair(ARCH, tmp_path_factory.mktemp("vllm-gw"), failure_policy="fail")
    try:
        yield started
    finally:
        started.producer.stop()
        started.consumer.stop()


def _gateway(pair: Pair, kv_address: str, workdir: Path) -> Proc:
    data = snapshot(
        decode_urls=(pair.consumer.url,), prefill_sites={"remote": (pair.producer.url,)}
    )
    data["model"]["name"] = pair.model
    data["model"]["engine_settings"] = {"max_model_len": 4096}
    data["kv_transfer"]["timeout_ms"] = KV_TIMEOUT_MS
    data["pools"]["decode"]["nodes"][0]["kv_address"] = kv_address
    workdir.mkdir(parents=True, exist_ok=True)
    return start_gateway(data, SETTINGS, workdir)


def _complete(
    url: str, model: str, prompt: str
) -> tuple[int, dict[str, Any], dict[str, str], float]:
    body = {"model": model, "prompt": prompt, "max_tokens": 12, "temperature": 0}
    request = urllib.request.Request(  # noqa: S310 - loopback
        url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    t0 = time.monotonic()
    try:
        with urllib.request.urlopen(request, timeout=300) as resp:  # noqa: S310 - loopback
            return resp.status, json.load(resp), dict(resp.headers), time.monotonic() - t0
    except urllib.error.HTTPError as exc:
        raise AssertionError(f"gateway answered {exc.code}: {exc.read()[:2000]!r}") from None


def _external(pair: Pair) -> float:
    return metric_sum(
        metrics(pair.consumer.url),
        "vllm:prompt_tokens_by_source_total",
        source="external_kv_transfer",
    )


def test_the_gateway_serves_long_prompts_remotely_over_vllm(failing_pair: Pair, tmp_path) -> None:
    gateway = _gateway(failing_pair, failing_pair.kv_destination, tmp_path / "gw")
    try:
        local = failing_pair.local(PROMPT, max_tokens=12)
        before = _external(failing_pair)
        status, answer, headers, _ = _complete(gateway.url, failing_pair.model, PROMPT)
        assert status == 200
        assert headers.get("x-pdbridge-path") == "remote"
        assert answer["choices"][0]["text"] == local["choices"][0]["text"]
        assert _external(failing_pair) > before  # the decode engine loaded it over the link
    finally:
        gateway.stop()


def test_kv_that_never_arrives_becomes_a_visible_local_fallback(
    failing_pair: Pair, tmp_path
) -> None:
    """The decode site's receiver unreachable (the snapshot names a dead port): the prefill
    engine's transfer fails, the decode engine fails the request at its deadline (policy
    fail), and the gateway answers by local prefill with ``x-pdbridge-path: fallback``."""
    gateway = _gateway(failing_pair, f"127.0.0.1:{free_port()}", tmp_path / "gw-dead")
    try:
        local = failing_pair.local(PROMPT, max_tokens=12)
        status, answer, headers, seconds = _complete(gateway.url, failing_pair.model, PROMPT)
        assert status == 200
        assert headers.get("x-pdbridge-path") == "fallback"
        assert answer["choices"][0]["text"] == local["choices"][0]["text"]
        assert seconds < KV_TIMEOUT_MS / 1000 + 60  # the deadline, then a local prefill
    finally:
        gateway.stop()

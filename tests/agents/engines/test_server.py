"""The reference engine's HTTP surface against a real engine process: SSE format, usage chunk,
concurrency and gauges, client disconnect, OpenAI-style 400s, KV refusal and fallback."""

from __future__ import annotations

import json
import socket
import threading
import time
import uuid

import pytest

from agents.engines.verify import make_prompt
from tests.agents.engines.client import decode_leg, get, metric, post, prefill_leg
from tests.agents.engines.conftest import serve_expecting_exit
from tests.support import deadline_in, wait_for


def _sse_events(raw: str) -> list[str]:
    assert raw.endswith("\n\n")
    events = raw.split("\n\n")[:-1]
    assert all(e.startswith("data: ") for e in events)
    return [e.removeprefix("data: ") for e in events]


def _stream(url: str, body: dict) -> tuple[int, dict[str, str], str]:
    import urllib.request

    req = urllib.request.Request(  # noqa: S310 - loopback URL built here
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=60) as resp:  # noqa: S310 - loopback URL built here
        return resp.status, dict(resp.headers), resp.read().decode()


def test_streaming_completion_sse_format_with_usage_chunk(engine_pair):
    prefill, _ = engine_pair
    body = {
        "model": "qwen3-next",
        "prompt": "hello there",
        "max_tokens": 5,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }

    status, headers, raw = _stream(f"{prefill.url}/v1/completions", body)
    _, _, whole = post(f"{prefill.url}/v1/completions", {**body, "stream": False})

    assert status == 200
    assert headers["Content-Type"].startswith("text/event-stream")
    events = _sse_events(raw)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len(chunks) == 6
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["id"].startswith("cmpl-")
    assert all(c["object"] == "text_completion" for c in chunks)
    assert [c["choices"][0]["finish_reason"] for c in chunks[:5]] == [
        None,
        None,
        None,
        None,
        "length",
    ]
    assert chunks[5]["choices"] == []
    assert chunks[5]["usage"] == {"prompt_tokens": 12, "completion_tokens": 5, "total_tokens": 17}
    assert [c["choices"][0]["token_ids"][0] for c in chunks[:5]] == whole["choices"][0]["token_ids"]
    assert [c["choices"][0]["logits_digests"][0] for c in chunks[:5]] == whole["choices"][0][
        "logits_digests"
    ]
    assert "".join(c["choices"][0]["text"] for c in chunks[:5]) == whole["choices"][0]["text"]


def test_streaming_chat_starts_with_role_delta(engine_pair):
    prefill, _ = engine_pair
    body = {
        "model": "gemma3",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 3,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }

    _, _, raw = _stream(f"{prefill.url}/v1/chat/completions", body)

    chunks = [json.loads(e) for e in _sse_events(raw)[:-1]]
    assert chunks[0]["object"] == "chat.completion.chunk"
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert len(chunks) == 4  # role + 3 tokens, no usage chunk unless asked
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_stop_string_ends_generation(engine_pair):
    prefill, _ = engine_pair
    body = {
        "model": "qwen3-next",
        "prompt": "abc",
        "max_tokens": 12,
        "temperature": 0,
        "ignore_eos": True,
    }
    _, _, free = post(f"{prefill.url}/v1/completions", body)
    text = free["choices"][0]["text"]
    stop = next(ch for ch in text[2:] if ch.isprintable() and ch != "\ufffd")

    _, _, stopped = post(f"{prefill.url}/v1/completions", {**body, "stop": [stop]})

    assert stopped["choices"][0]["finish_reason"] == "stop"
    assert stopped["choices"][0]["text"] == text[: text.index(stop)]


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        ({"model": "qwen3-next", "prompt": "x", "max_tokens": -1}, "max_tokens", "invalid_value"),
        ({"model": "nope", "prompt": "x"}, "model", "model_not_found"),
        ({"model": "qwen3-next", "prompt": "x" * 9000}, "prompt", "context_length_exceeded"),
        ({"model": "qwen3-next", "prompt": [1, 2, 100000]}, "prompt", "invalid_value"),
        (
            {"model": "qwen3-next", "prompt": "x", "temperature": "hot"},
            "temperature",
            "invalid_value",
        ),
        (
            {
                "model": "qwen3-next",
                "prompt": "x",
                "kv_transfer_params": {"do_remote_decode": True},
            },
            "kv_transfer_params.transfer_id",
            "invalid_value",
        ),
        (b"{not json", None, "malformed_json"),
        (b"[]", None, "invalid_value"),
    ],
    ids=[
        "negative-max-tokens",
        "unknown-model",
        "too-long",
        "bad-token-id",
        "bad-temperature",
        "kv-no-id",
        "malformed",
        "not-object",
    ],
)
def test_bad_requests_get_openai_style_400(engine_pair, body, param, code):
    prefill, _ = engine_pair

    status, _, data = post(f"{prefill.url}/v1/completions", body)

    assert status == 400
    assert data["error"]["type"] == "invalid_request_error"
    assert data["error"]["param"] == param
    assert data["error"]["code"] == code


def test_decode_role_refuses_prefill_leg(engine_pair, spool):
    _, decode = engine_pair
    body = {
        "model": "dense",
        "prompt": "x",
        "kv_transfer_params": {
            "do_remote_decode": True,
            "transfer_id": "x1",
            "kv_destination": f"spool:{spool}",
        },
    }

    status, _, data = post(f"{decode.url}/v1/completions", body)

    assert status == 400
    assert "role decode" in data["error"]["message"]


def test_models_health_and_metrics_endpoints(engine_pair):
    prefill, decode = engine_pair

    _, models = get(f"{decode.url}/v1/models")
    status, _ = get(f"{decode.url}/health")
    _, text = get(f"{decode.url}/metrics")

    entry = next(m for m in json.loads(models)["data"] if m["id"] == "gemma3-bf16")
    assert entry["pdbridge"]["dtype"] == "bfloat16"
    assert entry["pdbridge"]["chunked_prefill_tokens"] == 64
    assert entry["pdbridge"]["fingerprint"] == prefill.ready["models"]["gemma3-bf16"]
    assert status == 200
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:inter_token_latency_seconds_bucket",
        "vllm:e2e_request_latency_seconds_bucket",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
    ):
        assert name in text


def test_the_engine_reports_its_busy_seconds_by_phase_as_the_rebalancer_reads_them(engine_pair):
    """A local completion adds one prefill and one decode and some compute seconds of each:
    what ``orchestrator.capacityops`` turns into the decode side's capacity."""
    from orchestrator.capacityops import engine_capacity, parse_engine

    _, decode = engine_pair
    before = parse_engine(get(f"{decode.url}/metrics")[1])
    body = {"model": "qwen3-next", "prompt": make_prompt(300, seed=3), "max_tokens": 6,
            "temperature": 0, "ignore_eos": True}  # fmt: skip
    assert post(f"{decode.url}/v1/completions", body)[0] == 200
    after = parse_engine(get(f"{decode.url}/metrics")[1])

    for phase in ("prefill", "decode"):
        assert after["done"][phase] == before["done"].get(phase, 0) + 1
        assert after["busy"][phase] > before["busy"].get(phase, 0)
    capacity = engine_capacity(before, after, "decode")
    assert capacity is not None
    assert capacity > 0
    assert capacity == pytest.approx(1 / (after["busy"]["decode"] - before["busy"]["decode"]))


def test_fingerprint_mismatch_is_refused_before_decode(engine_pair, spool):
    prefill, decode = engine_pair
    tid = f"t-{uuid.uuid4().hex}"
    body = {"model": "qwen3-next", "prompt": "same prompt", "max_tokens": 4, "temperature": 0}
    prefill_leg(prefill.url, body, tid, f"spool:{spool}")

    # Same weights, other dtype: another architecture hash, hence another fingerprint.
    status, headers, data = decode_leg(decode.url, {**body, "model": "qwen3-next-bf16"}, tid, 10)

    assert status == 503
    assert data["error"]["type"] == "kv_transfer_error"
    assert data["error"]["code"] == "kv_rejected"
    assert "fingerprint" in data["error"]["message"]
    assert headers["x-pdbridge-path"] == "remote"


def test_prompt_mismatch_is_refused(engine_pair, spool):
    prefill, decode = engine_pair
    tid = f"t-{uuid.uuid4().hex}"
    body = {"model": "dense", "prompt": "one prompt", "max_tokens": 2, "temperature": 0}
    prefill_leg(prefill.url, body, tid, f"spool:{spool}")

    status, _, data = decode_leg(decode.url, {**body, "prompt": "another prompt"}, tid)

    assert status == 503
    assert "different prompt" in data["error"]["message"]


def test_missing_kv_times_out_with_distinct_error_or_falls_back(engine_pair):
    _, decode = engine_pair
    body = {
        "model": "gemma3",
        "prompt": "nobody prefilled this",
        "max_tokens": 4,
        "temperature": 0,
        "ignore_eos": True,
    }
    tid = f"t-{uuid.uuid4().hex}"

    status, _, err = decode_leg(decode.url, body, tid, 0.3)
    fb_status, fb_headers, fb = decode_leg(decode.url, body, tid + "-fb", 0.3, fallback="local")
    _, _, local = post(f"{decode.url}/v1/completions", body)

    assert status == 503
    assert err["error"]["code"] == "kv_timeout"
    assert fb_status == 200
    assert fb_headers["x-pdbridge-path"] == "fallback"
    assert fb["pdbridge"]["fallback_reason"] == "kv_timeout"
    assert fb["choices"][0]["token_ids"] == local["choices"][0]["token_ids"]


def test_concurrent_requests_are_queued_and_all_served(engine_pair):
    prefill, _ = engine_pair
    body = {
        "model": "qwen3-next",
        "prompt": make_prompt(300),
        "max_tokens": 40,
        "temperature": 0,
        "ignore_eos": True,
    }
    results: list[tuple[int, list[int]]] = []
    samples: list[tuple[float, float]] = []
    stop = threading.Event()

    def call() -> None:
        status, _, data = post(f"{prefill.url}/v1/completions", body)
        results.append((status, data["choices"][0]["token_ids"]))

    def watch() -> None:
        while not stop.is_set():
            _, text = get(f"{prefill.url}/metrics")
            samples.append(
                (
                    metric(text, "vllm:num_requests_running", model_name="qwen3-next"),
                    metric(text, "vllm:num_requests_waiting", model_name="qwen3-next"),
                )
            )
            time.sleep(0.01)

    threads = [threading.Thread(target=call) for _ in range(7)]
    watcher = threading.Thread(target=watch)
    watcher.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    stop.set()
    watcher.join()

    assert len(results) == 7
    assert all(status == 200 for status, _ in results)
    assert len({tuple(ids) for _, ids in results}) == 1  # interleaving does not change results
    assert max(r for r, _ in samples) == 4  # max_num_seqs
    assert max(w for _, w in samples) >= 1  # the rest waited, and the gauge said so
    assert samples[-1] == (0.0, 0.0) or all(s <= 4 for s, _ in samples)


def test_a_decode_leg_whose_caller_hung_up_stops_waiting_for_its_kv(grpc_decode):
    """The gateway gave up on a decode leg (it fell back or failed over, closing the leg's
    connection) whose KV has not come: the engine stops waiting within a poll instead of at
    the 60 s deadline, freeing the slot that the request's fallback queues for."""
    _, before = get(f"{grpc_decode.url}/metrics")
    body = {
        "model": "dense", "prompt": "nobody prefills this", "max_tokens": 3, "temperature": 0,
        "kv_transfer_params": {"do_remote_prefill": True, "transfer_id": f"gone-{uuid.uuid4().hex}",
                               "deadline_s": 60},
    }  # fmt: skip
    payload = json.dumps(body).encode()
    host, port = grpc_decode.url.removeprefix("http://").split(":")
    cancelled = "pdbridge:requests_cancelled_total"

    def waiting_now() -> float:
        return metric(get(f"{grpc_decode.url}/metrics")[1], "vllm:num_requests_running",
                      model_name="dense")  # fmt: skip

    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(payload)}\r\n\r\n".encode()
            + payload
        )
        wait_for(lambda: waiting_now() >= 1, 30, 0.05, what="the decode leg holding its slot")
    hung_up = time.monotonic()

    def freed() -> bool:
        text = get(f"{grpc_decode.url}/metrics")[1]
        return metric(text, cancelled, model_name="dense") > metric(
            before, cancelled, model_name="dense"
        )

    wait_for(freed, 30, 0.05, what="the engine noticing the caller left")
    assert time.monotonic() - hung_up < 10  # a poll, not the 60 s KV deadline
    assert waiting_now() == 0


def test_client_disconnect_cancels_work(engine_pair):
    prefill, _ = engine_pair
    _, before = get(f"{prefill.url}/metrics")
    body = {
        "model": "dense",
        "prompt": "go",
        "max_tokens": 5000,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    payload = json.dumps(body).encode()
    host, port = prefill.url.removeprefix("http://").split(":")

    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(payload)}\r\n\r\n".encode()
            + payload
        )
        received = b""
        while b"data: " not in received:
            received += sock.recv(4096)

    deadline = deadline_in(30)
    while time.monotonic() < deadline:
        _, after = get(f"{prefill.url}/metrics")
        if metric(after, "pdbridge:requests_cancelled_total", model_name="dense") > metric(
            before, "pdbridge:requests_cancelled_total", model_name="dense"
        ):
            break
        time.sleep(0.05)
    generated = metric(after, "vllm:generation_tokens_total", model_name="dense") - metric(
        before, "vllm:generation_tokens_total", model_name="dense"
    )
    assert (
        metric(after, "pdbridge:requests_cancelled_total", model_name="dense")
        == metric(before, "pdbridge:requests_cancelled_total", model_name="dense") + 1
    )
    assert generated < 5000
    assert metric(after, "vllm:num_requests_running", model_name="dense") == 0


def test_weights_hash_mismatch_refuses_to_serve(models_dir):
    result = serve_expecting_exit(
        "--model", "dense", "--models-dir", str(models_dir), "--expect-sha256", "0" * 64
    )

    assert result.returncode == 2
    assert "expect_sha256" in result.stderr
    assert "refusing to serve" in result.stderr
    assert result.stdout == ""


def test_logprobs_completions_and_chat(engine_pair):
    prefill, _ = engine_pair
    body = {
        "model": "dense",
        "prompt": "abc",
        "max_tokens": 3,
        "temperature": 0,
        "ignore_eos": True,
    }

    _, _, comp = post(f"{prefill.url}/v1/completions", {**body, "logprobs": 2})
    chat_body = {
        "model": "dense",
        "messages": [{"role": "user", "content": "abc"}],
        "max_tokens": 2,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": True,
        "top_logprobs": 3,
    }
    _, _, chat = post(f"{prefill.url}/v1/chat/completions", chat_body)
    status, _, bad = post(f"{prefill.url}/v1/completions", {**body, "logprobs": 21})

    lp = comp["choices"][0]["logprobs"]
    assert len(lp["token_logprobs"]) == 3
    assert all(len(top) <= 2 for top in lp["top_logprobs"])
    # Greedy: the chosen token is the most likely one.
    assert all(
        abs(max(top.values()) - chosen) < 1e-6
        for top, chosen in zip(lp["top_logprobs"], lp["token_logprobs"], strict=True)
    )
    content = chat["choices"][0]["logprobs"]["content"]
    assert len(content) == 2
    assert all(len(c["top_logprobs"]) == 3 for c in content)
    assert status == 400
    assert bad["error"]["param"] == "logprobs"

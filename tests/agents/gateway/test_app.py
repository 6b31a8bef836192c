"""HTTP behaviour of the gateway against engine test doubles on loopback."""

import asyncio
import dataclasses
import json
import time

import aiohttp
import pytest

from tests.agents.gateway.harness import FAST, LONG, completion, gateway_env, sse_text


def run(coro):
    return asyncio.run(coro)


def test_short_request_goes_local_with_bytes_and_request_id_passed_through():
    async def scenario():
        async with gateway_env() as env:
            status, headers, body = await env.post(completion("hi"), **{"x-request-id": "req-42"})
            return (
                status,
                headers,
                body,
                env.decode.raw_bodies,
                env.decode.headers,
                env.prefill.requests,
            )

    status, headers, body, raw_bodies, upstream_headers, prefill_requests = run(scenario())

    assert status == 200
    assert headers["x-pdbridge-path"] == "local"
    assert headers["x-request-id"] == "req-42"
    assert json.loads(body)["choices"][0]["text"]
    assert raw_bodies == [json.dumps(completion("hi")).encode()]
    assert upstream_headers[0]["X-Request-Id"] == "req-42"
    assert prefill_requests == []


def test_request_id_generated_when_absent():
    async def scenario():
        async with gateway_env() as env:
            _, headers, _ = await env.post(completion("hi"))
            return headers["x-request-id"], env.decode.headers[0]["X-Request-Id"]

    generated, propagated = run(scenario())

    assert len(generated) == 32
    assert propagated == generated


def test_long_request_goes_remote_with_both_legs_and_same_output_as_local():
    async def scenario():
        async with gateway_env() as env:
            status, headers, body = await env.post(completion(LONG), **{"x-request-id": "r1"})
            remote = (status, headers, json.loads(body))
        async with gateway_env(kill_switch=True) as env_local:
            status, headers, body = await env_local.post(completion(LONG))
            local = (status, headers, json.loads(body))
        return remote, local, env.prefill.requests, env.decode.requests, env.prefill.headers

    remote, local, prefill_requests, decode_requests, prefill_headers = run(scenario())

    assert remote[0] == 200
    assert remote[1]["x-pdbridge-path"] == "remote"
    assert local[1]["x-pdbridge-path"] == "local"
    assert remote[2]["choices"][0]["text"] == local[2]["choices"][0]["text"]
    [prefill] = prefill_requests
    [decode] = decode_requests
    kv = prefill["kv_transfer_params"]
    assert (kv["do_remote_decode"], kv["do_remote_prefill"]) == (True, False)
    assert kv["kv_destination"] == "127.0.0.1:7100"
    assert (prefill["stream"], prefill["max_tokens"]) == (False, 1)
    assert decode["kv_transfer_params"] == {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "transfer_id": kv["transfer_id"],
        "deadline_s": 4.0,
        "request_id": "r1",
    }
    assert kv["request_id"] == "r1"
    assert decode["max_tokens"] == 5
    assert prefill_headers[0]["X-Request-Id"] == "r1"


def test_pull_mode_sends_prefill_first_and_hands_its_kv_params_to_the_decode_leg():
    """vLLM's built-in connectors (kv_transfer.mode: pull): the decode leg goes out only after
    the prefill leg answered, carrying the prefill's ``kv_transfer_params`` unchanged."""

    async def scenario():
        async with gateway_env(kv_mode="pull") as env:
            env.prefill.prefill_delay_s = 0.3
            plain = await env.post(completion(LONG))
            streamed = await env.post(completion(LONG, stream=True))
            pull = (plain, streamed, env.prefill.requests, env.decode.requests)
            timing = (env.prefill.arrivals, env.decode.arrivals)
        async with gateway_env(kill_switch=True) as env_local:
            local = await env_local.post(completion(LONG))
        return pull, timing, local

    (plain, streamed, prefills, decodes), (prefill_at, decode_at), local = run(scenario())

    assert [(r[0], r[1]["x-pdbridge-path"]) for r in (plain, streamed)] == [(200, "remote")] * 2
    assert json.loads(plain[2])["choices"] == json.loads(local[2])["choices"]
    assert streamed[2].endswith(b"data: [DONE]\n\n")
    for prefill, decode, sent, asked in zip(prefills, decodes, prefill_at, decode_at, strict=True):
        assert prefill["kv_transfer_params"] == {
            "do_remote_decode": True,
            "do_remote_prefill": False,
            "remote_engine_id": None,
            "remote_block_ids": None,
            "remote_host": None,
            "remote_port": None,
        }
        assert (prefill["stream"], prefill["max_tokens"]) == (False, 1)
        params = decode["kv_transfer_params"]
        assert params["remote_engine_id"] == "prefill"
        assert params["remote_request_id"].startswith("pull-")
        assert asked - sent >= 0.3  # sent after the prefill answered, not beside it
    assert decodes[1]["stream"] is True


def test_pull_mode_prefill_answer_without_kv_params_falls_back():
    async def scenario():
        async with gateway_env(kv_mode="pull") as env:
            env.prefill.omit_kv_params = True
            result = await env.post(completion(LONG))
            return result, env.decode.requests, await env.metrics()

    (status, headers, _), decode_requests, metrics = run(scenario())

    assert (status, headers["x-pdbridge-path"]) == (200, "fallback")
    [local_leg] = decode_requests  # only the local prefill + decode, no remote decode leg
    assert "kv_transfer_params" not in local_leg
    assert 'pdbridge_gateway_fallbacks_total{cause="prefill_error"} 1.0' in metrics


def test_streaming_passes_sse_through_byte_for_byte():
    body = completion(LONG, stream=True, stream_options={"include_usage": True})

    async def scenario():
        async with gateway_env() as env:
            status, headers, through = await env.post(body)
            # The same request straight to the double's local path.
            async with env.client.post(env.decode.url + "/v1/completions", json=body) as r:
                direct = await r.read()
            return status, headers, through, direct

    status, headers, through, direct = run(scenario())

    assert status == 200
    assert headers["x-pdbridge-path"] == "remote"
    assert headers["Content-Type"].startswith("text/event-stream")
    events = [line for line in through.decode().split("\n\n") if line]
    assert events[-1] == "data: [DONE]"
    assert '"usage"' in events[-2]

    # Remote decode and direct local produce the same stream modulo the creation time.
    def strip(raw):
        return [
            json.loads(e[6:]) | {"created": 0}
            for e in raw.decode().split("\n\n")
            if e.startswith("data: {")
        ]

    assert strip(through) == strip(direct)
    assert sse_text(through) == sse_text(direct)


def test_chat_completions_route_remote_and_local():
    chat_long = {"model": "tiny", "messages": [{"role": "user", "content": LONG}], "max_tokens": 3}
    chat_short = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}

    async def scenario():
        async with gateway_env() as env:
            long = await env.post(chat_long, "/v1/chat/completions")
            short = await env.post(chat_short, "/v1/chat/completions")
            return long, short

    long, short = run(scenario())

    assert (long[0], long[1]["x-pdbridge-path"]) == (200, "remote")
    assert (short[0], short[1]["x-pdbridge-path"]) == (200, "local")
    assert json.loads(long[2])["choices"][0]["message"]["content"]


def test_prefill_failure_falls_back_then_breaker_opens_and_stops_sending_remote():
    async def scenario():
        async with gateway_env() as env:
            env.prefill.fail_status = 500
            paths = []
            for _ in range(6):
                status, headers, _ = await env.post(completion(LONG))
                paths.append((status, headers["x-pdbridge-path"]))
            async with env.client.get(env.url + "/debug/routing") as r:
                debug = await r.json()
            return paths, len(env.prefill.requests), await env.metrics(), debug

    paths, prefill_calls, metrics, debug = run(scenario())

    assert paths == [(200, "fallback")] * 6
    # consecutive_failures=3 opens the breaker; later requests never reach the prefill site.
    assert prefill_calls == 3
    assert 'pdbridge_gateway_fallbacks_total{cause="prefill_error"} 3.0' in metrics
    assert 'pdbridge_gateway_fallbacks_total{cause="breaker_open"} 3.0' in metrics
    assert 'pdbridge_gateway_breaker_state{name="remote",scope="site"} 2.0' in metrics
    assert 'pdbridge_gateway_requests_total{outcome="ok",path="fallback"} 6.0' in metrics
    site = debug["sites"][0]
    assert site["breaker"]["state"] == "open"
    assert site["breaker"]["last_reason"] == "consecutive_failures"
    assert site["available"] is False


def test_kv_that_never_arrives_falls_back_as_a_deadline_not_as_damaged_kv():
    """The decode engine's 503 ``kv_timeout`` (it waited the deployment's deadline) is the
    cause ``kv_timeout``, never ``kv_transfer`` (rejected or corrupt KV)."""

    async def scenario():
        async with gateway_env(kv_timeout_s=0.3) as env:
            env.prefill.drop_kv = True
            result = await env.post(completion(LONG, stream=True))
            return result, await env.metrics()

    (status, headers, body), metrics = run(scenario())

    assert (status, headers["x-pdbridge-path"]) == (200, "fallback")
    assert body.endswith(b"data: [DONE]\n\n")
    assert 'pdbridge_gateway_fallbacks_total{cause="kv_timeout"} 1.0' in metrics
    assert 'pdbridge_gateway_fallbacks_total{cause="kv_transfer"} 0.0' in metrics


def test_a_prefill_engine_whose_send_missed_the_kv_deadline_falls_back_as_a_deadline():
    """The prefill engine's 503 ``kv_timeout`` (its send ran past ``kv_transfer.timeout_ms``)
    is the cause ``kv_timeout``, not a prefill error and not damaged KV."""

    async def scenario():
        async with gateway_env() as env:
            env.prefill.fail_status = 503
            env.prefill.fail_code = "kv_timeout"
            return await env.post(completion(LONG)), await env.metrics()

    (status, headers, _), metrics = run(scenario())

    assert (status, headers["x-pdbridge-path"]) == (200, "fallback")
    assert 'pdbridge_gateway_fallbacks_total{cause="kv_timeout"} 1.0' in metrics
    assert 'pdbridge_gateway_fallbacks_total{cause="kv_transfer"} 0.0' in metrics
    assert 'pdbridge_gateway_fallbacks_total{cause="prefill_error"} 0.0' in metrics


def test_slow_prefill_times_out_and_falls_back():
    from dataclasses import replace

    from tests.agents.gateway.harness import FAST

    async def scenario():
        async with gateway_env(replace(FAST, prefill_timeout_s=0.2), kv_timeout_s=5) as env:
            env.prefill.prefill_delay_s = 2
            result = await env.post(completion(LONG))
            return result, await env.metrics(), env.decode.cancelled

    (status, headers, _), metrics, decode_cancelled = run(scenario())

    assert (status, headers["x-pdbridge-path"]) == (200, "fallback")
    assert 'pdbridge_gateway_fallbacks_total{cause="prefill_timeout"} 1.0' in metrics
    # The decode leg that was waiting for the KV was cancelled, not left waiting.
    assert decode_cancelled == 1


def test_kill_switch_and_zero_share_keep_long_requests_local():
    async def scenario():
        async with gateway_env(kill_switch=True) as env:
            killed = await env.post(completion(LONG))
        async with gateway_env(remote_share_percent=0) as env:
            unshared = await env.post(completion(LONG))
        return killed[1]["x-pdbridge-path"], unshared[1]["x-pdbridge-path"]

    assert run(scenario()) == ("local", "local")


def test_fallback_budget_exhausted_gives_503_with_retry_after():
    from dataclasses import replace

    from tests.agents.gateway.harness import FAST

    settings = replace(FAST, fallback_rate_per_s=1, fallback_burst=2, fallback_max_wait_s=0.1)

    async def scenario():
        async with gateway_env(settings) as env:
            env.prefill.fail_status = 503
            results = await asyncio.gather(*(env.post(completion(LONG)) for _ in range(8)))
            return results, await env.metrics(), env.decode.requests

    results, metrics, decode_requests = run(scenario())

    statuses = sorted(status for status, _, _ in results)
    assert statuses == [200, 200, 503, 503, 503, 503, 503, 503]
    rejected = [(h, json.loads(b)) for s, h, b in results if s == 503]
    for headers, body in rejected:
        assert int(headers["retry-after"]) >= 1
        assert headers["x-pdbridge-path"] == "fallback"
        assert body["error"]["code"] == "fallback_budget_exhausted"
    # Decode nodes prefilled locally only the budgeted fallbacks (the other requests they saw
    # were remote decode legs, cancelled when their prefill failed).
    assert len([r for r in decode_requests if "kv_transfer_params" not in r]) == 2
    assert "pdbridge_gateway_fallback_budget_rejections_total 6.0" in metrics


@pytest.mark.parametrize("code", ["kv_peer_refused", "kv_unreachable"])
def test_a_prefill_engine_refused_by_or_cut_from_the_kv_receiver_falls_back_with_that_cause(code):
    """The prefill engine's 503 ``kv_peer_refused`` (TLS or allowlist between it and the
    decode site's receiver: a certificate to fix) or ``kv_unreachable`` (it could not reach
    the receiver: down, or the path cut) is told apart from other prefill errors."""

    async def scenario():
        async with gateway_env() as env:
            env.prefill.fail_status = 503
            env.prefill.fail_code = code
            return await env.post(completion(LONG)), await env.metrics()

    (status, headers, _), metrics = run(scenario())

    assert (status, headers["x-pdbridge-path"]) == (200, "fallback")
    assert f'pdbridge_gateway_fallbacks_total{{cause="{code}"}} 1.0' in metrics
    assert 'pdbridge_gateway_fallbacks_total{cause="prefill_error"} 0.0' in metrics


def test_fallback_disabled_gives_503_without_touching_decode():
    async def scenario():
        async with gateway_env(fallback_to_local_prefill=False) as env:
            env.prefill.fail_status = 500
            return await env.post(completion(LONG)), env.decode.requests

    (status, _, body), decode_requests = run(scenario())

    assert status == 503
    assert json.loads(body)["error"]["code"] == "prefill_error"
    assert len(decode_requests) == 1  # only the cancelled remote decode leg


@pytest.mark.parametrize(
    ("raw", "status", "code", "param"),
    [
        (b"{not json", 400, "invalid_json", None),
        (b"[1, 2]", 400, "invalid_json", None),
        (json.dumps({"model": "gpt-9", "prompt": "x"}).encode(), 404, "model_not_found", "model"),
        (json.dumps({"model": "tiny"}).encode(), 400, "invalid_value", "prompt"),
        (json.dumps({"model": "tiny", "prompt": ""}).encode(), 400, "invalid_value", "prompt"),
        (json.dumps({"model": "tiny", "prompt": [1.5]}).encode(), 400, "invalid_type", "prompt"),
        (
            json.dumps({"model": "tiny", "prompt": "x", "max_tokens": 0}).encode(),
            400,
            "invalid_value",
            "max_tokens",
        ),
        (
            json.dumps({"model": "tiny", "prompt": "x", "temperature": 9}).encode(),
            400,
            "invalid_value",
            "temperature",
        ),
        (
            json.dumps({"model": "tiny", "prompt": "x", "stream": "yes"}).encode(),
            400,
            "invalid_type",
            "stream",
        ),
        (
            json.dumps({"model": "tiny", "prompt": "x", "kv_transfer_params": {}}).encode(),
            400,
            "invalid_value",
            "kv_transfer_params",
        ),
        (
            json.dumps({"model": "tiny", "prompt": list(range(9000))}).encode(),
            400,
            "context_length_exceeded",
            "prompt",
        ),
    ],
)
def test_bad_input_gets_openai_style_4xx(raw, status, code, param):
    async def scenario():
        async with (
            gateway_env() as env,
            env.client.post(
                env.url + "/v1/completions", data=raw, headers={"Content-Type": "application/json"}
            ) as r,
        ):
            return r.status, await r.json(), env.decode.requests

    got_status, body, decode_requests = run(scenario())

    assert got_status == status
    assert body["error"]["code"] == code
    assert body["error"]["param"] == param
    assert body["error"]["type"] == "invalid_request_error"
    assert decode_requests == []


def test_bad_chat_messages_name_the_field():
    async def scenario():
        async with gateway_env() as env:
            return await env.post(
                {"model": "tiny", "messages": [{"content": "x"}]}, "/v1/chat/completions"
            )

    status, _, body = run(scenario())

    assert status == 400
    assert json.loads(body)["error"]["param"] == "messages[0]"


def test_body_too_large_is_413():
    from dataclasses import replace

    from tests.agents.gateway.harness import FAST

    async def scenario():
        async with gateway_env(replace(FAST, max_body_bytes=1000)) as env:
            return await env.post(completion("x" * 2000))

    status, _, body = run(scenario())

    assert status == 413
    assert json.loads(body)["error"]["code"] == "body_too_large"


def test_models_health_and_unknown_route():
    async def scenario():
        async with gateway_env() as env:
            async with env.client.get(env.url + "/v1/models") as r:
                models = await r.json()
            async with env.client.get(env.url + "/health") as r:
                health = (r.status, await r.json())
            async with env.client.get(env.url + "/v1/nothing") as r:
                missing = (r.status, await r.json())
            return models, health, missing

    models, health, missing = run(scenario())

    assert [m["id"] for m in models["data"]] == ["tiny"]
    assert health == (
        200,
        {
            "status": "ok",
            "config_version": 3,
            "pools": [
                {
                    "role": "decode",
                    "site": "local",
                    "healthy": 1,
                    "total": 1,
                    "drained": 0,
                    "status": "ok",
                },
                {
                    "role": "prefill",
                    "site": "remote",
                    "healthy": 1,
                    "total": 1,
                    "drained": 0,
                    "status": "ok",
                },
            ],
        },
    )
    assert missing[0] == 404
    assert missing[1]["error"]["type"] == "invalid_request_error"


def test_client_disconnect_cancels_remote_legs():
    async def scenario():
        async with gateway_env(kv_timeout_s=5) as env:
            env.decode.token_delay_s = 0.2
            body = completion(LONG, stream=True, max_tokens=50)
            async with env.client.post(env.url + "/v1/completions", json=body) as r:
                assert r.headers["x-pdbridge-path"] == "remote"
                await r.content.readany()
            for _ in range(50):
                if env.decode.cancelled:
                    break
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.1)
            return env.decode.cancelled, env.decode.completed, await env.metrics()

    cancelled, completed, metrics = run(scenario())

    assert cancelled == 1
    assert completed == 0
    assert 'pdbridge_gateway_requests_total{outcome="canceled",path="remote"} 1.0' in metrics


def test_client_disconnect_while_waiting_for_kv_cancels_both_legs():
    async def scenario():
        async with gateway_env(kv_timeout_s=5) as env:
            env.prefill.prefill_delay_s = 3
            body = completion(LONG, stream=True)
            with pytest.raises(asyncio.TimeoutError):
                async with env.client.post(
                    env.url + "/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=0.3)
                ) as r:
                    await r.read()
            for _ in range(40):
                if env.decode.cancelled and env.prefill.cancelled:
                    break
                await asyncio.sleep(0.05)
            return env.decode.cancelled, env.prefill.cancelled

    assert run(scenario()) == (1, 1)


def test_stream_chunks_reach_the_client_while_the_upstream_holds_the_rest():
    """Pass-through, never buffered: the events sent so far arrive while the engine waits
    (also the first one alone, and the last one before the stream's end)."""

    async def read_events(response, n):
        seen = b""
        while seen.count(b"data: ") < n:
            seen += await asyncio.wait_for(response.content.readany(), 5)
        return seen

    async def scenario():
        async with gateway_env() as env:
            env.decode.hold_after_events = 3
            env.decode.token_delay_s = 0.02  # events leave the engine one by one
            body = completion("hi", stream=True, max_tokens=6)
            async with env.client.post(env.url + "/v1/completions", json=body) as response:
                before = await read_events(response, 3)
                upstream_still_open = env.decode.active
                env.decode.release.set()
                rest = await response.read()
            return before, upstream_still_open, rest

    before, upstream_still_open, rest = run(scenario())

    assert before.count(b"data: ") == 3
    assert upstream_still_open == 1
    assert rest.count(b"data: {") == 3
    assert rest.endswith(b"data: [DONE]\n\n")


def test_engine_holding_the_end_of_a_stream_does_not_hold_its_last_event():
    async def scenario():
        async with gateway_env() as env:
            env.decode.hold_after_events = 4  # after the last token event, before [DONE]
            env.decode.token_delay_s = 0.02
            body = completion("hi", stream=True, max_tokens=4)
            async with env.client.post(env.url + "/v1/completions", json=body) as response:
                seen = b""
                while seen.count(b"data: {") < 4:
                    seen += await asyncio.wait_for(response.content.readany(), 5)
                env.decode.release.set()
                return seen + await response.read()

    body = run(scenario())

    assert [e for e in body.decode().split("\n\n") if e][-1] == "data: [DONE]"
    assert body.count(b"data: {") == 4


def test_error_after_first_byte_is_an_sse_error_event():
    async def scenario():
        async with gateway_env() as env:
            env.decode.die_after_events = 2
            return await env.post(completion("hi", stream=True, max_tokens=5)), await env.metrics()

    (status, headers, body), metrics = run(scenario())

    assert (status, headers["x-pdbridge-path"]) == (200, "local")
    events = [e for e in body.decode().split("\n\n") if e]
    assert len(events) == 3
    assert json.loads(events[-1][6:])["error"]["code"] == "upstream_error"
    assert 'pdbridge_gateway_requests_total{outcome="upstream_error",path="local"} 1.0' in metrics


def test_slow_reader_does_not_stall_other_streams():
    async def scenario():
        async with gateway_env() as env:
            body = completion("x", stream=True, max_tokens=4000)
            stalled = await env.client.post(env.url + "/v1/completions", json=body)
            await stalled.content.readany()  # then never read again
            others = await asyncio.wait_for(
                asyncio.gather(*(env.post(completion("y", stream=True)) for _ in range(10))), 10
            )
            stalled.close()
            return [status for status, _, _ in others]

    assert run(scenario()) == [200] * 10


def test_local_engine_error_is_relayed_as_4xx_or_502():
    async def scenario():
        async with gateway_env() as env:
            env.decode.fail_status = 500
            server_error = await env.post(completion("hi"))
            env.decode.fail_status = 400
            client_error = await env.post(completion("hi"))
            return server_error, client_error

    server_error, client_error = run(scenario())

    assert server_error[0] == 502
    assert json.loads(server_error[2])["error"]["type"] == "upstream_error"
    assert client_error[0] == 400
    assert json.loads(client_error[2])["error"]["message"] == "injected failure"


def test_leg_past_request_timeout_ends_with_an_error_event_or_502():
    """request_timeout_s bounds the whole local leg: mid-stream it becomes an SSE error event,
    before the headers a 502 naming the timeout; the engine's work is aborted both times."""
    settings = dataclasses.replace(FAST, request_timeout_s=0.6)

    async def scenario():
        async with gateway_env(settings) as env:
            env.decode.token_delay_s = 0.2  # 10 tokens: 2 s, past the 0.6 s bound
            started = time.monotonic()
            streamed = await env.post(completion("hi", stream=True, max_tokens=10))
            streamed_s = time.monotonic() - started
            whole = await env.post(completion("hi", max_tokens=10))
            await asyncio.sleep(0.1)
            return streamed, streamed_s, whole, env.decode.cancelled, await env.metrics()

    (status, headers, body), streamed_s, whole, cancelled, metrics = run(scenario())

    assert (status, headers["x-pdbridge-path"]) == (200, "local")
    events = [e for e in body.decode().split("\n\n") if e]
    assert 1 <= len(events) - 1 <= 4
    assert json.loads(events[-1][6:])["error"] == {
        "message": "upstream failed: TimeoutError", "type": "upstream_error", "param": None,
        "code": "upstream_error",
    }  # fmt: skip
    assert streamed_s < 1.5
    assert whole[0] == 502
    assert json.loads(whole[2])["error"]["message"] == "the decode engine failed: timeout"
    assert cancelled == 2
    assert 'pdbridge_gateway_requests_total{outcome="upstream_error",path="local"} 2.0' in metrics


def test_metrics_exported_with_prefix():
    async def scenario():
        async with gateway_env() as env:
            await env.post(completion("hi", stream=True))
            await env.post(completion(LONG, stream=True))
            return await env.metrics()

    metrics = run(scenario())

    assert 'pdbridge_gateway_decisions_total{path="local",reason="below_threshold"} 1.0' in metrics
    assert 'pdbridge_gateway_decisions_total{path="remote",reason="remote"} 1.0' in metrics
    assert 'pdbridge_gateway_time_to_first_token_seconds_count{path="remote"} 1.0' in metrics
    assert 'pdbridge_gateway_time_per_output_token_seconds_count{path="local"} 1.0' in metrics
    assert "pdbridge_gateway_effective_threshold_tokens 100.0" in metrics
    assert "pdbridge_gateway_remote_share_ratio 1.0" in metrics
    assert 'pdbridge_gateway_requests_in_flight{path="remote"} 0.0' in metrics


def test_engine_refusal_is_relayed_and_does_not_trip_the_breaker():
    async def scenario():
        async with gateway_env() as env:
            # Estimated under the context (7,750 tokens), refused by the engine (its limit).
            results = [await env.post(completion("w" * 31000)) for _ in range(4)]
            breaker = env.gateway.router.site_breakers["remote"].state
            return results, breaker, await env.metrics()

    results, breaker, metrics = run(scenario())

    for status, headers, body in results:
        assert status == 400
        assert headers["x-pdbridge-path"] == "remote"
        assert json.loads(body)["error"]["code"] == "context_length_exceeded"
    assert breaker == "closed"
    assert 'pdbridge_gateway_requests_total{outcome="client_error",path="remote"} 4.0' in metrics
    assert 'pdbridge_gateway_fallbacks_total{cause="prefill_error"} 0.0' in metrics

"""Admission control through a real gateway server and engine doubles on loopback: requests
beyond the in-flight limit wait in a bounded queue; beyond the queue (or past its wait) a 429
in OpenAI's error shape with Retry-After, counted; queued requests are served once a slot
frees, oldest first."""

import asyncio
import dataclasses
import json

from agents.gateway.admission import Admission
from tests.agents.gateway.harness import FAST, completion, gateway_env

LIMITED = dataclasses.replace(
    FAST, max_in_flight_requests=2, max_queued_requests=2, admission_queue_timeout_s=60.0
)


def run(coro):
    return asyncio.run(coro)


async def _until(predicate, timeout_s: float = 30.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not predicate():
            await asyncio.sleep(0.01)


def test_beyond_in_flight_and_queue_a_429_with_retry_after_then_the_queue_is_served():
    async def scenario():
        async with gateway_env(LIMITED) as env:
            env.decode.hold_after_events = 1
            held = [
                asyncio.create_task(env.post(completion(f"p{i}", stream=True))) for i in range(2)
            ]
            await _until(lambda: env.decode.active == 2)
            queued = [asyncio.create_task(env.post(completion(f"q{i}"))) for i in range(2)]
            await _until(lambda: env.gateway.admission.queued == 2)
            refused = await env.post(completion("over"))
            engine_saw = len(env.decode.requests)
            env.decode.release.set()
            served = await asyncio.gather(*held, *queued)
            return refused, engine_saw, served, await env.metrics()

    (status, headers, body), engine_saw, served, metrics = run(scenario())

    assert status == 429
    assert headers["retry-after"] == "1"
    assert json.loads(body) == {
        "error": {
            "message": "the gateway is serving its limit of 2 requests with 2 waiting "
            "(queue_full); retry later",
            "type": "requests",
            "param": None,
            "code": "rate_limit_exceeded",
        }
    }
    assert engine_saw == 2
    assert [s for s, _, _ in served] == [200, 200, 200, 200]
    assert 'pdbridge_gateway_admission_rejections_total{reason="queue_full"} 1.0' in metrics


def test_a_request_queued_past_its_wait_gets_429_queue_timeout():
    settings = dataclasses.replace(
        LIMITED, max_in_flight_requests=1, max_queued_requests=4, admission_queue_timeout_s=0.2
    )

    async def scenario():
        async with gateway_env(settings) as env:
            env.decode.hold_after_events = 1
            held = asyncio.create_task(env.post(completion("p", stream=True)))
            await _until(lambda: env.decode.active == 1)
            refused = await env.post(completion("late"))
            env.decode.release.set()
            await held
            after = await env.post(completion("after"))
            return refused, after, await env.metrics(), env.gateway.admission.in_flight

    (status, headers, _), after, metrics, in_flight = run(scenario())

    assert (status, headers["retry-after"]) == (429, "1")
    assert after[0] == 200
    assert 'pdbridge_gateway_admission_rejections_total{reason="queue_timeout"} 1.0' in metrics
    assert in_flight == 0


def test_slots_go_to_the_oldest_waiter_and_a_cancelled_waiter_leaves_the_queue():
    async def scenario():
        admission = Admission(max_in_flight=1, max_queued=3, queue_timeout_s=30)
        order: list[str] = []
        assert await admission.acquire() is None

        async def wait(name: str) -> None:
            assert await admission.acquire() is None
            order.append(name)

        first = asyncio.create_task(wait("first"))
        gone = asyncio.create_task(wait("gone"))
        last = asyncio.create_task(wait("last"))
        await _until(lambda: admission.queued == 3)
        gone.cancel()
        await _until(lambda: admission.queued == 2)
        admission.release()
        await first
        admission.release()
        await last
        admission.release()
        return order, admission.in_flight, admission.queued

    order, in_flight, queued = run(scenario())

    assert order == ["first", "last"]
    assert (in_flight, queued) == (0, 0)


BODILESS = (
    b"POST /v1/completions HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n"
)


def test_bodiless_posts_hold_no_admission_slot_and_normal_requests_are_served():
    """1,100 connections send a chunked POST head and nothing more (more than the 1,024
    slots): admission comes after the body, so 20 normal requests are all served."""
    settings = dataclasses.replace(FAST, admission_queue_timeout_s=2.0)

    async def scenario():
        async with gateway_env(settings) as env:
            server = env.running.runner.server
            assert server is not None
            before = server.requests_count
            writers = []
            for _ in range(1100):
                _, writer = await asyncio.open_connection("127.0.0.1", env.running.port)
                writer.write(BODILESS)
                writers.append(writer)
            # Every head reached a request handler (aiohttp's, after the fast path's handover).
            await _until(lambda: server.requests_count - before >= 1100, 120)
            served = await asyncio.gather(*(env.post(completion(f"n{i}")) for i in range(20)))
            in_flight = env.gateway.admission.in_flight
            for writer in writers:
                writer.close()
            return [s for s, _, _ in served], in_flight

    statuses, in_flight = run(scenario())

    assert statuses == [200] * 20
    assert in_flight == 0


def test_a_request_whose_body_does_not_arrive_in_time_gets_408_and_its_connection_closes():
    """On aiohttp's side (a chunked body) and on the fast path's (a Content-Length body
    that stops half way)."""
    settings = dataclasses.replace(FAST, request_read_timeout_s=1.0)
    partial = (
        b"POST /v1/completions HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n"
        b'Content-Length: 100\r\n\r\n{"model": "tiny"'
    )

    async def answer(port: int, data: bytes) -> bytes:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(data)
        try:
            async with asyncio.timeout(30):
                return await reader.read()  # to the connection's end
        finally:
            writer.close()

    async def scenario():
        async with gateway_env(settings) as env:
            chunked = await answer(env.running.port, BODILESS)
            fast = await answer(env.running.port, partial)
            after = await env.post(completion("after"))
            return chunked, fast, after[0], env.gateway.admission.in_flight

    chunked, fast, after, in_flight = run(scenario())

    for raw in (chunked, fast):
        head, _, body = raw.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408 "), raw
        assert json.loads(body)["error"]["code"] == "request_timeout"
    assert b"request_read_timeout_s" in chunked
    assert (after, in_flight) == (200, 0)


def test_one_client_address_holds_at_most_its_share_of_the_slots():
    settings = dataclasses.replace(LIMITED, max_in_flight_requests=8, max_in_flight_per_client=2)

    async def scenario():
        async with gateway_env(settings) as env:
            env.decode.hold_after_events = 1
            held = [
                asyncio.create_task(env.post(completion(f"p{i}", stream=True))) for i in range(2)
            ]
            await _until(lambda: env.decode.active == 2)
            refused = await env.post(completion("third"))
            env.decode.release.set()
            await asyncio.gather(*held)
            after = await env.post(completion("after"))
            return refused, after[0], await env.metrics(), env.gateway.admission.per_client

    (status, headers, body), after, metrics, per_client = run(scenario())

    assert (status, headers["retry-after"]) == (429, "1")
    assert json.loads(body)["error"]["message"] == (
        "this client address holds its limit of 2 requests served or waiting (client_limit); "
        "retry later"
    )
    assert after == 200
    assert 'pdbridge_gateway_admission_rejections_total{reason="client_limit"} 1.0' in metrics
    assert per_client == {}


def test_a_lone_decode_instance_whose_probes_fail_keeps_its_waiting_requests():
    """Legs waiting on an instance found unhealthy are abandoned only when another decode
    instance can take them: an overloaded lone engine (its /health failing) still serves the
    requests it holds, it does not turn them into 502s."""
    settings = dataclasses.replace(FAST, health_check_interval_s=0.1, health_check_timeout_s=0.5)

    async def scenario():
        async with gateway_env(settings) as env:
            env.decode.local_prefill_delay_s = 2.0
            waiting = asyncio.create_task(env.post(completion("held", stream=True)))
            await _until(lambda: env.decode.active == 1)
            env.decode.health_status = 503
            await _until(lambda: env.gateway.router.pool("decode", "local").healthy_count() == 0)
            status, _, _ = await waiting
            return status

    assert run(scenario()) == 200

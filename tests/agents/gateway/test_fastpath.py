"""The gateway's own HTTP/1.1 server for the completions endpoints (``fast_server``): it
answers exactly as aiohttp's does, and hands every connection it does not serve (another
endpoint, anything unusual, a malformed request) to aiohttp intact. Raw sockets against a
real gateway and engine test doubles on loopback."""

import asyncio
import dataclasses
import json

import httptools
import pytest

from tests.agents.gateway.harness import FAST, completion, gateway_env


def run(coro):
    return asyncio.run(coro)


class _Responses:
    """httptools callbacks collecting whole responses from a byte stream."""

    def __init__(self):
        self.done = []
        self._headers = {}
        self._body = []
        self.parser = httptools.HttpResponseParser(self)

    def on_header(self, name, value):
        self._headers[name.decode().lower()] = value.decode()

    def on_body(self, body):
        self._body.append(body)

    def on_message_complete(self):
        status = self.parser.get_status_code()
        if status != 100:  # an interim "100 Continue" is not an answer
            self.done.append((status, self._headers, b"".join(self._body)))
        self._headers, self._body = {}, []


async def exchange(port, raw, responses, reader_writer=None):
    """Send ``raw`` on one connection (a new one, or ``reader_writer``) and read
    ``responses`` whole responses. Returns them and the connection."""
    reader, writer = reader_writer or await asyncio.open_connection("127.0.0.1", port)
    writer.write(raw)
    collected = _Responses()
    while len(collected.done) < responses:
        data = await asyncio.wait_for(reader.read(65536), 5)
        if not data:
            break
        collected.parser.feed_data(data)
    return collected.done, (reader, writer)


def post(body, path="/v1/completions", extra=b"", version=b"1.1"):
    data = json.dumps(body).encode()
    return (
        b"POST %s HTTP/%s\r\nHost: gw\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n%s\r\n%s" % (path.encode(), version, len(data), extra, data)
    )


@pytest.mark.parametrize("fast_server", [True, False])
def test_both_servers_answer_alike(fast_server):
    """The same requests, streamed and not, on the fast server and on aiohttp's alone."""
    settings = dataclasses.replace(FAST, fast_server=fast_server)

    async def scenario():
        async with gateway_env(settings) as env:
            stream = completion("hi", stream=True, max_tokens=4)
            raw = post(stream, extra=b"x-request-id: r-1\r\n") + post(completion("hi"))
            answers, (_, writer) = await exchange(env.running.port, raw, 2)
            writer.close()
            return answers, env.running.fast is not None

    (streamed, whole), fast = run(scenario())

    assert fast == fast_server
    status, headers, body = streamed
    assert (status, headers["x-pdbridge-path"], headers["x-request-id"]) == (200, "local", "r-1")
    assert headers["content-type"] == "text/event-stream"
    assert headers["transfer-encoding"] == "chunked"
    assert headers["cache-control"] == "no-cache"
    assert body.count(b"data: {") == 4
    assert body.endswith(b"data: [DONE]\n\n")
    status, headers, body = whole
    assert (status, headers["x-pdbridge-path"]) == (200, "local")
    assert headers["content-type"] == "application/json"
    assert int(headers["content-length"]) == len(body)
    assert json.loads(body)["choices"][0]["text"]


def test_connection_handed_to_aiohttp_keeps_serving():
    """After a fast request, a GET on the same connection goes to aiohttp, which then serves
    the connection's completions too; pipelined requests are answered in order."""

    async def scenario():
        async with gateway_env() as env:
            port = env.running.port
            first, conn = await exchange(port, post(completion("hi")), 1)
            rest, conn = await exchange(
                port,
                b"GET /health HTTP/1.1\r\nHost: gw\r\n\r\n" + post(completion("hi", stream=True)),
                2,
                conn,
            )
            conn[1].close()
            return first + rest

    (first, health, after) = run(scenario())

    assert first[0] == 200
    assert first[1]["x-pdbridge-path"] == "local"
    assert health[0] == 200
    assert json.loads(health[2])["status"] == "ok"
    assert after[0] == 200
    assert after[2].endswith(b"data: [DONE]\n\n")


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        (b"Expect: 100-continue\r\n", 200),  # handed over: aiohttp sends 100 Continue first
        (b"Connection: close\r\n", 200),
        (b"x-pdbridge-key: a\r\nx-pdbridge-key: b\r\n", 200),
    ],
)
def test_unusual_requests_are_served_by_aiohttp(extra, expected):
    async def scenario():
        async with gateway_env() as env:
            answers, (_, writer) = await exchange(
                env.running.port, post(completion("hi", stream=True), extra=extra), 1
            )
            writer.close()
            return answers

    answers = run(scenario())

    assert answers[0][0] == expected
    assert answers[0][2].endswith(b"data: [DONE]\n\n")


def test_chunked_request_body_and_http10_are_served():
    body = json.dumps(completion("hi")).encode()
    chunked = (
        b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nTransfer-Encoding: chunked\r\n"
        b"Content-Type: application/json\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
    )

    async def scenario():
        async with gateway_env() as env:
            port = env.running.port
            a, (_, w1) = await exchange(port, chunked, 1)
            b, (r2, w2) = await exchange(port, post(completion("hi"), version=b"1.0"), 1)
            closed = await asyncio.wait_for(r2.read(), 5)
            w1.close()
            w2.close()
            return a[0], b[0], closed

    chunked_answer, http10_answer, after_http10 = run(scenario())

    assert chunked_answer[0] == 200
    assert json.loads(chunked_answer[2])["choices"]
    assert http10_answer[0] == 200
    assert json.loads(http10_answer[2])["choices"]
    assert after_http10 == b""  # HTTP/1.0 without keep-alive: the connection ends


@pytest.mark.parametrize(
    ("raw", "status"),
    [
        (b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Length: 5\r\n\r\n{bad}", 400),
        (b"PUT /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Length: 0\r\n\r\n", 405),
        (b"POST /v1/other HTTP/1.1\r\nHost: gw\r\nContent-Length: 2\r\n\r\n{}", 404),
        (b"POST /v1/completions HTTP/1.1\r\nHo st: gw\r\n\r\n", 400),
        (b"GARBAGE\r\n\r\n", 400),
        # Bare line feeds: answered (by aiohttp), not left waiting for a CRLF head end.
        (b"POST /v1/completions HTTP/1.1\nHost: gw\nContent-Length: 2\n\n{}", 400),
    ],
)
def test_bad_requests_get_clear_4xx(raw, status):
    async def scenario():
        async with gateway_env() as env:
            answers, (_, writer) = await exchange(env.running.port, raw, 1)
            writer.close()
            return answers

    answers = run(scenario())

    assert answers[0][0] == status


def test_stop_lets_an_in_flight_fast_stream_finish():
    async def scenario():
        async with gateway_env() as env:
            env.decode.token_delay_s = 0.05
            task = asyncio.create_task(
                exchange(env.running.port, post(completion("hi", stream=True, max_tokens=6)), 1)
            )
            await asyncio.sleep(0.1)
            await env.running.stop(grace_s=5)
            answers, (_, writer) = await task
            writer.close()
            return answers

    answers = run(scenario())

    assert answers[0][0] == 200
    assert answers[0][2].count(b"data: {") == 6
    assert answers[0][2].endswith(b"data: [DONE]\n\n")


def test_fast_path_and_hand_over_over_tls(tmp_path):
    """HTTPS serving: a completion on the fast path, then a GET handed to aiohttp on the same
    TLS connection, then another completion (aiohttp's from then on)."""
    import ssl

    from agents.gateway.app import Gateway
    from agents.gateway.config import parse_snapshot
    from agents.gateway.server import start
    from grpc_kv.certs import create_ca, create_node_cert
    from tests.agents.gateway.engine_double import EngineDouble, KvStore
    from tests.agents.gateway.snapshots import snapshot

    ca = create_ca(tmp_path / "ca")
    cert = create_node_cert(ca, tmp_path / "certs", "gateway", loopback=True)
    server_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_tls.load_cert_chain(cert.cert_file, cert.key_file)
    client_tls = ssl.create_default_context(cafile=str(ca.ca_file))

    async def scenario():
        kv = KvStore()
        decode = await EngineDouble("decode", kv).start()
        prefill = await EngineDouble("prefill", kv).start()
        gateway = Gateway(FAST)
        gateway.apply(
            parse_snapshot(
                snapshot(decode_urls=(decode.url,), prefill_sites={"remote": (prefill.url,)})
            )
        )
        running = await start(gateway, ssl_server=server_tls)
        try:
            conn = await asyncio.open_connection(
                "127.0.0.1", running.port, ssl=client_tls, server_hostname="127.0.0.1"
            )
            answers = []
            for raw in (
                post(completion("hi", stream=True)),
                b"GET /health HTTP/1.1\r\nHost: gw\r\n\r\n",
                post(completion("hi")),
            ):
                got, conn = await exchange(running.port, raw, 1, conn)
                answers += got
            conn[1].close()
            return answers
        finally:
            await running.stop()
            await decode.stop()
            await prefill.stop()

    streamed, health, whole = run(scenario())

    assert streamed[0] == 200
    assert streamed[2].endswith(b"data: [DONE]\n\n")
    assert json.loads(health[2])["status"] == "ok"
    assert whole[0] == 200
    assert json.loads(whole[2])["choices"]

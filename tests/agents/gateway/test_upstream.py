"""The gateway's upstream HTTP/1.1 client (agents.gateway.upstream.Upstream) against small raw
servers on loopback that misbehave on purpose: connection reuse and its one retry, responses
delimited by the connection's end, malformed responses, deadlines."""

import asyncio

import pytest

from agents.gateway.upstream import LegError, Upstream

OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"


class RawEngine:
    """Answers each request per ``answer(index_on_connection, request_bytes)``: bytes to send
    (None: close the connection without answering; b"": send nothing)."""

    def __init__(self, answer):
        self.answer = answer
        self.connections = 0
        self.requests = 0
        self.server = None

    async def start(self):
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _serve(self, reader, writer):
        self.connections += 1
        index = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
                await reader.readexactly(length)
                self.requests += 1
                reply = self.answer(index, head)
                index += 1
                if reply is None:
                    break
                writer.write(reply)
                await writer.drain()
                if reply.startswith(b"HTTP/1.0"):
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def stop(self):
        self.server.close()


def run(coro):
    return asyncio.run(coro)


async def calls(answer, n, timeout_s=5.0):
    engine = RawEngine(answer)
    url = await engine.start()
    upstream = Upstream(connect_timeout_s=1.0)
    results = []
    try:
        for i in range(n):
            try:
                results.append(
                    await upstream.call(url + "/v1/completions", b"{}", f"r{i}", timeout_s)
                )
            except LegError as error:
                results.append((error.cause, error.status))
            await asyncio.sleep(0.05)
    finally:
        await upstream.close()
        await engine.stop()
    return results, engine.connections, engine.requests


def test_kept_alive_connection_is_reused():
    results, connections, requests = run(calls(lambda i, head: OK, 5))

    assert results == [b"{}"] * 5
    assert (connections, requests) == (1, 5)


def test_reused_connection_closed_unanswered_is_retried_once_on_a_new_one():
    # Every connection answers its first request and closes unanswered on its second.
    results, connections, requests = run(calls(lambda i, head: OK if i == 0 else None, 3))

    assert results == [b"{}"] * 3
    assert (connections, requests) == (3, 5)


def test_new_connection_closed_unanswered_is_a_connect_error_without_retry():
    results, connections, requests = run(calls(lambda i, head: None, 1))

    assert results == [("connect", None)]
    assert (connections, requests) == (1, 1)


def test_body_ended_by_the_connection_and_error_statuses():
    replies = {
        "close": b'HTTP/1.0 200 OK\r\nContent-Type: application/json\r\n\r\n{"a": 1}',
        "status": b"HTTP/1.1 503 Busy\r\nContent-Length: 4\r\n\r\nbusy",
        "garbage": b"NOT HTTP AT ALL\r\n\r\n",
    }

    async def scenario():
        out = {}
        for name, reply in replies.items():
            out[name] = (await calls(lambda i, head, reply=reply: reply, 1))[0][0]
        return out

    out = run(scenario())

    assert out["close"] == b'{"a": 1}'
    assert out["status"] == ("status", 503)
    assert out["garbage"] == ("connect", None)


def test_deadline_before_the_headers_is_a_timeout():
    results, _, _ = run(calls(lambda i, head: b"", 1, timeout_s=0.3))

    assert results == [("timeout", None)]


def test_request_carries_the_request_id_and_length():
    seen = []

    def answer(i, head):
        seen.append(head)
        return OK

    run(calls(answer, 1))

    assert b"POST /v1/completions HTTP/1.1\r\n" in seen[0]
    assert b"X-Request-Id: r0\r\n" in seen[0]
    assert b"Content-Length: 2\r\n" in seen[0]


@pytest.mark.parametrize("url", ["ftp://x/y", "http://", "http://host:notaport/"])
def test_invalid_engine_url_is_a_connect_error(url):
    async def scenario():
        upstream = Upstream(connect_timeout_s=1.0)
        try:
            await upstream.call(url, b"{}", "r", 1.0)
        except LegError as error:
            return error.cause
        finally:
            await upstream.close()

    assert run(scenario()) == "connect"

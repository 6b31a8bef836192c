"""A TEST DOUBLE for an inference engine (vLLM / the reference engine), standing in for them
until the reference engine with the prefill/decode split is available to these tests.

It is a real aiohttp server on loopback speaking the same HTTP surface the gateway uses:
``/v1/completions`` and ``/v1/chat/completions`` (JSON or SSE with ids, a usage chunk and
``[DONE]``), ``/health``, ``/metrics`` (``vllm:num_requests_waiting``), ``/tokenize``, and the
push-mode ``kv_transfer_params`` convention: a prefill leg (``do_remote_decode``) deposits the
"KV" for its ``transfer_id`` in a store shared by the doubles of one test; a decode leg
(``do_remote_prefill``) waits for it up to ``kv_timeout_s`` and answers 503 with the code
``kv_timeout`` (as a real engine) when it does not come. Pull mode (vLLM's built-in connectors): a
prefill leg without a ``transfer_id`` deposits the KV under a handle of its own and answers
``kv_transfer_params`` naming it (``remote_request_id``, with NixlConnector-like fields); a
decode leg finds the KV by that handle. Output tokens are a deterministic function of
the prompt, so remote, local and fallback answers can be compared.

Behaviour knobs (attributes, changeable mid-test): ``fail_status`` (answer every generation
with this status; ``fail_code``: the error code in its body, as a real engine names a KV
failure), ``prefill_delay_s``, ``local_prefill_delay_s`` (a request without
``kv_transfer_params`` waits this long before its first token, as a local prefill would),
``token_delay_s``, ``drop_kv`` (prefill answers 200
but deposits nothing), ``die_after_events`` (close the connection mid-stream),
``omit_kv_params`` (a pull-mode prefill answers without ``kv_transfer_params``),
``health_status`` (what ``/health`` answers).
``journal``: a file that gets one JSON line per generation request once it ended (``leg``:
``prefill``, ``decode`` or ``local``; its ``transfer_id``; ``outcome``: ``completed`` or
``cancelled``; ``status``), so that a test can tell which transfers a process served.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiohttp import web


@dataclass
class KvStore:
    """Transfers "in flight" between doubles of one test: transfer_id -> event."""

    arrived: dict[str, asyncio.Event] = field(default_factory=dict)

    def event(self, transfer_id: str) -> asyncio.Event:
        return self.arrived.setdefault(transfer_id, asyncio.Event())


def tokens_for(prompt: Any, n: int) -> list[str]:
    """Deterministic output tokens for a prompt (the double's 'model')."""
    seed = hashlib.sha256(json.dumps(prompt, sort_keys=True).encode()).hexdigest()
    return [f" w{seed[i % 60 : i % 60 + 4]}" for i in range(n)]


class EngineDouble:
    """One engine test double; ``start()`` binds an ephemeral loopback port."""

    def __init__(self, name: str, kv: KvStore, kv_timeout_s: float = 2.0) -> None:
        self.name = name
        self.kv = kv
        self.kv_timeout_s = kv_timeout_s
        self.fail_status: int | None = None
        self.fail_code: str | None = None
        self.prefill_delay_s = 0.0
        self.local_prefill_delay_s = 0.0
        self.token_delay_s = 0.0
        self.drop_kv = False
        self.omit_kv_params = False
        self.arrivals: list[float] = []  # time.monotonic() of each generation request
        self.die_after_events: int | None = None
        # Pass-through tests: a stream stops after this many events until ``release`` is set.
        self.hold_after_events: int | None = None
        self.release = asyncio.Event()
        self.max_prompt_chars = 30_000
        self.waiting = 0
        self.health_status = 200  # what /health answers (503: its probes fail)
        # What a real engine's metrics say about its work, from the double's own delays (its
        # stand-in for compute): completed prefill legs and decodes, seconds of each.
        self.prefills = 0
        self.decodes = 0
        self.busy_s = {"prefill": 0.0, "decode": 0.0}
        self.requests: list[dict[str, Any]] = []
        self.raw_bodies: list[bytes] = []
        self.headers: list[Any] = []
        self.cancelled = 0
        self.completed = 0
        self.active = 0
        self.runner: web.AppRunner | None = None
        self.url = ""
        self.journal: Path | None = None

    async def start(
        self, ssl_context: Any = None, port: int = 0, host: str = "127.0.0.1"
    ) -> EngineDouble:
        app = web.Application()
        app.router.add_post("/v1/completions", self.generate)
        app.router.add_post("/v1/chat/completions", self.generate)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_post("/tokenize", self.tokenize)
        self.runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, host, port, ssl_context=ssl_context)
        await site.start()
        scheme = "https" if ssl_context else "http"
        self.url = f"{scheme}://127.0.0.1:{self.runner.addresses[0][1]}"
        return self

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response({}, status=self.health_status)

    async def metrics(self, request: web.Request) -> web.Response:
        model = 'model_name="tiny"'
        return web.Response(
            text=(
                "# TYPE vllm:num_requests_waiting gauge\n"
                f'vllm:num_requests_waiting{{{model},engine="0"}} {self.waiting}\n'
                "# TYPE vllm:request_prefill_time_seconds summary\n"
                f"vllm:request_prefill_time_seconds_count{{{model}}} {self.prefills}\n"
                f"vllm:request_prefill_time_seconds_sum{{{model}}} {self.busy_s['prefill']}\n"
                "# TYPE vllm:request_decode_time_seconds summary\n"
                f"vllm:request_decode_time_seconds_count{{{model}}} {self.decodes}\n"
                f"vllm:request_decode_time_seconds_sum{{{model}}} {self.busy_s['decode']}\n"
                "# TYPE pdbridge:engine_busy_seconds counter\n"
                + "".join(
                    f'pdbridge:engine_busy_seconds_total{{{model},phase="{p}"}} {s}\n'
                    for p, s in self.busy_s.items()
                )
            )
        )

    async def tokenize(self, request: web.Request) -> web.Response:
        body = await request.json()
        return web.json_response({"count": len(body["prompt"].split()), "tokens": []})

    async def generate(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        body = json.loads(raw)
        self.raw_bodies.append(raw)
        self.arrivals.append(time.monotonic())
        self.requests.append(body)
        self.headers.append(request.headers.copy())
        self.active += 1
        outcome, status = "cancelled", None
        try:
            response = await self._generate(request, body)
            self.completed += 1
            outcome, status = "completed", response.status
            return response
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self.active -= 1
            if self.journal is not None:
                self._note(self.journal, body, outcome, status)

    @staticmethod
    def _note(journal: Path, body: dict[str, Any], outcome: str, status: int | None) -> None:
        kv = body.get("kv_transfer_params") or {}
        leg = "prefill" if kv.get("do_remote_decode") else "decode" if kv else "local"
        line = {"leg": leg, "transfer_id": kv.get("transfer_id"), "outcome": outcome,
                "status": status, "ended_at": time.time()}  # fmt: skip
        with journal.open("a") as f:
            f.write(json.dumps(line) + "\n")

    async def _generate(self, request: web.Request, body: dict[str, Any]) -> web.StreamResponse:
        if self.fail_status is not None:
            return web.json_response(
                {
                    "error": {
                        "message": "injected failure",
                        "type": "server_error",
                        "code": self.fail_code,
                    }
                },
                status=self.fail_status,
            )
        kv = body.get("kv_transfer_params") or {}
        chat = "messages" in body
        prompt = body["messages"] if chat else body["prompt"]
        if len(json.dumps(prompt)) > self.max_prompt_chars:
            return web.json_response(
                {"error": {"message": "prompt too long", "type": "invalid_request_error",
                           "param": "prompt", "code": "context_length_exceeded"}},
                status=400,
            )  # fmt: skip
        if kv.get("do_remote_decode"):
            await asyncio.sleep(self.prefill_delay_s)
            self.prefills += 1
            self.busy_s["prefill"] += self.prefill_delay_s
            handle = kv.get("transfer_id") or f"pull-{uuid.uuid4().hex}"
            if not self.drop_kv:
                self.kv.event(handle).set()
            answer: dict[str, Any] = {
                "id": "cmpl-prefill", "object": "text_completion", "choices": [
                    {"index": 0, "text": tokens_for(prompt, 1)[0], "finish_reason": "length"}]}  # fmt: skip
            if "transfer_id" in kv:
                answer["kv_transfer_params"] = {"transfer_id": handle, "sent": not self.drop_kv}
            elif not self.omit_kv_params:
                answer["kv_transfer_params"] = {
                    "do_remote_prefill": True, "do_remote_decode": False,
                    "remote_engine_id": self.name, "remote_block_ids": [0, 1],
                    "remote_host": "127.0.0.1", "remote_port": 5600, "remote_request_id": handle}  # fmt: skip
            return web.json_response(answer)
        if kv.get("do_remote_prefill"):
            handle = kv.get("transfer_id") or kv.get("remote_request_id")
            if not handle:
                return web.json_response(
                    {"error": {"message": "kv_transfer_params: no KV to fetch",
                               "type": "server_error", "code": "kv_transfer_params"}},
                    status=500,
                )  # fmt: skip
            try:
                await asyncio.wait_for(self.kv.event(handle).wait(), self.kv_timeout_s)
            except TimeoutError:
                return web.json_response(
                    {"error": {"message": "the KV did not arrive in time",
                               "type": "kv_transfer_error", "code": "kv_timeout"}},
                    status=503,
                )  # fmt: skip
        elif self.local_prefill_delay_s:
            await asyncio.sleep(self.local_prefill_delay_s)
        n = body.get("max_tokens") or body.get("max_completion_tokens") or 8
        words = tokens_for(prompt, n)
        self.decodes += 1
        self.busy_s["decode"] += self.token_delay_s * n
        created = int(time.time())
        obj = "chat.completion" if chat else "text_completion"
        if not body.get("stream"):
            choice: dict[str, Any] = (
                {"index": 0, "message": {"role": "assistant", "content": "".join(words)}, "finish_reason": "length"}
                if chat
                else {"index": 0, "text": "".join(words), "finish_reason": "length"}
            )  # fmt: skip
            await asyncio.sleep(self.token_delay_s * n)
            return web.json_response(
                {"id": "cmpl-1", "object": obj, "created": created, "model": body["model"],
                 "choices": [choice],
                 "usage": {"prompt_tokens": 1, "completion_tokens": n, "total_tokens": n + 1}}
            )  # fmt: skip
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for i, word in enumerate(words):
            if self.die_after_events is not None and i >= self.die_after_events:
                assert request.transport is not None
                request.transport.abort()
                return response
            if self.hold_after_events is not None and i == self.hold_after_events:
                await self.release.wait()
            delta = {"delta": {"content": word}} if chat else {"text": word}
            event = {"id": "cmpl-1", "object": obj + ".chunk", "created": created,
                     "model": body["model"], "choices": [{"index": 0, **delta, "finish_reason": None}]}  # fmt: skip
            await response.write(f"data: {json.dumps(event)}\n\n".encode())
            if self.token_delay_s:
                await asyncio.sleep(self.token_delay_s)
        if self.hold_after_events == len(words):
            await self.release.wait()
        if (body.get("stream_options") or {}).get("include_usage"):
            usage = {"id": "cmpl-1", "object": obj + ".chunk", "created": created, "model": body["model"],
                     "choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": n, "total_tokens": n + 1}}  # fmt: skip
            await response.write(f"data: {json.dumps(usage)}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

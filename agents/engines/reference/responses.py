"""Writing the reference engine's answers: a whole completion (``_collect``) or a server-sent
event stream (``_stream``) from the tokens :class:`~agents.engines.reference.server.ReferenceEngine`
produces, with the pdbridge extension (path, timings), the KV summary and the request's
metrics. One request's state between prefill and its last token is a :class:`Session`."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from agents.engines.reference import reqlog
from agents.engines.reference.metrics import EngineMetrics
from agents.engines.reference.protocol import (
    CompletionRequest,
    TextTracker,
    chunk_body,
    completion_id,
    full_body,
    sse,
    usage,
)
from agents.engines.reference.runner import Runner
from agents.engines.reference.zoo import LoadedModel
from pdproto.http import PATH_HEADER, REQUEST_ID_HEADER


class ClientGone(Exception):
    """The client went away while its answer was being written."""


@dataclass
class Session:
    """One request's state between the prefill (or KV import) and the last token."""

    req: CompletionRequest
    lm: LoadedModel
    runner: Runner
    prompt_ids: list[int]
    t_arrival: float
    cache: Any = None
    logits: Any = None
    path: str = "local"
    kv_summary: dict[str, Any] | None = None
    fallback_reason: str | None = None
    token_ids: list[int] = field(default_factory=list)
    digests: list[str] = field(default_factory=list)
    logprobs: list[dict[str, Any]] | None = None
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def chunk_tokens(self) -> int:
        return self.req.chunked_prefill_tokens or self.runner.chunk_tokens


class Responses:
    """The answer-writing half of the engine (a base of ``ReferenceEngine``, which sets
    ``metrics`` and produces the tokens)."""

    metrics: EngineMetrics

    def _tokens(
        self, request: web.Request, sess: Session, tracker: TextTracker
    ) -> AsyncIterator[tuple[int, str, str, str | None]]:
        """Each output token: id, logits digest, text delta, finish reason or None."""
        raise NotImplementedError

    def _ext(self, sess: Session) -> dict[str, Any]:
        sess.timings["e2e_s"] = time.monotonic() - sess.t_arrival
        return {
            "path": sess.path,
            "fallback_reason": sess.fallback_reason,
            "chunked_prefill_tokens": sess.chunk_tokens,
            "timings": {k: round(v, 6) for k, v in sess.timings.items()},
        }

    def _finish(self, sess: Session, reason: str) -> None:
        labels = {"model_name": sess.req.model}
        self.metrics.e2e.labels(**labels).observe(time.monotonic() - sess.t_arrival)
        decode_s = time.monotonic() - sess.t_arrival - sess.timings.get("ttft_s", 0.0)
        self.metrics.decode_time.labels(**labels).observe(max(decode_s, 0.0))
        self.metrics.success.labels(finished_reason=reason, **labels).inc()
        reqlog.request_done(sess)

    async def _collect(self, request: web.Request, sess: Session) -> web.Response:
        tracker = TextTracker(sess.lm.tokenizer, sess.req.stop)
        finish = "length"
        async for _tok, _dig, _delta, reason in self._tokens(request, sess, tracker):
            finish = reason or finish
        tracker.flush()
        self._finish(sess, finish)
        body = full_body(
            sess.req,
            completion_id(sess.req.chat),
            text=tracker.text,
            finish=finish,
            prompt_ids=sess.prompt_ids,
            token_ids=sess.token_ids,
            digests=sess.digests,
            ext=self._ext(sess),
            kv=sess.kv_summary,
            logprobs=sess.logprobs,
        )
        return web.json_response(
            body, headers={PATH_HEADER: sess.path, REQUEST_ID_HEADER: sess.req.request_id}
        )

    async def _stream(self, request: web.Request, sess: Session) -> web.StreamResponse:
        resp = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                PATH_HEADER: sess.path,
                REQUEST_ID_HEADER: sess.req.request_id,
            }
        )
        req = sess.req
        cid, created = completion_id(req.chat), int(time.time())
        tracker = TextTracker(sess.lm.tokenizer, req.stop)
        try:
            await resp.prepare(request)
            if req.chat:
                await resp.write(
                    sse(
                        chunk_body(
                            req,
                            cid,
                            created,
                            text="",
                            finish=None,
                            token_ids=[],
                            digests=[],
                            role=True,
                        )
                    )
                )
            finish = "length"
            async for tok, dig, delta, reason in self._tokens(request, sess, tracker):
                finish = reason or finish
                step_lp = sess.logprobs[-1:] if sess.logprobs else None
                body = chunk_body(
                    req,
                    cid,
                    created,
                    text=delta,
                    finish=reason,
                    token_ids=[tok],
                    digests=[dig],
                    logprobs=step_lp,
                )
                await resp.write(sse(body))
            self._finish(sess, finish)
            if req.include_usage:
                tail = {
                    "id": cid,
                    "object": "chat.completion.chunk" if req.chat else "text_completion",
                    "created": created,
                    "model": req.model,
                    "choices": [],
                    "usage": usage(len(sess.prompt_ids), len(sess.token_ids)),
                    "prompt_token_ids": sess.prompt_ids,
                    "kv_transfer_params": sess.kv_summary,
                    "pdbridge": self._ext(sess),
                }
                await resp.write(sse(tail))
            await resp.write(sse("[DONE]"))
            await resp.write_eof()
        except (ConnectionResetError, ConnectionError) as exc:
            raise ClientGone from exc
        return resp

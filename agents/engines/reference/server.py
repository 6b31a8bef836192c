"""The reference engine's HTTP server (aiohttp): OpenAI-compatible completions and chat
completions, ``/v1/models``, ``/health``, ``/metrics``, and the prefill/decode split through
``kv_transfer_params``.

Concurrency: the event loop only parses, routes and streams. All model compute runs on one
compute thread, one chunk or one decode step per call, so concurrent requests interleave
step by step, the loop never blocks, and a request whose client went away stops at the next
step. ``max_num_seqs`` requests run at once; the rest wait (both gauges are true).

Who calls it: ``pdbridge engine serve`` (``run_server``) and tests (``ReferenceEngine.app``).
Failures reach clients as OpenAI-style error bodies: 400 for bad input (the field named),
503 ``kv_transfer_error`` when remote KV did not arrive or failed verification and the
request did not ask for ``fallback: local`` (the error's ``code`` says why: ``kv_timeout``,
``kv_rejected``, ``kv_import_refused``, ``kv_corrupt``, ...).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from aiohttp import web

from agents.engines.reference import kvstate, reqlog
from agents.engines.reference.auth import api_key_middleware
from agents.engines.reference.metrics import EngineMetrics
from agents.engines.reference.protocol import (
    BadRequest,
    CompletionRequest,
    TextTracker,
    error_body,
    parse_request,
)
from agents.engines.reference.responses import ClientGone, Responses, Session
from agents.engines.reference.runner import Runner, Sampling
from agents.engines.reference.streaming import PrefillStreamer
from agents.engines.reference.transport import (
    ImportRefused,
    KvReceiver,
    SenderFactory,
    TransferError,
    TransferRejected,
    open_spool_sender,
)
from agents.engines.reference.zoo import LoadedModel
from pdproto.http import PATH_HEADER, REQUEST_ID_HEADER, clip_request_id
from pdproto.kv import KV_ERROR_TYPE, KV_PEER_REFUSED, KV_UNREACHABLE, REQUEST_ID

log = logging.getLogger("pdbridge.engines.server")
T = TypeVar("T")
ROLES = ("prefill", "decode", "both")
#: How often a decode leg waiting for its KV checks that its caller is still there.
CLIENT_POLL_S = 0.2


@dataclass
class EngineSettings:
    """Knobs of one engine process (documented once, in docs/engines.md)."""

    role: str = "both"
    chunked_prefill_tokens: int = 512
    max_num_seqs: int = 4
    threads: int = 1
    #: Require ``Authorization: Bearer <api_key>`` on ``/v1/`` paths (vLLM's ``--api-key``).
    api_key: str | None = field(default=None, repr=False)


class ReferenceEngine(Responses):
    """Serves loaded models over HTTP. Create, then ``app()``; ``close()`` on shutdown."""

    def __init__(
        self,
        models: dict[str, LoadedModel],
        settings: EngineSettings,
        receiver: KvReceiver | None = None,
        open_sender: SenderFactory = open_spool_sender,
    ) -> None:
        if settings.role not in ROLES:
            raise ValueError(f"role: {settings.role!r} is not one of {', '.join(ROLES)}")
        self.models = models
        self.settings = settings
        self.runners = {
            name: Runner(lm, settings.chunked_prefill_tokens) for name, lm in models.items()
        }
        self.receiver = receiver
        self.open_sender = open_sender
        self.metrics = EngineMetrics()
        for name in models:
            self.metrics.add_model(name)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-compute")
        self._slots = asyncio.Semaphore(settings.max_num_seqs)

    def app(self) -> web.Application:
        middlewares = [api_key_middleware(self.settings.api_key)] if self.settings.api_key else []
        app = web.Application(client_max_size=64 << 20, middlewares=middlewares)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._list_models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.on_cleanup.append(self._on_cleanup)
        return app

    async def _on_cleanup(self, _app: web.Application) -> None:
        await self.close()

    async def close(self) -> None:
        if self.receiver is not None:
            await self.receiver.close()
        self._executor.shutdown(wait=False, cancel_futures=True)

    async def _compute(
        self, fn: Callable[..., T], *args: Any, phase: str = "", model: str = ""
    ) -> T:
        """Run ``fn`` on the compute thread; with ``phase``, its seconds there count as that
        phase's busy time of ``model`` (``pdbridge:engine_busy_seconds``)."""
        if not phase:
            return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)
        busy = self.metrics.busy.labels(model_name=model, phase=phase)

        def timed() -> T:
            started = time.perf_counter()
            try:
                return fn(*args)
            finally:
                busy.inc(time.perf_counter() - started)

        return await asyncio.get_running_loop().run_in_executor(self._executor, timed)

    # --- simple endpoints -------------------------------------------------------------------

    async def _health(self, _request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "role": self.settings.role})

    async def _metrics(self, _request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), content_type="text/plain", charset="utf-8")

    async def _list_models(self, _request: web.Request) -> web.Response:
        data = [
            {
                "id": name,
                "object": "model",
                "created": 0,
                "owned_by": "pdbridge",
                "max_model_len": lm.max_model_len,
                "pdbridge": {
                    "architecture": lm.architecture,
                    "dtype": lm.dtype,
                    "weights_sha256": lm.weights_sha256,
                    "architecture_hash": lm.architecture_hash,
                    "fingerprint": lm.fingerprint,
                    "chunked_prefill_tokens": self.settings.chunked_prefill_tokens,
                    "threads": self.settings.threads,
                    "role": self.settings.role,
                },
            }
            for name, lm in self.models.items()
        ]
        return web.json_response({"object": "list", "data": data})

    # --- completions ------------------------------------------------------------------------

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, chat=False)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._handle(request, chat=True)

    def _validate(self, req: CompletionRequest) -> tuple[LoadedModel, list[int]]:
        lm = self.models.get(req.model)
        if lm is None:
            raise BadRequest(f"model: {req.model!r} does not exist", "model", "model_not_found")
        kv = req.kv
        if kv is not None and kv.do_remote_decode and self.settings.role == "decode":
            raise BadRequest(
                "kv_transfer_params.do_remote_decode: this engine has role decode",
                "kv_transfer_params",
            )
        if kv is not None and kv.do_remote_prefill:
            if self.settings.role == "prefill":
                raise BadRequest(
                    "kv_transfer_params.do_remote_prefill: this engine has role prefill",
                    "kv_transfer_params",
                )
            if self.receiver is None:
                raise BadRequest(
                    "kv_transfer_params.do_remote_prefill: this engine has no KV receiver",
                    "kv_transfer_params",
                )
        if req.messages is not None:
            ids = lm.tokenizer.encode(lm.tokenizer.render_chat(req.messages))
        elif req.prompt_ids is not None:
            vocab = int(lm.config.get_text_config(decoder=True).vocab_size)
            if any(not 0 <= i < vocab for i in req.prompt_ids):
                raise BadRequest(f"prompt: token ids must be in [0, {vocab})", "prompt")
            ids = req.prompt_ids
        else:
            ids = lm.tokenizer.encode(req.prompt or "")
        if not ids:
            raise BadRequest("prompt: empty after tokenization", "prompt")
        if len(ids) + req.max_tokens > lm.max_model_len:
            raise BadRequest(
                f"prompt: {len(ids)} prompt tokens + max_tokens {req.max_tokens} exceed the model's "
                f"maximum context length {lm.max_model_len}",
                "prompt",
                "context_length_exceeded",
            )
        return lm, ids

    async def _handle(self, request: web.Request, *, chat: bool) -> web.StreamResponse:
        t_arrival = time.monotonic()
        header_rid = request.headers.get(REQUEST_ID_HEADER)
        try:
            req = parse_request(await request.read(), chat=chat)
            # vLLM's convention: the caller's X-Request-Id is the request's id (then the
            # gateway's kv_transfer_params.request_id, then the body's, else a fresh one).
            rid = header_rid or (req.kv.extra.get(REQUEST_ID) if req.kv is not None else None)
            if rid:
                req.request_id = clip_request_id(str(rid))
            lm, ids = self._validate(req)
        except BadRequest as exc:
            return web.json_response(
                error_body(
                    exc.message, type_="invalid_request_error", param=exc.param, code=exc.code
                ),
                status=400,
                headers={REQUEST_ID_HEADER: clip_request_id(header_rid)} if header_rid else None,
            )
        if req.kv is not None and req.kv.do_remote_decode:
            req.max_tokens = 1  # the prefill leg returns only the first token
        sess = Session(req, lm, self.runners[req.model], ids, t_arrival)
        labels = {"model_name": req.model}
        self.metrics.waiting.labels(**labels).inc()
        try:
            await self._slots.acquire()
        finally:
            self.metrics.waiting.labels(**labels).dec()
        self.metrics.running.labels(**labels).inc()
        sess.timings["queue_s"] = time.monotonic() - t_arrival
        self.metrics.queue.labels(**labels).observe(sess.timings["queue_s"])
        try:
            try:
                await self._start(request, sess)
            except TransferError as exc:
                log.warning(
                    "kv_transfer_failed request_id=%s transfer_id=%s reason=%s detail=%s",
                    req.request_id,
                    req.kv.transfer_id if req.kv is not None else "",
                    exc.reason,
                    exc,
                )
                return web.json_response(
                    error_body(
                        str(exc),
                        type_=KV_ERROR_TYPE,
                        param="kv_transfer_params",
                        code=exc.reason,
                    ),
                    status=503,
                    headers={PATH_HEADER: "remote", REQUEST_ID_HEADER: req.request_id},
                )
            self.metrics.by_path.labels(path=sess.path, **labels).inc()
            if req.stream:
                return await self._stream(request, sess)
            return await self._collect(request, sess)
        except ClientGone:
            self.metrics.cancelled.labels(**labels).inc()
            log.info(
                "request_cancelled request_id=%s tokens=%d", req.request_id, len(sess.token_ids)
            )
            return web.Response(status=499)
        except Exception:
            # A bug, not bad input: log it with its traceback, answer in the API's error shape.
            log.exception("request_failed request_id=%s", req.request_id)
            return web.json_response(
                error_body(
                    "internal error; see the engine log",
                    type_="internal_error",
                    code="internal_error",
                ),
                status=500,
            )
        finally:
            self.metrics.running.labels(**labels).dec()
            self._slots.release()

    @staticmethod
    def _check_client(request: web.Request) -> None:
        if request.transport is None or request.transport.is_closing():
            raise ClientGone

    async def _local_prefill(
        self, request: web.Request, sess: Session, streamer: PrefillStreamer | None
    ) -> None:
        runner = sess.runner
        cache = runner.new_cache()
        ids = sess.prompt_ids
        logits = None
        try:
            chunk_tokens = sess.chunk_tokens
            for start in range(0, len(ids), chunk_tokens):
                self._check_client(request)
                end = min(start + chunk_tokens, len(ids))

                def chunk(start: int = start, end: int = end) -> Any:
                    out = runner.prefill_chunk(cache, ids, start, end)
                    if streamer is not None:
                        streamer.on_chunk(cache, start, end, out)
                    return out

                logits = await self._compute(chunk, phase="prefill", model=sess.req.model)
        except BaseException:
            if streamer is not None:
                await asyncio.shield(streamer.abort("prefill failed"))
            raise
        sess.cache, sess.logits = cache, logits

    async def _start(self, request: web.Request, sess: Session) -> None:
        """Fill the cache: local prefill, prefill + stream to a decoder, or import remote KV."""
        kv = sess.req.kv
        labels = {"model_name": sess.req.model}
        t0 = time.monotonic()
        if kv is not None and kv.do_remote_decode:
            streamer = PrefillStreamer(sess, kv.kv_destination, self.open_sender)
            try:
                await self._local_prefill(request, sess, streamer)
                t_computed = time.monotonic()
                summary = await streamer.finish()
                # What the link did not hide behind compute: the wait after the last chunk.
                sess.timings["compute_s"] = t_computed - t0
                sess.timings["kv_tail_s"] = time.monotonic() - t_computed
            except TransferError as exc:
                await asyncio.shield(streamer.abort("transfer failed"))
                # Causes an operator acts on by name; the rest stay "failed" (bounded labels).
                outcome = (
                    exc.reason if exc.reason in (KV_PEER_REFUSED, KV_UNREACHABLE) else "failed"
                )
                self.metrics.kv_transfers.labels(direction="send", outcome=outcome, **labels).inc()
                raise
            except BaseException:
                # Cancelled (the gateway dropped the prefill leg) or anything unexpected: the
                # transfer and its connections still have to be released.
                await asyncio.shield(streamer.abort("prefill canceled"))
                raise
            self.metrics.kv_transfers.labels(direction="send", outcome="ok", **labels).inc()
            self.metrics.kv_bytes.labels(direction="send", **labels).inc(summary.bytes)
            reqlog.kv_sent(sess, summary)
            sess.path = "prefill"
            sess.kv_summary = {
                "transfer_id": summary.transfer_id,
                "segments": summary.segments,
                "bytes": summary.bytes,
                "send_seconds": round(summary.seconds, 6),
                "fingerprint": sess.lm.fingerprint,
                "prompt_tokens": len(sess.prompt_ids),
                "do_remote_prefill": True,
                **summary.extra,
            }
            self.metrics.prompt_by_source.labels(source="local_compute", **labels).inc(
                len(sess.prompt_ids)
            )
        elif kv is not None and kv.do_remote_prefill:
            try:
                await self._import(request, sess)
                sess.path = "remote"
                self.metrics.kv_transfers.labels(direction="receive", outcome="ok", **labels).inc()
                self.metrics.prompt_by_source.labels(source="external_kv_transfer", **labels).inc(
                    len(sess.prompt_ids)
                )
            except TransferError as exc:
                self.metrics.kv_transfers.labels(
                    direction="receive", outcome=exc.reason, **labels
                ).inc()
                log.warning(
                    "kv_import_failed request_id=%s transfer_id=%s reason=%s fallback=%s",
                    sess.req.request_id,
                    kv.transfer_id,
                    exc.reason,
                    kv.fallback,
                )
                if kv.fallback != "local":
                    raise
                sess.path, sess.fallback_reason = "fallback", exc.reason
                await self._local_prefill(request, sess, None)
                self.metrics.prompt_by_source.labels(source="local_compute", **labels).inc(
                    len(sess.prompt_ids)
                )
        else:
            await self._local_prefill(request, sess, None)
            self.metrics.prompt_by_source.labels(source="local_compute", **labels).inc(
                len(sess.prompt_ids)
            )
        sess.timings["prefill_s"] = time.monotonic() - t0
        self.metrics.prefill_time.labels(**labels).observe(sess.timings["prefill_s"])
        self.metrics.prompt_tokens.labels(**labels).inc(len(sess.prompt_ids))

    async def _import(self, request: web.Request, sess: Session) -> None:
        kv = sess.req.kv
        if kv is None or self.receiver is None:
            raise TransferRejected("kv_transfer_params: no transfer to import")
        # The model's KV layout (cached after the first import): the receiver checks the
        # manifest against it when the header arrives, before reading any segment.
        layout = await self._compute(sess.runner.layout)
        receiving = asyncio.ensure_future(
            self.receiver.receive(
                kv.transfer_id, sess.lm.fingerprint, kv.deadline_s, accept=layout.check
            )
        )
        try:
            # A decode leg the gateway gave up on (it fell back or failed over: its connection
            # closed) stops waiting at once: waiting out the KV deadline would hold one of
            # max_num_seqs slots that the fallback of that very request queues for.
            while not (await asyncio.wait({receiving}, timeout=CLIENT_POLL_S))[0]:
                self._check_client(request)
            received = receiving.result()
        except ImportRefused as exc:
            log.warning(
                "kv_import_refused transfer_id=%s request_id=%s model=%s detail=%s",
                kv.transfer_id,
                sess.req.request_id,
                sess.req.model,
                exc,
            )
            raise
        finally:
            if not receiving.done():
                receiving.cancel()
                with contextlib.suppress(asyncio.CancelledError, TransferError):
                    await receiving
        manifest = received.header.manifest
        if manifest.prompt_digest != kvstate.prompt_digest(sess.prompt_ids):
            raise TransferRejected("prompt: the transfer's KV was computed for a different prompt")
        try:
            sess.cache, sess.logits = await self._compute(
                kvstate.import_cache, sess.lm.model.config, manifest, received.segments, layout
            )
        except kvstate.ManifestMismatch as exc:  # a receiver that does not call accept
            raise ImportRefused(f"manifest: {exc}") from exc
        except kvstate.KvLayoutError as exc:
            raise TransferRejected(f"layout: {exc}") from exc
        self.metrics.kv_bytes.labels(direction="receive", model_name=sess.req.model).inc(
            sum(len(v) for v in received.segments.values())
        )
        sess.timings["kv_wait_s"] = received.wait_seconds
        reqlog.kv_imported(sess, kv.transfer_id, received)

    async def _tokens(self, request: web.Request, sess: Session, tracker: TextTracker) -> Any:
        """Async generator of (token, digest, text delta); stops at max_tokens, EOS or a stop string."""
        sampling = Sampling(sess.req.temperature, sess.req.top_p, sess.req.seed)
        eos = None if sess.req.ignore_eos else sess.lm.tokenizer.eos_token_id
        position = len(sess.prompt_ids)
        labels = {"model_name": sess.req.model}
        last = time.monotonic()
        for i in range(sess.req.max_tokens):
            self._check_client(request)
            if i > 0:
                prev = sess.token_ids[-1]
                sess.logits = await self._compute(
                    sess.runner.step, sess.cache, prev, position + i - 1,
                    phase="decode", model=sess.req.model,
                )  # fmt: skip
            token = sampling.pick(sess.logits)
            digest, entry = await self._compute(
                _step_info, sess.logits, token, sess.req.logprobs, sess.lm.tokenizer,
                phase="decode", model=sess.req.model,
            )  # fmt: skip
            if entry is not None:
                sess.logprobs = [*(sess.logprobs or []), entry]
            now = time.monotonic()
            if i == 0:
                sess.timings["ttft_s"] = now - sess.t_arrival
                self.metrics.ttft.labels(**labels).observe(sess.timings["ttft_s"])
            else:
                self.metrics.itl.labels(**labels).observe(now - last)
            last = now
            sess.token_ids.append(token)
            sess.digests.append(digest)
            self.metrics.generation_tokens.labels(**labels).inc()
            if token == eos:
                yield token, digest, tracker.flush(), "stop"
                return
            delta = tracker.add(token)
            if tracker.stopped:
                yield token, digest, delta, "stop"
                return
            if i + 1 == sess.req.max_tokens:
                yield token, digest, delta + tracker.flush(), "length"
            else:
                yield token, digest, delta, None


def _step_info(
    logits: Any, token: int, top_k: int | None, tokenizer: Any
) -> tuple[str, dict[str, Any] | None]:
    """Compute-thread work per output token: the logits digest, and logprobs when asked."""
    import torch

    from agents.engines.reference.runner import logits_digest

    digest = logits_digest(logits)
    if top_k is None:
        return digest, None
    logp = torch.log_softmax(logits.float(), dim=-1)
    values, ids = torch.topk(logp, top_k) if top_k else (logp[:0], logp[:0].long())
    entry = {
        "token": tokenizer.token_text(token),
        "logprob": float(logp[token]),
        "top": [(tokenizer.token_text(int(i)), float(v)) for v, i in zip(values, ids, strict=True)],
    }
    return digest, entry

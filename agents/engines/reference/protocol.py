"""OpenAI-compatible request parsing and response shapes of the reference engine (the same
surface as vLLM's server, plus the pdbridge extension fields used by verification).

Called by the HTTP handlers. Pure functions; bad input raises ``BadRequest`` naming the field,
which the server turns into an OpenAI-style 400 error body.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

#: Default wait for a remote prefill's KV on the decode side (seconds).
DEFAULT_KV_DEADLINE_S = 30.0


class BadRequest(Exception):
    """Invalid client input; ``param`` names the offending field."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


def error_body(
    message: str, *, type_: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    """OpenAI's error envelope."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


@dataclass
class KvParams:
    """The ``kv_transfer_params`` of a request (vLLM's convention).

    Prefill leg: ``do_remote_decode`` + ``transfer_id`` + ``kv_destination``.
    Decode leg: ``do_remote_prefill`` + ``transfer_id`` (+ ``deadline_s``, ``fallback``).
    """

    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    transfer_id: str = ""
    kv_destination: str = ""
    deadline_s: float = DEFAULT_KV_DEADLINE_S
    fallback: str = "none"
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class CompletionRequest:
    """A validated completions or chat-completions request."""

    model: str
    chat: bool
    prompt: str | None
    prompt_ids: list[int] | None
    messages: list[dict[str, str]] | None
    max_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    stop: list[str]
    stream: bool
    include_usage: bool
    kv: KvParams | None
    request_id: str
    ignore_eos: bool = False
    #: Top-k logprobs per output token (None = not requested).
    logprobs: int | None = None
    #: Extension: prefill chunk for this request (verification reproduces another engine's
    #: chunk boundaries with it); None = the engine's own.
    chunked_prefill_tokens: int | None = None


def _number(body: dict[str, Any], name: str, default: float, low: float, high: float) -> float:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise BadRequest(f"{name}: must be a number", name)
    if not low <= float(value) <= high:
        raise BadRequest(f"{name}: must be between {low} and {high}", name)
    return float(value)


def _kv_params(raw: Any) -> KvParams | None:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise BadRequest("kv_transfer_params: must be an object", "kv_transfer_params")
    kv = KvParams(
        do_remote_decode=bool(raw.get("do_remote_decode", False)),
        do_remote_prefill=bool(raw.get("do_remote_prefill", False)),
        transfer_id=str(raw.get("transfer_id") or ""),
        kv_destination=str(raw.get("kv_destination") or ""),
        fallback=str(raw.get("fallback") or "none"),
        extra={k: v for k, v in raw.items() if k not in KvParams.__dataclass_fields__},
    )
    deadline = raw.get("deadline_s", DEFAULT_KV_DEADLINE_S)
    if (
        isinstance(deadline, bool)
        or not isinstance(deadline, int | float)
        or not 0 < deadline <= 3600
    ):
        raise BadRequest(
            "kv_transfer_params.deadline_s: must be in (0, 3600]", "kv_transfer_params.deadline_s"
        )
    kv.deadline_s = float(deadline)
    if kv.do_remote_decode and kv.do_remote_prefill:
        raise BadRequest(
            "kv_transfer_params: do_remote_decode and do_remote_prefill are exclusive",
            "kv_transfer_params",
        )
    if (kv.do_remote_decode or kv.do_remote_prefill) and not kv.transfer_id:
        raise BadRequest(
            "kv_transfer_params.transfer_id: required", "kv_transfer_params.transfer_id"
        )
    if kv.do_remote_decode and not kv.kv_destination:
        raise BadRequest(
            "kv_transfer_params.kv_destination: required for do_remote_decode",
            "kv_transfer_params.kv_destination",
        )
    if kv.fallback not in {"none", "local"}:
        raise BadRequest(
            "kv_transfer_params.fallback: 'none' or 'local'", "kv_transfer_params.fallback"
        )
    return kv


def parse_request(raw: bytes, *, chat: bool) -> CompletionRequest:
    """Validate a request body. Raises ``BadRequest`` naming the field."""
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadRequest(f"body: malformed JSON ({exc})", None, "malformed_json") from exc
    if not isinstance(body, dict):
        raise BadRequest("body: must be a JSON object", None)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest("model: required string", "model")
    prompt: str | None = None
    prompt_ids: list[int] | None = None
    messages: list[dict[str, str]] | None = None
    if chat:
        raw_messages = body.get("messages")
        if not isinstance(raw_messages, list) or not raw_messages:
            raise BadRequest("messages: required non-empty list", "messages")
        messages = []
        for i, m in enumerate(raw_messages):
            if (
                not isinstance(m, dict)
                or not isinstance(m.get("role"), str)
                or not isinstance(m.get("content"), str)
            ):
                raise BadRequest(
                    f"messages[{i}]: role and content strings required", f"messages[{i}]"
                )
            messages.append({"role": m["role"], "content": m["content"]})
    else:
        p = body.get("prompt")
        if isinstance(p, str):
            prompt = p
        elif (
            isinstance(p, list)
            and p
            and all(isinstance(x, int) and not isinstance(x, bool) for x in p)
        ):
            prompt_ids = [int(x) for x in p]
        elif isinstance(p, list) and len(p) == 1 and isinstance(p[0], str):
            prompt = p[0]
        else:
            raise BadRequest("prompt: a string or a non-empty list of token ids", "prompt")
    max_tokens = body.get(
        "max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens", 16
    )
    if max_tokens is None:
        max_tokens = 16
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise BadRequest("max_tokens: must be a positive integer", "max_tokens")
    stop = body.get("stop") or []
    if isinstance(stop, str):
        stop = [stop]
    if (
        not isinstance(stop, list)
        or not all(isinstance(s, str) and s for s in stop)
        or len(stop) > 8
    ):
        raise BadRequest("stop: a string or up to 8 non-empty strings", "stop")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise BadRequest("seed: must be an integer", "seed")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("stream: must be a boolean", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise BadRequest("stream_options: must be an object", "stream_options")
    n = body.get("n", 1)
    if n != 1:
        raise BadRequest("n: only 1 is supported", "n")
    return CompletionRequest(
        model=model,
        chat=chat,
        prompt=prompt,
        prompt_ids=prompt_ids,
        messages=messages,
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 1e-6, 1.0),
        seed=seed,
        stop=list(stop),
        stream=stream,
        include_usage=bool(options.get("include_usage", False)),
        kv=_kv_params(body.get("kv_transfer_params")),
        request_id=str(body.get("request_id") or uuid.uuid4().hex),
        ignore_eos=bool(body.get("ignore_eos", False)),
        logprobs=_logprobs(body, chat),
        chunked_prefill_tokens=_chunk(body),
    )


def _chunk(body: dict[str, Any]) -> int | None:
    value = body.get("chunked_prefill_tokens")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 1 << 20:
        raise BadRequest(
            "chunked_prefill_tokens: an integer between 1 and 1048576", "chunked_prefill_tokens"
        )
    return value


def _logprobs(body: dict[str, Any], chat: bool) -> int | None:
    """Completions: ``logprobs: k``; chat: ``logprobs: true`` + ``top_logprobs: k``."""
    if chat:
        if not body.get("logprobs"):
            return None
        value, name = body.get("top_logprobs", 0), "top_logprobs"
    else:
        value, name = body.get("logprobs"), "logprobs"
        if value is None:
            return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 20:
        raise BadRequest(f"{name}: an integer between 0 and 20", name)
    return value


class TextTracker:
    """Turns a growing list of output token ids into text deltas: holds back an incomplete
    UTF-8 sequence and anything that could still become a stop string."""

    def __init__(self, tokenizer: Any, stop: list[str]) -> None:
        self._tok = tokenizer
        self._stop = stop
        self._hold = max((len(s) for s in stop), default=1) - 1
        self.ids: list[int] = []
        self.emitted = 0
        self.text = ""
        self.stopped = False

    def add(self, token: int) -> str:
        """Record a token; return the text that may be sent now (may be empty)."""
        self.ids.append(token)
        text = self._tok.decode(self.ids)
        for s in self._stop:
            cut = text.find(s)
            if cut >= 0:
                self.stopped = True
                text = text[:cut]
        self.text = text
        if self.stopped:
            return self.flush()
        ready = len(text) - self._hold
        if text.endswith("\ufffd"):
            ready = min(ready, len(text) - 1)
        if ready <= self.emitted:
            return ""
        delta = text[self.emitted : ready]
        self.emitted = ready
        return delta

    def flush(self) -> str:
        delta = self.text[self.emitted :]
        self.emitted = len(self.text)
        return delta


def format_logprobs(entries: list[dict[str, Any]] | None, chat: bool) -> dict[str, Any] | None:
    """OpenAI's logprobs object from per-step entries ``{token, logprob, top: [(token, lp)]}``."""
    if entries is None:
        return None
    if chat:
        return {
            "content": [
                {
                    "token": e["token"],
                    "logprob": e["logprob"],
                    "bytes": list(e["token"].encode()),
                    "top_logprobs": [
                        {"token": t, "logprob": lp, "bytes": list(t.encode())} for t, lp in e["top"]
                    ],
                }
                for e in entries
            ]
        }
    return {
        "tokens": [e["token"] for e in entries],
        "token_logprobs": [e["logprob"] for e in entries],
        "top_logprobs": [dict(e["top"]) for e in entries],
        "text_offset": [],
    }


def completion_id(chat: bool) -> str:
    return ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex


def chunk_body(
    req: CompletionRequest,
    cid: str,
    created: int,
    *,
    text: str | None,
    finish: str | None,
    token_ids: list[int],
    digests: list[str],
    role: bool = False,
    logprobs: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """One SSE chunk, vLLM/OpenAI shape, with ``token_ids`` and ``logits_digests`` extensions."""
    if req.chat:
        delta: dict[str, Any] = {}
        if role:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        content: dict[str, Any] = {"delta": delta}
    else:
        content = {"text": text or ""}
    return {
        "id": cid,
        "object": "chat.completion.chunk" if req.chat else "text_completion",
        "created": created,
        "model": req.model,
        "choices": [_choice(req, finish, logprobs, content, token_ids, digests)],
    }


def _choice(
    req: CompletionRequest,
    finish: str | None,
    logprobs: list[dict[str, Any]] | None,
    content: dict[str, Any],
    token_ids: list[int],
    digests: list[str],
) -> dict[str, Any]:
    """A response's one choice: ``content`` (text, message or delta) between OpenAI's fields
    and the extensions verification reads."""
    return {
        "index": 0,
        "logprobs": format_logprobs(logprobs, req.chat),
        "finish_reason": finish,
        **content,
        "token_ids": token_ids,
        "logits_digests": digests,
    }


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def full_body(
    req: CompletionRequest,
    cid: str,
    *,
    text: str,
    finish: str,
    prompt_ids: list[int],
    token_ids: list[int],
    digests: list[str],
    ext: dict[str, Any],
    kv: dict[str, Any] | None,
    logprobs: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """A non-streaming response with the extension fields verification reads."""
    content = {"message": {"role": "assistant", "content": text}} if req.chat else {"text": text}
    choice = _choice(req, finish, logprobs, content, token_ids, digests)
    return {
        "id": cid,
        "object": "chat.completion" if req.chat else "text_completion",
        "created": int(time.time()),
        "model": req.model,
        "choices": [choice],
        "usage": usage(len(prompt_ids), len(token_ids)),
        "prompt_token_ids": prompt_ids,
        "kv_transfer_params": kv,
        "pdbridge": ext,
    }


def sse(data: dict[str, Any] | str) -> bytes:
    payload = data if isinstance(data, str) else json.dumps(data, separators=(",", ":"))
    return f"data: {payload}\n\n".encode()

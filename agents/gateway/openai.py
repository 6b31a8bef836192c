"""OpenAI request validation and error bodies for the gateway.

The request handler calls :func:`parse_request` on the decoded JSON body of
``/v1/completions`` or ``/v1/chat/completions``; it raises :class:`RequestError` (status,
message, ``param`` naming the field, ``code``) for anything an engine would reject, so the
client gets an OpenAI-style 4xx from the gateway instead of a routed failure. Pure, no I/O.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

Kind = Literal["completions", "chat"]


class RequestError(Exception):
    """A client error; :meth:`body` is the OpenAI error document."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.kind = kind

    def body(self) -> bytes:
        return error_body(self.message, self.kind, self.param, self.code)


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> bytes:
    """``{"error": {"message", "type", "param", "code"}}`` as bytes."""
    doc = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return json.dumps(doc).encode()


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    """What routing needs from a request body: streaming or not, the prompt's length (exact
    ``prompt_tokens`` when the client sent token ids, else characters), the text to tokenize
    when asked, and the optional ``user`` sticky key."""

    stream: bool
    prompt_chars: int
    prompt_tokens: int | None
    max_tokens: int | None
    user: str | None
    text: str | None
    token_ids: list[int] | None = None


def _int(body: Mapping[str, Any], key: str, low: int) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise RequestError(400, f"'{key}' must be an integer >= {low}", key, "invalid_value")
    return value


def _float(body: Mapping[str, Any], key: str, low: float, high: float) -> None:
    value = body.get(key)
    if value is None:
        return
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or not low <= value <= high
    ):
        raise RequestError(
            400, f"'{key}' must be a number in [{low}, {high}]", key, "invalid_value"
        )


def _ids(value: list[Any]) -> bool:
    return all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value)


def _prompt(value: Any) -> tuple[int, list[int] | None, str | None]:
    """(characters, token ids if given as ids, text) of a completions ``prompt``."""
    if isinstance(value, str):
        if not value:
            raise RequestError(400, "'prompt' must not be empty", "prompt", "invalid_value")
        return len(value), None, value
    if isinstance(value, list) and value:
        if _ids(value):
            return 0, value, None
        if all(isinstance(p, str) for p in value):
            text = "".join(value)
            return len(text), None, text
        if all(isinstance(p, list) and p and _ids(p) for p in value):
            return 0, [t for p in value for t in p], None
    raise RequestError(
        400,
        "'prompt' must be a non-empty string, list of strings, or list of token ids",
        "prompt",
        "invalid_type",
    )


def _messages(value: Any) -> tuple[int, str]:
    """(characters, concatenated text) of chat ``messages``."""
    if not isinstance(value, list) or not value:
        raise RequestError(400, "'messages' must be a non-empty list", "messages", "invalid_type")
    parts: list[str] = []
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise RequestError(
                400, f"'{where}' must be an object with a 'role'", where, "invalid_type"
            )
        content = message.get("content")
        if isinstance(content, str):
            parts.append(content)
        elif isinstance(content, list):
            for part in content:
                if isinstance(part, Mapping) and isinstance(part.get("text"), str):
                    parts.append(part["text"])
        elif content is not None:
            raise RequestError(
                400, f"'{where}.content' must be a string or a list of parts",
                f"{where}.content", "invalid_type",
            )  # fmt: skip
    text = "\n".join(parts)
    return len(text), text


def parse_body(raw: bytes, kind: Kind, model_name: str) -> tuple[Any, ParsedRequest]:
    """Decode and validate a request body: (the JSON document, what routing needs). Raises
    :class:`RequestError` (400 ``invalid_json`` for a body that is not JSON)."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as error:
        raise RequestError(
            400, f"the request body is not valid JSON: {error}", None, "invalid_json"
        ) from error
    return body, parse_request(kind, body, model_name)


def parse_request(kind: Kind, body: Any, model_name: str) -> ParsedRequest:
    """Validate a completions/chat body. Raises :class:`RequestError`."""
    if not isinstance(body, Mapping):
        raise RequestError(400, "the request body must be a JSON object", None, "invalid_json")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise RequestError(400, "'model' is required", "model", "invalid_value")
    if model != model_name:
        raise RequestError(404, f"The model '{model}' does not exist", "model", "model_not_found")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError(400, "'stream' must be true or false", "stream", "invalid_type")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, Mapping):
        raise RequestError(
            400, "'stream_options' must be an object", "stream_options", "invalid_type"
        )
    if kind == "completions":
        if "prompt" not in body:
            raise RequestError(400, "'prompt' is required", "prompt", "invalid_value")
        chars, ids, text = _prompt(body["prompt"])
        max_tokens = _int(body, "max_tokens", 1)
    else:
        chars, text = _messages(body.get("messages"))
        ids = None
        max_tokens = _int(body, "max_completion_tokens", 1) or _int(body, "max_tokens", 1)
    _int(body, "n", 1)
    _int(body, "min_tokens", 0)
    _float(body, "temperature", 0.0, 2.0)
    _float(body, "top_p", 0.0, 1.0)
    _float(body, "presence_penalty", -2.0, 2.0)
    _float(body, "frequency_penalty", -2.0, 2.0)
    if "kv_transfer_params" in body:
        # The gateway owns the disaggregation fields; a client must not steer the legs.
        raise RequestError(
            400, "'kv_transfer_params' is set by the gateway", "kv_transfer_params", "invalid_value"
        )
    user = body.get("user")
    return ParsedRequest(
        stream=stream,
        prompt_chars=chars,
        prompt_tokens=None if ids is None else len(ids),
        max_tokens=max_tokens,
        user=user if isinstance(user, str) and user else None,
        text=text,
        token_ids=ids,
    )

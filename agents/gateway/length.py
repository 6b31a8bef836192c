"""Prompt length: what the gateway knows of a request's length against the model's context.

Pure functions, called by :meth:`agents.gateway.app.Gateway.complete` once per request. A
count is *exact* for token-id prompts and when the decode engine's ``/tokenize`` answered;
otherwise it is an estimate from characters (``chars_per_token``), which could be wrong either
way: an estimate is never refused, it is only capped at the model's context (so that one
mis-estimated prompt cannot count for more than a whole context against a link), and the
engine refuses a prompt that is really too long (its 4xx is relayed as is).
"""

from __future__ import annotations

from agents.gateway.openai import Kind, RequestError


def needs_count(
    estimate: int,
    max_tokens: int | None,
    threshold: int,
    max_model_len: int | None,
    tokenize_near_threshold: bool,
) -> bool:
    """Whether an estimate is worth an exact count: near the threshold (when the gateway's
    ``tokenize`` setting asks for it), or over the model's context (always: a 400 before any
    leg is cheaper than a refused leg, and it names the client's own numbers)."""
    if max_model_len is not None and estimate + (max_tokens or 1) > max_model_len:
        return True
    return tokenize_near_threshold and threshold / 2 <= estimate <= threshold * 2


def capped(estimate: int, max_model_len: int | None) -> int:
    """An estimate no longer than the model's context."""
    return estimate if max_model_len is None else min(estimate, max_model_len)


def context_error(
    kind: Kind, prompt_tokens: int, max_tokens: int | None, max_model_len: int | None
) -> RequestError | None:
    """The 400 for an exactly counted prompt that does not fit the model's context with the
    output it asks for (at least one token), or None."""
    if max_model_len is None or prompt_tokens + (max_tokens or 1) <= max_model_len:
        return None
    field = "prompt" if kind == "completions" else "messages"
    if max_tokens is None:
        message = (
            f"the prompt is {prompt_tokens} tokens; this model's context is {max_model_len} "
            "tokens, which leaves no room for any output"
        )
    else:
        message = (
            f"the prompt is {prompt_tokens} tokens and max_tokens asks for {max_tokens} more: "
            f"{prompt_tokens + max_tokens} tokens, over this model's context of "
            f"{max_model_len} tokens"
        )
    return RequestError(400, message, field, "context_length_exceeded")

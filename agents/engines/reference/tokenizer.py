"""Tokenizers of the reference engine: a built-in byte-level tokenizer for the generated zoo
models (no download), and a wrapper around a checkpoint's own tokenizer for real weights.

Called by the engine's HTTP handlers (encode prompts, render chats, decode output). Pure,
non-blocking CPU work; never raises on odd bytes (decoding replaces invalid UTF-8).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol


class Tokenizer(Protocol):
    """What the engine needs from a tokenizer."""

    eos_token_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def render_chat(self, messages: list[dict[str, str]]) -> str: ...

    def token_text(self, token: int) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes are tokens 0..255; BOS, EOS and PAD follow. ``encode`` prepends BOS."""

    BOS = 256
    EOS = 257
    PAD = 258

    eos_token_id: int | None = EOS

    def encode(self, text: str) -> list[int]:
        return [self.BOS, *text.encode("utf-8")]

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def token_text(self, token: int) -> str:
        """A unique printable name per token (logprobs keys): ASCII as is, other bytes as
        ``<0xNN>``, specials by name."""
        if 32 <= token < 127:
            return chr(token)
        if 0 <= token < 256:
            return f"<0x{token:02X}>"
        return {self.BOS: "<bos>", self.EOS: "<eos>", self.PAD: "<pad>"}.get(token, f"<id:{token}>")

    def render_chat(self, messages: list[dict[str, str]]) -> str:
        """A minimal chat template: ``<|role|>\\ncontent\\n`` per message, then the assistant cue."""
        parts = [f"<|{m['role']}|>\n{m['content']}\n" for m in messages]
        return "".join(parts) + "<|assistant|>\n"


class HFTokenizer:
    """A checkpoint directory's own tokenizer (transformers ``AutoTokenizer``, loaded offline)."""

    def __init__(self, path: Path, gguf_file: str | None = None) -> None:
        from transformers import AutoTokenizer

        extra = {"gguf_file": gguf_file} if gguf_file else {}
        self._tok: Any = AutoTokenizer.from_pretrained(path, **extra)
        self.eos_token_id = self._tok.eos_token_id

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text))

    def decode(self, ids: list[int]) -> str:
        return str(self._tok.decode(ids, skip_special_tokens=True))

    def token_text(self, token: int) -> str:
        return str(self._tok.convert_ids_to_tokens(token))

    def render_chat(self, messages: list[dict[str, str]]) -> str:
        return str(
            self._tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        )

"""Model execution of the reference engine: chunked prefill, single-token decode steps, greedy
or seeded sampling, and the per-step logits digest that verification compares.

Who calls it: the HTTP server (one step at a time on its single compute thread), the oracle
tests and benchmarks (directly). Every method is blocking CPU work and must run on one thread
at a time per model. Positions are always passed explicitly (one hybrid family silently
decodes at position 0 otherwise).
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from agents.engines.reference import kvstate
from agents.engines.reference.zoo import LoadedModel

#: Default prefill chunk (tokens). Results are bit-identical only between runs that use the
#: same chunk boundaries, so both engines of a pair must agree on it.
DEFAULT_CHUNK_TOKENS = 512

ChunkCallback = Callable[[Any, int, int, torch.Tensor], None]


def logits_digest(logits: torch.Tensor) -> str:
    """First 16 hex digits of the sha256 of one step's logits, bit for bit in their dtype."""
    t = logits.detach().contiguous().cpu()
    raw = (
        t.view(torch.int16).numpy().tobytes() if t.dtype == torch.bfloat16 else t.numpy().tobytes()
    )
    return hashlib.sha256(raw).hexdigest()[:16]


def set_threads(threads: int) -> None:
    """Pin torch's intra-op threads. Both engines of a pair must use the same count: fp32 logit
    bits changed between 1 and 2 threads."""
    torch.set_num_threads(threads)
    # Inter-op parallelism can only be set once per process; ignore a repeat.
    with contextlib.suppress(RuntimeError):
        torch.set_num_interop_threads(1)


@dataclass
class Sampling:
    """Decoding parameters of one request; temperature 0 is greedy."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    _gen: torch.Generator | None = field(default=None, init=False, repr=False)

    def pick(self, logits: torch.Tensor) -> int:
        if self.temperature <= 0.0:
            return int(torch.argmax(logits).item())
        if self._gen is None:
            self._gen = torch.Generator().manual_seed(self.seed if self.seed is not None else 0)
        probs = torch.softmax(logits.float() / self.temperature, dim=-1)
        if self.top_p < 1.0:
            sorted_p, order = torch.sort(probs, descending=True)
            keep = torch.cumsum(sorted_p, dim=-1) - sorted_p < self.top_p
            probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_p[keep])
        return int(torch.multinomial(probs, 1, generator=self._gen).item())


class Runner:
    """Runs one loaded model. Not thread-safe: call from one thread at a time."""

    def __init__(self, loaded: LoadedModel, chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> None:
        if chunk_tokens < 1:
            raise ValueError("chunked_prefill_tokens: must be >= 1")
        self.loaded = loaded
        self.chunk_tokens = chunk_tokens
        self._layout: kvstate.ModelLayout | None = None

    def new_cache(self) -> Any:
        from transformers import DynamicCache

        return DynamicCache(config=self.loaded.model.config)

    def layout(self) -> kvstate.ModelLayout:
        """The KV layout this model's transfers must have (what a decode engine checks an
        incoming manifest against). Read once from a two-token prefill into a fresh cache
        (every layer's states exist after it), then cached; blocking, compute thread."""
        if self._layout is None:
            cache = self.new_cache()
            logits = self.prefill_chunk(cache, [0, 1], 0, 2)  # ids 0 and 1 exist in any vocab
            self._layout = kvstate.layout_of(cache, logits)
        return self._layout

    @torch.inference_mode()
    def prefill_chunk(self, cache: Any, ids: list[int], start: int, end: int) -> torch.Tensor:
        """Run prompt tokens [start, end) into ``cache``; returns the last position's logits."""
        input_ids = torch.tensor([ids[start:end]], dtype=torch.long)
        positions = torch.arange(start, end, dtype=torch.long)[None]
        out = self.loaded.model(
            input_ids=input_ids,
            position_ids=positions,
            cache=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        return out.logits[0, -1]

    def prefill(
        self, ids: list[int], on_chunk: ChunkCallback | None = None
    ) -> tuple[Any, torch.Tensor]:
        """Chunked prefill of a whole prompt; ``on_chunk(cache, start, end, logits)`` after each
        chunk (the prefill engine streams the new KV from there)."""
        cache = self.new_cache()
        logits = torch.empty(0)
        for start in range(0, len(ids), self.chunk_tokens):
            end = min(start + self.chunk_tokens, len(ids))
            logits = self.prefill_chunk(cache, ids, start, end)
            if on_chunk is not None:
                on_chunk(cache, start, end, logits)
        return cache, logits

    @torch.inference_mode()
    def step(self, cache: Any, token: int, position: int) -> torch.Tensor:
        """One decode step: feed ``token`` at ``position``, return the next logits."""
        out = self.loaded.model(
            input_ids=torch.tensor([[token]], dtype=torch.long),
            position_ids=torch.tensor([[position]], dtype=torch.long),
            cache=cache,
            use_cache=True,
        )
        return out.logits[0, -1]

    def generate(
        self,
        cache: Any,
        logits: torch.Tensor,
        prompt_len: int,
        max_tokens: int,
        sampling: Sampling | None = None,
        position_shift: int = 0,
    ) -> list[tuple[int, str]]:
        """Decode ``max_tokens`` tokens from a prefilled cache; returns (token, digest) per step,
        the digest being that of the logits the token was picked from. ``position_shift`` exists
        for the oracle's mutation tests (decode at wrong positions must be caught)."""
        sampling = sampling or Sampling()
        out: list[tuple[int, str]] = []
        for i in range(max_tokens):
            token = sampling.pick(logits)
            out.append((token, logits_digest(logits)))
            if i + 1 < max_tokens:
                logits = self.step(cache, token, prompt_len + i + position_shift)
        return out

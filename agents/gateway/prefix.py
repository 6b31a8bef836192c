"""A gateway-side estimate of the decode pool's prefix cache, so that routing counts only the
*incremental* prompt length (PrfaaS: route on uncached tokens).

Engines do not say, before a request, how much of a prompt they hold cached; the gateway
remembers which prompt prefixes it recently sent to the decode pool, in fixed blocks of
characters (or token ids) hashed as a chain (block i's key covers blocks 0..i, as vLLM's
block hashes do), and counts the leading blocks it has seen. Bounded LRU; pure, event-loop
only. Enabled by ``prefix_cache_estimate`` (off by default: an engine without prefix caching
would make it over-count).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import xxhash


def _blocks(prompt: str | Sequence[int], block: int) -> list[int]:
    """Chained hashes of the prompt's complete blocks."""
    if isinstance(prompt, str):
        data = prompt.encode("utf-8", "surrogatepass")
        unit = block
    else:
        data = b"".join(t.to_bytes(4, "little", signed=False) for t in prompt)
        unit = block * 4
    keys = []
    h = 0
    for start in range(0, len(data) - unit + 1, unit):
        h = xxhash.xxh64_intdigest(data[start : start + unit], seed=h)
        keys.append(h)
    return keys


class PrefixIndex:
    """Which prompt prefixes the decode pool has recently seen."""

    def __init__(self, block: int, capacity: int) -> None:
        self.block = block
        self.capacity = capacity
        self._seen: OrderedDict[int, None] = OrderedDict()

    def cached_units(self, prompt: str | Sequence[int]) -> int:
        """Leading characters (text) or tokens (ids) of ``prompt`` seen before."""
        count = 0
        for key in _blocks(prompt, self.block):
            if key not in self._seen:
                break
            self._seen.move_to_end(key)
            count += 1
        return count * self.block

    def remember(self, prompt: str | Sequence[int]) -> None:
        """The decode pool is about to hold this prompt's KV."""
        seen = self._seen
        for key in _blocks(prompt, self.block):
            seen[key] = None
            seen.move_to_end(key)
        while len(seen) > self.capacity:
            seen.popitem(last=False)

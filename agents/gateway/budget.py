"""The fallback budget: a token bucket bounding how many requests per second may be served by
local prefill *instead of* the remote path, so that a remote outage cannot bury the decode
nodes under prefill work.

:class:`TokenBucket` is pure (injected clock). :class:`FallbackBudget` adds the bounded wait
the request handler awaits: at most ``max_waiters`` requests queue, each for at most
``max_wait_s``; a request that gets no token is answered 503 with ``retry-after``.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable


class TokenBucket:
    """``rate`` tokens per second, holding at most ``burst``. Starts full. Not thread-safe."""

    def __init__(self, rate: float, burst: float, clock: Callable[[], float]) -> None:
        if rate <= 0 or burst < 1:
            raise ValueError("fallback budget needs rate > 0 and burst >= 1")
        self.rate = rate
        self.burst = burst
        self._clock = clock
        self._tokens = float(burst)
        self._stamp = clock()

    def _refill(self) -> float:
        now = self._clock()
        self._tokens = min(self.burst, self._tokens + (now - self._stamp) * self.rate)
        self._stamp = now
        return self._tokens

    @property
    def tokens(self) -> float:
        """Tokens available now."""
        return self._refill()

    def try_take(self) -> bool:
        """Take one token if there is one."""
        if self._refill() >= 1.0:
            self._tokens -= 1.0
            return True
        return False

    def seconds_until_token(self) -> float:
        """How long until one whole token is available (0 when one is)."""
        missing = 1.0 - self._refill()
        return max(missing / self.rate, 0.0)


class FallbackBudget:
    """The async face of the bucket for the request handler (event-loop only)."""

    def __init__(
        self,
        rate: float,
        burst: float,
        max_wait_s: float,
        max_waiters: int,
        clock: Callable[[], float],
    ) -> None:
        self.bucket = TokenBucket(rate, burst, clock)
        self.max_wait_s = max_wait_s
        self.max_waiters = max_waiters
        self.waiting = 0

    async def acquire(self) -> bool:
        """Wait (bounded) for a token. False: the request must be refused (503). Waiters are
        not strictly FIFO; each re-checks after the time one token takes to accrue."""
        if self.bucket.try_take():
            return True
        if self.waiting >= self.max_waiters or self.max_wait_s <= 0:
            return False
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.max_wait_s
        self.waiting += 1
        try:
            while True:
                delay = max(self.bucket.seconds_until_token(), 0.001)
                if loop.time() + delay > deadline:
                    return False
                await asyncio.sleep(delay)
                if self.bucket.try_take():
                    return True
        finally:
            self.waiting -= 1

    def retry_after_s(self) -> int:
        """The ``retry-after`` to send with a 503: when the queue ahead has drained."""
        backlog = self.waiting + 1 - self.bucket.tokens
        return max(math.ceil(backlog / self.bucket.rate), 1)

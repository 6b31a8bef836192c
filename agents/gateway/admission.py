"""Admission control: at most ``max_in_flight`` requests served at once per gateway process,
at most ``max_queued`` more waiting (each for at most ``queue_timeout_s``) for one of them to
end; any other request is refused at once (429 with ``Retry-After``). One client address holds
at most ``max_per_client`` of the slots and queue places together (0: no cap), so that one
client cannot take them all. Memory and engine load stay bounded whatever the clients send.

Who calls it: :meth:`agents.gateway.app.Gateway.complete`, once per completions request after
the client key check and after its body arrived (a client that sends a head and no body holds
no slot; the body has ``request_read_timeout_s``); :meth:`Admission.release` when it ends.
Waiters are served first come, first served: a slot that frees goes straight to the oldest
waiter. Event-loop only; never blocks the loop.
"""

from __future__ import annotations

import asyncio
from collections import deque

#: Why a request was refused (the ``reason`` label of the rejections counter).
QUEUE_FULL = "queue_full"
QUEUE_TIMEOUT = "queue_timeout"
CLIENT_LIMIT = "client_limit"


class Admission:
    """The in-flight limit and its bounded queue (``max_in_flight`` 0: no limit)."""

    def __init__(
        self,
        max_in_flight: int,
        max_queued: int,
        queue_timeout_s: float,
        max_per_client: int = 0,
    ) -> None:
        self.max_in_flight = max_in_flight
        self.max_queued = max_queued
        self.queue_timeout_s = queue_timeout_s
        self.max_per_client = max_per_client
        self.in_flight = 0
        self._waiters: deque[asyncio.Future[None]] = deque()
        #: Slots and queue places per client address (only addresses holding some).
        self.per_client: dict[str, int] = {}

    @property
    def queued(self) -> int:
        return len(self._waiters)

    async def acquire(self, client: str = "") -> str | None:
        """Admit the request of ``client`` (its address; "" unknown) -- None -- or say why
        not (:data:`QUEUE_FULL`, :data:`QUEUE_TIMEOUT`, :data:`CLIENT_LIMIT`). An admitted
        request must call :meth:`release` once, with the same ``client``."""
        held = self.per_client.get(client, 0)
        if self.max_per_client > 0 and client and held >= self.max_per_client:
            return CLIENT_LIMIT
        self.per_client[client] = held + 1
        if self.max_in_flight <= 0 or (self.in_flight < self.max_in_flight and not self._waiters):
            self.in_flight += 1
            return None
        try:
            refusal = await self._wait()
        except BaseException:
            self._forget(client)
            raise
        if refusal is not None:
            self._forget(client)
        return refusal

    def _forget(self, client: str) -> None:
        held = self.per_client.get(client, 0) - 1
        if held > 0:
            self.per_client[client] = held
        else:
            self.per_client.pop(client, None)

    async def _wait(self) -> str | None:
        """Wait in the queue for a slot (or say why not)."""
        if len(self._waiters) >= self.max_queued or self.queue_timeout_s <= 0:
            return QUEUE_FULL
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await asyncio.wait_for(asyncio.shield(waiter), self.queue_timeout_s)
        except TimeoutError:
            if waiter.done():  # the slot came just as the wait ran out: take it
                return None
            self._waiters.remove(waiter)
            return QUEUE_TIMEOUT
        except asyncio.CancelledError:
            # The client went away while queued: a slot handed over meanwhile goes on.
            if waiter.done() and not waiter.cancelled():
                self._release_slot()
            else:
                self._waiters.remove(waiter)
            raise
        return None

    def release(self, client: str = "") -> None:
        """An admitted request of ``client`` ended: its slot goes to the oldest waiter, if
        any."""
        self._forget(client)
        self._release_slot()

    def _release_slot(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # the slot passes on; in_flight is unchanged
                return
        self.in_flight = max(self.in_flight - 1, 0)

"""Fault life cycle: validate, journal, apply, expire, restore.

The journal (``faults.json`` in the state directory) is written atomically (temp file, fsync,
rename) *before* a fault is applied and after it is restored, so a crash at any point leaves
at worst a journalled fault that was never applied — restoring it is harmless because every
restore is idempotent.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from agents.faults import Fault, FaultContext, FaultError, injector

log = logging.getLogger("pdbridge.agent.faults")

SWEEP_INTERVAL_S = 0.5


def _iso(epoch: float) -> str:
    return (
        datetime.fromtimestamp(epoch, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
    )


class Journal:
    """The on-disk list of active faults (blocking small-file writes, called on the loop)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def load(self) -> list[Fault]:
        """The journalled faults. A journal that cannot be parsed (not JSON, or records of
        another shape) is moved aside to ``faults.json.unreadable`` for an operator to undo by
        hand, and logged as an error; the agent starts rather than crash-looping on it."""
        try:
            data = json.loads(self.path.read_text())
            return [Fault.from_json(item) for item in data.get("faults", [])]
        except FileNotFoundError:
            return []
        except (OSError, ValueError, TypeError, AttributeError) as exc:
            aside = self.path.with_name(self.path.name + ".unreadable")
            with contextlib.suppress(OSError):
                os.replace(self.path, aside)
            log.error(
                "agent.fault_journal_unreadable",
                extra={"path": str(self.path), "moved_to": str(aside), "error": str(exc)},
            )
            return []

    def save(self, faults: list[Fault]) -> None:
        tmp = self.path.with_suffix(".tmp")
        with tmp.open("w") as fh:
            json.dump({"faults": [f.to_json() for f in faults]}, fh, indent=1)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, self.path)


class FaultManager:
    """Owns the active faults of this agent.

    Called by the control API (``inject``, ``clear``) and by the agent's start/stop. A sweeper
    task restores faults whose expiry passed, without any further call. Failures surface as
    :class:`FaultError`; a restore that fails is logged and retried by the next sweep.
    """

    def __init__(
        self,
        journal: Journal,
        ctx: FaultContext,
        max_duration_s: float,
        on_restored: Callable[[], None] = lambda: None,
    ) -> None:
        self.journal = journal
        self.ctx = ctx
        self.max_duration_s = max_duration_s
        self.active: dict[str, Fault] = {}
        self.on_restored = on_restored
        self._lock = asyncio.Lock()
        self._sweeper: asyncio.Task[None] | None = None

    async def start(self) -> int:
        """Restore everything a previous agent journalled, then start the expiry sweeper.

        Returns how many journalled faults were restored.
        """
        leftovers = self.journal.load()
        now = time.time()
        for fault in leftovers:
            # Overdue from now on: a restore that fails here is retried by every sweep.
            fault.expires_epoch = min(fault.expires_epoch, now)
            self.active[fault.id] = fault
        for fault in leftovers:
            await self._restore(fault, reason="agent_restart")
        self._sweeper = asyncio.create_task(self._sweep(), name="fault-sweeper")
        return len(leftovers)

    async def close(self) -> None:
        """Restore every active fault (agent shutdown)."""
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper
        for fault in list(self.active.values()):
            await self._restore(fault, reason="shutdown")

    async def inject(
        self, kind: str, target: str, duration_s: float, params: dict[str, Any]
    ) -> Fault:
        if not duration_s > 0:  # also NaN, which every comparison fails
            raise FaultError("duration_s", "a fault needs an expiry: duration_s > 0")
        if duration_s > self.max_duration_s:
            raise FaultError(
                "duration_s", f"at most {self.max_duration_s:g} s (faults.max_duration_s)"
            )
        handler = injector(kind)
        now = time.time()
        fault = Fault(
            id=uuid.uuid4().hex[:12],
            kind=kind,
            target=target,
            params=params,
            created_at=_iso(now),
            expires_at=_iso(now + duration_s),
            expires_epoch=now + duration_s,
        )
        async with self._lock:
            for other in self.active.values():
                if other.kind == kind and other.target == target:
                    raise FaultError(
                        "target",
                        f"{kind} on {target!r} is already active as {other.id}",
                        "ALREADY_EXISTS",
                    )
            handler.prepare(fault, self.ctx)
            self.active[fault.id] = fault
            self.journal.save(list(self.active.values()))
            try:
                await handler.apply(fault, self.ctx)
            except Exception:
                await self._restore_locked(fault, reason="apply_failed")
                raise
        log.warning(
            "agent.fault_injected",
            extra={
                "fault": fault.id,
                "kind": kind,
                "target": target,
                "expires_at": fault.expires_at,
            },
        )
        return fault

    async def clear(self, fault_id: str) -> list[Fault]:
        """Restore one fault (or all with an empty id); FaultError NOT_FOUND for an unknown id,
        UNAVAILABLE when a restore failed (the fault stays active and the sweeper retries it
        every second: a caller must not believe the link is back when it is not)."""
        if fault_id and fault_id not in self.active:
            raise FaultError("id", f"no active fault {fault_id!r}", "NOT_FOUND")
        targets = [self.active[fault_id]] if fault_id else list(self.active.values())
        failed = []
        for fault in targets:
            error = await self._restore(fault, reason="cleared")
            if error is not None:
                failed.append(f"{fault.id} ({error})")
        if failed:
            raise FaultError(
                "id",
                f"restore failed for {', '.join(failed)}; still active, retried every second",
                "UNAVAILABLE",
            )
        return targets

    async def _restore(self, fault: Fault, reason: str) -> str | None:
        async with self._lock:
            return await self._restore_locked(fault, reason)

    async def _restore_locked(self, fault: Fault, reason: str) -> str | None:
        """Restore and forget ``fault``; returns the error when the restore failed (then the
        fault stays active and is retried, except after a failed apply)."""
        if fault.id not in self.active:
            return None
        try:
            await injector(fault.kind).restore(fault, self.ctx)
        except Exception as exc:
            log.error(
                "agent.fault_restore_failed",
                extra={"fault": fault.id, "reason": reason, "error": str(exc)},
            )
            if reason != "apply_failed":
                # Retried by the sweeper in a second (not in a hot loop).
                fault.expires_epoch = time.time() + 1.0
                return str(exc)
        fault.state = "restored"
        del self.active[fault.id]
        self.journal.save(list(self.active.values()))
        self.on_restored()
        log.warning(
            "agent.fault_restored", extra={"fault": fault.id, "kind": fault.kind, "reason": reason}
        )
        return None

    async def _sweep(self) -> None:
        while True:
            # Wake at the next expiry (restores land on time), at least every half second
            # (a new fault, a failed restore to retry).
            upcoming = [f.expires_epoch for f in self.active.values()]
            delay = min([SWEEP_INTERVAL_S, *(e - time.time() for e in upcoming)])
            await asyncio.sleep(max(delay, 0.005))
            now = time.time()
            for fault in list(self.active.values()):
                if fault.expires_epoch <= now:
                    await self._restore(fault, reason="expired")

"""``engine_kill`` (kill -9 a child and keep it down until expiry) and ``engine_restart``
(kill -9 a child; supervision brings it back at once)."""

from __future__ import annotations

from agents.faults import Fault, FaultContext, FaultError, FaultInjector


class _EngineFault(FaultInjector):
    hold = False

    def prepare(self, fault: Fault, ctx: FaultContext) -> None:
        child = ctx.children.get(fault.target)
        if child is None:
            raise FaultError("target", f"no child named {fault.target!r}", "NOT_FOUND")
        if fault.params:
            raise FaultError("params", f"{fault.kind} takes no params")
        fault.mechanism = "signal"
        fault.details = {"pid": child.pid}

    async def apply(self, fault: Fault, ctx: FaultContext) -> None:
        child = ctx.children.get(fault.target)
        if child is None:
            raise FaultError("target", f"no child named {fault.target!r}", "NOT_FOUND")
        await child.kill(hold=self.hold)

    async def restore(self, fault: Fault, ctx: FaultContext) -> None:
        child = ctx.children.get(fault.target)
        if child is not None and self.hold:
            child.release()


class EngineKill(_EngineFault):
    hold = True


class EngineRestart(_EngineFault):
    hold = False

"""Workflows the orchestrator tests run through a real worker (registered in the worker with
PDBRIDGE_EXTRA_WORKFLOWS). Their side effects are lines in files named by the run's params, so
a test can count exactly what happened in the worker process."""

from __future__ import annotations

import os
import time
from pathlib import Path

from orchestrator.steps import Done, Fail, RollBack, Step, StepContext, StepResult


def _append(path: str, line: str) -> None:
    with open(path, "a") as handle:
        handle.write(line + "\n")
        handle.flush()
        os.fsync(handle.fileno())


def prepare(ctx: StepContext) -> StepResult:
    _append(ctx.params["journal"], f"prepare attempt={ctx.attempt}")
    return Done({"prepared": True})


def check(ctx: StepContext) -> StepResult:
    """Fails while the 'cause' file exists (a test removes it, then retries)."""
    _append(ctx.params["journal"], f"check attempt={ctx.attempt}")
    if Path(ctx.params["cause"]).exists():
        return Fail("cause present", {"cause": ctx.params["cause"]})
    return Done({"checked": True})


def launch(ctx: StepContext) -> StepResult:
    """An idempotent 'launch': re-checks the world (the marker) before acting, then works for a
    while (the test kills the worker during that time)."""
    marker = Path(ctx.params["marker"])
    _append(
        ctx.params["journal"], f"exec attempt={ctx.attempt} resumed={ctx.resumed} pid={os.getpid()}"
    )
    if not marker.exists():
        marker.write_text(str(os.getpid()))
        _append(ctx.params["journal"], "launched")
    deadline = time.monotonic() + float(ctx.params.get("work_s", 0))
    while time.monotonic() < deadline:
        time.sleep(0.05)
    return Done({"launched_by": int(marker.read_text())})


def gate(ctx: StepContext) -> StepResult:
    return RollBack("gate failed: ttft_p99 2.0x > 1.5x", {"ttft_p99_ratio": 2.0, "limit": 1.5})


FLAKY = [Step("prepare", prepare), Step("check", check)]
SLOW = [Step("launch", launch)]
GATED = [Step("prepare", prepare), Step("gate", gate)]

"""What a workflow step is and what it may return.

A step function takes a ``StepContext`` and returns one of ``Done``, ``Wait``, ``Fail`` or
``RollBack`` (or raises, which counts as ``Fail``). It runs in a Celery worker, may block for a
while (a heartbeat keeps its claim alive) but must not sleep through long waits: it returns
``Wait(seconds)`` and is called again after that many seconds, with the evidence it returned
available as ``ctx.evidence``. Steps are idempotent by design: a step may be re-executed after
its worker died, so it re-checks the world before acting (an engine already launched is
reused, not launched twice).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class StepContext:
    run_id: int
    kind: str
    target_type: str
    target_id: str
    params: dict[str, Any]
    step_index: int
    step_name: str
    attempt: int
    resumed: bool
    evidence: dict[str, Any]  # what this step recorded on its previous call (Wait / resume)
    previous: dict[str, dict[str, Any]]  # evidence of earlier steps, by step name
    # This execution of the step: the same across its Wait re-checks and a resume after its
    # worker died, new when an operator retries the step. Agent request ids derive from it, so
    # a resumed step repeats its requests (the agent answers them once) while a retry asks anew.
    execution: str = ""
    log_lines: list[str] = field(default_factory=list)

    def log(self, message: str) -> None:
        """A line for the step's log excerpt (shown on the run page)."""
        self.log_lines.append(message)


@dataclass(frozen=True)
class Done:
    evidence: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Wait:
    seconds: float
    evidence: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Fail:
    error: str
    evidence: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class RollBack:
    """The step's gate failed and the workflow undid its change; the run ends rolled_back."""

    reason: str
    evidence: dict[str, Any] = field(default_factory=dict)


StepResult = Done | Wait | Fail | RollBack


@dataclass(frozen=True)
class Step:
    name: str
    run: Callable[[StepContext], StepResult]

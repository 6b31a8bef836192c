"""Test workflow module 'flaky' (see workflows_for_tests): fails while a cause file exists;
its on_failure hook records that it ran (the safe-state hook real workflows use)."""

from orchestrator.steps import StepContext
from tests.orchestrator.workflows_for_tests import FLAKY as STEPS
from tests.orchestrator.workflows_for_tests import _append

__all__ = ["STEPS", "on_failure"]


def on_failure(ctx: StepContext) -> None:
    _append(ctx.params["journal"], f"on_failure step={ctx.step_name}")

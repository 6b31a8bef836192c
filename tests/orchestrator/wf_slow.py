"""Test workflow module 'slow' (see workflows_for_tests)."""

from tests.orchestrator.workflows_for_tests import SLOW as STEPS

__all__ = ["STEPS"]

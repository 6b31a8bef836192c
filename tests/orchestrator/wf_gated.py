"""Test workflow module 'gated' (see workflows_for_tests)."""

from tests.orchestrator.workflows_for_tests import GATED as STEPS

__all__ = ["STEPS"]

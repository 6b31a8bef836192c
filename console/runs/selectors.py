"""Reads for runs."""

from __future__ import annotations

from django.db.models import QuerySet

from console.runs.models import WorkflowRun

# Workflows an operator may start from POST /api/runs/ directly (they need no target object).
_STANDALONE = {"selfcheck": ["database", "worker", "scheduled_recheck"]}


def standalone_workflows() -> list[str]:
    return sorted(_STANDALONE)


def standalone_steps(kind: str) -> list[str]:
    return list(_STANDALONE[kind])


def run_list() -> QuerySet[WorkflowRun]:
    return WorkflowRun.objects.select_related("created_by").prefetch_related("steps")

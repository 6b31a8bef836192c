"""Workflow registry: name -> module, imported lazily.

A workflow module defines ``STEPS`` (an ordered list of ``Step``) and may define
``on_failure(ctx)``, called once when a step fails, to leave the system in the workflow's
documented safe state (for deployments: remote share 0 %). Extra workflows (plugins, the test
suite's) are registered with ``PDBRIDGE_EXTRA_WORKFLOWS="name=module.path,..."``.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

WORKFLOWS: dict[str, str] = {
    "selfcheck": "orchestrator.workflows.selfcheck",
    "deploy": "orchestrator.workflows.deploy",
    "canary": "orchestrator.workflows.canary",
    "drill_link_cut": "orchestrator.workflows.drill",
    "drill_remote_restart": "orchestrator.workflows.drill",
    "rebalance": "orchestrator.workflows.rebalance",
}


def _extra() -> dict[str, str]:
    raw = os.environ.get("PDBRIDGE_EXTRA_WORKFLOWS", "")
    pairs = (item.split("=", 1) for item in raw.split(",") if "=" in item)
    return {name.strip(): module.strip() for name, module in pairs}


def workflow_module(kind: str) -> ModuleType:
    """The module implementing workflow ``kind``; KeyError for an unknown kind."""
    registry = {**WORKFLOWS, **_extra()}
    return importlib.import_module(registry[kind])


def workflow_steps(kind: str) -> list[str]:
    return [step.name for step in workflow_module(kind).STEPS]


def known_workflows() -> list[str]:
    return sorted({**WORKFLOWS, **_extra()})

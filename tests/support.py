"""Helpers shared by tests: skipping honestly."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import NoReturn

import pytest

from tests.services import IN_CI


def unavailable(reason: str) -> NoReturn:
    """Skip a test whose real dependency is missing, except under CI=true where it fails."""
    if IN_CI:
        pytest.fail(f"{reason} (CI=true: this would be a skip, which CI does not allow)")
    pytest.skip(reason)


def repo_root() -> Path:
    return Path(__file__).resolve().parent.parent


def subprocess_env(**extra: str) -> dict[str, str]:
    """Environment for a child Python process of the code under test: imports come from this
    checkout (not from wherever the package happens to be installed)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(repo_root()), env.get("PYTHONPATH", "")]))
    env.update(extra)
    return env


def connections_to(port: int) -> int:
    """Established TCP connections on this machine whose destination is ``port`` (the
    clients' side: what a process that leaks connections keeps open), counted by ``ss``."""
    out = subprocess.run(
        ["ss", "-Htn", "state", "established", f"( dport = :{port} )"],
        capture_output=True, text=True, check=True, timeout=10,
    ).stdout  # fmt: skip
    return len(out.splitlines())

"""Helpers shared by tests: skipping honestly, and waiting with deadlines a loaded machine can meet."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import pytest

from tests.services import IN_CI


def unavailable(reason: str) -> NoReturn:
    """Skip a test whose real dependency is missing, except under CI=true where it fails."""
    if IN_CI:
        pytest.fail(f"{reason} (CI=true: this would be a skip, which CI does not allow)")
    pytest.skip(reason)


#: Scales every deadline the tests wait under: on a loaded machine (the CI job that runs a
#: subset beside CPU burners, or a shared host) ``PDBRIDGE_TEST_TIME_SCALE=3`` gives every wait
#: three times as long. Waits are for events; the deadline only bounds how long a test that
#: will fail takes to say so, so a larger scale never slows a passing run.
TIME_SCALE = max(1.0, float(os.environ.get("PDBRIDGE_TEST_TIME_SCALE", "1") or 1))


def scaled(seconds: float) -> float:
    """``seconds`` stretched by TIME_SCALE: for timeouts handed to other APIs."""
    return seconds * TIME_SCALE


def deadline_in(seconds: float) -> float:
    """The ``time.monotonic()`` value ``seconds`` (scaled) from now."""
    return time.monotonic() + seconds * TIME_SCALE


def wait_for(
    predicate: Callable[[], Any], timeout: float = 60.0, interval: float = 0.1, what: str = ""
) -> Any:
    """Poll until ``predicate()`` is truthy and return its value; fail after ``timeout``
    (scaled) seconds, naming ``what`` was awaited."""
    deadline = deadline_in(timeout)
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not reached within {scaled(timeout):g} s: {what or predicate!r}")
        time.sleep(interval)


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

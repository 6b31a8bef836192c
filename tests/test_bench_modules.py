"""Every benchmark ``make bench-<part>`` runs imports and has a ``main`` (a benchmark that
only breaks when someone next runs it, days later, is how bench/agent.py lost its wait_for)."""

from __future__ import annotations

import importlib
import re
import subprocess

import pytest

from tests.support import repo_root

MODULES = sorted(p.stem for p in (repo_root() / "bench").glob("*.py") if p.stem != "__init__")


def make_benches() -> set[str]:
    """The bench-<part> targets the Makefile defines."""
    out = subprocess.run(
        ["make", "-pn", "-f", "Makefile", "bench"],
        cwd=repo_root(),
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    line = next(row for row in out.splitlines() if row.startswith("BENCHES :="))
    return set(re.findall(r"bench-(\w+)", line))


@pytest.mark.parametrize("name", MODULES)
def test_every_bench_module_imports(name):
    importlib.import_module(f"bench.{name}")


def test_every_make_bench_target_has_a_main_and_every_main_a_target():
    targets = make_benches()
    with_main = {
        n for n in MODULES if callable(getattr(importlib.import_module(f"bench.{n}"), "main", None))
    }
    assert targets == with_main

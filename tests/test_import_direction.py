"""Imports go one way: the arrows of docs/architecture.md ("Dependency direction"), checked on
the source text (AST, nothing imported), so that an arrow added against them fails the suite.

Every ``import`` and ``from ... import`` counts, at module level or inside a function (a lazy
import is still a dependency), under ``if TYPE_CHECKING`` too; relative imports are resolved;
``importlib.import_module("literal")`` counts as an import of the literal.

The rules (``RULES``):

* ``console`` never imports ``orchestrator`` (it sends Celery tasks by name), nor ``agents`` /
  ``grpc_kv`` beyond their public client modules, ``PUBLIC``: ``agents.client`` (the control
  RPC client) and ``grpc_kv.api`` (the link library's surface: certificates, options, probe).
* ``agents`` and ``grpc_kv`` never import ``console``, ``orchestrator`` nor Django.
* ``grpc_kv`` (the link library) never imports ``agents``.
* ``pdbridge_vllm`` (runs inside vLLM's processes) imports neither Django, ``console``,
  ``orchestrator`` nor ``agents``.
* ``pdproto`` (the shared names) imports the standard library only.
"""

from __future__ import annotations

import ast
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support import repo_root

#: Top-level packages of the source tree (tests and benchmarks are not held to the arrows).
PACKAGES = ("agents", "console", "grpc_kv", "orchestrator", "pdbridge", "pdbridge_vllm", "pdproto")

#: Modules of agents and grpc_kv that the console may import (and their submodules).
PUBLIC = ("agents.client", "grpc_kv.api")


@dataclass(frozen=True)
class Rule:
    """Modules under ``source`` must not import anything under ``forbidden`` (a module or a
    package prefix) unless it is under one of ``allowed``."""

    source: str
    forbidden: tuple[str, ...]
    why: str
    allowed: tuple[str, ...] = ()


RULES = (
    Rule(
        "console",
        ("orchestrator",),
        "the console starts work with a Celery task sent by name, never workflow code",
    ),
    Rule(
        "console",
        ("agents", "grpc_kv"),
        "the console uses agents and the link through their public client modules only",
        allowed=PUBLIC,
    ),
    Rule(
        "agents", ("console", "orchestrator", "django"), "agents never depend on the control plane"
    ),
    Rule(
        "grpc_kv",
        ("console", "orchestrator", "django"),
        "the link never depends on the control plane",
    ),
    Rule("grpc_kv", ("agents",), "the link is a library the agent uses, not the other way"),
    Rule(
        "pdbridge_vllm",
        ("django", "console", "orchestrator", "agents"),
        "the connector runs inside vLLM's processes: the link library and pdproto only",
    ),
)
#: Packages whose modules may import only the standard library and themselves.
STDLIB_ONLY = ("pdproto",)


@dataclass(frozen=True)
class Import:
    """One imported module, where it is imported."""

    module: str
    path: str
    line: int


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def imports_of(
    source: str, module: str, is_package: bool, known: frozenset[str]
) -> list[tuple[int, str]]:
    """(line, imported module) for every import in ``source``, the text of ``module``.
    ``from pkg import name`` names ``pkg.name`` when that is a module of the tree (``known``),
    else ``pkg``."""
    package = module if is_package else module.rpartition(".")[0]
    out: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1])
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                out.append((node.lineno, sub if sub in known else target))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute | ast.Name)
            and (node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id)
            == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            out.append((node.lineno, node.args[0].value))
    return out


def module_name(root: Path, path: Path) -> tuple[str, bool]:
    """The dotted name of a source file under ``root`` and whether it is a package."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    is_package = parts[-1] == "__init__"
    if is_package:
        parts.pop()
    return ".".join(parts), is_package


def collect(root: Path, packages: tuple[str, ...] = PACKAGES) -> dict[str, list[Import]]:
    """Module name -> its imports, for every ``.py`` file of ``packages`` under ``root``
    (migrations and generated stubs included: they are code that runs)."""
    files = [p for pkg in packages for p in sorted((root / pkg).rglob("*.py"))]
    names = {p: module_name(root, p) for p in files}
    known = frozenset(name for name, _ in names.values())
    out: dict[str, list[Import]] = {}
    for path, (name, is_package) in names.items():
        rel = str(path.relative_to(root))
        found = imports_of(path.read_text(encoding="utf-8"), name, is_package, known)
        out[name] = [Import(target, rel, line) for line, target in found]
    return out


def violations(
    graph: dict[str, list[Import]],
    rules: tuple[Rule, ...] = RULES,
    stdlib_only: tuple[str, ...] = STDLIB_ONLY,
) -> list[str]:
    """One line per import against the arrows: ``path:line: a -> b (why)``."""
    out = []
    for module, imports in sorted(graph.items()):
        for imp in imports:
            for rule in rules:
                if (
                    _under(module, rule.source)
                    and any(_under(imp.module, f) for f in rule.forbidden)
                    and not any(_under(imp.module, a) for a in rule.allowed)
                ):
                    out.append(f"{imp.path}:{imp.line}: {module} -> {imp.module} ({rule.why})")
            for pkg in stdlib_only:
                top = imp.module.split(".")[0]
                if _under(module, pkg) and top != pkg and top not in sys.stdlib_module_names:
                    out.append(
                        f"{imp.path}:{imp.line}: {module} -> {imp.module} "
                        f"({pkg} imports the standard library only)"
                    )
    return out


def test_the_source_tree_imports_along_the_arrows():
    graph = collect(repo_root())

    assert len(graph) > 100  # the walk found the tree
    assert violations(graph) == []


def _tree(tmp_path: Path, files: dict[str, str]) -> dict[str, list[Import]]:
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return collect(tmp_path)


def test_the_checker_sees_an_arrow_against_the_direction(tmp_path):
    graph = _tree(
        tmp_path,
        {
            "grpc_kv/__init__.py": "",
            "grpc_kv/sender.py": "import os\n\ndef f():\n    from agents.gateway import app\n",
            "agents/__init__.py": "",
            "agents/gateway/__init__.py": "",
            "agents/gateway/app.py": "",
            "console/__init__.py": "",
            "console/drills/__init__.py": "from agents.client import AgentClient\n",
            "console/drills/services.py": "from agents import loadgen\nimport grpc_kv.api\n",
            "agents/loadgen.py": "",
            "pdproto/__init__.py": "import json\nfrom . import kv\n",
            "pdproto/kv.py": "import aiohttp\n",
            "pdbridge_vllm/__init__.py": "from importlib import import_module\nimport_module('django.conf')\n",
            "orchestrator/__init__.py": "",
            "orchestrator/drills.py": "from console.drills import services\n",
        },
    )

    found = violations(graph)

    assert found == [
        "console/drills/services.py:1: console.drills.services -> agents.loadgen "
        "(the console uses agents and the link through their public client modules only)",
        "grpc_kv/sender.py:4: grpc_kv.sender -> agents.gateway.app "
        "(the link is a library the agent uses, not the other way)",
        "pdbridge_vllm/__init__.py:2: pdbridge_vllm -> django.conf "
        "(the connector runs inside vLLM's processes: the link library and pdproto only)",
        "pdproto/kv.py:1: pdproto.kv -> aiohttp (pdproto imports the standard library only)",
    ]


@pytest.mark.parametrize(
    ("module", "is_package", "source", "expected"),
    [
        ("agents.engines.base", False, "from . import vllm", ["agents.engines.vllm"]),
        ("agents.engines.base", False, "from ..gateway.app import x", ["agents.gateway.app"]),
        ("agents.engines", True, "from .base import x", ["agents.engines.base"]),
        (
            "agents.engines",
            True,
            "from agents.engines import base, nothing",
            ["agents.engines.base", "agents.engines"],
        ),
        ("x", False, "import a.b as c, d", ["a.b", "d"]),
        ("x", False, "if TYPE_CHECKING:\n    import console.models", ["console.models"]),
    ],
)
def test_imports_are_resolved_to_the_module_they_load(module, is_package, source, expected):
    known = frozenset({"agents.engines.vllm", "agents.engines.base", "agents.gateway.app"})

    assert [name for _, name in imports_of(source, module, is_package, known)] == expected

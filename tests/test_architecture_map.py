"""docs/architecture.md's "Where does X happen" table names objects that exist: every
``module:attr.path`` in its second column imports and resolves."""

from __future__ import annotations

import importlib
import re

from tests.support import repo_root

_NAME = re.compile(r"`([a-z_][\w.]*):([A-Za-z_][\w.]*)`")


def map_rows() -> list[tuple[str, list[tuple[str, str]]]]:
    """(behaviour, [(module, attribute path)]) for each row of the table."""
    text = (repo_root() / "docs" / "architecture.md").read_text(encoding="utf-8")
    section = text.split("## Where does X happen", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 2 and cells[1] and not set(cells[1]) <= {"-"}:
            names = _NAME.findall(cells[1])
            if names:
                rows.append((cells[0], names))
    return rows


def test_the_map_has_30_to_50_rows_each_naming_code():
    rows = map_rows()

    assert 30 <= len(rows) <= 50
    assert all(names for _, names in rows)


def test_every_name_in_the_map_imports():
    missing = []
    for behaviour, names in map_rows():
        for module, path in names:
            try:
                obj = importlib.import_module(module)
                for part in path.split("."):
                    obj = getattr(obj, part)
            except (ImportError, AttributeError) as exc:
                missing.append(f"{behaviour}: {module}:{path} ({exc})")

    assert missing == []

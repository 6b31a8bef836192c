"""Benchmarks (``make bench-<part>``): each compares variants side by side in one run and
writes its results as JSON."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_json(path: Path, result: Any) -> None:
    """Write a benchmark's ``result`` to ``path`` (its folder made if needed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")

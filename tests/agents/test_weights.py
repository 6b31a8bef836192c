"""The agent's weights hasher on real files: digests equal the reference engine's, hashing
happens off the caller's thread and is cached by path+mtime+size, engine model specs resolve
like the engine resolves them, and problems are reported, never raised."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path
from typing import Any

import pytest

from agents.engines.reference import checkpoints
from agents.weights import WeightsHasher, parse_model_spec, weight_files
from tests.support import wait_for


def _settled(hasher: WeightsHasher, path: Path) -> dict[str, Any]:
    return wait_for(lambda: (r := hasher.lookup(path))["state"] != "hashing" and r, 10)


def test_first_lookup_queues_the_hash_and_a_later_one_returns_it(tmp_path: Path) -> None:
    data = os.urandom(2 * 1024 * 1024 + 5)
    (tmp_path / "model.safetensors").write_bytes(data)
    hasher = WeightsHasher()

    first = hasher.lookup(tmp_path)
    done = _settled(hasher, tmp_path)

    assert first == {"path": str(tmp_path), "state": "hashing", "sha256": None, "detail": ""}
    assert done["sha256"] == hashlib.sha256(data).hexdigest()
    assert done["state"] == "ok"


def test_a_file_replaced_in_place_is_hashed_again(tmp_path: Path) -> None:
    weights = tmp_path / "w.gguf"
    weights.write_bytes(b"a" * 1000)
    hasher = WeightsHasher()
    before = _settled(hasher, weights)["sha256"]

    weights.write_bytes(b"b" * 1000)  # same size: the mtime must tell them apart
    os.utime(weights, ns=(time.time_ns() + 10**9, time.time_ns() + 10**9))

    assert hasher.lookup(weights)["state"] == "hashing"
    assert _settled(hasher, weights)["sha256"] == hashlib.sha256(b"b" * 1000).hexdigest() != before


def test_sharded_checkpoints_hash_their_files_in_name_order(tmp_path: Path) -> None:
    for name, data in (
        ("model-00002-of-00002.safetensors", b"two"),
        ("model-00001-of-00002.safetensors", b"one"),
    ):
        (tmp_path / name).write_bytes(data)
    (tmp_path / "config.json").write_text("{}")

    assert [p.name for p in weight_files(tmp_path)] == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]
    assert _settled(WeightsHasher(), tmp_path)["sha256"] == hashlib.sha256(b"onetwo").hexdigest()


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("tiny=qwen3-next@bfloat16", ("tiny", "qwen3-next")),
        ("qwen3-next", ("qwen3-next", "qwen3-next")),
        ("/models/x@float32", ("/models/x", "/models/x")),
        ("m=/models/x", ("m", "/models/x")),
    ],
)
def test_model_specs_parse_like_the_engine_parses_them(
    spec: str, expected: tuple[str, str]
) -> None:
    assert parse_model_spec(spec) == expected


def test_report_covers_held_models_and_engine_children(tmp_path: Path) -> None:
    zoo = checkpoints.zoo_dir("qwen3-next", tmp_path / "models")
    zoo.mkdir(parents=True)
    (zoo / "model.safetensors").write_bytes(b"zoo weights")
    held = tmp_path / "held.gguf"
    held.write_bytes(b"held weights")
    hasher = WeightsHasher()
    models = {"catalog-name": str(held), "gone": str(tmp_path / "missing")}
    engines = {
        "dep1-prefill": ("tiny=qwen3-next", str(tmp_path / "models")),
        "dep1-decode": ("tiny=gemma3", str(tmp_path / "models")),
    }

    hasher.report(models, engines)
    report = wait_for(
        lambda: (
            (r := hasher.report(models, engines)) and all(e["state"] != "hashing" for e in r) and r
        ),
        10,
    )

    assert [(e["model"], e["child"], e["state"], e["sha256"]) for e in report] == [
        ("catalog-name", None, "ok", hashlib.sha256(b"held weights").hexdigest()),
        ("gone", None, "error", None),
        ("tiny", "dep1-decode", "error", None),
        ("tiny", "dep1-prefill", "ok", hashlib.sha256(b"zoo weights").hexdigest()),
    ]
    assert report[1]["detail"].startswith("[Errno 2] No such file or directory")
    assert report[2]["detail"] == (
        "model: 'gemma3' is neither a path on this node nor generated zoo weights "
        f"({checkpoints.zoo_dir('gemma3', tmp_path / 'models')})"
    )
    assert report[3]["path"] == str(zoo)


def test_a_directory_without_weights_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")

    result = WeightsHasher().lookup(tmp_path)

    assert result == {
        "path": str(tmp_path),
        "state": "error",
        "sha256": None,
        "detail": f"model: {tmp_path} holds no weights file",
    }

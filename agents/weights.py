"""The sha256 of the model weights a node holds or serves, for heartbeats.

The console's readiness check compares these with the catalog's ``weights_sha256`` on every
node of both pools (a prefill engine and a decode engine with different weights would exchange
caches that do not fit). Hashing a real checkpoint takes seconds to minutes (sha256 runs at
about 1.6 GB/s), so it happens on one background thread and the result is cached by each
file's path, mtime and size: the heartbeat only ever reads the cache, and a file replaced in
place is hashed again.

Who calls it: :meth:`agents.service.AgentService.heartbeat_body` on the event loop, once per
beat. :meth:`WeightsHasher.report` never blocks beyond a ``stat`` per weights file; failures
(missing path, unreadable file) are reported as ``state: error`` with the reason, never raised.
"""

from __future__ import annotations

import hashlib
import logging
import queue
import threading
from pathlib import Path
from typing import Any

from agents.engines.reference import checkpoints

log = logging.getLogger("pdbridge.agent.weights")

#: File kinds that hold weights, in the order a checkpoint directory is searched.
WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".bin", ".pt", ".pth")

FileKey = tuple[tuple[str, int, int], ...]


def parse_model_spec(spec: str) -> tuple[str, str]:
    """``name=source@dtype`` (the engine's ``--model`` value) -> ``(served name, source)``."""
    name, sep, rest = spec.partition("=")
    source = rest if sep else spec
    source = source.rsplit("@", 1)[0] if "@" in source else source
    return (name if sep else source), source


def resolve_source(source: str, models_dir: str | None = None) -> Path:
    """Where an engine's model source lives on this node: an existing path as is, a zoo
    architecture under the models directory, ``smollm2`` in its package. Raises ModelError."""
    path = Path(source)
    if path.exists():
        return path
    if source == checkpoints.REAL_SMOLLM2:
        return checkpoints.smollm2_dir()
    generated = checkpoints.zoo_dir(source, Path(models_dir) if models_dir else None)
    if generated.is_dir():
        return generated
    raise checkpoints.ModelError(
        f"model: {source!r} is neither a path on this node nor generated zoo weights ({generated})"
    )


def weight_files(path: Path) -> list[Path]:
    """The files whose bytes the weights sha256 covers: the file itself, or a checkpoint
    directory's ``model.safetensors`` / single GGUF (the reference engine's convention, so the
    hash equals the one the engine checks), else every weights file of the directory in name
    order (sharded checkpoints: the hash of their concatenation)."""
    if path.is_file():
        return [path]
    try:
        return [checkpoints.weights_file(path)[0]]
    except checkpoints.ModelError:
        pass
    shards = sorted(p for p in path.iterdir() if p.is_file() and p.suffix in WEIGHT_SUFFIXES)
    if not shards:
        raise checkpoints.ModelError(f"model: {path} holds no weights file")
    return shards


def hash_files(files: list[Path]) -> str:
    """sha256 over the files' bytes in order (blocking; 1 MiB reads)."""
    digest = hashlib.sha256()
    for file in files:
        with file.open("rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()


class WeightsHasher:
    """Hashes weights on a daemon thread (one file set at a time) and caches the digests.

    A daemon thread rather than an executor: an agent asked to stop must not wait for the hash
    of a 100 GB checkpoint to finish.
    """

    def __init__(self) -> None:
        self._digests: dict[FileKey, str] = {}
        self._errors: dict[FileKey, str] = {}
        self._pending: set[FileKey] = set()
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue[tuple[FileKey, list[Path]]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def _ensure_thread(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._work, name="weights-hasher", daemon=True)
            self._thread.start()

    def _work(self) -> None:
        while True:
            key, files = self._queue.get()
            try:
                digest = hash_files(files)
            except OSError as exc:
                with self._lock:
                    self._errors[key] = f"cannot read {exc.filename}: {exc.strerror}"
                    self._pending.discard(key)
                continue
            with self._lock:
                self._digests[key] = digest
                self._pending.discard(key)
            log.info("agent.weights_hashed", extra={"files": len(files), "sha256": digest})

    def lookup(self, path: Path) -> dict[str, Any]:
        """``{path, state, sha256, detail}`` for ``path``: ``ok`` with the digest, ``hashing``
        while the background thread works on it (it is queued by this call), or ``error``."""
        out: dict[str, Any] = {"path": str(path), "state": "error", "sha256": None, "detail": ""}
        try:
            files = weight_files(path)
            key: FileKey = tuple(
                (str(f), st.st_mtime_ns, st.st_size) for f in files for st in [f.stat()]
            )
        except (OSError, checkpoints.ModelError) as exc:
            out["detail"] = str(exc)
            return out
        with self._lock:
            if key in self._digests:
                return {**out, "state": "ok", "sha256": self._digests[key]}
            if key in self._errors:
                return {**out, "detail": self._errors[key]}
            if key not in self._pending:
                self._pending.add(key)
                self._queue.put((key, files))
        self._ensure_thread()
        return {**out, "state": "hashing"}

    def report(
        self, models: dict[str, str], engines: dict[str, tuple[str, str | None]]
    ) -> list[dict[str, Any]]:
        """The heartbeat's ``weights`` list: one entry per held model (``models``: catalog name
        -> path, from ``agent.yaml``) and per engine child (``engines``: child name -> (model
        spec, models_dir))."""
        entries: list[dict[str, Any]] = []
        for name, held in sorted(models.items()):
            entries.append({"model": name, "child": None, **self.lookup(Path(held))})
        for child, (spec, models_dir) in sorted(engines.items()):
            served, source = parse_model_spec(spec)
            try:
                path = resolve_source(source, models_dir)
            except checkpoints.ModelError as exc:
                entries.append(
                    {
                        "model": served,
                        "child": child,
                        "path": source,
                        "state": "error",
                        "sha256": None,
                        "detail": str(exc),
                    }
                )
                continue
            entries.append({"model": served, "child": child, **self.lookup(path)})
        return entries

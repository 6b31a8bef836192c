"""Generated gRPC stubs of the agent control API (``pdbridge.agent.v1``).

The ``.proto`` is the source; ``*_pb2*.py`` are git-ignored and generated on first import by
:func:`ensure_generated` (or ``make protos``), under a file lock so that concurrent first
imports do not race. Callers import :mod:`agents.proto.api` instead of the generated modules.
"""

from __future__ import annotations

import fcntl
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent
PROTOS = [Path(__file__).resolve().parent / "pdbridge" / "agent" / "v1" / "agent.proto"]


def _stale(proto: Path) -> bool:
    outputs = [
        proto.with_name(proto.stem + suffix) for suffix in ("_pb2.py", "_pb2_grpc.py", "_pb2.pyi")
    ]
    mtime = proto.stat().st_mtime
    return any(not out.exists() or out.stat().st_mtime < mtime for out in outputs)


def ensure_generated() -> None:
    """Generate the Python stubs next to each .proto when missing or older than it.

    Blocking (runs protoc in-process, well under a second); raises RuntimeError if protoc fails.
    """
    if not any(_stale(p) for p in PROTOS):
        return
    import grpc_tools
    from grpc_tools import protoc

    include = Path(grpc_tools.__file__).resolve().parent / "_proto"
    lock_path = PROTOS[0].parent / ".generate.lock"
    with lock_path.open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        for proto in PROTOS:
            if not _stale(proto):
                continue
            args = [
                "protoc",
                f"-I{ROOT}",
                f"-I{include}",
                f"--python_out={ROOT}",
                f"--pyi_out={ROOT}",
                f"--grpc_python_out={ROOT}",
                str(proto.relative_to(ROOT)),
            ]
            if protoc.main(args) != 0:
                raise RuntimeError(f"protoc failed for {proto}")

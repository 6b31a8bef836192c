"""The generated protobuf/gRPC modules of ``pdbridge.kv.v1``, built on first import.

Stubs are git-ignored (``*_pb2*.py``) and produced from ``proto/pdbridge/kv/v1/kv.proto`` by
grpcio-tools, either by ``make protos`` or, when missing or older than the .proto, here at
import time (under a file lock, so parallel test workers do not race). Everything else in
``grpc_kv`` imports ``pb`` and ``pb_grpc`` from this module, never the files directly.
"""

from __future__ import annotations

import fcntl
import importlib
from pathlib import Path
from types import ModuleType

PROTOCOL_VERSION = 1
PACKAGE = "pdbridge.kv.v1"

_ROOT = Path(__file__).resolve().parent.parent
_PROTO = Path(__file__).resolve().parent / "proto" / "pdbridge" / "kv" / "v1" / "kv.proto"
_OUTPUTS = ("kv_pb2.py", "kv_pb2.pyi", "kv_pb2_grpc.py")


def _stale() -> bool:
    proto_mtime = _PROTO.stat().st_mtime
    for name in _OUTPUTS:
        out = _PROTO.parent / name
        if not out.exists() or out.stat().st_mtime < proto_mtime:
            return True
    return False


def generate(force: bool = False) -> None:
    """Compile kv.proto into ``kv_pb2.py``, ``kv_pb2.pyi`` and ``kv_pb2_grpc.py`` beside it.

    Called by ``make protos`` and on first import. Blocking (about a second). Raises
    RuntimeError with protoc's exit code when compilation fails.
    """
    from grpc_tools import protoc  # heavy import, only needed when (re)generating

    lock_path = _PROTO.parent / ".generate.lock"
    with lock_path.open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not force and not _stale():
            return
        rel = _PROTO.relative_to(_ROOT)
        code = protoc.main(
            [
                "grpc_tools.protoc",
                f"-I{_ROOT}",
                f"--python_out={_ROOT}",
                f"--pyi_out={_ROOT}",
                f"--grpc_python_out={_ROOT}",
                str(rel),
            ]
        )
        if code != 0:
            raise RuntimeError(f"protoc failed with exit code {code} on {rel}")


def _load() -> tuple[ModuleType, ModuleType]:
    if _stale():
        generate()
    base = "grpc_kv.proto.pdbridge.kv.v1"
    return importlib.import_module(f"{base}.kv_pb2"), importlib.import_module(f"{base}.kv_pb2_grpc")


pb, pb_grpc = _load()

if __name__ == "__main__":
    generate(force=True)

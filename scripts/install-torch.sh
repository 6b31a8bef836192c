#!/usr/bin/env bash
# Installs a torch build that fits this machine into the given Python environment, before the
# project's own dependencies (which accept the installed torch and pull nothing bigger).
#  - already installed: nothing to do;
#  - a local CPU wheel of the pinned release (pip's find-links, as on the project's CI machines): use it;
#  - no NVIDIA GPU: the CPU build from the PyTorch CPU index (PyPI's default Linux wheel is a
#    multi-GB CUDA build);
#  - an NVIDIA GPU: the default (CUDA) build from PyPI.
# Override with TORCH_SPEC (e.g. torch==2.14.1) and TORCH_INDEX_URL.
set -euo pipefail
py=${1:?usage: install-torch.sh PYTHON}
spec=${TORCH_SPEC:-torch==2.13.0}
if "$py" -c 'import torch' 2>/dev/null; then
  exit 0
fi
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
if "$py" -m pip download --quiet --no-deps --no-index -d "$tmp" "$spec" >/dev/null 2>&1; then
  echo "install-torch: using the local wheel $(ls "$tmp")"
  exec "$py" -m pip install --quiet "$spec"
fi
if [ -n "${TORCH_INDEX_URL:-}" ]; then
  exec "$py" -m pip install --quiet "$spec" --index-url "$TORCH_INDEX_URL" --extra-index-url https://pypi.org/simple
fi
if command -v nvidia-smi >/dev/null 2>&1; then
  echo "install-torch: NVIDIA GPU found, installing the CUDA build from PyPI"
  exec "$py" -m pip install --quiet "$spec"
fi
echo "install-torch: no GPU, installing the CPU build"
exec "$py" -m pip install --quiet "$spec" --index-url https://download.pytorch.org/whl/cpu --extra-index-url https://pypi.org/simple

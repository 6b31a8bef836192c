#!/usr/bin/env bash
# The suite on a busy machine (#19): CPU-burning processes beside a subset of the tests whose
# waits a loaded machine stresses most (agents starting, faults restored, health probes,
# failover), then the README's run command under the same load. Waits in the tests scale by
# PDBRIDGE_TEST_TIME_SCALE (3 here); the subset must pass as it does on an idle machine.
#
#   scripts/test-under-load.sh            # UNDER_LOAD_BURNERS=2, PDBRIDGE_TEST_TIME_SCALE=3
#   UNDER_LOAD_TESTS="tests/agents/test_daemon.py" scripts/test-under-load.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
BURNERS=${UNDER_LOAD_BURNERS:-2}
export PDBRIDGE_TEST_TIME_SCALE=${PDBRIDGE_TEST_TIME_SCALE:-3}
TESTS=${UNDER_LOAD_TESTS:-"
  tests/agents/test_faults_netns.py
  tests/agents/test_console_heartbeats.py
  tests/agents/gateway/test_pools.py
  tests/agents/gateway/test_failover.py
  tests/agents/test_daemon.py
"}

burners=()
stop_burners() {
  for pid in "${burners[@]}"; do kill "$pid" 2>/dev/null || true; done
  wait 2>/dev/null || true
}
trap stop_burners EXIT INT TERM
for _ in $(seq "$BURNERS"); do
  # A busy loop at normal priority: the tests compete for the CPU as they would with a
  # neighbour's build on a shared host.
  "$PY" -c 'while True: pass' &
  burners+=("$!")
done
echo "under-load: ${#burners[@]} CPU burners (pids ${burners[*]}), PDBRIDGE_TEST_TIME_SCALE=$PDBRIDGE_TEST_TIME_SCALE"

started=$(date +%s)
# shellcheck disable=SC2086  # TESTS is a whitespace-separated list of paths
"$PY" -m pytest -p no:cacheprovider $TESTS
echo "under-load: tests passed in $(($(date +%s) - started)) s"

started=$(date +%s)
var_dir=$(mktemp -d "${TMPDIR:-/tmp}/pdbridge-under-load.XXXXXX")
"$PY" -m pdbridge.cli run --port 0 --gateway-port 0 --exit-after 20 --var-dir "$var_dir"
rm -rf "$var_dir"
echo "under-load: the README's run command came up and served in $(($(date +%s) - started)) s"

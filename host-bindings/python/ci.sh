#!/usr/bin/env bash
# CI for the Python host: venv, install (pip install .[test]), mypy --strict, the host scenarios
# (conformance/hosts), pytest (unit, conformance, end-to-end on 127.0.0.1), and the benchmark in
# its short mode.
# Expects the component built in $LEVEE_WASM_DIR (default <repo>/target/levee).
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$HERE"
ROOT="$(git rev-parse --show-toplevel 2>/dev/null || (cd ../.. && pwd))"
export LEVEE_WASM_DIR="${LEVEE_WASM_DIR:-$ROOT/target/levee}"
case "$LEVEE_WASM_DIR" in /*) ;; *) LEVEE_WASM_DIR="$ROOT/$LEVEE_WASM_DIR" ;; esac  # relative: to the repo root
if [ ! -f "$LEVEE_WASM_DIR/levee_policy.wasm" ]; then
  echo "ci.sh: $LEVEE_WASM_DIR/levee_policy.wasm is missing; build it with:" >&2
  echo "  cd $ROOT && cargo run -q --release -p levee-build -- target/levee" >&2
  exit 1
fi
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
VPY="$HERE/.venv/bin/python"
quiet() { # run quietly; show the output only on failure
  local log
  log="$(mktemp)"
  if ! "$@" >"$log" 2>&1; then cat "$log" >&2; rm -f "$log"; return 1; fi
  rm -f "$log"
}
echo "== install"
quiet "$VPY" -m pip install --upgrade pip
# a fresh wheel every time, so the component inside it is the one just built
quiet "$VPY" -m pip install --force-reinstall --no-deps .
quiet "$VPY" -m pip install ".[test]"
rm -rf build src/*.egg-info

echo "== ruff"
"$HERE/.venv/bin/ruff" check src tests bench demo.py setup.py
"$HERE/.venv/bin/ruff" format --check src tests bench demo.py setup.py
echo "== mypy --strict"
"$VPY" -m mypy --strict src/levee tests bench
echo "== host scenarios (conformance/hosts: inputs as scenarios.py writes them, schema, replay)"
"$VPY" ../../conformance/hosts/scenarios.py --check
"$VPY" -m pytest -q -p no:cacheprovider tests/test_host_scenarios.py::test_scenarios_match_the_schema
"$VPY" tests/hosts_runner.py
echo "== pytest"
# run from a directory where `import levee` resolves to the installed wheel, not src/
"$VPY" -m pytest -q -p no:cacheprovider tests
echo "== benchmark (short)"
"$VPY" bench/bench.py --quick
echo "== snapshots at many keys (smoke size; the full run: python bench/snapshot.py)"
"$VPY" bench/snapshot.py --n 1,1000,20000 --seconds 0.5 --check
echo "== production-load harness (smoke size; the full run: python bench/load.py)"
"$VPY" bench/load.py --levels 1,200 --rounds 3 --single 5
d="$(mktemp -d)"; LEVEE_CACHE_DIR="$d" "$VPY" bench/coldstart.py; LEVEE_CACHE_DIR="$d" "$VPY" bench/coldstart.py; rm -rf "$d"

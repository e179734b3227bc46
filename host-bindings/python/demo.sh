#!/usr/bin/env bash
# Run one policy against a URL and print each decision, one line per step:
#   ./demo.sh http://127.0.0.1:8080/flaky [policy.yaml] [policy-name]
# (default policy: $LEVEE_DEMO_POLICY, else the repository's examples/demo/policy.yaml if present,
# else a built-in one; default name: `demo`, else the first policy). Installs the package into .venv on first use.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
if [ $# -lt 1 ]; then
  echo "usage: $0 URL [policy-file] [policy-name]" >&2
  exit 2
fi
if [ ! -x "$HERE/.venv/bin/python" ] || ! "$HERE/.venv/bin/python" -c "import levee, httpx" 2>/dev/null; then
  ROOT="$(git -C "$HERE" rev-parse --show-toplevel 2>/dev/null || (cd "$HERE/../.." && pwd))"
  export LEVEE_WASM_DIR="${LEVEE_WASM_DIR:-$ROOT/target/levee}"
  case "$LEVEE_WASM_DIR" in /*) ;; *) LEVEE_WASM_DIR="$ROOT/$LEVEE_WASM_DIR" ;; esac
  [ -x "$HERE/.venv/bin/python" ] || python3 -m venv "$HERE/.venv"
  "$HERE/.venv/bin/python" -m pip install -q "$HERE[httpx]" >&2
fi
exec "$HERE/.venv/bin/python" "$HERE/demo.py" "$@"

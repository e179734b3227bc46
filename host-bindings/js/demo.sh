#!/usr/bin/env bash
# Run one policy against a URL and print each decision (one line per step).
#   ./demo.sh URL [policy.yaml] [policy-name]
# (default policy: $LEVEE_DEMO_POLICY, else examples/demo/policy.yaml if present, else a built-in one)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
cd "$here"
if [ ! -f dist/index.js ] || [ ! -f wasm/levee_policy.js ]; then
  repo="$(git rev-parse --show-toplevel)"
  export LEVEE_WASM_DIR="${LEVEE_WASM_DIR:-$repo/target/levee}"
  [ -d node_modules ] || npm ci --no-audit --no-fund >/dev/null
  node scripts/transpile.mjs >/dev/null
  npx tsc -p tsconfig.json
fi
exec node demo.mjs "$@"

#!/usr/bin/env bash
# CI for the JavaScript host: install (npm ci), transpile the component with the pinned jco, type-check
# and build, run every test (unit, conformance vectors, end to end on 127.0.0.1, workerd).
# Expects the component already built in $LEVEE_WASM_DIR (default <repo>/target/levee).
set -euo pipefail
cd "$(dirname "$0")"
repo="$(git rev-parse --show-toplevel)"
export LEVEE_WASM_DIR="${LEVEE_WASM_DIR:-$repo/target/levee}"

npm ci --no-audit --no-fund
node scripts/transpile.mjs
npx prettier --check .
npx tsc -p tsconfig.json --noEmit
npx tsc -p tsconfig.json
node --test --test-concurrency=1 test/
# production-load harness, smoke size (the full run: node --expose-gc bench/load.mjs, see docs/performance.md)
node bench/load.mjs --levels 1,200 --rounds 3 --single 5
node bench/coldstart.mjs
# snapshots at many keys, smoke size (the full run: node --expose-gc bench/snapshot.mjs, see docs/performance.md)
node bench/snapshot.mjs --sizes 1000,20000 --seconds 0.5 --snapshot export-snapshot

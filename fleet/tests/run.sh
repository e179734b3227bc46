#!/usr/bin/env bash
# The fleet's multi-process test (docs/fleet.md): a private Redis on 127.0.0.1 (Debian's
# redis-server, installed when missing) on a free port, Python, Go, JavaScript and Rust processes
# sharing it: the Lua GCRA against the core's cases, 1,000/s across 5 processes for 10 s (async leases and
# strict), one bad node, a quorum of bad nodes, Redis killed and restarted, Redis blocked
# for a second, concurrent failure records from four languages. Redis is stopped at the end. About four minutes.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
export LEVEE_WASM_DIR="${LEVEE_WASM_DIR:-$ROOT/target/levee}"
if [ ! -f "$LEVEE_WASM_DIR/levee_policy.wasm" ]; then
  echo "fleet: $LEVEE_WASM_DIR/levee_policy.wasm is missing; build it with ./dev component" >&2
  exit 1
fi
quiet() { local log; log="$(mktemp)"; if ! "$@" >"$log" 2>&1; then cat "$log" >&2; rm -f "$log"; return 1; fi; rm -f "$log"; }

echo "== the Lua scripts: one source (fleet/lua), copied into the hosts"
for f in gcra.lua state.lua; do
  cmp "$ROOT/fleet/lua/$f" "$ROOT/host-bindings/python/src/levee/_fleet/$f"
  cmp "$ROOT/fleet/lua/$f" "$ROOT/host-bindings/go/fleet/lua/$f"
  cmp "$ROOT/fleet/lua/$f" "$ROOT/host-bindings/js/lua/$f"
  cmp "$ROOT/fleet/lua/$f" "$ROOT/host-rust/src/fleet/$f"
done

echo "== install: redis-server, a venv with the Python host and redis-py, the Go worker"
if ! command -v redis-server >/dev/null; then
  quiet apt-get update
  quiet env DEBIAN_FRONTEND=noninteractive apt-get install -y redis-server
fi
VENV="$ROOT/fleet/.venv"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
quiet "$VENV/bin/pip" install --upgrade pip
quiet "$VENV/bin/pip" install --force-reinstall --no-deps "$ROOT/host-bindings/python"
quiet "$VENV/bin/pip" install "$ROOT/host-bindings/python[fleet]" "mypy>=1.10"  # redis-py ships its types
rm -rf "$ROOT/host-bindings/python/build" "$ROOT"/host-bindings/python/src/*.egg-info
echo "== mypy --strict levee.fleet"
(cd "$ROOT/host-bindings/python" && MYPYPATH=src "$VENV/bin/python" -m mypy --strict --follow-imports=silent src/levee/fleet.py)
WORK="$(mktemp -d)"
(cd "$ROOT/host-bindings/go/fleet" && gofmt -l . | (! grep .) && go vet ./... && go build -o "$WORK/fleet-worker" ./cmd/fleet-worker)
echo "== the JS host with ioredis (a devDependency; an optional peer for users), tsc --strict"
(cd "$ROOT/host-bindings/js" \
  && { [ -d node_modules/ioredis ] && [ ! package-lock.json -nt node_modules/.package-lock.json ] \
       || quiet npm ci --no-audit --no-fund --loglevel=error; } \
  && node scripts/transpile.mjs >/dev/null && npx tsc -p tsconfig.json \
  && npx prettier --config .prettierrc.json --check src/fleet.ts "$ROOT/fleet/tests/"*.mjs >/dev/null \
  && npm pack --dry-run --json --ignore-scripts 2>/dev/null >"$WORK/pack.json")
"$VENV/bin/python" - "$WORK/pack.json" <<'PY'
import json, sys
files = {f["path"] for f in json.load(open(sys.argv[1]))[0]["files"]}
missing = {"lua/gcra.lua", "lua/state.lua", "dist/fleet.js", "dist/fleet.d.ts"} - files
assert not missing, f"npm pack leaves out {sorted(missing)}"
print("   npm pack ships lua/gcra.lua, lua/state.lua and dist/fleet.js")
PY
echo "== the Rust worker (release, feature fleet-redis, the workspace's target/)"
# --workspace keeps the workspace's feature set (wasmtime is not rebuilt); the feature adds redis-rs.
RUST_FEATURES=(--release --workspace --features levee-resilience/fleet-redis)
(cd "$ROOT" && cargo build -q "${RUST_FEATURES[@]}" --example fleet-worker)
RS_WORKER="${CARGO_TARGET_DIR:-$ROOT/target}/release/examples/fleet-worker"

PORT="$("$VENV/bin/python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
REDIS_CMD=(redis-server --port "$PORT" --bind 127.0.0.1 --save "" --appendonly no --daemonize yes --enable-debug-command local
           --pidfile "$WORK/redis.pid" --logfile "$WORK/redis.log" --dir "$WORK")
stop() {
  if [ -f "$WORK/redis.pid" ]; then kill "$(cat "$WORK/redis.pid")" 2>/dev/null || true; fi
  rm -rf "$WORK"
}
trap stop EXIT
"${REDIS_CMD[@]}"
for _ in $(seq 50); do redis-cli -p "$PORT" ping >/dev/null 2>&1 && break; sleep 0.1; done
echo "== redis $(redis-server --version | awk '{print $3}') on 127.0.0.1:$PORT"

echo "== the Lua GCRA reproduces the core's (fleet/tests/gcra-cases.json)"
"$VENV/bin/python" "$HERE/gcra_cases.py" "127.0.0.1:$PORT"

echo "== the JS fleet option on its own (fleet/tests/js.test.mjs)"
FLEET_REDIS="127.0.0.1:$PORT" node --test "$HERE/js.test.mjs"
echo "== the JS fleet option on a Redis Cluster of 3 masters (fleet/tests/js_cluster.test.mjs)"
node --test "$HERE/js_cluster.test.mjs"
echo "== the Rust host's fleet tests against it (tests/fleet.rs, the Redis ones included)"
(cd "$ROOT" && LEVEE_FLEET_REDIS="127.0.0.1:$PORT" cargo test -q "${RUST_FEATURES[@]}" --test fleet -- --include-ignored)

echo "== the multi-process scenarios"
FLEET_PY="$VENV/bin/python" FLEET_GO_WORKER="$WORK/fleet-worker" FLEET_RS_WORKER="$RS_WORKER" FLEET_REDIS="127.0.0.1:$PORT" \
  FLEET_REDIS_CMD="$("$VENV/bin/python" -c 'import json, sys; print(json.dumps(sys.argv[1:]))' "${REDIS_CMD[@]}")" \
  timeout 600 "$VENV/bin/python" "$HERE/check.py"

if [ "${FLEET_BENCH:-0}" = 1 ]; then
  echo "== benchmarks (docs/performance.md)"
  FLEET_GO_WORKER="$WORK/fleet-worker" FLEET_RS_WORKER="$RS_WORKER" "$VENV/bin/python" "$HERE/bench.py" "127.0.0.1:$PORT"
fi

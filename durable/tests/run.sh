#!/usr/bin/env bash
# The durable-call crash tests: SQLite, then a private PostgreSQL cluster on 127.0.0.1 (installed
# from Debian's packages when missing, run as the `postgres` user in a temporary directory,
# stopped at the end), then 10,000 calls across 4 workers killed at random. Workers are Python,
# Go, JS and Rust processes: a call one of them wrote is resumed by another (docs/durable.md).
#   DURABLE_SCALE=N overrides the 10,000 calls (0 skips the scale run).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
export LEVEE_WASM_DIR="${LEVEE_WASM_DIR:-$root/target/levee}"
venv="$root/target/durable-venv"
if [ ! -x "$venv/bin/python" ]; then python3 -m venv "$venv"; fi
py="$venv/bin/python"
# `python -m pip`, not bin/pip: a venv copied from another tree keeps bin/pip's shebang, which
# would install into the other tree's venv.
"$py" -m pip install --quiet --disable-pip-version-check --force-reinstall --no-deps "$root/host-bindings/python"
"$py" -m pip install --quiet --disable-pip-version-check "$root/host-bindings/python[postgres]"
rm -rf "$root/host-bindings/python/build" "$root"/host-bindings/python/src/*.egg-info

work="$(mktemp -d /tmp/levee-durable.XXXXXX)"
chmod 755 "$work"
pgdata="$work/pg"
pgbin=""
sqlite_run=""
cleanup() {
  if [ -n "$sqlite_run" ]; then kill "$sqlite_run" 2>/dev/null && wait "$sqlite_run" 2>/dev/null || true; fi
  if [ -n "$pgbin" ] && [ -f "$pgdata/postmaster.pid" ]; then
    su postgres -s /bin/bash -c "'$pgbin/pg_ctl' -D '$pgdata' -m immediate stop" >/dev/null 2>&1 || true
  fi
  rm -rf "$work"
}
trap cleanup EXIT

echo "== durable: the Go executor (gofmt, go vet, go test, the crash tests' worker)"
godir="$root/host-bindings/go/durable"
(cd "$godir" && go mod download)
unformatted="$(cd "$godir" && gofmt -l .)"
if [ -n "$unformatted" ]; then echo "run.sh: gofmt -l reports: $unformatted" >&2; exit 1; fi
(cd "$godir" && go vet ./... && go test -count=1 ./... && go build -o "$work/go-worker" ./internal/testworker)

echo "== durable: the JS executor (build, with its optional drivers better-sqlite3 and pg)"
jsdir="$root/host-bindings/js"
# The drivers are optional peer dependencies of the package, which `npm install --no-save`
# leaves out ("up to date"), and `npm ci` (the JS host's own CI) removes anything not in the
# lock file. So they live in their own prefix under target/ (built once: better-sqlite3
# compiles) and are linked into node_modules for the run; Node resolves their own
# dependencies from the real path.
drivers="$root/target/js-durable-drivers"
if [ ! -d "$drivers/node_modules/better-sqlite3" ] || [ ! -d "$drivers/node_modules/pg" ]; then
  mkdir -p "$drivers"
  npm install --prefix "$drivers" --no-audit --no-fund --loglevel=error better-sqlite3@12.11.1 pg@8.23.1
fi
(cd "$jsdir" && { [ -d node_modules/typescript ] || npm ci --no-audit --no-fund --loglevel=error; } \
  && ln -sfn "$drivers/node_modules/better-sqlite3" node_modules/better-sqlite3 \
  && ln -sfn "$drivers/node_modules/pg" node_modules/pg \
  && node scripts/transpile.mjs >/dev/null && npx tsc -p tsconfig.json \
  && bash "$here/need-postgres.sh" >/dev/null \
  && LEVEE_REQUIRE_POSTGRES=1 node --test test/durable.test.mjs test/durable-tx.test.mjs test/durable-renew.test.mjs)

echo "== durable: the Rust executor (rustfmt, clippy with its features, its tests on SQLite, the crash tests' worker)"
# durable/tests/rust-worker is a workspace of its own with the natively linked core, built into
# target/durable-rust/: the durable features in the repository's workspace would change features
# of crates wasmtime shares and rebuild it for every Rust build (see its Cargo.toml).
rustdir="$root/durable/tests/rust-worker"
rust_target="$root/target/durable-rust"
(cd "$root" && cargo fmt -p levee-resilience -- --check \
  && cargo clippy -q --release -p levee-resilience --no-default-features --features native,durable-sqlite,durable-postgres \
       --target-dir "$rust_target" -- -D warnings)
(cd "$rustdir" && cargo fmt -- --check \
  && cargo clippy -q --release --target-dir "$rust_target" --all-targets -- -D warnings \
  && cargo build -q --release --target-dir "$rust_target" \
  && cargo test -q --release --target-dir "$rust_target")
rust_worker="$rust_target/release/levee-durable-worker"
workers=(--python "$py" --go "$work/go-worker" --node "$here/worker.mjs" --rust "$rust_worker")

# The crash tests wait out backoffs and leases (seconds each, the CPU idle), so the SQLite run
# goes on in the background while PostgreSQL starts and runs its own; its log is shown after.
# The tests' tolerance (an attempt at most 1 s late) is far above what the other run costs.
echo "== durable: SQLite (in the background, its log below)"
(cd "$work" && "$py" "$here/crash_test.py" --store "sqlite:$work/calls.db" "${workers[@]}") >"$work/sqlite.log" 2>&1 &
sqlite_run=$!

echo "== durable: PostgreSQL"
pgbin="$(bash "$here/need-postgres.sh")"
port=55432
mkdir -p "$pgdata" && chown postgres "$pgdata"
su postgres -s /bin/bash -c "'$pgbin/initdb' -D '$pgdata' -A trust -U postgres --no-sync" >/dev/null
su postgres -s /bin/bash -c "'$pgbin/pg_ctl' -D '$pgdata' -w -l '$pgdata/log' -o '-c listen_addresses=127.0.0.1 -p $port -k $pgdata -c fsync=off -c max_connections=50' start" >/dev/null
dsn="host=127.0.0.1 port=$port user=postgres dbname=postgres"

echo "== durable: the Rust executor's tests on PostgreSQL too (a schema per test)"
(cd "$rustdir" && LEVEE_TEST_POSTGRES="$dsn" cargo test -q --release --target-dir "$rust_target" --test executor)
echo "== durable: \`levee durable\` on PostgreSQL (list filters and pages, counts, cancel, retry, prune)"
# --workspace, as test-rust builds it: the same features, so nothing is compiled again.
(cd "$root" && LEVEE_TEST_POSTGRES="$dsn" LEVEE_REQUIRE_POSTGRES=1 cargo test -q --release --workspace --test durable)
echo "== durable: the Go executor's tests on PostgreSQL too (a schema per test)"
(cd "$godir" && LEVEE_TEST_POSTGRES="$dsn" go test -count=1 ./...)

scale="${DURABLE_SCALE:-10000}"
(cd "$work" && "$py" "$here/crash_test.py" --store "postgres:$dsn" "${workers[@]}" --scale "$scale" --workers 4)

echo "== durable: SQLite (the background run's log)"
sqlite_rc=0
wait "$sqlite_run" || sqlite_rc=$?
sqlite_run=""
cat "$work/sqlite.log"
[ "$sqlite_rc" -eq 0 ] || { echo "run.sh: the SQLite crash tests failed (exit $sqlite_rc)" >&2; exit 1; }

if [ "${DURABLE_BENCH:-0}" = 1 ]; then
  echo "== durable: benchmark (calls per second, 2,000 calls, 1 call in 10 fails once)"
  for lang in python rust; do
    worker=(); [ "$lang" = rust ] && worker=(--worker "$rust_worker")
    rm -f "$work/bench.db"*
    (cd "$work" && "$py" "$here/bench.py" --name "$lang" --store "sqlite:$work/bench.db" --calls 2000 --workers 1 "${worker[@]}")
    for w in 1 3; do
      su postgres -s /bin/bash -c "psql -h 127.0.0.1 -p $port -U postgres -qc 'DROP TABLE IF EXISTS levee_durable_calls'" >/dev/null
      (cd "$work" && "$py" "$here/bench.py" --name "$lang" --store "postgres:$dsn" --calls 2000 --workers "$w" "${worker[@]}")
    done
  done
fi

if [ "${DURABLE_PEER:-0}" = 1 ]; then
  echo "== peer: Celery with Redis (the same job, 2,000 tasks)"
  if ! command -v redis-server >/dev/null; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null
  fi
  "$py" -m pip install --quiet --disable-pip-version-check "celery[redis]==5.7.0"
  redis-server --port 56379 --bind 127.0.0.1 --save '' --appendonly no --daemonize yes --pidfile "$work/redis.pid" >/dev/null
  for w in 1 3; do
    (cd "$here" && PEER_REDIS=redis://127.0.0.1:56379/0 "$py" peer_celery.py --calls 2000 --workers "$w")
  done
  kill "$(cat "$work/redis.pid")" || true
fi

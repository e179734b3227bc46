#!/usr/bin/env bash
# Durable calls per second, Levee against River, side by side in one sitting (issue 40).
#
#   bash durable/bench/run.sh [--calls N] [--rounds R] [--concurrency C] [--systems "river levee-go ..."]
#
# The job: N calls (10,000) submitted first, handlers that do no work, about one call in ten
# failing once and retried after a backoff of about 100 ms; calls per second from the workers'
# start until no call is left to run, on SQLite with 1 worker process and on a private
# PostgreSQL 15 on 127.0.0.1 with 1 and 3, each worker running C calls at once (1,000). A fresh
# store for every run. Systems:
#   river         River v0.51.2 (Go; riverpgxv5, riversqlite), durable/bench/river: InsertMany
#                 in batches of 1,000, a 100 ms retry policy, MaxWorkers C
#   levee-go      the Go executor (the crash tests' worker, durable/tests/bench.py)
#   levee-python  the Python executor (the same)
#   levee-rust    the Rust executor (the same; built with its release profile)
# The Levee workers are the crash tests' workers: they append a line to a log file at each
# attempt's start and end, which River's handler does not. Submission: River's InsertMany, and
# Levee's Go `Submit` one call at a time (a process start and the engine's load included).
#
# Not part of `./dev test`: it installs River (Go modules) and takes minutes. The table it prints
# goes to docs/performance.md ("Durable calls against River").
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$(cd "$here/../.." && pwd)"
calls=10000 rounds=3 concurrency=1000 systems="river levee-go levee-python levee-rust"
while [ $# -gt 0 ]; do
  case "$1" in
    --calls) calls="$2"; shift 2 ;;
    --rounds) rounds="$2"; shift 2 ;;
    --concurrency) concurrency="$2"; shift 2 ;;
    --systems) systems="$2"; shift 2 ;;
    *) echo "run.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
export LEVEE_WASM_DIR="${LEVEE_WASM_DIR:-$root/target/levee}"
work="$(mktemp -d /tmp/levee-durable-bench.XXXXXX)"
chmod 755 "$work"
pgdata="$work/pg" pgbin=""
cleanup() {
  if [ -n "$pgbin" ] && [ -f "$pgdata/postmaster.pid" ]; then
    su postgres -s /bin/bash -c "'$pgbin/pg_ctl' -D '$pgdata' -m immediate stop" >/dev/null 2>&1 || true
  fi
  rm -rf "$work"
}
trap cleanup EXIT

echo "== build: River's bench, the Levee workers"
(cd "$here/river" && go build -o "$work/river-bench" .)
venv="$root/target/durable-venv"
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
py="$venv/bin/python"
"$py" -m pip install --quiet --disable-pip-version-check --force-reinstall --no-deps "$root/host-bindings/python"
"$py" -m pip install --quiet --disable-pip-version-check "$root/host-bindings/python[postgres]"
rm -rf "$root/host-bindings/python/build" "$root"/host-bindings/python/src/*.egg-info
(cd "$root/host-bindings/go/durable" && go build -o "$work/go-worker" ./internal/testworker)
case " $systems " in *" levee-rust "*)
  (cd "$root/durable/tests/rust-worker" && cargo build -q --release --target-dir "$root/target/durable-rust") ;;
esac
rust_worker="$root/target/durable-rust/release/levee-durable-worker"

pgbin="$(bash "$root/durable/tests/need-postgres.sh")"
port=55434
mkdir -p "$pgdata" && chown postgres "$pgdata"
su postgres -s /bin/bash -c "'$pgbin/initdb' -D '$pgdata' -A trust -U postgres --no-sync" >/dev/null
su postgres -s /bin/bash -c "'$pgbin/pg_ctl' -D '$pgdata' -w -l '$pgdata/log' -o '-c listen_addresses=127.0.0.1 -p $port -k $pgdata -c max_connections=200' start" >/dev/null
psql() { su postgres -s /bin/bash -c "'$pgbin/psql' -h 127.0.0.1 -p $port -U postgres -qc \"$1\"" >/dev/null; }
fresh_pg() { psql "DROP DATABASE IF EXISTS bench"; psql "CREATE DATABASE bench"; }
dsn="host=127.0.0.1 port=$port user=postgres dbname=bench"
url="postgres://postgres@127.0.0.1:$port/bench"

one() { # system store workers
  local system="$1" store="$2" workers="$3" spec
  if [ "$store" = sqlite ]; then rm -f "$work"/b.db*; else fresh_pg; fi
  case "$system" in
    river)
      if [ "$store" = sqlite ]; then spec="sqlite:$work/b.db"; else spec="postgres:$url"; fi
      "$work/river-bench" run --store "$spec" --calls "$calls" --workers "$workers" --concurrency "$concurrency" ;;
    levee-*)
      if [ "$store" = sqlite ]; then spec="sqlite:$work/b.db"; else spec="postgres:$dsn"; fi
      local cmd=()
      case "$system" in
        levee-go) cmd=(--worker "$work/go-worker") ;;
        levee-rust) cmd=(--worker "$rust_worker") ;;
      esac
      (cd "$work" && "$py" "$root/durable/tests/bench.py" --name "$system" --store "$spec" --calls "$calls" \
        --workers "$workers" --concurrency "$concurrency" "${cmd[@]}") ;;
  esac
}

for round in $(seq 1 "$rounds"); do
  echo "== round $round of $rounds (load: $(cut -d' ' -f1-3 /proc/loadavg))"
  for system in $systems; do
    one "$system" sqlite 1 || echo "$system sqlite 1: failed"
    one "$system" postgres 1 || echo "$system postgres 1: failed"
    one "$system" postgres 3 || echo "$system postgres 3: failed"
  done
  case " $systems " in *" levee-go "*)
    fresh_pg
    t0=$(date +%s%N)
    "$work/go-worker" "postgres:$dsn" --log "$work/submit.log" --owner submit --submit-only --scale "$calls" >/dev/null
    t1=$(date +%s%N)
    echo "levee-go submit, postgres: $calls calls at $(( calls * 1000000000 / (t1 - t0) )) calls/s (Submit one at a time)" ;;
  esac
done

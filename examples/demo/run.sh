#!/usr/bin/env bash
# The cross-language demo (`just demo`): start a deterministic flaky HTTP server on
# 127.0.0.1, run the same policy through every Levee host that exists, and print their
# decisions side by side. Every host meets 503, 429 (Retry-After: 1), 503, then 200.
#
#   examples/demo/run.sh [-v] [--plan] [HOST ...]   HOST: python js go rust (default: all, in that order)
#
# A host whose demo.sh is missing, or that fails, is skipped with a note. -v also prints
# each host's own output; --plan prints the hosts in the order they would run, and exits.
# The hosts that need no build of wasmtime run first, so that a first run shows results in
# seconds; Rust runs last, its build's progress on the terminal (a first build compiles
# wasmtime: minutes). Each host gets LEVEE_DEMO_TIMEOUT seconds (default 900). The server
# stops with this script (and by itself when idle).
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(git -C "$here" rev-parse --show-toplevel 2>/dev/null || (cd "$here/../.." && pwd))"
export LEVEE_WASM_DIR="${LEVEE_WASM_DIR:-$root/target/levee}"
policy="$here/policy.yaml"
verbose=0
plan=0
while [ $# -gt 0 ]; do
  case "$1" in
    -v) verbose=1; shift ;;
    --plan) plan=1; shift ;;
    *) break ;;
  esac
done
hosts=("$@")
[ ${#hosts[@]} -gt 0 ] || hosts=(python js go rust)
if [ "$plan" = 1 ]; then echo "${hosts[*]}"; exit 0; fi
limit="${LEVEE_DEMO_TIMEOUT:-900}"
# One jitter seed for every host: the same policy, seed and trace give the same delays.
seed="${LEVEE_DEMO_SEED:-1}"
export LEVEE_DEMO_SEED="$seed"

bold() { if [ -t 1 ] && [ -z "${NO_COLOR:-}" ]; then printf '\033[1m%s\033[0m\n' "$*"; else printf '%s\n' "$*"; fi; }

work="$(mktemp -d)"
server_pid=""
cleanup() {
  if [ -n "$server_pid" ]; then kill "$server_pid" 2>/dev/null; wait "$server_pid" 2>/dev/null; fi
  rm -rf "$work"
}
trap cleanup EXIT INT TERM

python3 "$here/flaky_server.py" --port-file "$work/port" --idle-exit 1200 &
server_pid=$!
for _ in $(seq 1 100); do [ -s "$work/port" ] && break; sleep 0.05; done
if [ ! -s "$work/port" ]; then echo "the flaky server did not start" >&2; exit 1; fi
port="$(cat "$work/port")"
bold "flaky server on http://127.0.0.1:$port/demo/<client>: 503, 429 (Retry-After: 1), 503, then 200"
bold "policy: $policy (seed $seed in every host)"
sed -n '/^policies:/,$p' "$policy"
echo

ran=()
for host in "${hosts[@]}"; do
  url="http://127.0.0.1:$port/demo/$host"
  case "$host" in
    rust) script="$root/examples/rust-reqwest/demo.sh"; args=(--policy-file "$policy" --policy demo --seed "$seed") ;;
    python) script="$root/host-bindings/python/demo.sh"; args=("$policy" demo) ;;
    js) script="$root/host-bindings/js/demo.sh"; args=("$policy") ;;
    go) script="$root/host-bindings/go/demo.sh"; args=(-policy-file "$policy" -policy demo -seed "$seed") ;;
    *) echo "unknown host '$host' (known: rust python js go)" >&2; continue ;;
  esac
  if [ ! -f "$script" ]; then
    bold "skip $host: ${script#"$root"/} does not exist yet"
    continue
  fi
  if [ "$host" = rust ]; then
    bold "build rust: examples/rust-reqwest (progress below; a first build compiles wasmtime, minutes on 2 cores)"
    # Build before the run, with progress on the terminal (demo.sh's output is captured).
    if ! bash "$root/examples/rust-reqwest/build.sh" >/dev/null; then
      bold "skip rust: the build failed"
      continue
    fi
  fi
  bold "run $host: ${script#"$root"/} $url"
  start=$(date +%s)
  LEVEE_DEMO_POLICY="$policy" timeout "$limit" bash "$script" "$url" "${args[@]}" >"$work/$host.out" 2>"$work/$host.err"
  rc=$?
  if [ "$verbose" = 1 ] || [ $rc -ne 0 ]; then
    sed "s/^/    [$host] /" "$work/$host.out"
  fi
  if [ $rc -ne 0 ]; then
    bold "skip $host: demo.sh failed (exit $rc$([ $rc -eq 124 ] && echo ", timed out after ${limit}s")); its last errors:"
    tail -n 5 "$work/$host.err" | sed "s/^/    [$host] /"
    continue
  fi
  echo "    done in $(( $(date +%s) - start ))s"
  ran+=("$host=$work/$host.out")
done

echo
if [ ${#ran[@]} -eq 0 ]; then
  bold "no host ran"
  exit 1
fi
bold "decisions, side by side"
python3 "$here/compare.py" "${ran[@]}"

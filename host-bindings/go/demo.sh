#!/usr/bin/env bash
# Runs one policy against the URL $1 through the Go host and prints each decision
# of the core, one line per step. Extra arguments go to levee-demo before the URL
# (for example: ./demo.sh http://127.0.0.1:8080/ -policy-file p.yaml -policy name).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(git -C "$here" rev-parse --show-toplevel 2>/dev/null || (cd "$here/../.." && pwd))"
wasm_dir="${LEVEE_WASM_DIR:-$root/target/levee}"
case "$wasm_dir" in /*) ;; *) wasm_dir="$root/$wasm_dir" ;; esac
if [ $# -lt 1 ]; then
  echo "usage: demo.sh URL [levee-demo flags]" >&2
  exit 2
fi
url="$1"; shift
if [ -f "$wasm_dir/levee_policy_core.wasm" ]; then
  cp "$wasm_dir/levee_policy_core.wasm" "$here/levee_policy_core.wasm"
fi
cd "$here"
exec go run ./cmd/levee-demo "$@" "$url"

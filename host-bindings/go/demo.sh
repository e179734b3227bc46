#!/usr/bin/env bash
# Runs one policy against the URL $1 through the Go host's http.RoundTripper and prints
# each decision of the core, one line per step:
#   ./demo.sh URL [policy-file] [policy-name]
#   ./demo.sh URL [-policy-file FILE] [-policy NAME] [-seed N]
# Default policy: $LEVEE_DEMO_POLICY, else the repository's examples/demo/policy.yaml if
# present, else a built-in one; default name: `demo`, else the first policy.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(git -C "$here" rev-parse --show-toplevel 2>/dev/null || (cd "$here/../.." && pwd))"
wasm_dir="${LEVEE_WASM_DIR:-$root/target/levee}"
case "$wasm_dir" in /*) ;; *) wasm_dir="$root/$wasm_dir" ;; esac
if [ $# -lt 1 ]; then
  echo "usage: demo.sh URL [policy-file] [policy-name]   (or flags: -policy-file F -policy N -seed S)" >&2
  exit 2
fi
url="$1"; shift
args=()
if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then
  args+=(-policy-file "$1"); shift
  if [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; then args+=(-policy "$1"); shift; fi
fi
args+=("$@")
case " ${args[*]-} " in
  *" -policy-file "*) ;;
  *)
    policy="${LEVEE_DEMO_POLICY:-}"
    [ -n "$policy" ] || { [ -f "$root/examples/demo/policy.yaml" ] && policy="$root/examples/demo/policy.yaml"; } || true
    [ -z "$policy" ] || args=(-policy-file "$policy" "${args[@]}")
    ;;
esac
# The module embeds its committed core module; a fresh build, when there is one, is passed
# instead (so the demo shows this tree's core even before `./dev go-core`).
if [ -f "$wasm_dir/levee_policy_core.wasm" ]; then
  export LEVEE_CORE_MODULE="$wasm_dir/levee_policy_core.wasm"
fi
cd "$here"
exec go run ./cmd/levee-demo "${args[@]}" "$url"

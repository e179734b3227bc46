#!/usr/bin/env bash
# Transpile the component with several jco versions and measure the glue's per-call cost with each.
#   bench/jco-versions.sh [version ...]     (default: 1.13.0 1.13.1 1.35.0)
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
versions=("$@")
[ ${#versions[@]} -gt 0 ] || versions=(1.13.0 1.13.1 1.35.0)
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
for v in "${versions[@]}"; do
  mkdir -p "$work/$v"
  (cd "$work/$v" && npm init -y >/dev/null && npm install --silent --no-audit --no-fund "@bytecodealliance/jco@$v" >/dev/null)
  node "$here/scripts/transpile.mjs" "" "$work/$v/out" "$(readlink -f "$work/$v/node_modules/.bin/jco")" >/dev/null
  echo '{"type":"module"}' > "$work/$v/out/package.json"
  echo "== jco $v"
  node "$here/bench/crossing.mjs" "$work/$v/out"
done

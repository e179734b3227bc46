#!/usr/bin/env bash
# The Go module embeds the core module (host-bindings/go/levee_policy_core.wasm), committed so
# that `go get` builds with no build step. It is a generated file:
#
#   release/go-core.sh           copy a fresh build's core module over it (`./dev go-core`)
#   release/go-core.sh --check   fail unless it is byte-identical to a fresh build (CI)
#
# The fresh build is $LEVEE_WASM_DIR/levee_policy_core.wasm (default target/levee; the justfile
# builds it first). The build is reproducible (release/reproducible.sh), so any difference
# means the committed file is stale: the core, the component layer, the WIT or the toolchain
# changed since it was generated.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
wasm_dir="${LEVEE_WASM_DIR:-$root/target/levee}"
case "$wasm_dir" in /*) ;; *) wasm_dir="$root/$wasm_dir" ;; esac
fresh="$wasm_dir/levee_policy_core.wasm"
committed="$root/host-bindings/go/levee_policy_core.wasm"
if [ ! -f "$fresh" ]; then
  echo "go-core: $fresh is missing; build it with ./dev component" >&2
  exit 1
fi
if [ "${1:-}" = "--check" ]; then
  if cmp -s "$fresh" "$committed"; then
    echo "go-core: host-bindings/go/levee_policy_core.wasm matches a fresh build ($(wc -c <"$committed") bytes)"
    exit 0
  fi
  have="missing"
  [ -f "$committed" ] && have="$(wc -c <"$committed") bytes, sha256 $(sha256sum "$committed" | cut -c1-12)"
  echo "go-core: host-bindings/go/levee_policy_core.wasm is stale: it is not the core module a fresh build makes" >&2
  echo "go-core:   committed: $have; fresh: $(wc -c <"$fresh") bytes, sha256 $(sha256sum "$fresh" | cut -c1-12)" >&2
  echo "go-core: run ./dev go-core and commit host-bindings/go/levee_policy_core.wasm" >&2
  exit 1
fi
cp "$fresh" "$committed"
echo "go-core: wrote host-bindings/go/levee_policy_core.wasm ($(wc -c <"$committed") bytes); commit it"

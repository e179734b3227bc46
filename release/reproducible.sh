#!/usr/bin/env bash
# The component is reproducible: build it a second time from a copy of the checkout at another
# path, in a target directory of its own, and require the same bytes as target/levee/ (built by
# `just component`). A difference names the files and the sizes; `cmp -l | head` shows where.
#
#   release/reproducible.sh [WASM_DIR]     (default: $LEVEE_WASM_DIR, else target/levee)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
first="${1:-${LEVEE_WASM_DIR:-$root/target/levee}}"
builder="$root/target/release/levee-build"
[ -x "$builder" ] || (cd "$root" && cargo build -q --release -p levee-build)
for f in levee_policy.wasm levee_policy_core.wasm; do
  [ -f "$first/$f" ] || { echo "reproducible: $first/$f is missing; run ./dev component" >&2; exit 1; }
done
work="$(mktemp -d "${TMPDIR:-/tmp}/levee-repro.XXXXXX")"
trap 'rm -rf "$work"' EXIT
# The tracked files as they are in the working tree (uncommitted edits included), elsewhere.
(cd "$root" && git ls-files -z --cached --others --exclude-standard | xargs -0 -I{} sh -c 'test -f "{}" && printf "%s\0" "{}"' \
  | tar --null -T - -cf -) | (mkdir -p "$work/src" && tar -xf - -C "$work/src")
start=$(date +%s)
"$builder" --source "$work/src" --target-dir "$work/target" "$work/out" >/dev/null
echo "reproducible: second build from $work/src in $(( $(date +%s) - start ))s"
status=0
for f in levee_policy.wasm levee_policy_core.wasm; do
  if cmp -s "$first/$f" "$work/out/$f"; then
    echo "reproducible: $f identical ($(wc -c <"$first/$f") bytes, sha256 $(sha256sum "$first/$f" | cut -c1-16)...)"
  else
    echo "reproducible: $f DIFFERS between two builds: $(wc -c <"$first/$f") vs $(wc -c <"$work/out/$f") bytes" >&2
    cmp -l "$first/$f" "$work/out/$f" | head -5 >&2 || true
    status=1
  fi
done
exit $status

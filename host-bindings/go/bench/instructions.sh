#!/usr/bin/env bash
# Instructions per call of each contender of the bench/ comparison, counted by
# callgrind: (instructions of the main thread with n=21000) - (with n=1000),
# divided by 20,000. Counts do not depend on the machine's load, unlike ns/op.
# GOGC=off keeps the count deterministic (the garbage collector's share of the
# main thread varies from run to run); it flatters the contenders that
# allocate per call (failsafe-go, gobreaker+backoff), whose GC work is left out.
# Async preemption is off because callgrind aborts on its signals.
# Usage: ./instructions.sh [contender...]   (needs valgrind; copy the core module in first, as ../ci.sh does)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
cd "$here"
command -v valgrind >/dev/null || { echo "instructions.sh: valgrind is needed" >&2; exit 1; }
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
go build -o "$tmp/hotloop" ./hotloop
count() { # contender n -> main-thread instructions
  local d="$tmp/$1-$2"
  mkdir -p "$d"
  (cd "$d" && GOGC=off GODEBUG=asyncpreemptoff=1 valgrind --tool=callgrind --separate-threads=yes \
    --callgrind-out-file="$d/cg.out" "$tmp/hotloop" -which "$1" -n "$2" >/dev/null 2>"$d/log") ||
    { cat "$d/log" >&2; exit 1; }
  awk '/^summary:/ {print $2; exit}' "$d/cg.out-01"
}
contenders=("$@")
[ ${#contenders[@]} -gt 0 ] || contenders=(levee levee-unbounded levee-keyed failsafe-go gobreaker-backoff bare)
for c in "${contenders[@]}"; do
  a="$(count "$c" 1000)"
  b="$(count "$c" 21000)"
  printf '%-20s %6d instructions per call\n' "$c" $(((b - a) / 20000))
done

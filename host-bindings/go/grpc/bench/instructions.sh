#!/usr/bin/env bash
# Instructions per unary call of each contender of the gRPC benchmark, counted by callgrind
# over every thread of the client process (the Flaky server runs in a child process, not
# traced, started once by this script): (instructions with -calls 2500) - (with -calls 500), divided by 2,000. Counts do
# not depend on the machine's load, unlike CPU time. GOGC=off keeps the count deterministic
# (it leaves out the garbage collector's work, which flatters the contenders that allocate
# more); async preemption is off because callgrind aborts on its signals.
# Usage: ./instructions.sh [contender-prefix...]   (needs valgrind)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
cd "$here"
command -v valgrind >/dev/null || { echo "instructions.sh: valgrind is needed" >&2; exit 1; }
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
go build -o "$tmp/bench" .
# the server, natively, for every counted run (its stdin is a FIFO kept open until the end)
mkfifo "$tmp/stdin"
"$tmp/bench" -serve <"$tmp/stdin" >"$tmp/addr" &
server=$!
exec 3>"$tmp/stdin"
trap 'exec 3>&-; wait "$server" 2>/dev/null; rm -rf "$tmp"' EXIT
for _ in $(seq 100); do [ -s "$tmp/addr" ] && break; sleep 0.1; done
addr="$(cat "$tmp/addr")"
count() { # contender calls -> instructions of all the client's threads
  local d="$tmp/$(echo "$1" | tr -c 'a-zA-Z0-9\n' _)-$2"
  mkdir -p "$d"
  (cd "$d" && GOGC=off GODEBUG=asyncpreemptoff=1 valgrind --tool=callgrind --separate-threads=yes \
    --callgrind-out-file="$d/cg.out" "$tmp/bench" -addr "$addr" -only "$1" -rounds 1 -warm 200 -calls "$2" >/dev/null 2>"$d/log") ||
    { cat "$d/log" >&2; exit 1; }
  cat "$d"/cg.out-* | awk '/^summary:/ {s += $2} END {print s}'
}
contenders=("$@")
[ ${#contenders[@]} -gt 0 ] || contenders=("no interceptor" "Levee" "failsafe-go" "grpc built-in")
for c in "${contenders[@]}"; do
  a="$(count "$c" 500)"
  b="$(count "$c" 2500)"
  printf '| %s | %d |\n' "$c" $(((b - a) / 2000))
done

#!/usr/bin/env bash
# Instructions per call of each case of bench/overhead.mjs, counted by valgrind (cachegrind, no cache
# simulation) as the difference between 100000 calls and none, with V8 on one thread so the count
# repeats (within ~3%). Wall-clock figures on a shared machine move by +-30%; these do not.
#
#   bench/instructions.sh [case ...]     (default: bare levee stubbed cockatiel)
set -euo pipefail
cd "$(dirname "$0")/.."
count() {
  valgrind --tool=cachegrind --cache-sim=no --smc-check=all-non-file --cachegrind-out-file=/dev/null \
    node --single-threaded bench/drive.mjs "$1" "$2" 2>&1 | awk '/I *refs/ { gsub(",", "", $4); print $4 }'
}
for c in "${@:-bare levee stubbed cockatiel}"; do
  for k in $c; do
    a=$(count "$k" 0)
    b=$(count "$k" 100000)
    echo "$k: $(((b - a) / 100000)) instructions per call"
  done
done

#!/usr/bin/env bash
# Instructions per unary gRPC call (benches/grpc.rs), each contender alone under
# `valgrind --tool=callgrind`: (Ir(3,000 calls) - Ir(1,000 calls)) / 2,000, which removes the
# setup, for the client's thread (the main thread: tonic, hyper, the layer) and for the whole
# process (adding the server's thread). Counts do not move with the machine's load.
#   bash host-rust/benches/grpc_instructions.sh [plain wasm native]
set -euo pipefail
root="$(git -C "$(dirname "$0")" rev-parse --show-toplevel)"
cd "$root"
# The workspace's feature set (as `just test-rust-host`), so a warm target/ is reused.
bin="$(cargo build -q --release --workspace --features levee-resilience/grpc --bench grpc --message-format=json |
  python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "grpc" and m["target"]["kind"] == ["bench"]:
        print(m["executable"])')"
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
# Ir of the client's thread and of the process for `calls` calls of contender `who`.
ir() {
  rm -f "$out"/o*
  valgrind --tool=callgrind --separate-threads=yes --callgrind-out-file="$out/o" \
    "$bin" --only "$1" --calls "$2" --rounds 1 --warmup 200 --no-clock >/dev/null 2>&1
  local client total
  client="$(sed -n 's/^summary: //p' "$out/o-01")"
  total="$(cat "$out"/o-* | sed -n 's/^summary: //p' | paste -sd+ | bc)"
  echo "$client $total"
}
printf '%-8s %14s %14s\n' contender client process
for who in "${@:-plain wasm native}"; do
  for w in $who; do
    read -r c1 t1 < <(ir "$w" 1000)
    read -r c3 t3 < <(ir "$w" 3000)
    printf '%-8s %14d %14d\n' "$w" $(((c3 - c1) / 2000)) $(((t3 - t1) / 2000))
  done
done

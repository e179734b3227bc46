#!/usr/bin/env bash
# CI for the `levee` command line (crate levee-cli): format, clippy -D warnings, tests, and
# every simulation scenario once. Release builds only (wasmtime is shared in target/).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(git -C "$here" rev-parse --show-toplevel 2>/dev/null || (cd "$here/.." && pwd))"
export LEVEE_WASM_DIR="${LEVEE_WASM_DIR:-$root/target/levee}"
cd "$root"

# `just test` sets LEVEE_WORKSPACE_TESTED after workspace-wide fmt, clippy and tests, which
# cover this crate; building with -p alone would resolve features for this package only and
# rebuild wasmtime (~10 minutes on 2 cores) for nothing.
if [ -z "${LEVEE_WORKSPACE_TESTED:-}" ]; then
  echo "== rustfmt"
  cargo fmt -p levee-cli -- --check
  echo "== clippy"
  cargo clippy --release -p levee-cli --all-targets -- -D warnings
  echo "== tests"
  cargo test --release -p levee-cli
fi
echo "== build"
# Under `just test`, the feature set of the workspace's test build (bins and tests in one
# invocation resolve features as `cargo test --workspace` did, so this only links).
if [ -n "${LEVEE_WORKSPACE_TESTED:-}" ]; then
  cargo build --release --workspace --bins --tests
else
  cargo build --release --workspace --bins
fi
bin="$(cargo metadata --format-version 1 --no-deps | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')/release/levee"

out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT

echo "== check the examples"
valid=(cli/examples/checkout.yaml cli/examples/retries-only.yaml cli/examples/ratio-budget.yaml cli/examples/rate-limited.yaml cli/examples/unbounded.yaml)
"$bin" check --color never "${valid[@]}" >/dev/null
set +e
"$bin" check --color never cli/examples/invalid.yaml >/dev/null
rc=$?
set -e
[ "$rc" -eq 1 ] || { echo "levee check on an invalid document exited $rc, not 1" >&2; exit 1; }
"$bin" explain --color never cli/examples/checkout.yaml --trace cli/examples/flaky.jsonl >/dev/null
"$bin" explain --color never cli/examples/checkout.yaml --trace cli/examples/outage.jsonl --json >/dev/null

echo "== every scenario once"
for s in healthy outage slow rate-limit three-layer-outage proxy-outage; do
  start=$(date +%s%N)
  "$bin" simulate cli/examples/checkout.yaml --scenario "$s" --quiet --color never --svg "$out/$s.svg" >"$out/$s.txt"
  ms=$(( ($(date +%s%N) - start) / 1000000 ))
  grep -q '<polyline' "$out/$s.svg"
  if grep -q 'invalid verdicts' "$out/$s.txt"; then cat "$out/$s.txt"; exit 1; fi
  echo "  $s: ok (${ms} ms)"
done
"$bin" simulate cli/examples/retries-only.yaml --scenario three-layer-outage --quiet --color never --no-svg | grep -q '27.00x dependency calls per request' \
  || { echo "three-layer-outage without budgets did not show 27x" >&2; exit 1; }
proxy="$("$bin" simulate cli/examples/retries-only.yaml --scenario proxy-outage --quiet --color never --no-svg)"
grep -q '9.00x dependency calls per request' <<<"$proxy" && grep -q '3.00x dependency calls per request' <<<"$proxy" \
  || { echo "proxy-outage did not show 9x without coordination and 3x with it" >&2; echo "$proxy" >&2; exit 1; }
echo "== the gRPC service config both ways (docs/grpc.md)"
for f in a6-retry a6-hedging channel; do
  "$bin" import grpc-service-config "grpc/service-config/$f.json" -o "$out/$f.yaml" 2>/dev/null
  "$bin" check --color never "$out/$f.yaml" >/dev/null
  "$bin" grpc-config "$out/$f.yaml" --all 2>/dev/null | diff -u "grpc/service-config/$f.export.json" - \
    || { echo "import then grpc-config --all of $f.json is not its pinned export" >&2; exit 1; }
done
echo "== the demo's flaky server and side-by-side comparison"
bash -n examples/demo/run.sh
python3 examples/demo/test_demo.py
echo "levee-cli: all checks passed"

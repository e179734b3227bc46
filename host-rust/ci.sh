#!/usr/bin/env bash
# CI for the Rust host (crate `levee`) and its example: format, clippy -D warnings, tests
# (release, sharing target/ with the rest of the workspace), and the minimal feature set the
# CLI builds with. The crate builds the policy component itself (build.rs -> levee-build),
# so LEVEE_WASM_DIR is not needed here; it is honoured by the component build of the caller.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(git -C "$here" rev-parse --show-toplevel 2>/dev/null || (cd "$here/.." && pwd))"
cd "$root"

rustup target list --installed 2>/dev/null | grep -q '^wasm32-unknown-unknown$' || rustup target add wasm32-unknown-unknown
rustup component list --installed 2>/dev/null | grep -q '^clippy' || rustup component add clippy rustfmt

# `just test` sets LEVEE_WORKSPACE_TESTED after workspace-wide fmt, clippy and tests, which
# cover these crates with the default backend; building with -p alone would resolve features
# for these packages only and rebuild wasmtime (~5-10 minutes on 2 cores) for nothing. What the
# workspace run does not cover is then built with the workspace's feature set.
if [ -z "${LEVEE_WORKSPACE_TESTED:-}" ]; then
  echo "== rustfmt"
  cargo fmt -p levee-resilience -p levee-example-reqwest -- --check

  echo "== clippy"
  cargo clippy --release -p levee-resilience -p levee-example-reqwest --all-targets -- -D warnings
  cargo clippy --release -p levee-resilience --all-targets --features grpc -- -D warnings
  cargo clippy --release -p levee-resilience --no-default-features --features wasm -- -D warnings

  echo "== tests"
  cargo test --release -p levee-resilience -p levee-example-reqwest
  # gRPC (feature `grpc`): tonic clients through the layer against a tonic server on 127.0.0.1.
  cargo test --release -p levee-resilience --features grpc --test grpc
  # The same end-to-end tests with the native backend as the default (the `native` feature).
  cargo test --release -p levee-resilience --features native --test http --test engine
else
  echo "== clippy (the wasm backend alone)"
  cargo clippy --release -p levee-resilience --no-default-features --features wasm -- -D warnings
fi

echo "== the example against a local server"
port="$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()')"
python3 -m http.server "$port" --bind 127.0.0.1 --directory "$here" >/dev/null 2>&1 &
server=$!
trap 'kill "$server" 2>/dev/null || true' EXIT
for _ in $(seq 50); do (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null && break; sleep 0.1; done
if [ -n "${LEVEE_WORKSPACE_TESTED:-}" ]; then
  # The binary with the feature set of the workspace's test build (bins and tests in one
  # invocation resolve features as `cargo test --workspace` did, so this links and reuses):
  # demo.sh's `cargo run -p` would resolve features for the example alone and rebuild wasmtime.
  cargo build -q --release --workspace --bins --tests
  target_dir="$(cargo metadata --format-version 1 --no-deps | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')"
  example=("$target_dir/release/levee-example-reqwest")
else
  example=("$root/examples/rust-reqwest/demo.sh")
fi
out="$("${example[@]}" "http://127.0.0.1:$port/ci.sh")"
echo "$out"
grep -q '^rust step 1 .* start -> attempt #1' <<<"$out"
grep -q '^rust result http 200' <<<"$out"
kill "$server" 2>/dev/null || true

if [ -n "${LEVEE_WORKSPACE_TESTED:-}" ]; then
  # gRPC (feature `grpc`, not in the workspace's test build): tonic clients through the layer
  # against a tonic server on 127.0.0.1. The feature rebuilds the crate and this test only.
  echo "== tests (gRPC, feature grpc)"
  cargo test --release --workspace --features levee-resilience/grpc --test grpc
  # Last: the `native` feature rebuilds the crate and these two tests, and the next cargo build
  # with the workspace's feature set rebuilds it back (the justfile runs test-fleet next, which
  # changes the crate's features anyway).
  echo "== tests (the end-to-end tests with the native backend as the default)"
  cargo test --release --workspace --features levee-resilience/native --test http --test engine
fi
echo "ci: ok"

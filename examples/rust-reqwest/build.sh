#!/usr/bin/env bash
# Build the example for the demo, printing progress on stderr while cargo works (a line when it
# starts compiling, then every 20 s) and the binary's path on stdout.
#
# It builds with the example's own feature set (`-p levee-example-reqwest`), which is a user's:
# levee-resilience with its default features, reqwest and tokio. The workspace's test build
# cannot be shared: it unifies wasmtime's dependencies' features with the tools' and
# dev-dependencies' (wit-component turns on hashbrown/indexmap `serde`, clap and criterion rustix
# `termios`, ...), so its wasmtime has other hashes; and the install test's fresh project does
# not leave this build behind either (issue 39 measured a wasmtime rebuild of over 10 minutes
# after `./dev test`). So a first run compiles wasmtime; later runs only link.
# The demo (examples/demo/run.sh) therefore runs the Rust host last, after the hosts that need no
# build.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
cd "$root"
target_dir="$(cargo metadata --format-version 1 --no-deps | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')"
log="$(mktemp)"
trap 'rm -f "$log"' EXIT
build=(cargo build --release -p levee-example-reqwest)
start=$(date +%s)
"${build[@]}" >"$log" 2>&1 &
pid=$!
said=0
while kill -0 "$pid" 2>/dev/null; do
  sleep 1
  t=$(( $(date +%s) - start ))
  if [ "$said" = 0 ] && grep -q 'Compiling' "$log"; then
    echo "rust: building the example (${build[*]}); a first build compiles wasmtime: 5 to 15 minutes on 2 cores; the other hosts' results are above" >&2
    said=1
  elif [ "$said" = 1 ] && [ $(( t % 20 )) -eq 0 ]; then
    echo "rust: still building (${t}s, $(grep -c 'Compiling' "$log") crates so far, now $(grep 'Compiling' "$log" | tail -n 1 | sed 's/^ *Compiling //'))" >&2
  fi
done
if ! wait "$pid"; then
  tail -n 30 "$log" >&2
  exit 1
fi
[ "$said" = 0 ] || echo "rust: built in $(( $(date +%s) - start ))s" >&2
echo "$target_dir/release/levee-example-reqwest"

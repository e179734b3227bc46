#!/usr/bin/env bash
# Runs one policy against the URL $1 through the Rust host (levee::client::Client over
# reqwest, the component in wasmtime) and prints each decision of the core, one line per
# step. Extra arguments go to the example before the URL
# (for example: ./demo.sh http://127.0.0.1:8080/ --policy-file p.yaml --policy name --native).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
if [ $# -lt 1 ]; then
  echo "usage: demo.sh URL [--policy-file FILE] [--policy NAME] [--seed N] [--native]" >&2
  exit 2
fi
url="$1"; shift
# One build with the workspace's feature set (build.sh), shared with `./dev test`.
bin="$(bash "$here/build.sh")"
exec "$bin" "$@" "$url"

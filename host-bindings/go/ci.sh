#!/usr/bin/env bash
# CI of the Go host: checks that the committed core module is a fresh build's, then gofmt,
# go vet, go test -race (unit, conformance, end-to-end; the gRPC module's too) and a short
# benchmark run.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(git -C "$here" rev-parse --show-toplevel 2>/dev/null || (cd "$here/../.." && pwd))"
wasm_dir="${LEVEE_WASM_DIR:-$root/target/levee}"
case "$wasm_dir" in /*) ;; *) wasm_dir="$root/$wasm_dir" ;; esac
# The module embeds the committed levee_policy_core.wasm (so that `go get` needs no build
# step); it must be the core module of this tree, or the tests below test another core.
LEVEE_WASM_DIR="$wasm_dir" bash "$root/release/go-core.sh" --check
cd "$here"
export LEVEE_VECTORS_DIR="${LEVEE_VECTORS_DIR:-$root/conformance/vectors}"
export LEVEE_HOSTS_DIR="${LEVEE_HOSTS_DIR:-$root/conformance/hosts}" # the host scenarios (hosts_test.go)
go mod download
unformatted="$(gofmt -l .)"
if [ -n "$unformatted" ]; then
  echo "ci.sh: gofmt -l reports:" >&2
  echo "$unformatted" >&2
  exit 1
fi
go vet ./...
go vet -tags levee_noembed ./...
go test -race -count=1 ./...
# the gRPC interceptors, a nested module (grpc/): generated code current, vet, and the tests
# against a real gRPC server on 127.0.0.1 (gofmt -l above covers it)
(cd grpc && go mod download && bash gen.sh --check && go vet ./... && go test -race -count=1 ./...)
# the README's gRPC example (example/main.go), and the gRPC benchmark compiles (run by hand:
# cd grpc/bench && go run ., see docs/perf/go.md)
example="$(cd grpc && go run ./example)"
grep -qx 'status: SERVING' <<<"$example" || { echo "ci.sh: the gRPC example printed: $example" >&2; exit 1; }
(cd grpc/bench && go mod download && go vet ./...)
cd bench
go mod download
go vet ./...
go test -run '^$' -bench . -benchtime 20000x -count 1 ./...
# production-load harness, smoke size (the full run: go run ./load, see docs/performance.md)
go run ./load -levels 1,200 -rounds 3 -single 5
# the recovery snapshot at many keys, smoke size (the full run: go run ./snapshot, see docs/performance.md)
go run ./snapshot -n 1000,20000 -t 500ms
# cold start, smoke (an empty cache, then warm)
d="$(mktemp -d)"; go build -o "$d/coldstart" ./coldstart; LEVEE_CACHE_DIR="$d" "$d/coldstart"; LEVEE_CACHE_DIR="$d" "$d/coldstart"; rm -rf "$d"

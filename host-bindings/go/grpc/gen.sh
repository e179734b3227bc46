#!/usr/bin/env bash
# Regenerates internal/flakypb from grpc/flaky.proto (the scripted test service every host's
# gRPC tests run against). protoc is the one in the grpcio-tools wheel (PyPI), the plugins are
# protoc-gen-go and protoc-gen-go-grpc at the versions pinned below; all three are installed
# into target/grpc-go-tools. Usage: bash gen.sh [--check]  (--check: fail when the committed
# files differ from a fresh generation).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(git -C "$here" rev-parse --show-toplevel 2>/dev/null || (cd "$here/../../.." && pwd))"
tools="$root/target/grpc-go-tools"
GRPCIO_TOOLS=1.85.1
PROTOC_GEN_GO=v1.36.12
PROTOC_GEN_GO_GRPC=v1.6.2
mkdir -p "$tools"
if [ ! -x "$tools/venv/bin/python" ] || ! "$tools/venv/bin/python" -c "import grpc_tools" 2>/dev/null; then
  python3 -m venv "$tools/venv"
  "$tools/venv/bin/pip" install --quiet --disable-pip-version-check "grpcio-tools==$GRPCIO_TOOLS"
fi
GOBIN="$tools/bin" go install "google.golang.org/protobuf/cmd/protoc-gen-go@$PROTOC_GEN_GO"
GOBIN="$tools/bin" go install "google.golang.org/grpc/cmd/protoc-gen-go-grpc@$PROTOC_GEN_GO_GRPC"
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
pkg="github.com/levee-dev/levee/host-bindings/go/grpc/internal/flakypb"
# flaky.proto names no go_package (it is every language's): the M option gives it one.
PATH="$tools/bin:$PATH" "$tools/venv/bin/python" -m grpc_tools.protoc -I "$root/grpc" \
  --go_out="$out" --go_opt=paths=source_relative --go_opt="Mflaky.proto=$pkg" \
  --go-grpc_out="$out" --go-grpc_opt=paths=source_relative --go-grpc_opt="Mflaky.proto=$pkg" \
  flaky.proto
dest="$here/internal/flakypb"
if [ "${1:-}" = "--check" ]; then
  for f in flaky.pb.go flaky_grpc.pb.go; do
    if ! cmp -s "$out/$f" "$dest/$f"; then
      echo "gen.sh: $dest/$f is stale (run bash host-bindings/go/grpc/gen.sh)" >&2
      exit 1
    fi
  done
  exit 0
fi
mkdir -p "$dest"
cp "$out/flaky.pb.go" "$out/flaky_grpc.pb.go" "$dest/"
echo "gen.sh: wrote $dest/flaky.pb.go and flaky_grpc.pb.go" >&2

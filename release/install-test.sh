#!/usr/bin/env bash
# Install tests: each artifact of dist/ (./dev dist) installed into a fresh directory outside the
# checkout, the way a user installs it from its registry, and its README's quickstart (the code
# blocks marked `<!-- install-test: FILE -->`, written out by release/readme_example.py) run
# against the demo's flaky server on 127.0.0.1 (503, 429 + Retry-After: 1, 503, then 200).
#
#   release/install-test.sh [python] [js] [go] [rust]      (default: all four)
#
# Each must print three `levee: retry-scheduled` lines and end with the 200. No Rust toolchain is
# on PATH for Python, JS and Go; nothing here uses the checkout's node_modules, venvs or target/
# (except that Rust's fresh project compiles into the workspace's target/ to reuse wasmtime).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
dist="$root/dist"
version="$(python3 "$root/release/version.py")"
langs=("$@")
[ ${#langs[@]} -gt 0 ] || langs=(python js go rust)
[ -f "$dist/SHA256SUMS" ] || { echo "install-test: no dist/; run ./dev dist first" >&2; exit 1; }
(cd "$dist" && sha256sum --quiet -c SHA256SUMS)

work="$(mktemp -d "${TMPDIR:-/tmp}/levee-install.XXXXXX")"
case "$work" in "$root"/*) echo "install-test: $work is inside the checkout" >&2; exit 1 ;; esac
server_pid=""
cleanup() {
  [ -z "$server_pid" ] || { kill "$server_pid" 2>/dev/null || true; wait "$server_pid" 2>/dev/null || true; }
  chmod -R u+w "$work" 2>/dev/null || true # the Go module cache is read-only
  rm -rf "$work"
}
trap cleanup EXIT
python3 "$root/examples/demo/flaky_server.py" --port-file "$work/port" --idle-exit 600 &
server_pid=$!
for _ in $(seq 100); do [ -s "$work/port" ] && break; sleep 0.05; done
[ -s "$work/port" ] || { echo "install-test: the flaky server did not start" >&2; exit 1; }
base="http://127.0.0.1:$(cat "$work/port")/demo"

# PATH without any Rust toolchain (cargo, rustc, rustup): Python, JS and Go users have none.
norust_path=""
IFS=: read -ra path_dirs <<<"$PATH"
for d in "${path_dirs[@]}"; do
  [ -e "$d/cargo" ] || [ -e "$d/rustc" ] || [ -e "$d/rustup" ] || norust_path="${norust_path:+$norust_path:}$d"
done
norust() { env -u LEVEE_WASM_DIR -u CARGO_HOME -u RUSTUP_HOME PATH="$norust_path" "$@"; }

say() { printf '%s install-test: %s\n' "$(date +%H:%M:%S)" "$*"; }
# check LANG OUTPUT-FILE CLIENT: the quickstart's output shows the policy at work.
check() {
  local lang="$1" out="$2" client="$3" retries
  sed "s/^/    [$lang] /" "$out"
  retries="$(grep -c '^levee: retry-scheduled' "$out" || true)"
  if [ "$retries" != 3 ] || ! tail -n 1 "$out" | grep -q "^200 request 4 from $client: 200$"; then
    echo "install-test: $lang: expected 3 retries then '200 request 4 from $client: 200'" >&2
    return 1
  fi
}
timed() { # run a step in a subshell with errexit in force (not under `||`, which would lift it)
  local t0 rc
  t0=$(date +%s)
  set +e
  (set -e; "$@")
  rc=$?
  set -e
  say "$1: $([ $rc -eq 0 ] && echo ok || echo "FAILED (exit $rc)") in $(( $(date +%s) - t0 ))s"
  return $rc
}

install_python() {
  local dir="$work/python" wheel="$dist/levee_resilience-$version-py3-none-any.whl" sdist="$dist/levee_resilience-$version.tar.gz"
  mkdir -p "$dir" && cd "$dir"
  python3 "$root/release/readme_example.py" "$root/host-bindings/python/README.md" "$dir"
  # The wheel, as `pip install "levee-resilience[httpx]"` installs it.
  norust python3 -m venv wheel-venv
  norust wheel-venv/bin/pip install --quiet --disable-pip-version-check "$wheel[httpx]"
  norust wheel-venv/bin/python quickstart.py "$base/install-python-wheel" >out-wheel.txt
  check python "$dir/out-wheel.txt" install-python-wheel
  # The sdist: pip builds a wheel from it (setuptools from the index) with no Rust toolchain.
  norust python3 -m venv sdist-venv
  norust sdist-venv/bin/pip install --quiet --disable-pip-version-check --no-binary levee-resilience "$sdist[httpx]"
  norust sdist-venv/bin/python quickstart.py "$base/install-python-sdist" >out-sdist.txt
  check python-sdist "$dir/out-sdist.txt" install-python-sdist
  # Both carry the same component as dist/component/.
  for v in wheel-venv sdist-venv; do
    cmp "$("$v/bin/python" -c 'import importlib.resources as r; print(r.files("levee") / "_wasm" / "levee_policy.wasm")')" "$dist/component/levee_policy.wasm"
  done
}

install_js() {
  local dir="$work/js" tarball="$dist/levee-resilience-$version.tgz" pkgjson="$root/host-bindings/js/package.json"
  dev() { node -e "console.log(require('$pkgjson').devDependencies['$1'])"; }
  mkdir -p "$dir/app" && cd "$dir/app"
  python3 "$root/release/readme_example.py" "$root/host-bindings/js/README.md" "$dir/app"
  printf '{ "name": "levee-install-test", "private": true, "type": "module" }\n' >package.json
  # `npm i levee-resilience`, from the tarball; TypeScript, Node's types and workerd at the
  # versions the package itself is developed with.
  norust npm install --no-audit --no-fund --loglevel=error "$tarball" \
    "typescript@$(dev typescript)" "@types/node@$(dev @types/node)" "workerd@$(dev workerd)"
  cat >tsconfig.json <<'JSON'
{
  "compilerOptions": {
    "target": "ES2022",
    "module": "NodeNext",
    "moduleResolution": "NodeNext",
    "types": ["node"],
    "strict": true,
    "skipLibCheck": false,
    "outDir": "out"
  },
  "include": ["quickstart.ts"]
}
JSON
  norust npx tsc --strict -p tsconfig.json
  node -e 'const [M] = process.versions.node.split(".").map(Number); if (M < 20) { console.error(`Node ${process.version} < 20`); process.exit(1); }'
  norust node out/quickstart.js "$base/install-js" >out.txt
  check js "$dir/app/out.txt" install-js
  # The durable executor reads the shared SQL from the package itself (no checkout behind it).
  norust node --input-type=module -e '
    import { statements } from "levee-resilience/durable";
    for (const d of ["sqlite", "postgres"]) {
      const n = Object.keys(statements(d)).length;
      if (n < 5) { console.error(`durable: ${d}.sql has ${n} statements`); process.exit(1); }
    }' || return 1
  cmp node_modules/levee-resilience/sql/sqlite.sql "$root/durable/sqlite.sql"
  # The installed package in workerd: the host's own workerd test, pointed at node_modules.
  LEVEE_JS_PACKAGE_DIR="$dir/app/node_modules/levee-resilience" LEVEE_WORKERD="$dir/app/node_modules/.bin/workerd" \
    norust node --test "$root/host-bindings/js/test/workerd.test.mjs" >workerd.txt 2>&1 || { cat workerd.txt >&2; return 1; }
  grep -E '^# (pass|fail)' workerd.txt | sed 's/^/    [js workerd] /'
}

install_go() {
  local dir="$work/go" proxy="$dist/goproxy" mod="github.com/levee-dev/levee/host-bindings/go" upstream
  mkdir -p "$dir/app" && cd "$dir/app"
  python3 "$root/release/readme_example.py" "$root/host-bindings/go/README.md" "$dir/app"
  # Levee from the on-disk proxy (module zip format; no `replace`), its dependencies from the
  # machine's module cache (itself a proxy layout) and then the usual proxy; a module cache of
  # this test's own so nothing cached from an earlier run is used.
  upstream="$(go env GOPROXY)"
  export GOPROXY="file://$proxy,file://$(go env GOMODCACHE)/cache/download,$upstream"
  export GOMODCACHE="$dir/modcache" GOFLAGS=-mod=mod GONOSUMDB="$mod" GOTOOLCHAIN=local
  norust go mod init example.com/quickstart >/dev/null 2>&1
  norust go get "$mod@v$version"
  grep -q "^require $mod v$version" go.mod || grep -q "$mod v$version" go.mod
  ! grep -q '^replace' go.mod
  norust go vet .
  norust go run . "$base/install-go" >out.txt
  check go "$dir/app/out.txt" install-go
  # Every nested module, each in a fresh module of its own: it resolves from dist/ alone (the
  # root module at this version, no replace) and every package of it builds.
  local sub
  for sub in durable fleet grpc; do
    mkdir -p "$dir/$sub" && cd "$dir/$sub"
    norust go mod init "example.com/use-$sub" >/dev/null 2>&1
    norust go get "$mod/$sub@v$version"
    grep -q "$mod/$sub v$version" go.mod && grep -q "$mod v$version" go.mod
    ! grep -q '^replace' go.mod
    norust go build "$mod/$sub/..."
    say "go: $mod/$sub@v$version installs and builds"
  done
}

install_rust() {
  local dir="$work/rust" t0
  mkdir -p "$dir/crates" "$dir/app/src" && cd "$dir/app"
  for c in levee-core levee-resilience; do tar -xzf "$dist/$c-$version.crate" -C "$dir/crates"; done
  python3 "$root/release/readme_example.py" "$root/host-rust/README.md" "$dir/app"
  python3 "$root/release/readme_example.py" "$root/policy-core/README.md" "$dir/app" # examples/virtual_time.rs
  # `cargo add levee-resilience` as the README's Cargo.toml says (and `cargo add levee-core` for
  # levee-core's example), with the registry's copies of Levee's crates replaced by the unpacked
  # .crate files (what the registry would serve).
  { printf '[package]\nname = "quickstart"\nversion = "0.1.0"\nedition = "2021"\npublish = false\n\n'
    cat deps.toml
    printf 'levee-core = "%s"\n' "$version"
    printf '\n[patch.crates-io]\nlevee-resilience = { path = "%s" }\nlevee-core = { path = "%s" }\n' \
      "$dir/crates/levee-resilience-$version" "$dir/crates/levee-core-$version"
  } >Cargo.toml
  # The workspace's lock, so that registry crates resolve to the versions the workspace tested.
  cp "$root/Cargo.lock" Cargo.lock
  # The project is outside the workspace, so its rust-toolchain.toml does not apply: build with
  # the toolchain it names (the README's minimum, which `just setup` installed), as a user with
  # that Rust would.
  local toolchain
  toolchain=$(sed -n 's/^channel = "\(.*\)"$/\1/p' "$root/rust-toolchain.toml")
  export RUSTUP_TOOLCHAIN="$toolchain"
  # `cargo run` as the README says: the dev profile, in the project's own target dir. Sharing the
  # workspace's target/ saved nothing: its build unifies the features of every member and
  # dev-dependency (criterion's syn "full", proptest's fnv "std", a bench's rustix "time"), so
  # wasmtime and cranelift, whose dependencies those are, were rebuilt in release anyway (277-458 s
  # on 2 cores, against about 160 s for this debug build from nothing).
  local target="$dir/target"
  t0=$(date +%s)
  env -u LEVEE_WASM_DIR CARGO_TARGET_DIR="$target" cargo build -q 2>build.txt || { cat build.txt >&2; return 1; }
  say "rust: fresh project built in $(( $(date +%s) - t0 ))s (dev profile, its own target dir)"
  env -u LEVEE_WASM_DIR CARGO_TARGET_DIR="$target" cargo run -q -- "$base/install-rust" >out.txt
  check rust "$dir/app/out.txt" install-rust
  # levee-core's README example: one call in virtual time (its asserts are the test).
  env -u LEVEE_WASM_DIR CARGO_TARGET_DIR="$target" cargo run -q --example virtual_time >core.txt
  sed 's/^/    [rust levee-core] /' core.txt
  grep -q '^retry-scheduled attempt=1' core.txt
}

for lang in "${langs[@]}"; do
  case "$lang" in
    python | js | go | rust) (timed "install_$lang") ;;
    *) echo "install-test: unknown '$lang' (python js go rust)" >&2; exit 2 ;;
  esac
done
say "every install test passed (${langs[*]})"

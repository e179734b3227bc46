#!/usr/bin/env bash
# `./dev dist`: every release artifact into dist/, from one version (VERSION; every manifest is
# checked against it first). The component must be built already ($LEVEE_WASM_DIR, default
# target/levee: the justfile's `component` recipe).
#
#   dist/component/             levee_policy.wasm, levee_policy_core.wasm, wit/levee.wit
#   dist/levee-component-V.tar.gz   the same, as one reproducible tarball
#   dist/levee_resilience-V-py3-none-any.whl, dist/levee_resilience-V.tar.gz   (PyPI)
#   dist/levee-resilience-V.tgz                                                 (npm)
#   dist/levee-core-V.crate, dist/levee-resilience-V.crate                      (crates.io)
#   dist/goproxy/               the Go modules in the GOPROXY on-disk layout (module zip format):
#                               host-bindings/go and its nested modules (durable, fleet, grpc), each
#                               requiring the root module at this version, with no `replace`
#   dist/levee-envoy-filter-V.wasm  the Envoy proxy-wasm filter (docs/envoy.md)
#   dist/SHA256SUMS
#
#   release/dist.sh [component python npm crates go envoy]   (default: all, into a clean dist/)
#
# LEVEE_DIST_VERIFY=0 skips `cargo package`'s verification build of levee-resilience (a debug
# build of wasmtime and the rest, 5-10 minutes on 2 cores). `./dev test` sets it: its install
# test (release/install-test.sh) builds the same .crate in release in a fresh project and runs
# the README's example, which verifies more than that debug build would.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
wasm_dir="${LEVEE_WASM_DIR:-$root/target/levee}"
case "$wasm_dir" in /*) ;; *) wasm_dir="$root/$wasm_dir" ;; esac
out="$root/dist"
stamp() { printf '%s dist: %s\n' "$(date +%H:%M:%S)" "$*"; }
timed() { # timed LABEL CMD...: run, then say how long it took
  local label="$1" t0 rc; shift
  t0=$(date +%s)
  set +e
  (set -e; "$@") # errexit in force inside (under `||` it would be lifted)
  rc=$?
  set -e
  stamp "$label: $(( $(date +%s) - t0 ))s$([ $rc -ne 0 ] && echo " (FAILED, exit $rc)")"
  return $rc
}

python3 release/version.py check
version="$(python3 release/version.py)"
for f in levee_policy.wasm levee_policy_core.wasm; do
  [ -f "$wasm_dir/$f" ] || { echo "dist: $wasm_dir/$f is missing; run ./dev component" >&2; exit 1; }
done
# The committed Go core module must be this build's (the Go module ships it as it is).
LEVEE_WASM_DIR="$wasm_dir" bash release/go-core.sh --check
# Times inside artifacts (tar entries, the Go .info) come from the last commit, not the clock.
export SOURCE_DATE_EPOCH="${SOURCE_DATE_EPOCH:-$(git log -1 --format=%ct 2>/dev/null || echo 0)}"
parts=("$@")
if [ ${#parts[@]} -eq 0 ]; then
  parts=(component python npm crates go envoy)
  rm -rf "$out"
fi
mkdir -p "$out/component/wit"
work="$(mktemp -d "${TMPDIR:-/tmp}/levee-dist.XXXXXX")"
cleanup() { rm -rf "$work" "$root/host-rust/wasm"; }
trap cleanup EXIT

component() {
  cp "$wasm_dir/levee_policy.wasm" "$wasm_dir/levee_policy_core.wasm" "$out/component/"
  cp wit/levee.wit "$out/component/wit/"
  tar --sort=name --mtime="@$SOURCE_DATE_EPOCH" --owner=0 --group=0 --numeric-owner \
    -C "$out" --transform "s,^component,levee-component-$version," -cf - component | gzip -n >"$out/levee-component-$version.tar.gz"
}

python_dists() {
  local venv="$root/target/dist-venv"
  [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet --disable-pip-version-check build==1.3.0 setuptools==84.2.1
  # sdist first, then the wheel built FROM the sdist (as pip does from PyPI): the sdist ships the
  # component. In the dist venv's pinned setuptools (no isolated env to set up, twice); the
  # install test builds the sdist again the way pip does, isolated and with no Rust toolchain.
  (cd host-bindings/python && LEVEE_WASM_DIR="$wasm_dir" "$venv/bin/python" -m build --no-isolation --skip-dependency-check \
    --outdir "$out" . >"$work/python-build.log" 2>&1) \
    || { cat "$work/python-build.log" >&2; return 1; }
  rm -rf host-bindings/python/build host-bindings/python/src/*.egg-info
  ls "$out"/levee_resilience-"$version"-py3-none-any.whl "$out"/levee_resilience-"$version".tar.gz >/dev/null
}

npm_tarball() {
  cd host-bindings/js
  # npm ci unless node_modules already is exactly the lock file's (js/ci.sh runs npm ci too).
  if [ ! -f node_modules/.package-lock.json ] || [ package-lock.json -nt node_modules/.package-lock.json ]; then
    npm ci --no-audit --no-fund --loglevel=error
  fi
  # prepack: transpile the component with the pinned jco into wasm/, then tsc into dist/.
  LEVEE_WASM_DIR="$wasm_dir" npm pack --pack-destination "$out" --loglevel=error >"$work/npm-pack.log" 2>&1 \
    || { cat "$work/npm-pack.log" >&2; return 1; }
  cd "$root"
  ls "$out/levee-resilience-$version.tgz" >/dev/null
}

crates() {
  # The host crate ships the prebuilt component (build.rs reads wasm/ in a packaged crate).
  mkdir -p host-rust/wasm
  cp "$wasm_dir/levee_policy.wasm" host-rust/wasm/
  # No LEVEE_WASM_DIR: the verification build must find the component in the package alone.
  # --no-metadata: no repository/homepage on purpose (docs/versioning.md). Both crates in one
  # invocation: levee-resilience's packaged manifest needs levee-core, which cargo then serves
  # from the packages it just made.
  local pkg=(env -u LEVEE_WASM_DIR cargo package -q --no-metadata --allow-dirty)
  # cargo serves those packages from a temporary registry and treats them as any registry
  # package, immutable for a name and version: it never extracts one again into
  # $CARGO_HOME/registry/src/-<hash>/, nor rebuilds its artifacts in target/debug. levee-core
  # packaged again with new code under the same version would be verified against the old one
  # (and fail on a function the old core lacks). A clean machine has neither; a developer's
  # has both after the first run.
  rm -rf "${CARGO_HOME:-$HOME/.cargo}"/registry/src/-*/levee-core-* "${CARGO_HOME:-$HOME/.cargo}"/registry/src/-*/levee-resilience-*
  cargo clean -q -p levee-core -p levee-resilience
  if [ "${LEVEE_DIST_VERIFY:-1}" = 1 ]; then
    "${pkg[@]}" -p levee-core -p levee-resilience
  else
    # levee-core is verified (no dependencies: seconds); levee-resilience's verification is a
    # debug build of wasmtime, which the install test replaces by building the same .crate in
    # release in a fresh project, reusing the workspace's wasmtime.
    "${pkg[@]}" --no-verify -p levee-core -p levee-resilience
    "${pkg[@]}" -p levee-core
  fi
  local target_dir
  target_dir="$(cargo metadata --format-version 1 --no-deps | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')"
  cp "$target_dir/package/levee-core-$version.crate" "$target_dir/package/levee-resilience-$version.crate" "$out/"
  rm -rf host-rust/wasm
}

# The nested Go modules under host-bindings/go that users install (`go get MODULE@vV`), and the
# ones that are not published: bench and grpc/bench are benchmark harnesses (docs/performance.md).
go_nested=(durable fleet grpc)
go_unpublished=(bench grpc/bench)

go_proxy() {
  # The module's tracked files as they are in the working tree (what a tag would publish).
  mkdir -p "$work/gomod"
  git ls-files -z --cached --others --exclude-standard host-bindings/go | tar --null -T - -cf - | tar -xf - -C "$work/gomod"
  (cd release/gomodproxy && go build -o "$work/gomodproxy" .)
  local when rootmod sub found
  when="$(date -u -d "@$SOURCE_DATE_EPOCH" +%Y-%m-%dT%H:%M:%SZ)"
  rootmod="$(cd host-bindings/go && go list -m)"
  # Every nested module is published or said not to be: a new one is not forgotten.
  for found in $(cd host-bindings/go && git ls-files '*/go.mod' | xargs -n1 dirname | LC_ALL=C sort); do
    case " ${go_nested[*]} ${go_unpublished[*]} " in *" $found "*) ;; *)
      echo "dist: host-bindings/go/$found is a Go module neither published nor listed in go_unpublished" >&2; return 1 ;;
    esac
  done
  "$work/gomodproxy" -module "$work/gomod/host-bindings/go" -version "v$version" -out "$out/goproxy" -time "$when"
  for sub in "${go_nested[@]}"; do
    # In the repository a nested module builds against the root next to it (`replace ../`, at
    # v0.0.0); published, it requires the root module of the same release.
    (cd "$work/gomod/host-bindings/go/$sub" && go mod edit -dropreplace="$rootmod" -require="$rootmod@v$version")
    if grep -q '^replace' "$work/gomod/host-bindings/go/$sub/go.mod"; then
      echo "dist: host-bindings/go/$sub/go.mod keeps a replace directive" >&2
      return 1
    fi
    "$work/gomodproxy" -module "$work/gomod/host-bindings/go/$sub" -version "v$version" -out "$out/goproxy" -time "$when"
  done
}

envoy_filter() {
  rustup target add wasm32-wasip1 >/dev/null
  cargo build -q --release --target wasm32-wasip1 -p levee-proxy-wasm
  local target_dir
  target_dir="$(cargo metadata --format-version 1 --no-deps | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')"
  cp "$target_dir/wasm32-wasip1/release/levee_proxy_wasm.wasm" "$out/levee-envoy-filter-$version.wasm"
}

t0=$(date +%s)
for part in "${parts[@]}"; do
  case "$part" in
    component) timed "component and WIT" component ;;
    python) timed "python wheel and sdist" python_dists ;;
    npm) timed "npm tarball" npm_tarball ;;
    crates) timed "crates (cargo package$([ "${LEVEE_DIST_VERIFY:-1}" = 1 ] && echo ", verified"))" crates ;;
    go) timed "go module proxy" go_proxy ;;
    envoy) timed "envoy filter" envoy_filter ;;
    *) echo "dist: unknown part '$part' (component python npm crates go envoy)" >&2; exit 2 ;;
  esac
done
(cd "$out" && find . -type f ! -name SHA256SUMS -printf '%P\n' | LC_ALL=C sort | xargs sha256sum >SHA256SUMS)
stamp "version $version, every artifact in dist/ in $(( $(date +%s) - t0 ))s:"
(cd "$out" && find . -maxdepth 1 -type f -printf '  %f (%s bytes)\n' | LC_ALL=C sort; echo "  goproxy/ component/")

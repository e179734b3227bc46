#!/usr/bin/env bash
# The fleet option against a real Redis Cluster (docs/fleet.md, "Redis Cluster"): three
# masters (Debian's redis-server, installed when missing) with --cluster-enabled on free ports
# of 127.0.0.1, joined by `redis-cli --cluster create`; Python (redis-py's RedisCluster) and Go
# (go-redis's ClusterClient) processes together: keys spread over the three shards, the GCRA
# fleet limit per key, the breaker quorum per key, and a master killed with SIGKILL and
# restarted under load. Every server is stopped at the end, on every exit path. About a minute.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
export LEVEE_WASM_DIR="${LEVEE_WASM_DIR:-$ROOT/target/levee}"
if [ ! -f "$LEVEE_WASM_DIR/levee_policy.wasm" ]; then
  echo "fleet cluster: $LEVEE_WASM_DIR/levee_policy.wasm is missing; build it with ./dev component" >&2
  exit 1
fi
quiet() { local log; log="$(mktemp)"; if ! "$@" >"$log" 2>&1; then cat "$log" >&2; rm -f "$log"; return 1; fi; rm -f "$log"; }

echo "== install: redis-server and redis-cli, a venv with the Python host and redis-py, the Go worker"
if ! command -v redis-server >/dev/null || ! command -v redis-cli >/dev/null; then
  quiet apt-get update
  quiet env DEBIAN_FRONTEND=noninteractive apt-get install -y redis-server redis-tools
fi
VENV="$ROOT/fleet/.venv"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
quiet "$VENV/bin/pip" install --upgrade pip
quiet "$VENV/bin/pip" install --force-reinstall --no-deps "$ROOT/host-bindings/python"
quiet "$VENV/bin/pip" install "$ROOT/host-bindings/python[fleet]" "mypy>=1.10"
rm -rf "$ROOT/host-bindings/python/build" "$ROOT"/host-bindings/python/src/*.egg-info
echo "== mypy --strict levee.fleet and the cluster worker"
(cd "$ROOT/host-bindings/python" && MYPYPATH=src "$VENV/bin/python" -m mypy --strict --follow-imports=silent \
  src/levee/fleet.py "$HERE/cluster_worker.py" "$HERE/cluster_check.py")
WORK="$(mktemp -d)"
(cd "$ROOT/host-bindings/go/fleet" && gofmt -l . | (! grep .) && go vet ./... && go build -o "$WORK/fleet-worker" ./cmd/fleet-worker)

# Three free ports whose cluster bus ports (port + 10000) are free too.
read -r -a PORTS <<<"$("$VENV/bin/python" - <<'EOF'
import socket
ports: list[int] = []
while len(ports) < 3:
    s = socket.socket(); s.bind(("127.0.0.1", 0)); p = s.getsockname()[1]
    if p + 10000 > 65535 or p in ports:
        s.close(); continue
    b = socket.socket()
    try:
        b.bind(("127.0.0.1", p + 10000))
    except OSError:
        continue
    finally:
        b.close(); s.close()
    ports.append(p)
print(*ports)
EOF
)"
stop() {
  for p in "${PORTS[@]}"; do
    if [ -f "$WORK/$p/redis.pid" ]; then kill "$(cat "$WORK/$p/redis.pid")" 2>/dev/null || true; fi
  done
  rm -rf "$WORK"
}
trap stop EXIT
# One command per node, kept so that the test can restart a killed node on its own port with
# its own nodes.conf (it then rejoins the cluster as the master of its slots, with no data).
CMDS=()
for p in "${PORTS[@]}"; do
  mkdir -p "$WORK/$p"
  cmd=(redis-server --port "$p" --bind 127.0.0.1 --save "" --appendonly no --daemonize yes
       --cluster-enabled yes --cluster-config-file "$WORK/$p/nodes.conf" --cluster-node-timeout 3000
       --pidfile "$WORK/$p/redis.pid" --logfile "$WORK/$p/redis.log" --dir "$WORK/$p")
  "${cmd[@]}"
  CMDS+=("$("$VENV/bin/python" -c 'import json, sys; print(json.dumps(sys.argv[1:]))' "${cmd[@]}")")
done
for p in "${PORTS[@]}"; do
  for _ in $(seq 50); do redis-cli -p "$p" ping >/dev/null 2>&1 && break; sleep 0.1; done
done
quiet redis-cli --cluster create "${PORTS[@]/#/127.0.0.1:}" --cluster-replicas 0 --cluster-yes
for _ in $(seq 100); do
  ok=0
  for p in "${PORTS[@]}"; do redis-cli -p "$p" cluster info | grep -q '^cluster_state:ok' && ok=$((ok + 1)); done
  [ "$ok" = 3 ] && break
  sleep 0.1
done
if [ "$ok" != 3 ]; then
  echo "fleet cluster: the cluster did not reach cluster_state:ok" >&2
  for p in "${PORTS[@]}"; do redis-cli -p "$p" cluster info >&2 || true; done
  exit 1
fi
echo "== redis $(redis-server --version | awk '{print $3}') cluster of 3 masters on 127.0.0.1:${PORTS[*]}: cluster_state:ok"

FLEET_PY="$VENV/bin/python" FLEET_GO_WORKER="$WORK/fleet-worker" \
  FLEET_CLUSTER="$(IFS=,; echo "${PORTS[*]/#/127.0.0.1:}")" \
  FLEET_CLUSTER_CMDS="$(printf '%s\n' "${CMDS[@]}")" \
  timeout 300 "$VENV/bin/python" "$HERE/cluster_check.py"

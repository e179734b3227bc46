"""One Python process of the Redis Cluster test (fleet/tests/cluster.sh): the fleet option on
a `redis.cluster.RedisCluster` client, calls spread round-robin over several keys, from a
common wall-clock start; prints one JSON line of counts (per key too)."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import levee
from levee.fleet import Fleet, FleetEvent
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.retry import Retry

HERE = Path(__file__).resolve().parent


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["rate", "breaker", "steady"])
    ap.add_argument("--addr", required=True, help="comma-separated host:port of the cluster's masters")
    ap.add_argument("--node", required=True)
    ap.add_argument("--start", type=float, required=True, help="wall-clock start (unix seconds)")
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--bad", default="", help="from:to seconds after start when the dependency fails")
    ap.add_argument("--keys", required=True, help="comma-separated keys the calls go round")
    ap.add_argument("--policy", required=True)
    a = ap.parse_args()
    engine = levee.load(str(HERE / "cluster.yaml"))
    quorum: dict[str, int] = {}

    def on_engine(ev: levee.Event) -> None:
        if ev.name == "fleet-quorum":
            quorum[ev.key] = quorum.get(ev.key, 0) + 1

    engine.add_listener(on_engine)
    events: list[str] = []

    def on_fleet(ev: FleetEvent) -> None:
        events.append(ev.kind)

    # The client a service would have: redis-py's cluster client with short timeouts (the
    # policies' fleet timeout) and no retries of its own; it follows MOVED and ASK itself.
    hosts = (x.rsplit(":", 1) for x in a.addr.split(","))
    nodes = [ClusterNode(h, int(p)) for h, p in hosts]  # type: ignore[no-untyped-call]
    client = RedisCluster(
        startup_nodes=nodes, socket_timeout=0.25, socket_connect_timeout=0.25, retry=Retry(NoBackoff(), 0)
    )
    fleet = Fleet(engine, client=client, node=a.node, listener=on_fleet)
    keys = a.keys.split(",")
    bad = tuple(float(x) for x in a.bad.split(":")) if a.bad else (-1.0, -1.0)
    counts = {"ok": 0, "limited": 0, "open": 0, "failed": 0, "errors": 0, "invoked": 0}
    per_key = {k: {"ok": 0, "limited": 0, "open": 0} for k in keys}
    phases: dict[str, dict[str, int]] = {}
    out: dict[str, Any] = {"node": a.node, "lang": "python", "mode": a.mode}
    slowest = 0.0
    _sleep_until(a.start)
    end = a.start + a.seconds
    while (now := time.time()) < end:
        t = now - a.start
        phase = phases.setdefault(str(int(t)), {"ok": 0, "open": 0, "failed": 0, "invoked": 0})
        failing = bad[0] <= t < bad[1]
        admitted = False
        for key in keys:

            def dependency(phase: dict[str, int] = phase, failing: bool = failing) -> int:
                counts["invoked"] += 1
                phase["invoked"] += 1
                if failing:
                    raise ConnectionError("the dependency is down")
                return 1

            begun = time.perf_counter()
            try:
                fleet.call(a.policy, dependency, key=key)
                counts["ok"] += 1
                phase["ok"] += 1
                per_key[key]["ok"] += 1
                admitted = True
            except levee.RateLimited:
                counts["limited"] += 1
                per_key[key]["limited"] += 1
            except levee.BreakerOpen:
                counts["open"] += 1
                phase["open"] += 1
                per_key[key]["open"] += 1
            except levee.CallFailed:
                counts["failed"] += 1
                phase["failed"] += 1
            except Exception as e:  # anything else is an error on the data path
                counts["errors"] += 1
                out.setdefault("error_samples", []).append(repr(e))
            slowest = max(slowest, time.perf_counter() - begun)
        if a.mode != "rate":
            time.sleep(0.005)
        elif not admitted:  # one round admitted nothing: every key's bucket is empty
            time.sleep(0.001)
    out.update(
        counts,
        per_key=per_key,
        phases=phases,
        quorum_keys=quorum,
        quorum_events=sum(quorum.values()),
        fleet_events=events,
        conflicts=fleet.conflicts,
        publications=fleet.publications,
        max_call_ms=round(slowest * 1000, 1),
    )
    print(json.dumps(out), flush=True)
    fleet.close()
    client.close()


def _sleep_until(at: float) -> None:
    while (d := at - time.time()) > 0:
        time.sleep(min(d, 0.05))


if __name__ == "__main__":
    main()

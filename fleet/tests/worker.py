"""One Python process of the fleet test (fleet/tests/run.sh): runs a scenario against the
shared Redis from a common wall-clock start and prints one JSON line of counts."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import levee
from levee.fleet import Fleet, FleetEvent


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["rate", "rate-strict", "breaker", "steady", "records"])
    ap.add_argument("--addr", required=True)
    ap.add_argument("--node", required=True)
    ap.add_argument("--start", type=float, required=True, help="wall-clock start (unix seconds)")
    ap.add_argument("--seconds", type=float, default=10.0)
    ap.add_argument("--bad", default="", help="from:to seconds after start when the dependency fails")
    ap.add_argument("--failures", type=int, default=0)
    a = ap.parse_args()
    engine = levee.load(sys.argv[0].rsplit("/", 1)[0] + "/policies.yaml")
    events: list[str] = []
    quorum = [0]

    def on_engine(ev: levee.Event) -> None:
        if ev.name == "fleet-quorum":
            quorum[0] += 1

    engine.add_listener(on_engine)

    def on_fleet(ev: FleetEvent) -> None:
        events.append(ev.kind)

    fleet = Fleet(engine, f"redis://{a.addr}/0", node=a.node, listener=on_fleet)
    out: dict[str, Any] = {"node": a.node, "lang": "python", "mode": a.mode}
    if a.mode == "records":
        for _ in range(a.failures):
            try:
                fleet.call("count", _fail, key="k")
            except levee.LeveeError:
                pass
        _sleep_until(a.start)
        for _ in range(50):
            fleet.sync("count", "k")
        out.update(conflicts=fleet.conflicts, publications=fleet.publications)
        print(json.dumps(out), flush=True)
        fleet.close()
        return
    bad = tuple(float(x) for x in a.bad.split(":")) if a.bad else (-1.0, -1.0)
    counts = {"ok": 0, "limited": 0, "open": 0, "failed": 0, "errors": 0, "invoked": 0}
    phases: dict[str, dict[str, int]] = {}
    policy = {"rate": "rate", "rate-strict": "rate-strict"}.get(a.mode, "dep")
    _sleep_until(a.start)
    end = a.start + a.seconds
    while (now := time.time()) < end:
        t = now - a.start
        phase = phases.setdefault(str(int(t)), {"ok": 0, "open": 0, "failed": 0, "invoked": 0})
        failing = bad[0] <= t < bad[1]

        def dependency(phase: dict[str, int] = phase, failing: bool = failing) -> int:
            counts["invoked"] += 1
            phase["invoked"] += 1
            if failing:
                raise ConnectionError("the dependency is down")
            return 1

        try:
            fleet.call(policy, dependency, key="k")
            counts["ok"] += 1
            phase["ok"] += 1
        except levee.RateLimited as e:
            counts["limited"] += 1
            time.sleep(min(e.retry_after or 0.001, 0.005))
        except levee.BreakerOpen:
            counts["open"] += 1
            phase["open"] += 1
        except levee.CallFailed:
            counts["failed"] += 1
            phase["failed"] += 1
        except Exception as e:  # anything else is an error on the data path
            counts["errors"] += 1
            out.setdefault("error_samples", []).append(repr(e))
        if a.mode in ("breaker", "steady"):
            time.sleep(0.005)
    out.update(
        counts,
        phases=phases,
        quorum_events=quorum[0],
        fleet_events=events,
        conflicts=fleet.conflicts,
        publications=fleet.publications,
    )
    print(json.dumps(out), flush=True)
    fleet.close()


def _fail() -> None:
    raise ConnectionError("recorded failure")


def _sleep_until(at: float) -> None:
    while (d := at - time.time()) > 0:
        time.sleep(min(d, 0.05))


if __name__ == "__main__":
    main()

"""Snapshots at many keys (issue 41): what the recovery snapshot costs the call path.

One policy with a breaker and room for 10^6 keys; N keys filled with a successful call each
(k0..k{N-1}), then the breaker of key "open" opened (a snapshot is due: taken on the transition
and then at most once a second of the engine's clock on the call path, docs/hosts.md section 7).
Then one caller cycles over k0..k999 for T seconds of real time. Each N gets an engine of its
own; all of them are built first, then the caller runs them in turns of `--slice` seconds (0.2)
until each has had T, so that the machine's load, which drifts over a run on a shared machine,
falls on every N alike (run one N after the other, the same command gave ratios from 0.64 to
1.18 between runs with and without snapshots). An unmeasured turn of each engine comes first.
The figures are side by side:

- `calls` and its ratio to N=1; `calls/cpu-s` and its ratio: calls per second of the caller's
  own CPU time (on a shared machine the wall-clock ratio is mostly the other processes' load);
- `slowest ms` and `p99.9 ms`: the slowest call, and the 99.9th percentile; `snap call ms`: the
  slowest call during which the call path took a snapshot (what a snapshot costs a call);
- `snapshot B` and `snap us`: the last snapshot's size, and one snapshot's own cost (the median
  of 21 taken after the run); `taken` and `max us`: the snapshots the call path took while the
  caller ran, and the slowest of them;
- `evicted`: keys evicted while the caller ran (with N = 10^6 the table is full once "open" is
  added: the first cycle makes each of its keys again, evicting the least recently used, then
  none; N = 999999 leaves room for "open");
- `faults`, and `open`: whether the breaker of "open" is still open at the end.

    python bench/snapshot.py                        # N = 1, 10^5, 10^6; T = 3 s
    python bench/snapshot.py --n 1,1000,20000 --seconds 0.5 --check   # the smoke run of ci.sh
    python bench/snapshot.py --with export-state    # the snapshot as it was before: the whole state

`--with export-state` takes the recovery snapshot with `export-state` (the host before issue 41)
instead of `export-snapshot`, to compare on one component; `--with none` takes no periodic
snapshot (only the one of the transition): what the table's size costs without any.
"""

from __future__ import annotations

import argparse
import gc
import time
from typing import Any

import levee
from levee._abi import Core

POLICY = """
policies:
  p:
    attempts: 1
    breaker: { window: { kind: count, size: 4 }, minimum-calls: 2, open-duration: 1h }
    keys: { max: 1000000 }
"""


#: how long each recovery snapshot took (ns), while the caller runs
_TAKEN: list[int] = []


class _TimedCore(Core):
    """A core that times its recovery snapshots."""

    def export_snapshot(self) -> bytes:
        t = time.perf_counter_ns()
        try:
            return super().export_snapshot()
        finally:
            _TAKEN.append(time.perf_counter_ns() - t)


class _StateCore(_TimedCore):
    """A core whose recovery snapshot is the whole state (`export-state`), as before issue 41."""

    def export_snapshot(self) -> bytes:
        t = time.perf_counter_ns()
        try:
            return self.export_state()
        finally:
            _TAKEN.append(time.perf_counter_ns() - t)


def _fail() -> None:
    raise ConnectionError("down")


class _Run:
    """One N: its engine, the caller's handles, and what its turns measured."""

    def __init__(self, n: int, snapshot: str) -> None:
        self.n = n
        engine = levee.Engine(POLICY, seed=1, snapshot_interval=0 if snapshot == "none" else 1.0)
        cls = _StateCore if snapshot == "export-state" else _TimedCore
        engine._core_class = cls
        engine._core.__class__ = cls
        t0 = time.perf_counter()
        for i in range(n):
            engine.policy("p", key=f"k{i}").call(int)
        self.fill = time.perf_counter() - t0
        opened = engine.policy("p", key="open")
        for _ in range(4):
            if engine.breaker_state("p", "open") is levee.BreakerState.OPEN:
                break
            try:
                opened.call(_fail)
            except (levee.RetriesExhausted, ConnectionError):  # ConnectionError: a degraded call (a fault)
                pass
        self.evictions = 0
        engine.add_listener(self._count)
        self.engine = engine
        self.handles = [engine.policy("p", key=f"k{i}").call for i in range(min(n, 1000))]
        self.calls = 0
        self.cpu = 0.0
        self.ran = 0.0
        self.times: list[int] = []
        self.on_path: list[int] = []  # the snapshots the call path took while the caller ran
        self.with_snapshot = 0  # the slowest call during which the call path took a snapshot

    def _count(self, ev: levee.Event) -> None:
        if ev.kind is levee.EventKind.KEY_EVICTED:
            self.evictions += 1

    def turn(self, seconds: float, measured: bool = True) -> None:
        """The caller cycles over the handles for `seconds` of real time."""
        handles = self.handles
        m = len(handles)
        calls = self.calls
        times: list[int] = []
        clock = time.perf_counter_ns
        first = len(_TAKEN)
        with_snapshot = self.with_snapshot
        cpu = time.thread_time()
        now = start = clock()
        end = now + int(seconds * 1e9)
        while now < end:
            taken = len(_TAKEN)
            handles[calls % m](int)
            after = clock()
            times.append(after - now)
            if len(_TAKEN) != taken and after - now > with_snapshot:
                with_snapshot = after - now
            now = after
            calls += 1
        cpu = time.thread_time() - cpu
        if measured:
            self.calls = calls
            self.cpu += cpu
            self.ran += (now - start) / 1e9
            self.times += times
            self.on_path += _TAKEN[first:]
            self.with_snapshot = with_snapshot

    def finish(self) -> dict[str, Any]:
        engine = self.engine
        times = sorted(self.times)
        # one snapshot's own cost, as the call path pays it (median of 21, under the engine's lock)
        took: list[int] = []
        if not engine._snapshots_stopped:
            with engine._lock:
                for _ in range(21):
                    t = time.perf_counter_ns()
                    engine._core.export_snapshot()
                    took.append(time.perf_counter_ns() - t)
            took.sort()
        on_path = self.on_path
        out = {
            "n": self.n,
            "fill_s": self.fill,
            "calls": self.calls,
            "cpu_rate": self.calls / self.cpu,
            "slowest_ms": times[-1] / 1e6,
            "p999_ms": times[int(len(times) * 0.999)] / 1e6,
            "with_snapshot_ms": self.with_snapshot / 1e6,
            "evicted": self.evictions,
            "open": engine.breaker_state("p", "open") is levee.BreakerState.OPEN,
            "snapshot_bytes": len(engine._snapshot or b""),
            "snapshot_us": took[len(took) // 2] / 1e3 if took else float("nan"),
            "on_path": len(on_path),
            "on_path_max_us": max(on_path) / 1e3 if on_path else float("nan"),
            "faults": engine.faults,
            "snapshots_stopped": engine._snapshots_stopped,
        }
        engine.close()
        self.handles = []
        return out


def run(ns: list[int], seconds: float, snapshot: str, slice_s: float) -> list[dict[str, Any]]:
    """Every N's engine built, then their turns in rotation until each has run `seconds`."""
    runs = [_Run(n, snapshot) for n in ns]
    gc.collect()
    for r in runs:  # the unmeasured turn: warming up is no N's cost
        r.turn(min(slice_s, seconds), measured=False)
    while any(r.ran < seconds for r in runs):
        for r in runs:
            if r.ran < seconds:
                r.turn(min(slice_s, seconds - r.ran))
    out = [r.finish() for r in runs]
    del runs
    gc.collect()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", default="1,100000,1000000", help="key counts, comma-separated")
    ap.add_argument("--seconds", type=float, default=3.0, help="T: how long the caller runs at each N")
    ap.add_argument("--slice", type=float, default=0.2, help="the length of one turn of an N, in seconds")
    ap.add_argument(
        "--with", dest="snapshot", choices=("export-snapshot", "export-state", "none"), default="export-snapshot"
    )
    ap.add_argument("--check", action="store_true", help="exit 1 if a run faulted or lost the open breaker (CI)")
    args = ap.parse_args()
    bad = []
    ns = [int(x) for x in args.n.split(",")]
    print(f"snapshot with {args.snapshot}, T = {args.seconds} s in turns of {args.slice} s, one caller over k0..k999")
    print(f"{'N':>9} {'fill s':>8} {'calls':>9} {'ratio':>6} {'calls/cpu-s':>11} {'ratio':>6} {'slowest ms':>11} "
          f"{'p99.9 ms':>9} {'snap call ms':>12} {'snapshot B':>11} {'snap us':>8} {'taken':>5} {'max us':>8} "
          f"{'evicted':>8} "
          f"{'faults':>6} {'open':>5}")  # fmt: skip
    base = 0
    base_rate = 0.0
    for r in run(ns, args.seconds, args.snapshot, args.slice):
        base = base or r["calls"]
        base_rate = base_rate or r["cpu_rate"]
        stopped = " (snapshots stopped)" if r["snapshots_stopped"] else ""
        print(f"{r['n']:>9} {r['fill_s']:>8.1f} {r['calls']:>9} {r['calls'] / base:>6.2f} {r['cpu_rate']:>11.0f} "
              f"{r['cpu_rate'] / base_rate:>6.2f} {r['slowest_ms']:>11.2f} "
              f"{r['p999_ms']:>9.3f} {r['with_snapshot_ms']:>12.2f} {r['snapshot_bytes']:>11} "
              f"{r['snapshot_us']:>8.0f} {r['on_path']:>5} "
              f"{r['on_path_max_us']:>8.0f} {r['evicted']:>8} "
              f"{r['faults']:>6} {r['open']!s:>5}{stopped}",
              flush=True)  # fmt: skip
        if r["faults"] or not r["open"]:
            bad.append(r["n"])
    if args.check and bad:
        raise SystemExit(f"snapshot.py: a fault, or the breaker of 'open' lost, at N = {bad}")


if __name__ == "__main__":
    main()

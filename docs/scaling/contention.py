"""Contention of one engine lock against sharded engines, by discrete-event simulation.

T threads each loop: app work (exponential, mean W), then one guest call holding the lock of
the shard its key hashes to (deterministic S), queueing FIFO if it is held. Keys are drawn from
K_KEYS keys by a Zipf(s) law (s=0: uniform; an unkeyed policy is one key). Prints the lock's
utilisation, the mean wait per call and the throughput against the no-lock ideal.

    python3 docs/scaling/contention.py            # the table in docs/scaling.md (~10 s)
"""

from __future__ import annotations

import heapq
import random


def simulate(threads: int, shards: int, work_us: float, hold_us: float, keys: int, zipf_s: float,
             calls: int = 200_000, seed: int = 1) -> tuple[float, float, float]:
    rng = random.Random(seed)
    weights = [1.0 / (k + 1) ** zipf_s for k in range(keys)]
    key_shard = [rng.randrange(shards) for _ in range(keys)]  # a hash: a uniform shard per key
    free_at = [0.0] * shards  # when each shard's lock is next free
    busy = [0.0] * shards
    events = [(rng.expovariate(1 / work_us), t) for t in range(threads)]
    heapq.heapify(events)
    waited = 0.0
    now = 0.0
    done = 0
    key_draws = rng.choices(range(keys), weights, k=calls)
    while done < calls:
        now, t = heapq.heappop(events)
        s = key_shard[key_draws[done]]
        start = max(now, free_at[s])  # FIFO: the lock is granted in arrival order
        waited += start - now
        free_at[s] = start + hold_us
        busy[s] += hold_us
        done += 1
        heapq.heappush(events, (start + hold_us + rng.expovariate(1 / work_us), t))
    ideal = threads / (work_us + hold_us) * now  # calls the threads would make with no waiting
    return max(busy) / now, waited / calls, done / ideal


def main() -> None:
    hold = 1.0  # us: one guest call (start with a settle), as measured in the hosts
    work = 20.0  # us of the application's own work between calls, per thread
    print(f"# hold {hold} us per call, {work} us of work between calls per thread")
    print(f"{'threads':>7} {'layout':<30} {'busiest lock':>12} {'wait us/call':>12} {'throughput/ideal':>16}")
    for threads in (2, 16, 64):
        for layout, shards, keys, s in (
            ("one engine", 1, 1, 0.0),
            ("16 shards, 1 key (unkeyed)", 16, 1, 0.0),
            ("16 shards, 10^4 keys, zipf 1", 16, 10_000, 1.0),
            ("64 shards, 10^4 keys, uniform", 64, 10_000, 0.0),
            ("per-thread engines", threads, threads, 0.0),
        ):
            if layout == "per-thread engines":
                util, wait, eff = hold / (work + hold), 0.0, 1.0  # no shared lock on the call path
            else:
                util, wait, eff = simulate(threads, shards, work, hold, keys, s)
            print(f"{threads:7d} {layout:<30} {util:12.2f} {wait:12.2f} {eff:16.2f}")


if __name__ == "__main__":
    main()

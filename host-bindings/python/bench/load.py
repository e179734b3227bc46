"""CPU time per call at production load: N asyncio tasks share one Levee engine (one tenacity and one
stamina decorator) and each makes ROUNDS calls of a coroutine that waits 5 ms, so about N calls are
in flight at any time. CPU time is time.process_time() (user + system) over the whole level divided
by the calls made; every contender runs at every level in this one process, so the ratios of one run
are comparable.

    python bench/load.py                                  # 1, 1,000, 10,000, 40,000 in flight
    python bench/load.py --levels 1,100 --rounds 5 --single 20   # the CI smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import importlib.metadata
import platform
import time
from collections.abc import Awaitable, Callable

import stamina
import tenacity

import levee

POLICY = """
policies:
  bench:
    attempts: 3
    backoff: { kind: exponential, base: 100ms, cap: 2s, jitter: full }
    retry-on: [timeout, connection-error, "error:ConnectionError"]
    breaker:
      window: { kind: count, size: 100 }
      failure-rate: 50
      minimum-calls: 20
      open-duration: 30s
"""


async def level(call: Callable[[], Awaitable[int]], n: int, rounds: int) -> tuple[float, float]:
    """CPU microseconds per call and wall seconds for n tasks making `rounds` calls each."""

    async def caller() -> int:
        s = 0
        for _ in range(rounds):
            s += await call()
        return s

    gc.collect()
    c0, w0 = time.process_time(), time.perf_counter()
    sums = await asyncio.gather(*(caller() for _ in range(n)))
    cpu, wall = time.process_time() - c0, time.perf_counter() - w0
    if any(s != rounds for s in sums):
        raise RuntimeError("a call failed")
    return cpu * 1e6 / (n * rounds), wall


async def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--levels", default="1,1000,10000,40000", help="tasks in flight, comma-separated")
    ap.add_argument("--rounds", type=int, default=20, help="calls per task (levels above 1)")
    ap.add_argument("--single", type=int, default=400, help="calls of the single task (level 1)")
    ap.add_argument("--wait-ms", type=float, default=5.0)
    args = ap.parse_args()
    wait = args.wait_ms / 1000

    async def work() -> int:
        await asyncio.sleep(wait)
        return 1

    engine = levee.Engine(POLICY, seed=1)
    contenders: dict[str, Callable[[], Awaitable[int]]] = {
        "levee": engine.policy("bench")(work),
        "tenacity": tenacity.retry(
            stop=tenacity.stop_after_attempt(3),
            wait=tenacity.wait_exponential_jitter(multiplier=0.1, max=2),
            retry=tenacity.retry_if_exception_type(ConnectionError),
            reraise=True,
        )(work),
        "stamina": stamina.retry(on=ConnectionError, attempts=3, wait_initial=0.1, wait_max=2.0)(work),
    }
    for call in contenders.values():  # warm up
        await level(call, 10, 10)
    wt = importlib.metadata.version("wasmtime")
    print(f"# levee {levee.__version__}, wasmtime-py {wt}, Python {platform.python_version()}, {args.wait_ms} ms wait")
    print(f"{'in flight':10s} {'contender':10s} {'calls':>8s} {'wall s':>8s} {'CPU us/call':>12s} {'levee/this':>10s}")
    for n in (int(x) for x in args.levels.split(",")):
        rounds = args.single if n == 1 else args.rounds
        first = 0.0
        for name, call in contenders.items():
            cpu_us, wall = await level(call, n, rounds)
            first = first or cpu_us
            print(f"{n:<10d} {name:10s} {n * rounds:8d} {wall:8.2f} {cpu_us:12.2f} {first / cpu_us:10.2f}")
    engine.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))

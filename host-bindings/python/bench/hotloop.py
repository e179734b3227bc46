"""The loop docs/perf/python.md counts instructions of: N first-time successes of a decorated
function under `bench.py`'s policy. Run it under callgrind for N = 1000 and 11000 and divide the
difference by 10000 (the import, the load and the loop's set-up cancel out):

    valgrind --tool=callgrind .venv/bin/python bench/hotloop.py sync 11000

With a directory as the third argument, `levee` is imported from there (a copy of another
version's `src/levee`, to compare two versions on one component)."""

from __future__ import annotations

import asyncio
import sys

if len(sys.argv) > 3:
    sys.path.insert(0, sys.argv[3])

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


def main() -> None:
    mode, n = sys.argv[1], int(sys.argv[2])
    pol = levee.Engine(POLICY, seed=1).policy("bench")
    if mode == "sync":

        @pol
        def work() -> int:
            return 1

        for _ in range(n):
            work()
        return

    @pol
    async def awork() -> int:
        return 1

    async def run() -> None:
        for _ in range(n):
            await awork()

    asyncio.run(run())


if __name__ == "__main__":
    main()

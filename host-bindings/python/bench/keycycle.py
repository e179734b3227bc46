"""What a keyed call costs when the caller cycles over 1,000 keys of an N-key table rather than
calling one key (issue 41's calls ratio), for instruction counts: fills max(N, 1000) keys (k0,
k1, ...) with a success each, then makes CALLS calls over one key (`one`) or k0..k999 (`cycle`).
Run under callgrind with CALLS = 0 and CALLS > 0; the difference divided by CALLS is one call's
instructions and cache misses (docs/performance.md, "Python's calls ratio, in turns"):

    valgrind --tool=callgrind --cache-sim=yes --smc-check=all python bench/keycycle.py cycle 100000 20000
"""

from __future__ import annotations

import sys

from snapshot import POLICY  # the policy of the snapshot bench, whose ratio this explains

import levee


def main() -> None:
    if len(sys.argv) != 4 or sys.argv[1] not in ("one", "cycle"):
        raise SystemExit("usage: keycycle.py one|cycle N CALLS")
    mode, n, calls = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    engine = levee.Engine(POLICY, seed=1, snapshot_interval=0)
    for i in range(max(n, 1000)):
        engine.policy("p", key=f"k{i}").call(int)
    keys = ["k0"] if mode == "one" else [f"k{i}" for i in range(1000)]
    handles = [engine.policy("p", key=k).call for k in keys]
    m = len(handles)
    for c in range(calls):
        handles[c % m](int)
    engine.close()


if __name__ == "__main__":
    main()

"""Durable calls per second: N calls submitted, then W worker processes run them to the end.

    python bench.py --store sqlite:/tmp/b.db --calls 2000 --workers 1 [--worker CMD]

CMD is the worker to time (default: worker.py with this Python; the Go, JS and Rust workers take
the same arguments). The calls are submitted by worker.py in every case: the rows are the same.
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def pending(store: str) -> int:
    kind, _, rest = store.partition(":")
    q = "SELECT COUNT(*) FROM levee_durable_calls WHERE status IN ('scheduled', 'running')"
    if kind == "sqlite":
        import sqlite3

        c = sqlite3.connect(rest)
        n = c.execute(q).fetchone()[0]
        c.close()
        return int(n)
    import psycopg

    with psycopg.connect(rest) as c:
        return int(c.execute(q).fetchone()[0])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--store", required=True)
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--worker", help="the worker command to time (default: worker.py)")
    ap.add_argument("--name", default="", help="what to call it in the output line")
    ap.add_argument("--concurrency", type=int, default=32, help="calls each worker runs at once")
    args = ap.parse_args()
    log = Path(tempfile.mkdtemp()) / "log"
    py = [sys.executable, str(HERE / "worker.py")]
    cmd = shlex.split(args.worker) if args.worker else py
    s0 = time.monotonic()
    subprocess.run([*py, args.store, "--log", str(log), "--owner", "submit", "--submit-only", "--scale", str(args.calls)],
                   check=True)
    submit = time.monotonic() - s0
    t0 = time.monotonic()
    w = [*cmd, args.store, "--log", str(log)]
    procs = [subprocess.Popen([*w, "--owner", f"bench{i}", "--concurrency", str(args.concurrency)]) for i in range(args.workers)]
    while pending(args.store) > 0 and time.monotonic() - t0 < 600:
        time.sleep(0.05)
    dt = time.monotonic() - t0
    for p in procs:
        p.terminate()
        p.wait(30)
    who = f"{args.name}, " if args.name else ""
    print(f"durable bench: {who}{args.store.partition(':')[0]}, {args.workers} worker(s): {args.calls} calls in {dt:.2f}s = "
          f"{args.calls / dt:.0f} calls/s (submitted by worker.py at {args.calls / submit:.0f} calls/s, a process start included)")


if __name__ == "__main__":
    main()

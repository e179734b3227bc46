"""A durable worker process for the crash tests (durable/tests/run.sh).

    python worker.py STORE --owner NAME --log FILE [--submit HANDLER[:KEY]]... [--die-after-outcome]
                     [--until-idle] [--scale N]

STORE is `sqlite:PATH` or `postgres:CONNINFO`. Handlers write one line per attempt start and
end to FILE (O_APPEND, one write per line): `start CALL ATTEMPT PID WALL_NS` and
`end CALL ATTEMPT PID WALL_NS RESULT`, which the harness reads to check what ran, when, where.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import time

import levee
from levee.durable import DurableContext, DurableExecutor, PostgresStore, SQLiteStore, Store
from levee.outcomes import Outcome

DOC = """
policies:
  flaky:
    attempts: 5
    attempt-timeout: 60s
    retry-on: [timeout, connection-error]
    backoff: { kind: constant, base: 3s, cap: 3s, jitter: none }
    durable: { lease: 2s, max-crashes: 3 }
  work:
    attempts: 10
    attempt-timeout: 10s
    backoff: { kind: exponential, base: 100ms, cap: 1s, jitter: full }
    durable: { lease: 2s, max-crashes: 5 }
"""


def store_of(spec: str) -> Store:
    kind, _, rest = spec.partition(":")
    if kind == "sqlite":
        return SQLiteStore(rest)
    if kind == "postgres":
        return PostgresStore(rest)
    raise SystemExit(f"unknown store {spec!r}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("store")
    ap.add_argument("--owner", required=True)
    ap.add_argument("--log", required=True)
    ap.add_argument("--submit", action="append", default=[])
    ap.add_argument("--die-after-outcome", action="store_true")
    ap.add_argument("--until-idle", action="store_true")
    ap.add_argument("--scale", type=int, default=0, help="submit N `work` calls")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--submit-only", action="store_true")
    args = ap.parse_args()

    fd = os.open(args.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def log(*parts: object) -> None:
        os.write(fd, (" ".join(str(p) for p in parts) + "\n").encode())

    def die_after(call_id: int, attempt: int, outcome: Outcome) -> None:
        log("outcome", call_id, attempt, os.getpid(), time.time_ns(), outcome.kind.value)
        os.kill(os.getpid(), signal.SIGKILL)  # between the outcome and its write

    ex = DurableExecutor(
        levee.loads(DOC),
        store_of(args.store),
        owner=args.owner,
        poll_interval=0.05,
        claim_hold=1.0,
        concurrency=args.concurrency,
        on_attempt_done=die_after if args.die_after_outcome else None,
    )

    async def flaky(payload: bytes, ctx: DurableContext) -> bytes:
        log("start", ctx.call_id, ctx.attempt, os.getpid(), time.time_ns())
        if ctx.attempt == 1:
            log("end", ctx.call_id, ctx.attempt, os.getpid(), time.time_ns(), "timeout")
            raise TimeoutError("the first attempt always times out")
        log("end", ctx.call_id, ctx.attempt, os.getpid(), time.time_ns(), "ok")
        return b"ok"

    async def slow(payload: bytes, ctx: DurableContext) -> bytes:
        log("start", ctx.call_id, ctx.attempt, os.getpid(), time.time_ns())
        await asyncio.sleep(float(payload or b"0") if ctx.attempt == 1 else 0.05)
        log("end", ctx.call_id, ctx.attempt, os.getpid(), time.time_ns(), "ok")
        return b"ok"

    async def work(payload: bytes, ctx: DurableContext) -> bytes:
        log("start", ctx.call_id, ctx.attempt, os.getpid(), time.time_ns())
        n = int(payload)
        await asyncio.sleep(0.001)
        if (n * 7 + ctx.attempt) % 10 == 0:  # about one call in ten fails once
            log("end", ctx.call_id, ctx.attempt, os.getpid(), time.time_ns(), "fail")
            raise ConnectionError("transient")
        if n % 1000 == 999:  # ten calls in 10,000 always fail with a non-retryable error
            log("end", ctx.call_id, ctx.attempt, os.getpid(), time.time_ns(), "fatal")
            raise ValueError(f"call {n} is refused")
        log("end", ctx.call_id, ctx.attempt, os.getpid(), time.time_ns(), "ok")
        return b"ok"

    ex.register("flaky", flaky, policy="flaky")
    ex.register("slow", slow, policy="flaky")
    ex.register("slow-bare", slow, policy="flaky", idempotent=False)
    ex.register("work", work, policy="work")

    for spec in args.submit:
        handler, _, rest = spec.partition(":")
        key, _, payload = rest.partition(":")
        cid = ex.submit(handler, payload.encode(), idempotency_key=key or None)
        log("submitted", cid, handler, key or "-", os.getpid(), time.time_ns())
    if args.scale:
        for i in range(args.scale):
            ex.submit("work", str(i).encode(), idempotency_key=f"work-{i}")
        log("submitted-scale", args.scale, os.getpid(), time.time_ns())
    log("ready", args.owner, os.getpid(), time.time_ns())
    if args.submit_only:
        return
    stop = asyncio.Event()

    async def run() -> None:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        await ex.run(stop=stop, until_idle=args.until_idle)

    asyncio.run(run())
    sys.exit(0)


if __name__ == "__main__":
    main()

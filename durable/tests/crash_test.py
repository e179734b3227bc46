"""Durable calls across real process deaths (SIGKILL), on SQLite and on PostgreSQL.

    python crash_test.py --store sqlite:/tmp/x.db   (or postgres:CONNINFO) [--scale 10000]
                         [--go GO_WORKER] [--node NODE_WORKER.mjs] [--rust RUST_WORKER]

Each case starts worker processes (worker.py, or the Go, JS and Rust workers that take the same
arguments and write the same log), kills one with SIGKILL at a chosen moment, starts another,
in the same language or another one, and checks from the handlers' log and the store what
happened. Bounded: every wait has a deadline; the script exits non-zero on the first broken
expectation.
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
S = 1_000_000_000


class Harness:
    def __init__(self, store: str, python: str, go: str | None, node: str | None, rust: str | None = None) -> None:
        self.store = store
        # the command of a worker, by language: every one takes worker.py's arguments
        self.cmds = {"py": [python, str(HERE / "worker.py")]}
        if go:
            self.cmds["go"] = [go]
        if node:
            self.cmds["js"] = ["node", node]
        if rust:
            self.cmds["rs"] = [rust]
        self.dir = Path(tempfile.mkdtemp(prefix="levee-durable-"))
        self.log = self.dir / "log"
        self.procs: list[subprocess.Popen[bytes]] = []
        self.n = 0

    def spawn(self, *args: str, lang: str = "py") -> subprocess.Popen[bytes]:
        self.n += 1
        cmd = [*self.cmds[lang], self.store, "--owner", f"w{self.n}-{lang}-{os.getpid()}", "--log", str(self.log), *args]
        with open(self.dir / f"w{self.n}-{lang}.err", "wb") as err:  # the child keeps its own descriptor
            p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err)
        self.procs.append(p)
        return p

    def lines(self) -> list[list[str]]:
        if not self.log.exists():
            return []
        return [ln.split() for ln in self.log.read_text().splitlines() if ln.strip()]

    def wait_line(self, pred, timeout: float, what: str) -> list[str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for ln in self.lines():
                if pred(ln):
                    return ln
            time.sleep(0.02)
        fail(f"timed out after {timeout}s waiting for {what}; log:\n" + self.log.read_text() if self.log.exists() else "")
        raise AssertionError

    def kill(self, p: subprocess.Popen[bytes]) -> None:
        p.send_signal(signal.SIGKILL)
        p.wait(10)

    def stop(self, p: subprocess.Popen[bytes]) -> None:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(10)

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)

    # the store, read directly (no levee code): status, attempts, error of a call
    def row(self, call: int) -> tuple[str, int, str | None]:
        kind, _, rest = self.store.partition(":")
        q = "SELECT status, attempts, error FROM levee_durable_calls WHERE id = "
        if kind == "sqlite":
            import sqlite3

            c = sqlite3.connect(rest)
            r = c.execute(q + "?", [call]).fetchone()
            c.close()
        else:
            import psycopg

            with psycopg.connect(rest) as c:
                r = c.execute(q + "%s", [call]).fetchone()
        assert r is not None, f"call {call} is not in the store"
        return str(r[0]), int(r[1]), r[2]

    def query(self, sql: str) -> list[tuple]:
        kind, _, rest = self.store.partition(":")
        if kind == "sqlite":
            import sqlite3

            c = sqlite3.connect(rest)
            out = c.execute(sql).fetchall()
            c.close()
            return out
        import psycopg

        with psycopg.connect(rest) as c:
            return list(c.execute(sql).fetchall())

    def wait_status(self, call: int, want: set[str], timeout: float) -> tuple[str, int, str | None]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            r = self.row(call)
            if r[0] in want:
                return r
            time.sleep(0.05)
        fail(f"call {call} is {self.row(call)} after {timeout}s, wanted {want}")
        raise AssertionError

    def submitted(self, p: subprocess.Popen[bytes], handler: str, key: str) -> int:
        ln = self.wait_line(lambda l: l[0] == "submitted" and l[2] == handler and l[3] == key and l[4] == str(p.pid),
                            30, f"submit {handler}")
        return int(ln[1])


def fail(msg: str) -> None:
    print(f"FAIL: {msg}", file=sys.stderr)
    sys.exit(1)


def check(cond: bool, msg: str) -> None:
    if not cond:
        fail(msg)
    print(f"  ok: {msg}")


NAMES = {"py": "Python", "go": "Go", "js": "JS", "rs": "Rust"}


def across(first: str, second: str) -> str:
    return f"{NAMES[first]} -> {NAMES[second]}"


def case_backoff(h: Harness, first: str = "py", second: str = "py") -> None:
    print(f"(a) killed during a backoff ({across(first, second)})")
    key = f"key-a-{first}-{second}"
    a = h.spawn("--submit", f"flaky:{key}", lang=first)
    cid = h.submitted(a, "flaky", key)
    end1 = h.wait_line(lambda l: l[:3] == ["end", str(cid), "1"], 30, "attempt 1 ends")
    time.sleep(0.5)
    h.kill(a)
    b = h.spawn(lang=second)
    start2 = h.wait_line(lambda l: l[:3] == ["start", str(cid), "2"], 30, "attempt 2 starts")
    ready = h.wait_line(lambda l: l[0] == "ready" and l[2] == str(b.pid), 30, "the new worker is ready")
    waited = (int(start2[4]) - int(end1[4])) / S
    late = (int(start2[4]) - max(int(end1[4]) + 3 * S, int(ready[3]))) / S
    check(waited >= 3.0 and late <= 1.0,
          f"attempt 2 ran at its scheduled time: {waited:.3f}s after attempt 1 (backoff 3s), "
          f"{late:.3f}s after it was due and the new worker was up")
    check(start2[3] == str(b.pid), f"attempt 2 ran in the new process ({NAMES[second]})")
    st = h.wait_status(cid, {"done"}, 10)
    check(st[:2] == ("done", 2), f"the call is done after 2 attempts: {st}")
    h.stop(b)


def case_attempt(h: Harness, first: str = "py", second: str = "py") -> None:
    print(f"(b) killed during an attempt ({across(first, second)})")
    key = f"key-b-{first}-{second}"
    a = h.spawn("--submit", f"slow:{key}:60", "--submit", "slow-bare::60", lang=first)
    keyed, bare = h.submitted(a, "slow", key), h.submitted(a, "slow-bare", "-")
    h.wait_line(lambda l: l[:3] == ["start", str(keyed), "1"], 30, "keyed attempt 1 starts")
    h.wait_line(lambda l: l[:3] == ["start", str(bare), "1"], 30, "bare attempt 1 starts")
    t_kill = time.time_ns()
    h.kill(a)
    b = h.spawn(lang=second)
    start2 = h.wait_line(lambda l: l[:3] == ["start", str(keyed), "2"], 30, "keyed attempt 2 starts")
    after = (int(start2[4]) - t_kill) / S
    check(after >= 3.0 and start2[3] == str(b.pid),
          f"the keyed call resumed at attempt 2 in the new process ({NAMES[second]}), {after:.2f}s after the kill "
          f"(lease 2s + backoff 3s)")
    st = h.wait_status(keyed, {"done"}, 10)
    check(st[:2] == ("done", 2), f"the keyed call is done: {st}")
    st = h.wait_status(bare, {"dead"}, 10)
    check(st[0] == "dead" and (st[2] or "").startswith("unknown-outcome"),
          f"the non-idempotent call without a key gave up with a clear reason: {st[2]}")
    check(not any(l[:3] == ["start", str(bare), "2"] for l in h.lines()), "the non-idempotent call never ran again")
    h.stop(b)


def case_live(h: Harness, first: str = "py", second: str = "py") -> None:
    print(f"(b') a live attempt is never taken over ({NAMES[first]} runs it, {NAMES[second]} polls)")
    key = f"key-c-{first}-{second}"
    a = h.spawn("--submit", f"slow:{key}:6", lang=first)
    cid = h.submitted(a, "slow", key)
    h.wait_line(lambda l: l[:3] == ["start", str(cid), "1"], 30, "attempt 1 starts")
    b = h.spawn(lang=second)
    h.wait_line(lambda l: l[:3] == ["end", str(cid), "1"], 30, "attempt 1 ends (6s, lease 2s renewed)")
    st = h.wait_status(cid, {"done"}, 10)
    starts = [l for l in h.lines() if l[:2] == ["start", str(cid)]]
    check(len(starts) == 1 and st[:2] == ("done", 1),
          f"the keyed call ran once, under a renewed lease, while another worker polled: {st}")
    h.stop(a)
    h.stop(b)


def case_outcome(h: Harness, first: str = "py", second: str = "py") -> None:
    print(f"(c) killed between an outcome and its write ({across(first, second)})")
    key = f"key-d-{first}-{second}"
    a = h.spawn("--submit", f"slow:{key}:0.1", "--die-after-outcome", lang=first)
    cid = h.submitted(a, "slow", key)
    h.wait_line(lambda l: l[:3] == ["outcome", str(cid), "1"], 30, "attempt 1's outcome")
    a.wait(10)
    check(a.returncode == -signal.SIGKILL, "the worker died before writing the outcome")
    st = h.row(cid)
    check(st[0] == "running", f"the store still says running: {st}")
    b = h.spawn(lang=second)
    start2 = h.wait_line(lambda l: l[:3] == ["start", str(cid), "2"], 30, "attempt 2 starts")
    st = h.wait_status(cid, {"done"}, 10)
    check(st[:2] == ("done", 2) and start2[3] == str(b.pid),
          f"the unknown outcome was retried as attempt 2 (idempotency key) by the new process: {st}")
    h.stop(b)


def case_scale(h: Harness, n: int, workers: int, budget: float) -> None:
    print(f"scale: {n} calls, {workers} workers killed at random")
    sub = h.spawn("--scale", str(n), "--submit-only")
    sub.wait(600)
    check(sub.returncode == 0, f"{n} calls submitted")
    rng = random.Random(17)
    langs = sorted(h.cmds, key=list(NAMES).index)  # the workers take turns: Python, Go, JS, Python, ...
    lang_of = [langs[i % len(langs)] for i in range(workers)]
    print(f"  workers: {', '.join(NAMES[l] for l in lang_of)} (a killed worker is replaced in its language)")
    live = [h.spawn("--concurrency", "32", lang=lang_of[i]) for i in range(workers)]
    t0 = time.monotonic()
    kills = 0
    # Three workers, chosen at random, are killed at random points of the run's progress (not
    # of the clock: a fast run must not end before its first kill).
    marks = sorted([rng.uniform(0.1, 0.3), rng.uniform(0.35, 0.55), rng.uniform(0.6, 0.8)])
    while time.monotonic() - t0 < budget:
        pending = h.query("SELECT COUNT(*) FROM levee_durable_calls WHERE handler = 'work' "
                          "AND status IN ('scheduled', 'running')")[0][0]
        if pending == 0:
            break
        if marks and 1 - pending / n >= marks[0]:
            marks.pop(0)
            i = rng.randrange(len(live))
            h.kill(live[i])
            kills += 1
            live[i] = h.spawn("--concurrency", "32", lang=lang_of[i])
        time.sleep(0.05)
    elapsed = time.monotonic() - t0
    for p in live:
        h.stop(p)
    counts = dict(h.query("SELECT status, COUNT(*) FROM levee_durable_calls WHERE handler = 'work' GROUP BY status"))
    reasons = h.query("SELECT error FROM levee_durable_calls WHERE handler = 'work' AND status = 'dead'")
    by_reason = collections.Counter((r[0] or "").split(":")[0] for r in reasons)
    ok_runs = collections.Counter(l[1] for l in h.lines() if l[0] == "end" and l[5] == "ok")
    dup = sum(1 for c in ok_runs.values() if c > 1)
    done, dead = counts.get("done", 0), counts.get("dead", 0)
    print(f"durable scale: {n} calls, {workers} workers, {kills} SIGKILLs, {elapsed:.1f}s: "
          f"{done} done, {dead} dead ({dict(by_reason)}), {counts.get('quarantined', 0)} quarantined, "
          f"{dup} calls whose handler succeeded more than once (at-least-once: a worker died between a "
          f"success and its write; these calls carry idempotency keys)")
    check(kills == 3, f"three workers were killed with SIGKILL mid-run ({kills})")
    check(done + dead == n, f"every call ended done or dead: {counts}")
    check(all(r[0] for r in reasons), "every dead call carries its reason")
    done_ids = h.query("SELECT id FROM levee_durable_calls WHERE handler = 'work' AND status = 'done'")
    check(all(ok_runs.get(str(i[0]), 0) >= 1 for i in done_ids),
          "every done call's handler succeeded")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--store", required=True)
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--go", help="the Go worker (host-bindings/go/durable/internal/testworker, built)")
    ap.add_argument("--node", help="the JS worker (durable/tests/worker.mjs)")
    ap.add_argument("--rust", help="the Rust worker (durable/tests/rust-worker, built: target/release/levee-durable-worker)")
    ap.add_argument("--scale", type=int, default=0)
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--budget", type=float, default=240.0)
    ap.add_argument("--cases", default="abcx")
    args = ap.parse_args()
    # SIGTERM (run.sh stopping a background run) unwinds through `finally`: the workers go too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
    h = Harness(args.store, args.python, args.go, args.node, args.rust)
    try:
        if "a" in args.cases:
            case_backoff(h)
        if "b" in args.cases:
            case_attempt(h)
            case_live(h)
        if "c" in args.cases:
            case_outcome(h)
        # across languages: the record a worker in one language wrote, resumed in another
        if args.go and "x" in args.cases:
            case_backoff(h, "py", "go")
            case_backoff(h, "go", "py")
            case_attempt(h, "py", "go")
            case_attempt(h, "go", "py")
            case_live(h, "go", "py")
            case_outcome(h, "go", "py")
        if args.node and "x" in args.cases:
            case_backoff(h, "js", "go")
            case_attempt(h, "go", "js")
            case_outcome(h, "js", "py")
            case_live(h, "js", "go")
        if args.rust and "x" in args.cases:
            case_backoff(h, "rs", "py")
            case_attempt(h, "py", "rs")
            case_outcome(h, "rs", "py")
            case_live(h, "rs", "py")
            if args.go:
                case_backoff(h, "go", "rs")
                case_attempt(h, "rs", "go")
            if args.node:
                case_outcome(h, "js", "rs")
        if args.scale:
            case_scale(h, args.scale, args.workers, args.budget)
    finally:
        h.close()
    print("durable crash tests passed")


if __name__ == "__main__":
    main()

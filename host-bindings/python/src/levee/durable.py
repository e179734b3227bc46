"""Durable calls: retries that survive a process restart.

```python
engine = levee.load("policies.yaml")
executor = DurableExecutor(engine, SQLiteStore("calls.db"))

@executor.handler("send-invoice", policy="email")
async def send_invoice(payload: bytes, ctx: DurableContext) -> bytes | None: ...

executor.submit("send-invoice", b'{"order": 17}', idempotency_key="invoice-17")
await executor.run()            # resumes what is due at start-up, then sleeps until the next
```

`submit(..., conn=...)` writes the call inside the caller's own transaction (the outbox
pattern: the call exists if and only if the caller's transaction commits):

```python
with sqlite3.connect("calls.db") as conn:   # psycopg.connect(...) for a PostgresStore
    conn.execute("INSERT INTO orders (id) VALUES (17)")
    executor.submit("send-invoice", b'{"order": 17}', idempotency_key="invoice-17", conn=conn)
# committed here (with the order); the executor runs it at its next poll at the latest
```

The executor is a driver, like the in-process call drivers: it asks the core
(`engine.durable_*`) at every step and does what the answer says. The core decides when a
call is due, what a record found after a crash means, whether to retry, and how long to wait;
the executor persists the record the core returns **before** each attempt and **after** each
outcome, through the shared statements of `durable/sqlite.sql` or `durable/postgres.sql`.

Every write is fenced by the row's holder (`lease_owner`): a process that lost a call (its
lease lapsed and another process took it, or an operator cancelled it) has its writes refused,
so it never records an outcome for a call it no longer holds. A record the core refuses
(corrupt, another version, a policy no longer loaded) is quarantined with the core's error.

See docs/durable.md for the guarantees (at-least-once; exactly-once effects only with
idempotency keys) and the clock rules.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import os
import re
import sqlite3
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .engine import Engine
from .errors import LeveeError
from .outcomes import Outcome, outcome_for_exception
from .types import DurableAction, DurableStep, LoadError

if TYPE_CHECKING:
    import psycopg

__all__ = [
    "CallStatus",
    "DurableContext",
    "DurableExecutor",
    "PostgresStore",
    "SQLiteStore",
    "Store",
    "statements",
]

_SQL_DIR_ENV = "LEVEE_DURABLE_SQL_DIR"
_STATUS = {
    DurableAction.RUN: "running",
    DurableAction.WAIT: "scheduled",
    DurableAction.DONE: "done",
    DurableAction.DEAD: "dead",
    DurableAction.CANCELLED: "cancelled",
}


def _sql_dir() -> Path:
    env = os.environ.get(_SQL_DIR_ENV)
    if env:
        return Path(env)
    packaged = Path(__file__).resolve().parent / "_sql"
    if packaged.is_dir():
        return packaged
    return Path(__file__).resolve().parents[4] / "durable"


def statements(dialect: str) -> dict[str, str]:
    """The shared statements of a dialect (`sqlite` or `postgres`), by name."""
    text = (_sql_dir() / f"{dialect}.sql").read_text(encoding="utf-8")
    out: dict[str, str] = {}
    for block in re.split(r"^-- name: ", text, flags=re.M)[1:]:
        name, _, body = block.partition("\n")
        out[name.strip()] = body.strip()
    return out


@dataclass(frozen=True, slots=True)
class Claimed:
    """A call this process has just claimed."""

    id: int
    handler: str
    payload: bytes
    record: bytes
    db_now: int
    idempotency_key: str | None

    @staticmethod
    def of_row(r: _Row) -> Claimed:
        """A row of the shared `claim` statement (the same columns in both dialects)."""
        return Claimed(int(r[0]), str(r[1]), bytes(r[2]), bytes(r[3]), int(r[4]), r[5])


@dataclass(frozen=True, slots=True)
class CallStatus:
    """What the store holds for a call; `record` is the core's description (canonical JSON
    decoded), or `None` for a record the core cannot read (then `error` says why)."""

    id: int
    handler: str
    status: str
    next_at: int
    attempts: int
    lease_owner: str | None
    idempotency_key: str | None
    error: str | None
    result: bytes | None
    record: dict[str, Any] | None


_Row = tuple[Any, ...]


class Store:
    """The statements of one dialect on one connection. Not thread-safe: one per executor.

    `now` and `insert` also take a caller's connection (`conn`) on the same database, checked
    once by `_theirs`: the statements then run on it, inside the caller's transaction, and
    nothing is committed."""

    dialect = ""

    def now(self, conn: Any = None) -> int:
        """The store's wall clock, ns since the Unix epoch (read on `conn` when given)."""
        raise NotImplementedError

    def _exec(self, name: str, params: Sequence[Any], conn: Any = None) -> list[_Row]:
        """Rows of a named statement, as tuples, on `conn` (as `_theirs` returned it) or the store's own."""
        raise NotImplementedError

    def _theirs(self, conn: object) -> Any:
        """The caller's connection, once checked to be of the kind (and database) this store
        uses; a TypeError naming `conn` otherwise."""
        raise NotImplementedError

    def transaction(self) -> contextlib.AbstractContextManager[None]:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def insert(
        self,
        handler: str,
        payload: bytes,
        idempotency_key: str | None,
        next_at: int,
        record: bytes,
        conn: Any = None,
    ) -> int:
        """Insert a call (or find the one holding `idempotency_key`) and return its id: in a
        transaction of the store's own connection, or on the caller's `conn` inside the
        caller's transaction, which the caller commits or rolls back."""
        if conn is None:
            with self.transaction():
                rows = self._insert_or_find(handler, payload, idempotency_key, next_at, record, None)
        else:
            rows = self._insert_or_find(handler, payload, idempotency_key, next_at, record, conn)
        if not rows:
            raise LeveeError("the store did not accept the call")
        return int(rows[0][0])

    def _insert_or_find(
        self, handler: str, payload: bytes, key: str | None, next_at: int, record: bytes, conn: Any
    ) -> list[_Row]:
        rows = self._insert(handler, payload, key, next_at, record, conn)
        if not rows and key is not None:
            rows = self._exec("find_by_key", [key], conn)
        return rows

    def _insert(
        self, handler: str, payload: bytes, key: str | None, next_at: int, record: bytes, conn: Any = None
    ) -> list[_Row]:
        raise NotImplementedError

    def claim(self, owner: str, hold: int, limit: int) -> list[Claimed]:
        raise NotImplementedError

    def write(
        self,
        call_id: int,
        owner: str,
        status: str,
        next_at: int,
        attempts: int,
        lease_owner: str | None,
        record: bytes,
        result: bytes | None,
        error: str | None,
    ) -> bool:
        """A fenced write: False when this process no longer holds the call."""
        raise NotImplementedError

    def quarantine(self, call_id: int, error: str) -> None:
        raise NotImplementedError

    def replace(
        self, call_id: int, status: str, next_at: int, attempts: int, record: bytes, error: str | None, old: bytes
    ) -> bool:
        raise NotImplementedError

    def get(self, call_id: int) -> _Row | None:
        rows = self._exec("get", [call_id])
        return rows[0] if rows else None

    def rows(self, dead_only: bool = False) -> list[_Row]:
        return self._exec("list_dead" if dead_only else "list", [])

    def next_due_in(self) -> int | None:
        raise NotImplementedError

    def counts(self) -> dict[str, int]:
        return {str(s): int(n) for s, n in self._exec("counts", [])}


class SQLiteStore(Store):
    """A store in one SQLite file (WAL mode), for one machine; its clock is this host's."""

    dialect = "sqlite"

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.sql = statements("sqlite")
        self.conn = sqlite3.connect(os.fspath(path), isolation_level=None, timeout=30.0, check_same_thread=False)
        self.conn.execute("PRAGMA journal_mode=WAL")
        self.conn.execute("PRAGMA synchronous=NORMAL")
        self.conn.execute("PRAGMA busy_timeout=30000")
        self.conn.executescript(self.sql["schema"])
        self._file = _main_file(self.conn)

    def now(self, conn: Any = None) -> int:
        return time.time_ns()  # this host's clock, whichever connection writes

    def _exec(self, name: str, params: Sequence[Any], conn: Any = None) -> list[_Row]:
        cur = (self.conn if conn is None else conn).cursor()
        cur.row_factory = None  # tuples, whatever the caller's connection's row_factory
        return cur.execute(self.sql[name], list(params)).fetchall()

    def _theirs(self, conn: object) -> sqlite3.Connection:
        if not isinstance(conn, sqlite3.Connection):
            raise TypeError(f"conn: an SQLite store takes a sqlite3.Connection on its file, not {_kind(conn)}")
        theirs = _main_file(conn)
        try:
            same = bool(theirs and self._file) and os.path.samefile(theirs, self._file)
        except OSError:
            same = False
        if not same:
            raise LeveeError(
                f"conn: the connection is on {theirs or 'an in-memory database'!r}, "
                f"not on the store's file {self._file or 'in memory'!r}"
            )
        return conn

    @contextlib.contextmanager
    def transaction(self) -> Any:
        self.conn.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            self.conn.execute("ROLLBACK")
            raise
        self.conn.execute("COMMIT")

    def close(self) -> None:
        self.conn.close()

    def _insert(
        self, handler: str, payload: bytes, key: str | None, next_at: int, record: bytes, conn: Any = None
    ) -> list[_Row]:
        return self._exec("insert", [handler, payload, key, next_at, record, self.now()], conn)

    def claim(self, owner: str, hold: int, limit: int) -> list[Claimed]:
        now = self.now()
        with self.transaction():
            rows = self._exec("claim", [owner, now + hold, now, limit])
        return [Claimed.of_row(r) for r in rows]

    def write(
        self,
        call_id: int,
        owner: str,
        status: str,
        next_at: int,
        attempts: int,
        lease_owner: str | None,
        record: bytes,
        result: bytes | None,
        error: str | None,
    ) -> bool:
        cur = self.conn.execute(
            self.sql["write"],
            [status, next_at, attempts, lease_owner, record, result, error, self.now(), call_id, owner],
        )
        return cur.rowcount == 1

    def quarantine(self, call_id: int, error: str) -> None:
        self._exec("quarantine", [error, self.now(), call_id])

    def replace(
        self, call_id: int, status: str, next_at: int, attempts: int, record: bytes, error: str | None, old: bytes
    ) -> bool:
        cur = self.conn.execute(
            self.sql["replace"], [status, next_at, attempts, record, error, self.now(), call_id, old]
        )
        return cur.rowcount == 1

    def next_due_in(self) -> int | None:
        rows = self._exec("next_due", [])
        if not rows or rows[0][0] is None:
            return None
        return int(rows[0][0]) - self.now()


class PostgresStore(Store):
    """A store in PostgreSQL, shared by processes on several machines. The database's
    `now()` is the one clock; claims skip rows other workers hold (`FOR UPDATE SKIP LOCKED`)."""

    dialect = "postgres"

    def __init__(self, conninfo: str) -> None:
        import psycopg  # an optional dependency: pip install levee[postgres]

        self.sql = {k: re.sub(r"\$(\d+)", r"%(p\1)s", v) for k, v in statements("postgres").items()}
        self.conn = psycopg.connect(conninfo, autocommit=True)
        with self.conn.cursor() as cur:
            cur.execute("SELECT pg_advisory_lock(7467001)")  # one schema creation at a time
            cur.execute(self.sql["schema"])
            cur.execute("SELECT pg_advisory_unlock(7467001)")

    def now(self, conn: Any = None) -> int:
        return int(self._exec("clock", [], conn)[0][0])

    def _exec(self, name: str, params: Sequence[Any], conn: Any = None) -> list[_Row]:
        from psycopg.rows import tuple_row

        args = {f"p{i + 1}": v for i, v in enumerate(params)}
        # tuples, whatever the caller's connection's row_factory
        with (self.conn if conn is None else conn).cursor(row_factory=tuple_row) as cur:
            cur.execute(self.sql[name], args)
            return list(cur.fetchall()) if cur.description else []

    def _theirs(self, conn: object) -> psycopg.Connection[Any]:
        import psycopg

        if not isinstance(conn, psycopg.Connection):
            raise TypeError(
                f"conn: a PostgreSQL store takes a psycopg.Connection (synchronous) on its database, not {_kind(conn)}"
            )
        return conn

    def _rowcount(self, name: str, params: Sequence[Any]) -> int:
        args = {f"p{i + 1}": v for i, v in enumerate(params)}
        with self.conn.cursor() as cur:
            cur.execute(self.sql[name], args)
            return int(cur.rowcount)

    def transaction(self) -> Any:
        return self.conn.transaction()

    def close(self) -> None:
        self.conn.close()

    def _insert(
        self, handler: str, payload: bytes, key: str | None, next_at: int, record: bytes, conn: Any = None
    ) -> list[_Row]:
        return self._exec("insert", [handler, payload, key, next_at, record], conn)

    def claim(self, owner: str, hold: int, limit: int) -> list[Claimed]:
        rows = self._exec("claim", [owner, hold, limit])
        return [Claimed.of_row(r) for r in rows]

    def write(
        self,
        call_id: int,
        owner: str,
        status: str,
        next_at: int,
        attempts: int,
        lease_owner: str | None,
        record: bytes,
        result: bytes | None,
        error: str | None,
    ) -> bool:
        n = self._rowcount("write", [status, next_at, attempts, lease_owner, record, result, error, call_id, owner])
        return n == 1

    def quarantine(self, call_id: int, error: str) -> None:
        self._rowcount("quarantine", [error, call_id])

    def replace(
        self, call_id: int, status: str, next_at: int, attempts: int, record: bytes, error: str | None, old: bytes
    ) -> bool:
        return self._rowcount("replace", [status, next_at, attempts, record, error, call_id, old]) == 1

    def next_due_in(self) -> int | None:
        rows = self._exec("next_due", [])
        if not rows or rows[0][0] is None:
            return None
        return int(rows[0][0])


def _main_file(conn: sqlite3.Connection) -> str:
    """The file of a connection's main database ('' in memory)."""
    cur = conn.cursor()
    cur.row_factory = None  # tuples, whatever the caller's connection's row_factory
    for _, name, file in cur.execute("PRAGMA database_list").fetchall():
        if name == "main":
            return str(file or "")
    return ""


def _kind(conn: object) -> str:
    t = type(conn)
    return f"{t.__module__}.{t.__qualname__}"


@dataclass(frozen=True, slots=True)
class DurableContext:
    """What a handler knows of the attempt it runs."""

    call_id: int
    attempt: int
    idempotency_key: str | None
    timeout: float | None


Handler = Callable[[bytes, DurableContext], Awaitable[bytes | None] | bytes | None]


@dataclass(frozen=True, slots=True)
class _Registered:
    fn: Handler
    policy: str
    idempotent: bool


class _Lost(Exception):
    """This process no longer holds the call (a fenced write was refused)."""


def _describe(err: LoadError) -> str:
    return f"{err.path}: {err.message}" if err.path else err.message


class DurableExecutor:
    """Runs durable calls from a store: at most one process at a time per call, under a lease.

    `owner` names this process in leases (default: host, pid and a random suffix; it must be
    unique per process). `concurrency` bounds the calls this process runs at once.
    `claim_hold` is how long a claim keeps calls out of other processes' due window before
    the core's answer is written (milliseconds later): a process that dies right after claiming
    delays its claimed calls by that much. `on_attempt_done(call_id, attempt, outcome)` is called
    after an attempt's outcome is known and before it is persisted (for metrics; the crash
    tests kill the process there).
    """

    def __init__(
        self,
        engine: Engine,
        store: Store,
        *,
        owner: str | None = None,
        concurrency: int = 16,
        poll_interval: float = 1.0,
        claim_hold: float = 5.0,
        on_attempt_done: Callable[[int, int, Outcome], None] | None = None,
    ) -> None:
        self.engine = engine
        self.store = store
        self.owner = owner or f"{os.uname().nodename}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.concurrency = max(1, concurrency)
        self.poll_interval = poll_interval
        self.claim_hold = int(claim_hold * 1e9)
        self.on_attempt_done = on_attempt_done
        self._handlers: dict[str, _Registered] = {}
        self._wake = asyncio.Event()
        self._running: set[asyncio.Task[None]] = set()
        self._store_lock = asyncio.Lock()

    # ------------------------------------------------------------ registration

    def register(self, name: str, fn: Handler, *, policy: str | None = None, idempotent: bool = True) -> None:
        """Register a handler under `name`, run under `policy` (default: the handler's name).
        `idempotent=False`: a call without an idempotency key is not retried after a failure
        or a crash (its outcome is unknown)."""
        self.engine.policy_info(policy or name)  # raises UnknownPolicy now, not at run time
        self._handlers[name] = _Registered(fn, policy or name, idempotent)

    def handler(self, name: str, *, policy: str | None = None, idempotent: bool = True) -> Callable[[Handler], Handler]:
        def deco(fn: Handler) -> Handler:
            self.register(name, fn, policy=policy, idempotent=idempotent)
            return fn

        return deco

    # ------------------------------------------------------------ submission and inspection

    def submit(
        self,
        handler: str,
        payload: bytes,
        *,
        idempotency_key: str | None = None,
        key: str = "",
        conn: sqlite3.Connection | psycopg.Connection[Any] | None = None,
    ) -> int:
        """Persist a new call and return its id. A second submission with the same
        idempotency key returns the first call's id and adds nothing.

        `conn`: submit inside your own transaction (the outbox pattern). The call is written
        on `conn` and not committed: it exists once you commit, with the rest of your
        transaction, and never if you roll back. A PostgreSQL store takes a `psycopg.Connection`
        on its database; an SQLite store a `sqlite3.Connection` on its file (a connection of
        another kind is a TypeError naming `conn`). A committed call is run at the executor's
        next poll (`poll_interval`) at the latest. Without `conn`, the call is committed
        on the executor's own connection before `submit` returns."""
        reg = self._handlers.get(handler)
        if reg is None:
            raise LeveeError(f"no durable handler named `{handler}` is registered")
        flags = 0 if reg.idempotent else 1
        theirs = None if conn is None else self.store._theirs(conn)  # checked once, before any statement
        now = self.store.now(theirs)
        step = self.engine.durable_begin(reg.policy, key, idempotency_key or "", flags, now)
        if isinstance(step, LoadError):
            raise LeveeError(_describe(step))
        call_id = self.store.insert(handler, bytes(payload), idempotency_key, step.next_at, step.record, theirs)
        if conn is None:
            self._wake.set()  # (a call in the caller's transaction is not visible before its commit)
        return call_id

    def status(self, call_id: int) -> CallStatus | None:
        row = self.store.get(call_id)
        return None if row is None else self._status(row)

    def calls(self) -> list[CallStatus]:
        return [self._status(r) for r in self.store.rows()]

    def dead(self) -> list[CallStatus]:
        """Calls given up (and quarantined records), with their last error."""
        return [self._status(r) for r in self.store.rows(dead_only=True)]

    def _status(self, row: _Row) -> CallStatus:
        cid, handler, status, next_at, attempts, owner, record, result, error, key = row
        described = self.engine.durable_inspect(bytes(record))
        rec = None if isinstance(described, LoadError) else json.loads(described)
        return CallStatus(
            int(cid),
            str(handler),
            str(status),
            int(next_at),
            int(attempts),
            owner,
            key,
            error,
            None if result is None else bytes(result),
            rec,
        )

    def cancel(self, call_id: int) -> bool:
        """Cancel a call that has not finished. An attempt running now may still complete;
        its outcome is then refused. False when the call is unknown or already finished."""
        return self._operator(call_id, lambda rec, now: self.engine.durable_cancel(rec, now))

    def retry(self, call_id: int) -> bool:
        """Give a dead or cancelled call a fresh set of attempts, due now."""
        ok = self._operator(call_id, lambda rec, now: self.engine.durable_revive(rec, now))
        self._wake.set()
        return ok

    def _operator(self, call_id: int, op: Callable[[bytes, int], DurableStep | LoadError]) -> bool:
        for _ in range(10):  # compare-and-set against concurrent writers
            row = self.store.get(call_id)
            if row is None:
                return False
            old = bytes(row[6])
            step = op(old, self.store.now())
            if isinstance(step, LoadError):
                return False
            err = None if step.action != DurableAction.CANCELLED else "cancelled by an operator"
            if self.store.replace(call_id, _STATUS[step.action], step.next_at, step.attempt, step.record, err, old):
                return True
        return False

    # ------------------------------------------------------------ running

    async def run(self, *, stop: asyncio.Event | None = None, until_idle: bool = False) -> None:
        """Claim and run due calls until `stop` is set (or, with `until_idle`, until no call
        is pending). Calls found due at start-up, including ones cut off by a crash once their
        lease lapses, are resumed first."""
        stop = stop or asyncio.Event()
        try:
            while not stop.is_set():
                free = self.concurrency - len(self._running)
                claimed: list[Claimed] = []
                # The records' last-seen becomes the claim's db_now, read while the statement
                # runs: the monotonic clock counts from before it, so that the time the claim
                # takes to return never shortens a wait (a retry may start late, never early).
                got = time.monotonic_ns()
                if free > 0:
                    async with self._store_lock:
                        claimed = self.store.claim(self.owner, self.claim_hold, free)
                for c in claimed:
                    task = asyncio.create_task(self._drive(c, got))
                    self._running.add(task)
                    task.add_done_callback(self._done)
                if claimed and len(self._running) < self.concurrency:
                    continue
                async with self._store_lock:
                    due_in = self.store.next_due_in()
                if until_idle and due_in is None and not self._running:
                    return
                timeout = self.poll_interval if due_in is None else min(self.poll_interval, max(due_in, 0) / 1e9)
                self._wake.clear()
                waiters = [asyncio.create_task(self._wake.wait()), asyncio.create_task(stop.wait())]
                _, pending = await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
                for p in pending:
                    p.cancel()
        finally:
            for t in list(self._running):
                t.cancel()
            if self._running:
                await asyncio.gather(*self._running, return_exceptions=True)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._running.discard(task)
        self._wake.set()

    async def _write(self, c: Claimed, step: DurableStep, result: bytes | None = None) -> None:
        status = _STATUS[step.action]
        holder = self.owner if step.action == DurableAction.RUN else None
        error = None
        if step.action == DurableAction.DEAD:
            error = self._dead_reason(step)
        async with self._store_lock:
            ok = self.store.write(
                c.id, self.owner, status, step.next_at, step.attempt, holder, step.record, result, error
            )
        if not ok:
            raise _Lost

    def _dead_reason(self, step: DurableStep) -> str:
        described = self.engine.durable_inspect(step.record)
        if isinstance(described, LoadError):
            return step.reason.value
        last = json.loads(described).get("last-error") or {}
        return (
            f"{step.reason.value}: attempt {last.get('attempt', 0)} failed with "
            f"`{last.get('class', '')}`: {last.get('message', '')}"
        )

    async def _drive(self, c: Claimed, claimed_at: int) -> None:
        try:
            reg = self._handlers.get(c.handler)
            if reg is None:
                async with self._store_lock:
                    self.store.quarantine(c.id, f"handler: no durable handler named `{c.handler}` is registered")
                return
            step = self.engine.durable_step(c.record, self.owner, c.db_now, 0)
            if isinstance(step, LoadError):
                async with self._store_lock:
                    self.store.quarantine(c.id, _describe(step))
                return
            await self._write(c, step)  # before the attempt
            if step.action != DurableAction.RUN:
                return  # a wait: the call is due again at next_at, for whichever process
            # the monotonic clock counts from the claim (whose db_now the record's last-seen is),
            # not from after the write above, which would shorten the backoff by the write's time
            record, got, result, outcome, message = await self._attempt(c, reg, step, claimed_at)
            if self.on_attempt_done is not None:
                self.on_attempt_done(c.id, step.attempt, outcome)
            # After the claim only the monotonic clock counts: the core works at
            # max(claim's wall time, last seen + monotonic time since it gave these bytes).
            after = self.engine.durable_outcome(
                record, self.owner, c.db_now, time.monotonic_ns() - got, outcome, message
            )
            if isinstance(after, LoadError):
                async with self._store_lock:
                    self.store.quarantine(c.id, _describe(after))
                return
            await self._write(c, after, result if after.action == DurableAction.DONE else None)
        except _Lost:
            return  # another process (or an operator) holds the call now: nothing to record
        except LeveeError as e:
            # the engine faulted: leave the call to be resumed when its claim lapses
            _log(f"levee durable: call {c.id}: {e}")

    async def _attempt(
        self, c: Claimed, reg: _Registered, step: DurableStep, got: int
    ) -> tuple[bytes, int, bytes | None, Outcome, str]:
        """Run the handler under the attempt's timeout, renewing the lease every third of it.
        `got` is the monotonic time of the claim (the record's last-seen). Returns the latest record
        (renewals change it) and the monotonic time the core gave it, the result, the outcome
        and the error's message."""
        timeout = step.timeout / 1e9 if step.timeout else None
        ctx = DurableContext(c.id, step.attempt, c.idempotency_key, timeout)
        current = step
        lost = asyncio.Event()

        async def renew() -> None:
            # A renewal the fence refuses (lost) or the core refuses ends the attempt; one the
            # store fails is tried again at the next tick while the lease lasts, then ends it.
            nonlocal current, got
            lease = step.lease_until - c.db_now  # the policy's lease, as the core granted it
            while True:
                await asyncio.sleep(max(0.05, lease / 3e9))
                asked = time.monotonic_ns()  # the renewed record's last-seen is this moment
                r = self.engine.durable_renew(current.record, self.owner, c.db_now, asked - got)
                if isinstance(r, LoadError):
                    lost.set()
                    return
                try:
                    await self._write(c, r)
                except _Lost:
                    lost.set()
                    return
                except Exception as e:  # the store: tried again, unless the lease has run out
                    if time.monotonic_ns() >= got + lease:
                        _log(f"levee durable: call {c.id}: renewing a lease: {e}; the lease ran out")
                        lost.set()
                        return
                    _log(f"levee durable: call {c.id}: renewing a lease: {e}")
                    continue
                got, current = asked, r

        renewer = asyncio.create_task(renew())
        work = asyncio.ensure_future(_call(reg.fn, c.payload, ctx))
        lost_wait = asyncio.create_task(lost.wait())
        try:
            done, _ = await asyncio.wait({work, lost_wait}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            if lost_wait in done:
                work.cancel()
                raise _Lost
            if work not in done:
                work.cancel()
                return current.record, got, None, Outcome.timeout(), "the attempt timed out"
            exc = work.exception()
            if exc is not None:
                return current.record, got, None, outcome_for_exception(exc), str(exc)[:4096]
            return current.record, got, work.result(), Outcome.success(), ""
        finally:
            renewer.cancel()
            lost_wait.cancel()
            with contextlib.suppress(asyncio.CancelledError, _Lost):
                await renewer


async def _call(fn: Handler, payload: bytes, ctx: DurableContext) -> bytes | None:
    if inspect.iscoroutinefunction(fn):
        out = await fn(payload, ctx)
    else:
        out = await asyncio.to_thread(fn, payload, ctx)
        if inspect.isawaitable(out):
            out = await out
    if out is not None and not isinstance(out, (bytes, bytearray, memoryview)):
        raise TypeError(f"a durable handler returns bytes or None, not {type(out).__name__}")
    return None if out is None else bytes(out)


def _log(msg: str) -> None:
    import sys

    print(msg, file=sys.stderr)

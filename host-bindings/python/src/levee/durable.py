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
import collections
import contextlib
import inspect
import json
import logging
import os
import re
import sqlite3
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ._constants import DURABLE_OPERATOR_TRIES, REPORT_OVERLOADED
from ._runtime import ExecutorGone, ExecutorRef
from .engine import Engine
from .errors import LeveeError
from .outcomes import Outcome, outcome_for_exception
from .types import (
    ClaimedCall,
    ExecAbandon,
    ExecClaim,
    ExecClaimed,
    ExecClaimFailed,
    ExecCommand,
    ExecDueIn,
    ExecEvent,
    ExecFinished,
    ExecIdle,
    ExecLog,
    ExecNextDue,
    ExecPoll,
    ExecQuarantine,
    ExecRenew,
    ExecRun,
    ExecSleep,
    ExecutorConfig,
    ExecWritten,
    LoadError,
    RowWrite,
    WriteFailed,
)

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
_logger = logging.getLogger("levee.durable")


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


def _describe(err: LoadError) -> str:
    return f"{err.path}: {err.message}" if err.path else err.message


class DurableExecutor:
    """Runs durable calls from a store: at most one process at a time per call, under a lease.

    `owner` names this process in leases (default: host, pid and a random suffix; it must be
    unique per process). `concurrency` bounds the calls this process runs at once.
    `poll_interval` (seconds) is the longest sleep between two looks at the store: calls other
    processes submit are seen within it. `claim_hold` (seconds) is how long a claim keeps calls
    out of other processes' due window before the core's answer is written (milliseconds
    later): a process that dies right after claiming delays its claimed calls by that much.
    Each left out (None) takes the core's default (docs/durable.md, "The executor").
    `on_attempt_done(call_id, attempt, outcome)` is called after an attempt's outcome is known
    and before it is persisted (for metrics; the crash tests kill the process there); what it
    raises is logged and changes nothing.

    The loop's decisions are the core's (the component's `executor` machine): this class feeds
    it what happened and carries out its commands with the store's statements, the handlers,
    asyncio's timers and cancellation, and the `levee.durable` logger.
    """

    def __init__(
        self,
        engine: Engine,
        store: Store,
        *,
        owner: str | None = None,
        concurrency: int | None = None,
        poll_interval: float | None = None,
        claim_hold: float | None = None,
        on_attempt_done: Callable[[int, int, Outcome], None] | None = None,
    ) -> None:
        self.engine = engine
        self.store = store
        self.owner = owner or f"{os.uname().nodename}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.concurrency = concurrency
        self.poll_interval = poll_interval
        self.claim_hold = claim_hold
        self.on_attempt_done = on_attempt_done
        self._handlers: dict[str, _Registered] = {}
        self._wake = asyncio.Event()
        self._loops: set[_Loop] = set()

    # ------------------------------------------------------------ registration

    def register(self, name: str, fn: Handler, *, policy: str | None = None, idempotent: bool = True) -> None:
        """Register a handler under `name`, run under `policy` (default: the handler's name).
        `idempotent=False`: a call without an idempotency key is not retried after a failure
        or a crash (its outcome is unknown)."""
        self.engine.policy_info(policy or name)  # raises UnknownPolicy now, not at run time
        self._handlers[name] = _Registered(fn, policy or name, idempotent)
        for loop in self._loops:  # a handler registered while `run()` runs
            with contextlib.suppress(ExecutorGone):  # (a machine made again registers them all)
                self.engine._executor_register(loop.machine, name)

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
        return self._operator(call_id, revive=False)

    def retry(self, call_id: int) -> bool:
        """Give a dead or cancelled call a fresh set of attempts, due now."""
        ok = self._operator(call_id, revive=True)
        self._wake.set()
        return ok

    def _operator(self, call_id: int, *, revive: bool) -> bool:
        """What the core says an operator's cancel or retry writes, compare-and-set against the
        record read, tried again against concurrent writers."""
        for _ in range(DURABLE_OPERATOR_TRIES):
            row = self.store.get(call_id)
            if row is None:
                return False
            old = bytes(row[6])
            w = self.engine._executor_operator(call_id, old, revive, self.store.now())
            if isinstance(w, LoadError):
                return False  # finished already, or a record the core cannot use: not changed
            if self.store.replace(call_id, w.status, w.next_at, w.attempts, w.record, w.error, old):
                return True
        return False

    # ------------------------------------------------------------ running

    async def run(self, *, stop: asyncio.Event | None = None, until_idle: bool = False) -> None:
        """Claim and run due calls until `stop` is set (or, with `until_idle`, until no call
        is pending). Calls found due at start-up, including ones cut off by a crash once their
        lease lapses, are resumed first."""
        config = ExecutorConfig(
            owner=self.owner,
            concurrency=max(0, self.concurrency or 0),
            poll=_ns(self.poll_interval),
            claim_hold=_ns(self.claim_hold),
            until_idle=until_idle,
        )
        loop = _Loop(self, config)
        self._loops.add(loop)
        try:
            await loop.run(stop or asyncio.Event())
        finally:
            self._loops.discard(loop)


def _ns(seconds: float | None) -> int:
    """Seconds as ns; None (or not positive) is 0: the core's default."""
    return max(0, int((seconds or 0) * 1e9))


class _Broken(Exception):
    """The machine answered a command this host cannot carry out (a contract fault)."""


@dataclass(slots=True)
class _Attempt:
    """A handler's attempt running, and the timer that renews its lease."""

    call: Claimed
    number: int
    task: asyncio.Task[tuple[bytes | None, Outcome, str]]
    renewer: asyncio.Task[None]


#: `next-due` when the store could not say: the machine then looks again after its poll interval
_UNKNOWN_DUE = (1 << 64) - 1


class _Loop:
    """One `run()`: the core's machine, fed what happens, and its commands carried out."""

    def __init__(self, ex: DurableExecutor, config: ExecutorConfig) -> None:
        self.ex = ex
        self.engine = ex.engine
        self.store = ex.store
        self.config = config
        self.machine = self._make()
        #: rows claimed and not yet run (their payload and idempotency key), by call id
        self.rows: dict[int, Claimed] = {}
        self.running: dict[int, _Attempt] = {}
        #: a finished handler's result, until its outcome is written
        self.results: dict[int, bytes | None] = {}
        #: what handlers and timers report, with the monotonic time it happened
        self.inbox: collections.deque[tuple[int, ExecEvent]] = collections.deque()
        self.signal = asyncio.Event()
        self.sleep_until: int | None = None
        self.idle = False

    def _make(self) -> ExecutorRef:
        return self.engine._executor_new(self.config, list(self.ex._handlers))

    async def run(self, stop: asyncio.Event) -> None:
        try:
            if not stop.is_set():
                self._feed(ExecPoll())
            while not stop.is_set() and not self.idle:
                poll = False
                while self.inbox and not self.idle:
                    at, ev = self.inbox.popleft()
                    self._feed(ev, at)
                    poll = poll or isinstance(ev, ExecFinished)  # an attempt's end frees a slot
                if self.ex._wake.is_set():  # a submission, an operator's retry
                    self.ex._wake.clear()
                    poll = True
                if self.idle:
                    break
                if not poll and not self.inbox:
                    # (awaited even when the sleep has ended already: handlers run meanwhile)
                    poll = await self._wait(stop)
                if poll and not stop.is_set():
                    self.sleep_until = None
                    self._feed(ExecPoll())
        finally:
            await self._stop()

    async def _wait(self, stop: asyncio.Event) -> bool:
        """Until something happens: an event from a handler or timer, a wake, `stop`, or the
        machine's sleep ending (then True: look at the store again)."""
        self.signal.clear()
        timeout = None
        if self.sleep_until is not None:
            timeout = min(max(0, self.sleep_until - time.monotonic_ns()) / 1e9, 86400.0)
        waiters = [asyncio.ensure_future(e.wait()) for e in (self.signal, self.ex._wake, stop)]
        try:
            await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waiters:
                w.cancel()
        return self.sleep_until is not None and time.monotonic_ns() >= self.sleep_until

    async def _stop(self) -> None:
        """Shutdown: stop the handlers (their rows stay as last written, resumed once their
        leases lapse) and drop the machine."""
        tasks: list[asyncio.Task[Any]] = []
        for cid, a in list(self.running.items()):
            a.task.cancel()
            a.renewer.cancel()
            tasks += [a.task, a.renewer]
            with contextlib.suppress(ExecutorGone):
                self.engine._executor_forget(self.machine, cid)
        self.running.clear()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        self.engine._executor_close(self.machine)

    # ------------------------------------------------------------ feeding the machine

    def _feed(self, event: ExecEvent, at: int | None = None) -> None:
        """Feed `event` and carry out the commands, each followed at once by what it came to
        (a claim's rows, a write's result), in order. A machine whose instance was replaced
        (a trap) is made again and the calls the old one held are abandoned."""
        try:
            self._carry_all(event, at)
        except (ExecutorGone, _Broken) as e:
            if isinstance(e, _Broken):
                self.engine._executor_fault(self.machine, str(e))
            self._abandon_all(str(e))
            self.machine = self._make()  # a second fault right away is the engine's: raised
            self._carry_all(ExecPoll(), None)
        finally:
            self.rows.clear()  # every claimed row is run, written back or set aside by now

    def _carry_all(self, event: ExecEvent, at: int | None) -> None:
        stack = [iter(self._ask(event, at))]
        while stack:
            cmd = next(stack[-1], None)
            if cmd is None:
                stack.pop()
                continue
            follow = self._carry(cmd)
            if follow is not None:
                stack.append(iter(self._ask(follow, None)))

    def _ask(self, event: ExecEvent, at: int | None) -> list[ExecCommand]:
        now = time.monotonic_ns() if at is None else at
        return self.engine._executor_feed(self.machine, now, event)

    def _abandon_all(self, why: str) -> None:
        """The machine is gone: cancel every attempt it held; nothing of them is recorded."""
        n = len(self.running)
        _logger.warning("levee durable: a new machine (%s); %d calls abandoned till their leases lapse", why, n)
        for a in self.running.values():
            a.task.cancel()
            a.renewer.cancel()
        self.running.clear()
        self.results.clear()
        self.inbox.clear()
        self.sleep_until = None

    def _known(self, cid: int) -> bool:
        return cid in self.rows or cid in self.running or cid in self.results

    def _carry(self, cmd: ExecCommand) -> ExecEvent | None:
        """Carry out one command; the event it came to, if the machine waits for one."""
        if isinstance(cmd, RowWrite):
            return self._write(cmd)
        if isinstance(cmd, ExecRun):
            self._run(cmd)
        elif isinstance(cmd, ExecClaim):
            return self._claim(cmd)
        elif isinstance(cmd, ExecNextDue):
            try:
                due = self.store.next_due_in()
            except Exception as e:
                _logger.error("levee durable: asking the store when the next call is due: %s", e)
                return ExecDueIn(_UNKNOWN_DUE)
            return ExecDueIn(None if due is None else max(0, due))
        elif isinstance(cmd, ExecSleep):
            self.sleep_until = cmd.until
        elif isinstance(cmd, ExecAbandon):
            a = self.running.pop(cmd.id, None)
            if a is not None:
                a.task.cancel()
                a.renewer.cancel()
            self.results.pop(cmd.id, None)
        elif isinstance(cmd, ExecQuarantine):
            if not self._known(cmd.id):
                raise _Broken(f"the executor quarantined call {cmd.id}, which it does not hold")
            self.results.pop(cmd.id, None)
            try:
                self.store.quarantine(cmd.id, cmd.error)
            except Exception as e:
                _logger.error("levee durable: setting call %d aside: %s", cmd.id, e)
        elif isinstance(cmd, ExecLog):
            text = f"{cmd.text} (call {cmd.id})" if cmd.id else cmd.text
            _logger.log(logging.WARNING if cmd.level == "warn" else logging.ERROR, "%s", text)
        elif isinstance(cmd, ExecIdle):
            self.idle = True
        return None

    def _claim(self, cmd: ExecClaim) -> ExecEvent:
        try:
            claimed = self.store.claim(self.config.owner, cmd.hold, cmd.limit)
        except Exception as e:
            return ExecClaimFailed(str(e))
        for c in claimed:
            if c.id not in self.running:
                self.rows[c.id] = c
        return ExecClaimed(tuple(ClaimedCall(c.id, c.handler, c.record, c.db_now) for c in claimed))

    def _write(self, w: RowWrite) -> ExecEvent:
        if not self._known(w.id):
            raise _Broken(f"the executor wrote call {w.id}, which it does not hold")
        result = self.results.get(w.id) if w.keep_result else None
        if not w.lease:
            self.results.pop(w.id, None)
        owner = self.config.owner
        try:
            ok = self.store.write(
                w.id, owner, w.status, w.next_at, w.attempts, owner if w.lease else None, w.record, result, w.error
            )
        except Exception as e:
            return ExecWritten(w.id, WriteFailed(str(e)))
        return ExecWritten(w.id, "applied" if ok else "lost")

    def _run(self, cmd: ExecRun) -> None:
        c = self.rows.pop(cmd.id, None)
        reg = None if c is None else self.ex._handlers.get(c.handler)
        if c is None or reg is None or cmd.id in self.running or cmd.renew_every <= 0:
            raise _Broken(f"the executor ran call {cmd.id}, which it cannot (not claimed, or running)")
        task = asyncio.ensure_future(_attempt(c, reg, cmd.attempt, cmd.timeout))
        renewer = asyncio.ensure_future(self._renew(cmd.id, cmd.renew_every))
        a = _Attempt(c, cmd.attempt, task, renewer)
        self.running[cmd.id] = a
        task.add_done_callback(lambda t: self._ended(a))

    async def _renew(self, cid: int, every: int) -> None:
        while True:
            await asyncio.sleep(every / 1e9)
            self._post(ExecRenew(cid))

    def _post(self, ev: ExecEvent) -> None:
        self.inbox.append((time.monotonic_ns(), ev))
        self.signal.set()

    def _ended(self, a: _Attempt) -> None:
        """A handler's attempt ended: its outcome is fed (unless it was abandoned or stopped)."""
        cid = a.call.id
        if self.running.get(cid) is not a:
            return
        del self.running[cid]
        a.renewer.cancel()
        if a.task.cancelled():
            return
        exc = a.task.exception()
        if exc is None:
            result, outcome, message = a.task.result()
        else:
            result, outcome, message = None, outcome_for_exception(exc), str(exc)
        hook = self.ex.on_attempt_done
        if hook is not None:
            try:
                hook(cid, a.number, outcome)
            except Exception:
                _logger.exception("levee durable: on_attempt_done failed for call %d", cid)
        self.results[cid] = result
        flags = REPORT_OVERLOADED if outcome.overloaded else 0
        self._post(ExecFinished(cid, outcome.kind, outcome.code, outcome.text, message, flags))


async def _attempt(c: Claimed, reg: _Registered, attempt: int, timeout_ns: int) -> tuple[bytes | None, Outcome, str]:
    """Run the handler under the attempt's timeout: its result, outcome and error message (empty
    for a timeout: the core's text)."""
    timeout = timeout_ns / 1e9 if timeout_ns else None
    ctx = DurableContext(c.id, attempt, c.idempotency_key, timeout)
    work = asyncio.ensure_future(_call(reg.fn, c.payload, ctx))
    try:
        done, _ = await asyncio.wait({work}, timeout=timeout)
    except asyncio.CancelledError:
        work.cancel()
        raise
    if work not in done:
        work.cancel()
        return None, Outcome.timeout(), ""
    exc = work.exception()
    if exc is not None:
        return None, outcome_for_exception(exc), str(exc)
    return work.result(), Outcome.success(), ""


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

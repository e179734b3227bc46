"""Submitting a durable call inside the caller's own transaction (the outbox pattern), on SQLite
and on PostgreSQL: the call exists exactly when the caller's transaction commits."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import levee
from levee.durable import DurableContext, DurableExecutor, PostgresStore, SQLiteStore

DOC = """
policies:
  job:
    attempts: 3
    backoff: { kind: constant, base: 50ms, cap: 50ms, jitter: none }
"""


@dataclass
class Db:
    """An executor on one store, and how a caller opens its own connections to the same database."""

    kind: str
    ex: DurableExecutor
    connect: Callable[[], Any]
    ran: list[bytes]

    def orders(self) -> list[str]:
        """The business rows, read on a fresh connection (so only what is committed)."""
        conn = self.connect()
        try:
            return [str(r[0]) for r in conn.execute("SELECT item FROM orders ORDER BY item").fetchall()]
        finally:
            conn.close()


@pytest.fixture(params=["sqlite", "postgres"])
def db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Db]:
    connect: Callable[[], Any]
    if request.param == "sqlite":
        path = tmp_path / "calls.db"
        store: SQLiteStore | PostgresStore = SQLiteStore(path)

        def connect() -> Any:
            return sqlite3.connect(path)  # Python's default: a transaction opened by the first write

    else:
        import psycopg

        dsn: str = request.getfixturevalue("postgres")
        store = PostgresStore(dsn)

        def connect() -> Any:
            return psycopg.connect(dsn)  # not autocommit: a transaction opened by the first statement

    setup = connect()
    setup.execute("CREATE TABLE orders (item TEXT PRIMARY KEY)")
    setup.commit()
    setup.close()
    ex = DurableExecutor(levee.loads(DOC), store, owner="t", poll_interval=0.1)
    ran: list[bytes] = []

    async def job(payload: bytes, ctx: DurableContext) -> bytes:
        ran.append(payload)
        return payload.upper()

    ex.register("job", job)
    try:
        yield Db(request.param, ex, connect, ran)
    finally:
        store.close()


async def test_a_rolled_back_submit_leaves_no_call_and_the_handler_never_runs(db: Db) -> None:
    conn = db.connect()
    cid = db.ex.submit("job", b"lost", conn=conn)
    assert db.ex.status(cid) is None  # not visible outside the transaction
    conn.rollback()
    conn.close()
    await asyncio.wait_for(db.ex.run(until_idle=True), 10)
    assert db.ex.status(cid) is None and db.ex.calls() == [] and db.ran == []


async def test_a_committed_submit_runs_and_the_call_ends_succeeded(db: Db) -> None:
    conn = db.connect()
    cid = db.ex.submit("job", b"kept", idempotency_key="order-1", conn=conn)
    assert db.ex.status(cid) is None and db.ex.calls() == []
    conn.commit()
    conn.close()
    st = db.ex.status(cid)
    assert st is not None and st.status == "scheduled" and st.idempotency_key == "order-1"
    assert st.record is not None and st.record["policy"] == "job"  # the core's durable begin, as submit writes it
    await asyncio.wait_for(db.ex.run(until_idle=True), 10)
    st = db.ex.status(cid)
    assert st is not None and st.status == "done" and st.result == b"KEPT" and db.ran == [b"kept"]


async def test_a_call_committed_while_the_executor_runs_is_run_by_its_next_poll(db: Db) -> None:
    stop = asyncio.Event()
    runner = asyncio.create_task(db.ex.run(stop=stop))
    try:
        await asyncio.sleep(0.15)  # the executor is idle, waiting for its next poll
        conn = db.connect()
        cid = db.ex.submit("job", b"later", conn=conn)
        conn.commit()
        conn.close()
        for _ in range(100):  # poll_interval is 0.1 s: done well within a second
            st = db.ex.status(cid)
            if st is not None and st.status == "done":
                break
            await asyncio.sleep(0.01)
        assert st is not None and st.status == "done" and db.ran == [b"later"]
    finally:
        stop.set()
        await asyncio.wait_for(runner, 5)


async def test_an_idempotency_key_reused_inside_the_transaction_returns_the_first_id(db: Db) -> None:
    conn = db.connect()
    first = db.ex.submit("job", b"1", idempotency_key="k-1", conn=conn)
    again = db.ex.submit("job", b"2", idempotency_key="k-1", conn=conn)
    assert again == first
    conn.commit()
    conn.close()
    # and after the commit, from outside the transaction too
    assert db.ex.submit("job", b"3", idempotency_key="k-1") == first
    calls = db.ex.calls()
    assert [c.id for c in calls] == [first]
    await asyncio.wait_for(db.ex.run(until_idle=True), 10)
    assert db.ran == [b"1"]


async def test_the_business_row_and_the_call_commit_or_roll_back_together(db: Db) -> None:
    conn = db.connect()
    conn.execute("INSERT INTO orders (item) VALUES ('rolled-back')")
    gone = db.ex.submit("job", b"rolled-back", idempotency_key="rolled-back", conn=conn)
    conn.rollback()
    assert db.orders() == [] and db.ex.status(gone) is None
    # the key was never taken: the same key in a committed transaction makes a new call
    conn.execute("INSERT INTO orders (item) VALUES ('committed')")
    kept = db.ex.submit("job", b"committed", idempotency_key="rolled-back", conn=conn)
    conn.commit()
    conn.close()
    assert db.orders() == ["committed"]
    assert [c.id for c in db.ex.calls()] == [kept]
    await asyncio.wait_for(db.ex.run(until_idle=True), 10)
    assert db.ran == [b"committed"]


def test_the_callers_row_factory_does_not_matter(db: Db) -> None:
    conn = db.connect()
    if db.kind == "sqlite":
        conn.row_factory = lambda cur, row: dict(zip([c[0] for c in cur.description], row, strict=True))
    else:
        from psycopg.rows import dict_row

        conn.row_factory = dict_row
    first = db.ex.submit("job", b"1", idempotency_key="dicts", conn=conn)
    assert db.ex.submit("job", b"2", idempotency_key="dicts", conn=conn) == first  # the find-by-key path too
    conn.commit()
    conn.close()
    assert [c.id for c in db.ex.calls()] == [first]


def test_the_same_errors_as_submit_and_nothing_written(db: Db) -> None:
    conn = db.connect()
    with pytest.raises(levee.LeveeError, match="no durable handler named `nope`"):
        db.ex.submit("nope", b"", conn=conn)
    conn.commit()
    conn.close()
    assert db.ex.calls() == []


async def test_a_connection_of_the_wrong_kind_is_a_type_error_naming_conn(tmp_path: Path, postgres: str) -> None:
    import psycopg

    lite = DurableExecutor(levee.loads(DOC), SQLiteStore(tmp_path / "calls.db"), owner="t")
    pg = DurableExecutor(levee.loads(DOC), PostgresStore(postgres), owner="t")
    for ex in (lite, pg):
        ex.register("job", lambda p, c: None)
    pg_conn = psycopg.connect(postgres)
    async_conn = await psycopg.AsyncConnection.connect(postgres)  # submit is synchronous
    lite_conn = sqlite3.connect(tmp_path / "calls.db")
    cases: list[tuple[DurableExecutor, Any, str]] = [
        (lite, pg_conn, "psycopg.Connection"),
        (pg, async_conn, "psycopg.AsyncConnection"),
        (pg, lite_conn, "sqlite3.Connection"),
        (lite, "calls.db", "builtins.str"),
        (pg, "host=127.0.0.1", "builtins.str"),
        (pg, 17, "builtins.int"),
    ]
    for ex, bad, named in cases:
        with pytest.raises(TypeError, match=r"^conn: ") as err:
            ex.submit("job", b"", conn=bad)
        assert named in str(err.value)
    # neither connection was used: no transaction opened on them, no call anywhere
    assert pg_conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    assert not lite_conn.in_transaction
    assert lite.calls() == [] and pg.calls() == []
    pg_conn.close()
    await async_conn.close()
    lite_conn.close()


def test_an_sqlite_connection_on_another_file_is_refused(tmp_path: Path) -> None:
    ex = DurableExecutor(levee.loads(DOC), SQLiteStore(tmp_path / "calls.db"), owner="t")
    ex.register("job", lambda p, c: None)
    other = sqlite3.connect(tmp_path / "other.db")
    with pytest.raises(levee.LeveeError, match=r"^conn: .*other\.db.*calls\.db"):
        ex.submit("job", b"", conn=other)
    memory = sqlite3.connect(":memory:")
    with pytest.raises(levee.LeveeError, match=r"^conn: .*in-memory"):
        ex.submit("job", b"", conn=memory)
    assert ex.calls() == []

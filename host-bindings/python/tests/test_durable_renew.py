"""A lease renewal that the store fails: tried again while the lease lasts (the attempt's outcome
is kept), and the attempt abandoned once the lease would have run out (issue 40: the Python
executor stopped renewing at the first store error and then dropped the finished attempt)."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path
from typing import Any

import levee
from levee.durable import DurableContext, DurableExecutor, SQLiteStore

DOC = """
policies:
  long:
    attempts: 1
    attempt-timeout: 10s
    durable: { lease: 1s }
"""


class FlakyStore(SQLiteStore):
    """Fails the renewals (writes of a running call after its first) numbered in `fail`."""

    def __init__(self, path: Path, fail: set[int]) -> None:
        super().__init__(path)
        self.fail = fail
        self.running_writes = 0

    def write(self, id: int, owner: str, status: str, *args: Any) -> bool:
        if status == "running":
            self.running_writes += 1
            if self.running_writes - 1 in self.fail:
                raise sqlite3.OperationalError("database is locked")
        return bool(super().write(id, owner, status, *args))


def make(tmp_path: Path, fail: set[int]) -> tuple[DurableExecutor, FlakyStore]:
    store = FlakyStore(tmp_path / "calls.db", fail)
    return DurableExecutor(levee.loads(DOC), store, owner="t1", poll_interval=0.05), store


async def test_a_renewal_the_store_fails_is_tried_again_and_the_outcome_kept(tmp_path: Path) -> None:
    ex, store = make(tmp_path, fail={1})  # the first renewal fails, the next ones succeed

    @ex.handler("job", policy="long")
    async def job(payload: bytes, ctx: DurableContext) -> bytes:
        await asyncio.sleep(1.2)  # renewed every third of the 1 s lease
        return b"ok"

    cid = ex.submit("job", b"")
    await asyncio.wait_for(ex.run(until_idle=True), 10)
    st = ex.status(cid)
    assert st is not None and st.status == "done" and st.result == b"ok", st
    assert store.running_writes >= 3, store.running_writes  # the claim's write, the failure, a retry


async def test_a_store_down_past_the_lease_abandons_the_attempt(tmp_path: Path) -> None:
    ex, store = make(tmp_path, fail=set(range(1, 1000)))  # every renewal fails
    cancelled = asyncio.Event()

    @ex.handler("job", policy="long")
    async def job(payload: bytes, ctx: DurableContext) -> bytes:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return b"too late"

    cid = ex.submit("job", b"")
    runner = asyncio.create_task(ex.run())
    await asyncio.wait_for(cancelled.wait(), 4)  # the lease (1 s) ran out long before 10 s
    assert store.running_writes >= 3, store.running_writes  # the claim's write, then renewals tried again
    runner.cancel()
    await asyncio.gather(runner, return_exceptions=True)
    st = ex.status(cid)
    # No outcome recorded for the abandoned attempt: the call stays running until its lapsed
    # lease is found (here by this executor's next claim, as a crash: attempts 1, so dead).
    assert st is not None and st.result is None and st.status in ("running", "dead"), st
    if st.status == "dead":
        assert "stopped before its outcome was recorded" in (st.error or ""), st.error

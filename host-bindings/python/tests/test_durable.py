"""The durable executor on an SQLite file: retries across runs, crashes found on restore,
idempotency keys, cancel and retry, quarantine of records the core refuses."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

import levee
from levee.durable import DurableContext, DurableExecutor, SQLiteStore

DOC = """
policies:
  flaky:
    attempts: 3
    attempt-timeout: 2s
    backoff: { kind: constant, base: 200ms, cap: 200ms, jitter: none }
    durable: { lease: 1s, max-crashes: 2 }
  once:
    attempts: 1
"""


def make(tmp_path: Path, owner: str = "t1") -> DurableExecutor:
    engine = levee.loads(DOC)
    return DurableExecutor(engine, SQLiteStore(tmp_path / "calls.db"), owner=owner, poll_interval=0.05)


async def test_a_failure_is_retried_after_its_backoff_and_the_result_kept(tmp_path: Path) -> None:
    ex = make(tmp_path)
    starts: list[tuple[int, float]] = []

    @ex.handler("job", policy="flaky")
    async def job(payload: bytes, ctx: DurableContext) -> bytes:
        starts.append((ctx.attempt, time.monotonic()))
        if ctx.attempt == 1:
            raise TimeoutError("slow")
        return payload.upper()

    cid = ex.submit("job", b"hello")
    await asyncio.wait_for(ex.run(until_idle=True), 10)
    st = ex.status(cid)
    assert st is not None and st.status == "done" and st.result == b"HELLO"
    assert [a for a, _ in starts] == [1, 2]
    assert starts[1][1] - starts[0][1] >= 0.2
    assert st.record is not None and st.record["attempts"] == 2 and st.record["failures"] == 1
    assert st.record["last-error"]["class"] == "timeout"


async def test_idempotency_keys_deduplicate_submissions(tmp_path: Path) -> None:
    ex = make(tmp_path)
    ex.register("job", lambda p, c: None, policy="flaky")
    a = ex.submit("job", b"1", idempotency_key="k-1")
    b = ex.submit("job", b"2", idempotency_key="k-1")
    assert a == b and len(ex.calls()) == 1


async def test_given_up_calls_are_listed_dead_with_their_last_error(tmp_path: Path) -> None:
    ex = make(tmp_path)

    def boom(payload: bytes, ctx: DurableContext) -> None:
        raise ConnectionError("no such invoice")

    ex.register("job", boom, policy="flaky")
    cid = ex.submit("job", b"")
    await asyncio.wait_for(ex.run(until_idle=True), 10)
    dead = ex.dead()
    assert [d.id for d in dead] == [cid]
    assert dead[0].status == "dead"
    assert dead[0].error is not None and "retries-exhausted" in dead[0].error and "no such invoice" in dead[0].error
    # an operator's retry gives it a fresh set of attempts
    assert ex.retry(cid)
    st = ex.status(cid)
    assert st is not None and st.status == "scheduled" and st.attempts == 0


async def test_cancel_stops_a_pending_call(tmp_path: Path) -> None:
    ex = make(tmp_path)
    ran: list[int] = []
    ex.register("job", lambda p, c: ran.append(c.attempt), policy="flaky")
    cid = ex.submit("job", b"")
    assert ex.cancel(cid)
    assert not ex.cancel(cid)
    await asyncio.wait_for(ex.run(until_idle=True), 5)
    st = ex.status(cid)
    assert st is not None and st.status == "cancelled" and ran == []


async def test_an_attempt_cut_off_by_a_crash_is_resumed_by_another_process(tmp_path: Path) -> None:
    first = make(tmp_path, owner="dies")
    first.register("job", lambda p, c: None, policy="flaky")
    keyed = first.submit("job", b"", idempotency_key="order-9")
    first.register("bare", lambda p, c: None, policy="flaky", idempotent=False)
    bare = first.submit("bare", b"")
    # "dies" claims both and starts their attempts (the record says running), then vanishes
    for c in first.store.claim("dies", 30_000_000_000, 10):
        step = first.engine.durable_step(c.record, "dies", c.db_now, 0)
        assert not isinstance(step, levee.LoadError)
        assert first.store.write(c.id, "dies", "running", step.next_at, step.attempt, "dies", step.record, None, None)
    second = make(tmp_path, owner="resumes")
    seen: list[tuple[int, str | None]] = []
    second.register("job", lambda p, c: seen.append((c.attempt, c.idempotency_key)), policy="flaky")
    second.register("bare", lambda p, c: seen.append((c.attempt, None)), policy="flaky", idempotent=False)
    await asyncio.wait_for(second.run(until_idle=True), 10)
    assert seen == [(2, "order-9")]
    k, b = second.status(keyed), second.status(bare)
    assert k is not None and k.status == "done" and k.record is not None and k.record["crashes"] == 1
    assert b is not None and b.status == "dead" and b.error is not None and b.error.startswith("unknown-outcome")


async def test_bad_records_are_quarantined_with_the_error_naming_them(tmp_path: Path) -> None:
    ex = make(tmp_path)
    ex.register("job", lambda p, c: None, policy="flaky")
    corrupt = ex.submit("job", b"")
    assert isinstance(ex.store, SQLiteStore)
    ex.store.conn.execute("UPDATE levee_durable_calls SET record = X'00010203' WHERE id = ?", [corrupt])
    other = ex.submit("job", b"")
    row = ex.store.get(other)
    assert row is not None
    v2 = bytearray(bytes(row[6]))
    v2[4] = 2
    ex.store.conn.execute("UPDATE levee_durable_calls SET record = ? WHERE id = ?", [bytes(v2), other])
    gone = ex.submit("job", b"")
    ex.engine.reload("policies:\n  once: { attempts: 1 }\n")
    await asyncio.wait_for(ex.run(until_idle=True), 5)
    errors = {d.id: (d.status, d.error) for d in ex.dead()}
    assert errors[corrupt][0] == "quarantined" and "record" in str(errors[corrupt][1])
    assert "record.version" in str(errors[other][1])
    assert "record.policy" in str(errors[gone][1]) and "flaky" in str(errors[gone][1])


def test_unknown_handlers_and_policies_are_refused(tmp_path: Path) -> None:
    ex = make(tmp_path)
    with pytest.raises(levee.LeveeError):
        ex.submit("nope", b"")
    with pytest.raises(levee.UnknownPolicy):
        ex.register("x", lambda p, c: None, policy="missing")

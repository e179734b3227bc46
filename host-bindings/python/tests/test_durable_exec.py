"""The durable executor drives the core's machine (the component's `executor` resource), which
lives in the engine's component instance: when a trap (or a command the host cannot carry out)
replaces the instance, the executor makes a new machine and abandons the calls the old one held;
their rows are resumed once their leases lapse, as after a crash (docs/durable.md)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

import levee
from levee._abi import Core
from levee.durable import DurableContext, DurableExecutor, SQLiteStore
from levee.testing import inject_fault
from levee.types import ExecCommand, ExecEvent, ExecRenew, RowWrite

DOC = """
policies:
  job:
    attempts: 3
    attempt-timeout: 10s
    durable: { lease: 1s, max-crashes: 3 }
  plain:
    attempts: 1
"""


def make(tmp_path: Path) -> DurableExecutor:
    return DurableExecutor(levee.loads(DOC), SQLiteStore(tmp_path / "calls.db"), owner="t1", poll_interval=0.05)


async def test_a_trap_elsewhere_replaces_the_machine_and_the_running_call_is_resumed(tmp_path: Path) -> None:
    ex = make(tmp_path)
    attempts: list[int] = []
    cancelled = asyncio.Event()

    @ex.handler("job", policy="job")
    async def job(payload: bytes, ctx: DurableContext) -> bytes:
        attempts.append(ctx.attempt)
        if ctx.attempt == 1:
            # Another user of the engine makes it trap: its instance, and the machine in it, go.
            inject_fault(ex.engine, "start")
            ex.engine.policy("plain").call(lambda: None)
            try:
                await asyncio.sleep(5)
            except asyncio.CancelledError:
                cancelled.set()
                raise
        return b"ok"

    cid = ex.submit("job", b"", idempotency_key="k")
    await asyncio.wait_for(ex.run(until_idle=True), 10)
    assert cancelled.is_set(), "the attempt the old machine held was abandoned"
    assert ex.engine.faults == 1
    st = ex.status(cid)
    # resumed once its lease lapsed, as after a crash, by the new machine
    assert st is not None and st.status == "done" and st.result == b"ok", st
    assert attempts == [1, 2] and st.record is not None and st.record["crashes"] == 1


async def test_a_command_the_host_cannot_carry_out_is_a_contract_fault(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ex = make(tmp_path)
    ex.register("job", lambda p, c: b"done", policy="job")
    cid = ex.submit("job", b"")
    real = Core.executor_feed
    bogus = [True]

    def feed(self: Core, x: int, now: int, event: ExecEvent) -> list[ExecCommand]:
        out = real(self, x, now, event)
        if bogus and not isinstance(event, ExecRenew):
            bogus.clear()  # once: a write of a call no claim returned
            return [RowWrite(424242, "done", 0, 1, b"", False, True, None)]
        return out

    monkeypatch.setattr(Core, "executor_feed", feed)
    await asyncio.wait_for(ex.run(until_idle=True), 10)
    assert ex.engine.faults == 1  # the instance was replaced, as after a trap
    st = ex.status(cid)
    assert st is not None and st.status == "done" and st.result == b"done", st
    assert ex.status(424242) is None


async def test_an_observer_that_raises_changes_nothing(tmp_path: Path) -> None:
    seen: list[tuple[int, int, Any]] = []

    def hook(call_id: int, attempt: int, outcome: Any) -> None:
        seen.append((call_id, attempt, outcome))
        raise RuntimeError("a broken metrics hook")

    ex = DurableExecutor(
        levee.loads(DOC), SQLiteStore(tmp_path / "calls.db"), owner="t1", poll_interval=0.05, on_attempt_done=hook
    )
    ex.register("job", lambda p, c: p + b"!", policy="job")
    cid = ex.submit("job", b"hi")
    await asyncio.wait_for(ex.run(until_idle=True), 10)
    st = ex.status(cid)
    assert st is not None and st.status == "done" and st.result == b"hi!", st
    assert [(c, a) for c, a, _ in seen] == [(cid, 1)]


async def test_a_handler_registered_while_running_is_run(tmp_path: Path) -> None:
    ex = make(tmp_path)
    ex.register("first", lambda p, c: None, policy="job")
    stop = asyncio.Event()
    runner = asyncio.create_task(ex.run(stop=stop))
    await asyncio.sleep(0.1)
    ex.register("late", lambda p, c: b"late", policy="job")
    cid = ex.submit("late", b"")
    for _ in range(100):
        st = ex.status(cid)
        if st is not None and st.status == "done":
            break
        await asyncio.sleep(0.05)
    stop.set()
    await asyncio.wait_for(runner, 5)
    st = ex.status(cid)
    assert st is not None and st.status == "done" and st.result == b"late", st

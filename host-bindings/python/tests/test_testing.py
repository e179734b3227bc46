"""levee.testing: the virtual clock (sync and asyncio), the no-waits switch, fault injection."""

from __future__ import annotations

import asyncio
import time

import pytest

import levee
from levee import EventKind
from levee.testing import VirtualClock, inject_fault, no_waits, set_waits, waits_enabled

DOC = """
policies:
  slow:
    attempts: 3
    backoff: { kind: constant, base: 2s, jitter: none }
  timed:
    attempts: 2
    attempt-timeout: 1s
    backoff: { kind: constant, base: 500ms, jitter: none }
  deadline:
    attempts: 5
    deadline: 3s
    backoff: { kind: constant, base: 2s, jitter: none }
"""


class Boom(Exception):
    pass


def failing_then(n: int, value: str = "ok") -> tuple[list[int], object]:
    seen: list[int] = []

    def fn() -> str:
        seen.append(1)
        if len(seen) <= n:
            raise ConnectionError("refused")
        return value

    return seen, fn


def test_sync_sleeps_move_the_virtual_clock_not_the_real_one() -> None:
    clock = VirtualClock()
    engine = levee.loads(DOC, seed=1, clock=clock)
    seen, fn = failing_then(2)
    t0 = time.monotonic()
    assert engine.policy("slow").call(fn) == "ok"  # type: ignore[arg-type]
    assert len(seen) == 3
    assert clock.monotonic() == pytest.approx(4.0)  # two 2 s backoffs, in virtual time
    assert time.monotonic() - t0 < 1.5


def test_sync_deadline_is_on_the_virtual_clock() -> None:
    clock = VirtualClock(start=10.0)
    engine = levee.loads(DOC, seed=1, clock=clock)
    _, fn = failing_then(99)
    with pytest.raises(levee.CallFailed) as info:
        engine.policy("deadline").call(fn)  # type: ignore[arg-type]
    assert clock.monotonic() <= 13.0 + 1e-9  # nothing sleeps past the 3 s deadline
    assert info.value.reason in (levee.Reason.DEADLINE, levee.Reason.RETRIES_EXHAUSTED)


async def test_async_attempt_that_hangs_is_cancelled_at_its_virtual_timeout() -> None:
    clock = VirtualClock()
    engine = levee.loads(DOC, seed=1, clock=clock)
    starts: list[float] = []

    @engine.policy("timed")
    async def fn() -> str:
        starts.append(clock.monotonic())
        if len(starts) == 1:
            await clock.sleep_async(3600)  # hangs: cancelled at the attempt's 1 s timeout
        return "second"

    t0 = time.monotonic()
    assert await fn() == "second"
    assert starts == [0.0, pytest.approx(1.5)]  # 1 s timeout, then the 500 ms backoff
    assert time.monotonic() - t0 < 1.5
    assert clock.pending() == 0


async def test_concurrent_tasks_share_the_virtual_clock_in_order() -> None:
    clock = VirtualClock()
    woke: list[tuple[str, float]] = []

    async def sleeper(name: str, s: float) -> None:
        await clock.sleep_async(s)
        woke.append((name, clock.monotonic()))

    await asyncio.gather(sleeper("b", 2.0), sleeper("a", 1.0), sleeper("c", 3.0))
    assert woke == [("a", 1.0), ("b", 2.0), ("c", 3.0)]


async def test_virtual_timeout_without_autojump_waits_for_advance() -> None:
    clock = VirtualClock(autojump=False)

    async def body() -> str:
        async with clock.timeout(5):
            await clock.sleep_async(10)
        return "not reached"

    task = asyncio.create_task(body())
    await asyncio.sleep(0)
    assert not task.done()
    clock.advance(4.9)
    await asyncio.sleep(0)
    assert not task.done()
    clock.advance(0.2)
    with pytest.raises(TimeoutError):
        await task


def test_no_waits_skips_real_sleeps_but_keeps_the_decisions() -> None:
    engine = levee.loads(DOC, seed=1)
    seen, fn = failing_then(2)
    retries: list[int] = []
    engine.add_listener(lambda e: retries.append(e.duration) if e.kind is EventKind.RETRY_SCHEDULED else None)
    t0 = time.monotonic()
    assert waits_enabled()
    with no_waits():
        assert not waits_enabled()
        assert engine.policy("slow").call(fn) == "ok"  # type: ignore[arg-type]
    assert waits_enabled()
    assert time.monotonic() - t0 < 1.5
    assert len(seen) == 3 and retries == [2_000_000_000, 2_000_000_000]
    set_waits(False)
    try:
        assert not waits_enabled()
    finally:
        set_waits(True)


def test_inject_fault_at_start_runs_the_degraded_attempt() -> None:
    clock = VirtualClock()
    engine = levee.loads(DOC, seed=1, clock=clock)
    events: list[levee.Event] = []
    engine.add_listener(events.append)
    inject_fault(engine, "start")
    assert engine.policy("slow").call(lambda: "degraded") == "degraded"
    assert engine.faults == 1
    assert [e.kind for e in events] == [EventKind.ENGINE_FAULT]
    assert engine.policy("slow").call(lambda: "normal") == "normal"  # the next call is guarded
    assert engine.faults == 1


def test_inject_fault_counts_survive_recovery() -> None:
    engine = levee.loads(DOC, seed=1, clock=VirtualClock())
    inject_fault(engine, "report", count=2)
    for _ in range(2):
        with pytest.raises(ConnectionError):
            engine.policy("slow").call(failing_then(9)[1])  # type: ignore[arg-type]
    assert engine.faults == 2
    with pytest.raises(ValueError):
        inject_fault(engine, "nonsense")


async def test_the_readme_example() -> None:
    doc = """
policies:
  checkout:
    attempts: 3
    attempt-timeout: 1s
    backoff: { kind: constant, base: 2s, jitter: none }
"""
    clock = VirtualClock()
    engine = levee.loads(doc, seed=42, clock=clock)

    @engine.policy("checkout")
    async def charge() -> str:
        await clock.sleep_async(3600)
        return "never"

    t0 = time.monotonic()
    with pytest.raises(levee.RetriesExhausted):
        await charge()
    assert clock.monotonic() == 7.0
    assert time.monotonic() - t0 < 1.5


def test_sync_late_success_is_a_timeout_decided_by_the_core() -> None:
    # A blocking function cannot be stopped: the host reports what it returned, with the time it
    # took, and the core decides that an outcome whose elapsed reaches the timeout is a timeout.
    clock = VirtualClock()
    engine = levee.loads(DOC, seed=1, clock=clock)
    answers = iter([1.5, 0.1])
    calls: list[float] = []

    def dependency() -> str:
        calls.append(clock.monotonic())
        clock.sleep(next(answers))
        return "late" if len(calls) == 1 else "in time"

    assert engine.policy("timed").call(dependency) == "in time"
    assert calls == [0.0, pytest.approx(2.0)]  # 1.5 s late, then the 500 ms backoff


def test_real_clock_late_success_is_never_held_back() -> None:
    doc = "policies:\n  p: { attempts: 2, attempt-timeout: 20ms, backoff: { kind: constant, base: 1ms } }\n"
    engine = levee.loads(doc, seed=1)
    n: list[int] = []

    def dependency() -> int:
        n.append(1)
        if len(n) == 1:
            time.sleep(0.05)  # returns after its 20 ms timeout
        return len(n)

    assert engine.policy("p").call(dependency) == 2

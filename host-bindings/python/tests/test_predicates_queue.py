"""Retry predicates (`retry_if=`) and the bulkhead queue's wake-ups, on the system clock: the
paths the host scenarios (virtual time) do not take: threads, the hot path's held-back success,
and what a predicate that misbehaves is told."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any

import pytest

import levee

DOC = """
policies:
  p:
    attempts: 3
    backoff: { kind: constant, base: 1ms, jitter: none }
    retry-on: ["error:Boom"]
  q:
    attempts: 1
    bulkhead: { max-concurrent: 1, queue: 2, queue-timeout: 3s }
"""


class Boom(Exception):
    pass


class Fatal(Exception):
    pass


def flaky(*outcomes: Any) -> Any:
    """A function returning or raising `outcomes` in turn, counting its calls."""
    it = iter(outcomes)
    calls = [0]

    def fn() -> Any:
        calls[0] += 1
        o = next(it)
        if isinstance(o, BaseException):
            raise o
        return o

    fn.calls = calls  # type: ignore[attr-defined]
    return fn


def test_predicate_sees_a_first_success_and_retries_it() -> None:
    # the hot path holds a first success back; with a predicate it must not (the predicate sees it)
    eng = levee.loads(DOC, seed=1)
    seen: list[Any] = []

    def pending(r: Any) -> bool | None:
        seen.append(r)
        return True if r == "pending" else None

    fn = flaky("pending", "ready")
    assert eng.policy("p", retry_if=pending).call(fn) == "ready"
    assert seen == ["pending", "ready"]


def test_predicate_false_refuses_a_retryable_error() -> None:
    eng = levee.loads(DOC, seed=1)
    fn = flaky(Boom(), "never")
    with pytest.raises(levee.CallFailed) as e:
        eng.policy("p", retry_if=lambda r: False).call(fn)
    assert e.value.reason is levee.Reason.NON_RETRYABLE and isinstance(e.value.last_error, Boom)
    assert fn.calls[0] == 1


def test_the_handles_predicate_wins_and_the_policys_can_be_removed() -> None:
    eng = levee.loads(DOC, seed=1)
    eng.retry_if("p", lambda r: True if isinstance(r, Fatal) else None)
    assert eng.policy("p").call(flaky(Fatal(), "by-policy")) == "by-policy"
    with pytest.raises(levee.CallFailed):
        eng.policy("p", retry_if=lambda r: False).call(flaky(Fatal(), "never"))
    eng.retry_if("p", None)
    with pytest.raises(levee.CallFailed) as e:  # the rules again: error:Fatal is not retried
        eng.policy("p").call(flaky(Fatal(), "never"))
    assert e.value.reason is levee.Reason.NON_RETRYABLE
    with pytest.raises(levee.UnknownPolicy):
        eng.retry_if("nope", None)


def test_a_predicate_that_raises_or_answers_oddly_is_logged_and_counts_as_none(
    caplog: pytest.LogCaptureFixture,
) -> None:
    eng = levee.loads(DOC, seed=1)

    def broken(r: Any) -> bool | None:
        raise RuntimeError("predicate bug")

    with caplog.at_level(logging.ERROR, logger="levee"):
        assert eng.policy("p", retry_if=broken).call(flaky(Boom(), "second")) == "second"  # the rules retry Boom
    assert any("retry_if predicate" in r.getMessage() and r.exc_info for r in caplog.records)
    caplog.clear()
    odd: Any = lambda r: "yes"  # noqa: E731  (a truthy answer is not True: it is refused, not guessed)
    with caplog.at_level(logging.ERROR, logger="levee"), pytest.raises(levee.CallFailed) as e:
        eng.policy("p", retry_if=odd).call(flaky(Fatal(), "never"))
    assert e.value.reason is levee.Reason.NON_RETRYABLE
    assert any("not True, False or None" in r.getMessage() for r in caplog.records)


def test_async_predicate_sees_the_attempts_result() -> None:
    eng = levee.loads(DOC, seed=1)
    seen: list[Any] = []

    async def dep(box: list[int]) -> str:
        box[0] += 1
        return "pending" if box[0] == 1 else "ready"

    def pred(r: Any) -> bool | None:
        seen.append(r)
        return r == "pending" or None

    assert asyncio.run(eng.policy("p", retry_if=pred).acall(dep, [0])) == "ready"
    assert seen == ["pending", "ready"]


def test_threads_parked_in_the_queue_wake_when_the_slot_frees() -> None:
    # a queue-timeout of 3 s: a waiter that only slept its payload would start 3 s late
    eng = levee.loads(DOC, seed=1)
    pol = eng.policy("q")
    started: dict[str, float] = {}
    ended: dict[str, float] = {}

    def work(name: str, hold: float) -> str:
        started[name] = time.monotonic()
        time.sleep(hold)
        ended[name] = time.monotonic()
        return name

    results: dict[str, str] = {}
    first = threading.Thread(target=lambda: results.setdefault("a", pol.call(work, "a", 0.2)))
    first.start()
    time.sleep(0.05)
    waiters = [threading.Thread(target=lambda n=n: results.setdefault(n, pol.call(work, n, 0.05))) for n in "bc"]
    for t in waiters:
        t.start()
        time.sleep(0.01)
    for t in (first, *waiters):
        t.join(10)
    assert results == {"a": "a", "b": "b", "c": "c"}
    # FIFO, each starting right after the previous one ended (the first's success is held back
    # on the hot path: its wake-up comes from there)
    assert started["b"] >= ended["a"] and started["c"] >= ended["b"]
    assert started["b"] - ended["a"] < 1.0 and started["c"] - ended["b"] < 1.0
    assert not eng._parked  # nothing left parked


def test_tasks_parked_in_the_queue_wake_on_a_cancel() -> None:
    eng = levee.loads(DOC, seed=1)
    pol = eng.policy("q")

    async def main() -> float:
        async def hang() -> None:
            await asyncio.sleep(60)

        async def quick() -> float:
            return time.monotonic()

        running = asyncio.create_task(pol.acall(hang))
        await asyncio.sleep(0.05)
        waiter = asyncio.create_task(pol.acall(quick))
        await asyncio.sleep(0.05)
        cancelled_at = time.monotonic()
        running.cancel()
        began = await asyncio.wait_for(waiter, 5)
        return began - cancelled_at

    assert asyncio.run(main()) < 1.0
    assert not eng._parked


def test_a_full_queue_rejects_at_once() -> None:
    eng = levee.loads(DOC, seed=1)
    pol = eng.policy("q")

    async def main() -> list[Any]:
        async def hold() -> str:
            await asyncio.sleep(0.2)
            return "held"

        tasks = [asyncio.create_task(pol.acall(hold))]
        await asyncio.sleep(0.02)
        for _ in range(3):  # two queue, the third is rejected
            tasks.append(asyncio.create_task(pol.acall(hold)))
            await asyncio.sleep(0.01)
        return await asyncio.gather(*tasks, return_exceptions=True)

    out = asyncio.run(main())
    assert out[:3] == ["held", "held", "held"]
    assert isinstance(out[3], levee.BulkheadFull)


def test_no_waits_still_parks_a_queued_call() -> None:
    # no_waits skips backoffs and limiter waits; a queued call waits for another call, and
    # skipping its park would spin on acquire (and starve the event loop that runs the holder)
    import levee.testing

    eng = levee.loads(DOC.replace("queue-timeout: 3s", "queue-timeout: 2s"), seed=1)
    pol = eng.policy("q")
    steps: list[levee.TraceStep] = []

    async def main() -> list[Any]:
        async def hold() -> int:
            await asyncio.sleep(0.1)
            return 1

        first = asyncio.create_task(pol.acall(hold))
        await asyncio.sleep(0.01)
        eng.trace = steps.append
        return list(await asyncio.gather(first, pol.acall(hold)))

    with levee.testing.no_waits():
        assert asyncio.run(main()) == [1, 1]
    assert len(steps) < 10, [str(s) for s in steps]

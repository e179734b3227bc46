"""Hedged calls (docs/policy.md, "Hedging") through the Python host's public APIs: asyncio
tasks, the sync API's threads, the attempts() loops, httpx (in process and against a real
server on 127.0.0.1), spans, and the checks of the guest's commands. The host scenarios
(conformance/hosts/hedge-*.json) pin the traces; these tests pin what they cannot: real threads
and sockets, the call leaving the engine's table once its cancelled attempts closed, spans."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any

import httpx
import pytest

import levee
from levee.http import AsyncLeveeTransport, LeveeTransport
from levee.testing import Fault, RecordingSink, VirtualClock, faults

from .conftest import Reply, Server

MS = 1_000_000


class Unavailable(Exception):
    pass


A6 = """
policies:
  p:
    hedge: { attempts: 4, delay: 500ms, non-fatal: ["error:Unavailable"] }
"""


def _live_calls(engine: levee.Engine) -> int:
    """Calls the core still has in its table (each hedged call until its last attempt closed)."""
    return sum(1 for c in range(1, engine._next_call) if engine.call_info(c) is not None)


# ---------------------------------------------------------------------------- asyncio


def test_a6_example_async_and_the_call_leaves_the_table() -> None:
    clock = VirtualClock(0.0)
    sink = RecordingSink()
    engine = levee.loads(A6, seed=1, clock=clock, telemetry=sink)
    plan: dict[int, tuple[float, str | Exception]] = {1: (0.7, Unavailable()), 2: (0.4, "second"), 3: (5.0, "third")}
    seen: list[tuple[int, int, int, bool]] = []
    n = 0

    @engine.policy("p")
    async def dependency() -> str:
        nonlocal n
        n += 1
        k = n
        t0 = clock.monotonic_ns()
        try:
            await clock.sleep_async(plan[k][0])
        except asyncio.CancelledError:
            seen.append((k, t0, clock.monotonic_ns(), True))
            raise
        seen.append((k, t0, clock.monotonic_ns(), False))
        out = plan[k][1]
        if isinstance(out, Exception):
            raise out
        return out

    async def main() -> str:
        value = await dependency()
        await asyncio.sleep(0)
        return value

    assert asyncio.run(main()) == "second"
    assert seen == [(1, 0, 700 * MS, False), (2, 500 * MS, 900 * MS, False), (3, 700 * MS, 900 * MS, True)]
    assert [a["levee.attempt"] for name, a in sink.events() if name == "hedge-started"] == [2, 3]
    assert sink.counters()["levee.hedges{levee.policy=p}"] == 2
    assert _live_calls(engine) == 0  # #3 was reported when it closed


def test_caller_cancel_aborts_every_attempt() -> None:
    clock = VirtualClock(0.0)
    engine = levee.loads(A6, seed=1, clock=clock)
    cancelled: list[int] = []
    n = 0

    @engine.policy("p")
    async def dependency() -> str:
        nonlocal n
        n += 1
        k = n
        try:
            await clock.sleep_async(10)
        except asyncio.CancelledError:
            cancelled.append(k)
            raise
        return "never"

    async def main() -> None:
        task = asyncio.ensure_future(dependency())
        await clock.sleep_async(0.6)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0)

    asyncio.run(main())
    assert sorted(cancelled) == [1, 2]
    assert _live_calls(engine) == 0


class Spans:
    """A span sink: which attempt spans a call has, and how each ended."""

    def __init__(self) -> None:
        self.attempts: list[tuple[int, str | None]] = []
        self.lock = threading.Lock()

    def event(self, name: str, attributes: Any) -> None:
        pass

    def add(self, counter: str, value: int, attributes: Any) -> None:
        pass

    def record(self, histogram: str, value: float, attributes: Any) -> None:
        pass

    def gauge(self, gauge: str, value: float, attributes: Any) -> None:
        pass

    def start_call(self, policy: str, key: str) -> Any:
        return object()

    def end_call(self, span: Any, result: str, reason: str | None) -> None:
        pass

    def start_attempt(self, call_span: Any, number: int, degraded: bool, http: bool) -> Any:
        return number

    def end_attempt(self, span: Any, outcome: str | None) -> None:
        with self.lock:
            self.attempts.append((span, outcome))


def test_one_span_per_hedged_attempt() -> None:
    clock = VirtualClock(0.0)
    spans = Spans()
    engine = levee.loads(A6, seed=1, clock=clock, telemetry=spans)
    delays = {1: 0.7, 2: 0.4, 3: 5.0}
    n = 0

    @engine.policy("p")
    async def dependency() -> str:
        nonlocal n
        n += 1
        k = n
        await clock.sleep_async(delays[k])
        if k == 1:
            raise Unavailable()
        return "ok"

    async def main() -> None:
        await dependency()
        await asyncio.sleep(0)

    asyncio.run(main())
    # #1 failed, #2 succeeded, #3 was cancelled (no outcome of its own)
    assert sorted(spans.attempts) == [(1, "error-class"), (2, "success"), (3, None)]


# ---------------------------------------------------------------------------- sync: threads

SYNC = """
policies:
  p:
    hedge: { attempts: 2, delay: 50ms }
  held:
    bulkhead: { max-concurrent: 2 }
    hedge: { attempts: 2, delay: 50ms }
"""


def test_sync_hedge_runs_in_threads_and_reports_the_loser_when_it_returns() -> None:
    engine = levee.loads(SYNC, seed=1)
    release = threading.Event()
    threads: list[str] = []

    @engine.policy("p")
    def dependency() -> str:
        threads.append(threading.current_thread().name)
        if len(threads) == 1:
            release.wait(5)  # the slow primary: a thread cannot be aborted
            return "slow"
        return "fast"

    t0 = time.monotonic()
    assert dependency() == "fast"
    assert time.monotonic() - t0 < 2.0
    assert threads[0] != threads[1] and threading.current_thread().name not in threads
    assert _live_calls(engine) == 1  # the primary still holds its attempt
    release.set()
    for _ in range(200):
        if _live_calls(engine) == 0:
            break
        time.sleep(0.01)
    assert _live_calls(engine) == 0


def test_sync_attempt_sees_its_cancel() -> None:
    engine = levee.loads(SYNC, seed=1)
    stopped = threading.Event()
    n = 0

    @engine.policy("p")
    def dependency() -> str:
        nonlocal n
        n += 1
        if n == 1:
            assert not levee.attempt_cancelled()
            for _ in range(500):  # the primary checks between steps, and stops when cancelled
                if levee.attempt_cancelled():
                    stopped.set()
                    return "stopped"
                time.sleep(0.01)
            return "slow"
        return "fast"

    assert dependency() == "fast"
    assert stopped.wait(2)
    for _ in range(200):
        if _live_calls(engine) == 0:
            break
        time.sleep(0.01)
    assert _live_calls(engine) == 0
    assert not levee.attempt_cancelled()  # outside an attempt


def test_sync_bulkhead_slot_held_until_the_cancelled_thread_returns() -> None:
    engine = levee.loads(SYNC, seed=1)
    release = threading.Event()
    calls: list[str] = []

    @engine.policy("held")
    def first() -> str:
        calls.append("first")
        if len(calls) == 1:
            release.wait(5)
            return "slow"
        return "fast"

    assert first() == "fast"
    # the cancelled primary still runs and holds one of the two slots: a second call gets the
    # other, and its hedge is refused (bulkhead full) instead of being sent
    second_attempts: list[float] = []

    @engine.policy("held")
    def second() -> str:
        second_attempts.append(time.monotonic())
        time.sleep(0.3)
        return "second"

    assert second() == "second"
    assert len(second_attempts) == 1
    release.set()


# ---------------------------------------------------------------------------- attempts() loops


def test_attempts_loop_runs_hedges_one_after_another() -> None:
    doc = 'policies:\n  p:\n    hedge: { attempts: 3, delay: 10ms, non-fatal: ["error:Unavailable"] }\n'
    engine = levee.loads(doc, seed=1, clock=VirtualClock(0.0))
    numbers = []
    attempts = engine.policy("p").attempts()
    for attempt in attempts:
        with attempt:
            numbers.append(attempt.number)
            if attempt.number == 1:
                raise Unavailable()
            attempt.result = f"from {attempt.number}"
    assert numbers == [1, 2]
    assert attempts.result == "from 2"
    assert _live_calls(engine) == 0


def test_async_attempts_loop_hedges_serially() -> None:
    doc = 'policies:\n  p:\n    hedge: { attempts: 2, delay: 10ms, non-fatal: ["error:Unavailable"] }\n'
    engine = levee.loads(doc, seed=1, clock=VirtualClock(0.0))

    async def main() -> Any:
        loop = engine.policy("p").attempts_async()
        async for attempt in loop:
            async with attempt:
                raise Unavailable()
        return loop.result

    with pytest.raises(levee.RetriesExhausted) as info:
        asyncio.run(main())
    assert info.value.attempts == 2


# ---------------------------------------------------------------------------- httpx


def test_httpx_sync_each_hedge_is_its_own_request() -> None:
    engine = levee.loads(SYNC, seed=1)
    seen: list[tuple[str, int]] = []
    lock = threading.Lock()

    def handler(request: httpx.Request) -> httpx.Response:
        n = request.headers["x-levee-attempt"]
        with lock:
            seen.append((n, id(request)))
        if n == "1":
            time.sleep(0.3)
            return httpx.Response(200, text="slow")
        return httpx.Response(200, text="fast")

    with httpx.Client(transport=LeveeTransport(engine, "p", transport=httpx.MockTransport(handler))) as client:
        r = client.get("http://svc.test/x")
    assert r.text == "fast"
    assert sorted(n for n, _ in seen) == ["1", "2"]
    assert seen[0][1] != seen[1][1]  # two request objects


@pytest.mark.asyncio
async def test_httpx_async_hedge_against_a_real_server(server: Server) -> None:
    server.script("/h", Reply(200, body=b"slow", delay=1.0), Reply(200, body=b"fast"))
    doc = "policies:\n  p:\n    hedge: { attempts: 2, delay: 100ms }\n"
    engine = levee.loads(doc, seed=1)
    async with httpx.AsyncClient(transport=AsyncLeveeTransport(engine, "p")) as client:
        t0 = time.monotonic()
        r = await client.get(server.url("/h"))
        took = time.monotonic() - t0
    assert r.text == "fast"
    assert took < 0.8  # the slow primary's request was cancelled, not waited for
    hits = server.hits("/h")
    assert [h.headers.get("x-levee-attempt") for h in hits] == ["1", "2"]
    for _ in range(100):  # the cancelled request unwinds (closes its connection), then is reported
        if _live_calls(engine) == 0:
            break
        await asyncio.sleep(0.01)
    assert _live_calls(engine) == 0


def test_httpx_stream_body_is_never_hedged() -> None:
    engine = levee.loads(SYNC, seed=1)
    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers["x-levee-attempt"])
        request.read()
        time.sleep(0.2)
        return httpx.Response(200)

    def body() -> Any:
        yield b"part"

    with httpx.Client(transport=LeveeTransport(engine, "p", transport=httpx.MockTransport(handler))) as client:
        assert client.post("http://svc.test/x", content=body()).status_code == 200
    assert seen == ["1"]


# ---------------------------------------------------------------------------- the guest's commands


HEDGE3 = """
policies:
  p:
    deadline: 1s
    hedge: { attempts: 3, delay: 100ms, non-fatal: ["error:Unavailable"] }
"""


@pytest.mark.parametrize(
    "commands",
    [
        ({"start": {"attempt": 1, "timeout": 1}},),  # already started
        ({"start": {"attempt": 12, "timeout": 1}},),  # past 11
        ({"start": {"attempt": 2, "timeout": 0}},),  # no timeout under a deadline
        ({"start": {"attempt": 2, "timeout": 2_000 * MS}},),  # past the deadline
        ({"cancel": 3},),  # never started
        ({"wait": 5_000 * MS},),  # past the deadline
        ({"end": {"attempt": 2, "verdict": 2}},),  # an attempt never reported
        ({"end": {"attempt": 1, "verdict": 7}},),  # a hedge verdict is no end
        ({"end": {"attempt": 1, "verdict": 0x15}},),  # fail without a reason
        ({"bogus": 1},),
        ({"start": {"attempt": 2, "timeout": 1}}, {"cancel": 9}),  # nothing of a bad answer runs
    ],
)
def test_a_command_that_breaks_the_contract_is_a_fault(commands: tuple[dict[str, Any], ...]) -> None:
    clock = VirtualClock(0.0)
    sink = RecordingSink()
    engine = levee.loads(HEDGE3, seed=1, clock=clock, telemetry=sink)
    n = 0

    @engine.policy("p")
    async def dependency() -> str:
        nonlocal n
        n += 1
        await clock.sleep_async(0.3)
        return f"v{n}"

    async def main() -> str:
        with faults(engine, Fault("hedge-step", 2, commands=commands)):
            value = await dependency()
        await asyncio.sleep(0)
        return value

    assert asyncio.run(main()) == "v1"  # attempt 1 goes on alone; its own result stands
    assert n == 1
    faulted = [a.get("levee.fault") for name, a in sink.events() if name == "engine-fault"]
    assert faulted == ["contract"]


def test_end_invalid_is_the_recovery_path_without_reinstantiation() -> None:
    clock = VirtualClock(0.0)
    sink = RecordingSink()
    engine = levee.loads(HEDGE3, seed=1, clock=clock, telemetry=sink)

    @engine.policy("p")
    async def dependency() -> str:
        await clock.sleep_async(0.05)
        raise Unavailable()

    async def main() -> None:
        with faults(engine, Fault("report-attempt", 1, commands=({"end": {"attempt": 0, "verdict": 0x106}},))):
            await dependency()

    with pytest.raises(Unavailable):  # the reported attempt's own error, raised as the user's own
        asyncio.run(main())
    assert [a.get("levee.fault") for name, a in sink.events() if name == "engine-fault"] == ["invalid"]
    assert engine.faults == 1


def test_trap_in_hedge_step_keeps_the_running_attempt() -> None:
    clock = VirtualClock(0.0)
    sink = RecordingSink()
    engine = levee.loads(HEDGE3, seed=1, clock=clock, telemetry=sink)

    @engine.policy("p")
    async def dependency() -> str:
        await clock.sleep_async(0.2)
        return "primary"

    async def main() -> str:
        with faults(engine, Fault("hedge-step", 2)):
            return await dependency()

    assert asyncio.run(main()) == "primary"
    assert [a.get("levee.fault") for name, a in sink.events() if name == "engine-fault"] == ["trap"]
    # the engine works after its re-instantiation
    assert asyncio.run(main()) == "primary"


def test_the_tracer_shows_the_commands() -> None:
    clock = VirtualClock(0.0)
    engine = levee.loads(A6, seed=1, clock=clock)
    steps: list[str] = []
    engine.trace = lambda s: steps.append(f"{s.op} {s.attempt} {list(s.commands)}")
    delays = {1: 0.7, 2: 0.4, 3: 5.0}
    n = 0

    @engine.policy("p")
    async def dependency() -> int:
        nonlocal n
        n += 1
        k = n
        await clock.sleep_async(delays[k])
        if k == 1:
            raise Unavailable()
        return k

    async def main() -> int:
        value = await dependency()
        await asyncio.sleep(0)
        return value

    assert asyncio.run(main()) == 2
    assert steps == [
        "start 0 []",
        "hedge-step 0 ['wait 500000000']",
        "hedge-step 0 ['start 2 timeout=0', 'wait 500000000']",
        "report-attempt 1 ['start 3 timeout=0', 'wait 500000000']",
        "report-attempt 2 ['cancel 3', 'end 2']",
        "report-attempt 3 ['-']",
    ]


def test_attempts_loop_reports_a_hedge_cancelled_before_it_ran() -> None:
    doc = 'policies:\n  p:\n    hedge: { attempts: 3, delay: 0, non-fatal: ["error:Unavailable"] }\n'
    engine = levee.loads(doc, seed=1, clock=VirtualClock(0.0))
    steps: list[str] = []
    engine.trace = lambda s: steps.append(f"{s.op} {list(s.commands)}")
    numbers = []
    loop = engine.policy("p").attempts()
    for attempt in loop:
        with attempt:
            numbers.append(attempt.number)
            if attempt.number == 1:
                raise Unavailable()
            attempt.result = attempt.number
    assert loop.result == 2
    assert numbers == [1, 2]  # #3 was started by the core, then cancelled before it ran
    assert _live_calls(engine) == 0, steps


async def test_close_during_a_hedged_call_starts_no_hedge_and_is_no_fault(caplog: pytest.LogCaptureFixture) -> None:
    """Issue 39 (graceful close): a hedged call in flight at `close()` starts no more attempts;
    the one in flight gives the call its value; nothing is reported as a fault."""
    clock = VirtualClock(0.0)
    engine = levee.loads(A6, seed=1, clock=clock)
    started = 0

    @engine.policy("p")
    async def dependency() -> str:
        nonlocal started
        started += 1
        await clock.sleep_async(0.2)
        engine.close()  # at 0.2 s, before the first hedge is due (0.5 s)
        await clock.sleep_async(0.6)
        return "first"

    with caplog.at_level(logging.WARNING, logger="levee"):
        assert await dependency() == "first"
    assert started == 1 and engine.faults == 0
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []

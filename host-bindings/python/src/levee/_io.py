"""The I/O the driver asks for, for synchronous and asyncio code: attempts (with the attempt's
deadline in a context variable, and asyncio's cancellation at its timeout), sleeps and
fallbacks."""

from __future__ import annotations

import contextvars
import functools
import inspect
import queue
import threading
import time
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING, Any

from . import _clock
from ._clock import SystemClock
from ._driver import (
    _SLEEP,
    ATTEMPT,
    HEDGE,
    HedgePlan,
    _AttemptResult,
    _Call,
    _fallback_context,
    _Hedge,
    _HedgeStop,
    _protocol,
    _unregistered,
)
from ._events import logger
from ._runtime import _Parker
from .outcomes import Outcome, outcome_for_exception
from .types import Reason

if TYPE_CHECKING:
    import asyncio

    from ._runtime import EngineRuntime

# asyncio is imported by the functions that use it, never at the top: `import levee` leaves it
# out for synchronous code (see `_clock.SystemClock`), and async code has it imported already.

_monotonic_ns = time.monotonic_ns


# ---------------------------------------------------------------------------- attempt context

# The absolute deadline (ns, on the engine's clock) of the attempt in progress, set only when it
# has one, and the clock it is on when that is not the system's (`levee.testing.VirtualClock`).
_ATTEMPT_DEADLINE: contextvars.ContextVar[int] = contextvars.ContextVar("levee_attempt_deadline", default=0)
_ATTEMPT_CLOCK: contextvars.ContextVar[Callable[[], int]] = contextvars.ContextVar(
    "levee_attempt_clock", default=_monotonic_ns
)


class _CancelEvent(threading.Event):
    """A synchronous hedged attempt's cancel flag, which also runs the callbacks an integration
    registered (`on_attempt_cancel`): a gRPC attempt cancels its call, so the server sees the
    cancellation even though the attempt's thread cannot be aborted."""

    def __init__(self) -> None:
        super().__init__()
        self._callbacks: list[Callable[[], Any]] = []
        self._callbacks_lock = threading.Lock()

    def on_set(self, fn: Callable[[], Any]) -> None:
        with self._callbacks_lock:
            if not self.is_set():
                self._callbacks.append(fn)
                return
        fn()

    def set(self) -> None:
        with self._callbacks_lock:
            super().set()
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            try:
                fn()
            except Exception:
                logger.exception("levee: a cancel callback of a hedged attempt failed")


# Set in a synchronous hedged attempt's thread: the core cancelled it (it cannot be aborted).
_ATTEMPT_CANCEL: contextvars.ContextVar[_CancelEvent | None] = contextvars.ContextVar(
    "levee_attempt_cancel", default=None
)


def on_attempt_cancel(fn: Callable[[], Any]) -> None:
    """Run `fn()` when the core cancels the synchronous hedged attempt in progress (at once if
    it already has); nothing outside such an attempt (asyncio attempts are cancelled as tasks)."""
    ev = _ATTEMPT_CANCEL.get()
    if ev is not None:
        ev.on_set(fn)


def attempt_cancelled() -> bool:
    """Whether the attempt in progress was cancelled while it runs: a synchronous hedged attempt
    the core cancelled (another attempt won, or the caller gave up). A thread cannot be aborted,
    so such an attempt goes on until its function returns, and holds what it holds (a bulkhead
    slot) until then; a function that checks this between steps ends sooner. Always False in
    asyncio code (a cancelled task is cancelled) and outside an attempt."""
    ev = _ATTEMPT_CANCEL.get()
    return ev is not None and ev.is_set()


def attempt_timeout() -> float | None:
    """Seconds left for the attempt in progress, or `None` when it has no timeout (or no attempt
    is in progress). Synchronous code passes this to its I/O (the httpx transport does)."""
    d = _ATTEMPT_DEADLINE.get()
    if not d:
        return None
    return max(0.0, (d - _ATTEMPT_CLOCK.get()()) / 1e9)


class _AttemptScope:
    """The attempt's deadline in the context variables while it runs (slow paths only)."""

    __slots__ = ("_clock", "_deadline")

    def __init__(self, eng: EngineRuntime, start: int, timeout: int) -> None:
        self._deadline: contextvars.Token[int] | None = _ATTEMPT_DEADLINE.set(start + timeout) if timeout else None
        now = eng._now
        self._clock = _ATTEMPT_CLOCK.set(now) if timeout and now is not _monotonic_ns else None

    def close(self) -> None:
        if self._deadline is not None:
            _ATTEMPT_DEADLINE.reset(self._deadline)
            self._deadline = None
        if self._clock is not None:
            _ATTEMPT_CLOCK.reset(self._clock)
            self._clock = None


def sleep_sync(eng: EngineRuntime, ns: int, park: _Parker | int = 0) -> None:
    """A wait the core asked for, on the engine's clock (none under `levee.testing.no_waits`).
    With `park`, the call waits in a bulkhead queue: the sleep ends early when the core grants it
    a slot and names it (`take-wakes`). On the system clock a thread waits on an event; a clock
    whose synchronous sleep is not interruptible (`VirtualClock`: the time passes at once) sleeps
    the payload, which the contract allows (docs/policy.md, "The queue"). A park is waited for
    even under `no_waits`: it waits for another call, and skipping it would only spin."""
    if ns <= 0:
        return
    if park:
        assert isinstance(park, _Parker)
        if type(eng._clock) is SystemClock:
            ev = park.event = threading.Event()
            if not park.woken:  # read after attaching the event: a wake in between is seen
                ev.wait(ns / 1e9)
        else:
            eng._clock.sleep(ns / 1e9)
    elif _clock._waits[0]:
        if type(eng._clock) is not SystemClock:
            eng._clock.sleep(ns / 1e9)
            return
        # woken early by `close()` only: the call cannot go on after it
        sleeper = eng._sleeper()
        if sleeper is None:
            return
        try:
            ev = sleeper.event = threading.Event()
            if not sleeper.woken:
                ev.wait(ns / 1e9)
        finally:
            eng._awake(sleeper)


async def sleep_async(eng: EngineRuntime, ns: int, park: _Parker | int = 0) -> None:
    """`sleep_sync` for asyncio: a parked task sleeps on the engine's clock (virtual time
    included) and a wake-up future, whichever completes first."""
    if ns <= 0:
        return
    if park:
        assert isinstance(park, _Parker)
        await _sleep_or_wake(eng, ns, park)
    elif _clock._waits[0]:
        # woken early by `close()` only: the call cannot go on after it
        sleeper = eng._sleeper()
        if sleeper is None:
            return
        try:
            await _sleep_or_wake(eng, ns, sleeper)
        finally:
            eng._awake(sleeper)


async def _sleep_or_wake(eng: EngineRuntime, ns: int, park: _Parker) -> None:
    """Sleep `ns` on the engine's clock, or until `park` is woken, whichever comes first."""
    import asyncio

    loop = asyncio.get_running_loop()
    fut: asyncio.Future[None] = loop.create_future()
    park.loop = loop
    park.fut = fut
    if park.woken:
        return
    sleeper = asyncio.ensure_future(eng._clock.sleep_async(ns / 1e9))
    try:
        await asyncio.wait((sleeper, fut), return_when=asyncio.FIRST_COMPLETED)
    finally:
        sleeper.cancel()
        fut.cancel()


def attempt_timeout_cm(eng: EngineRuntime, ns: int) -> AbstractAsyncContextManager[Any]:
    """The timeout of an asyncio attempt, on the engine's clock."""
    import asyncio

    clock = eng._clock
    return asyncio.timeout(ns / 1e9) if type(clock) is SystemClock else clock.timeout(ns / 1e9)


def _run_fallback_sync(st: _Call, name: str, reason: Reason) -> tuple[bool, Any]:
    fn = st.engine._fallbacks.get(name)
    if fn is None:
        return _unregistered(st, name)
    try:
        value = fn(_fallback_context(st, name, reason))
    except Exception as e:
        logger.warning("levee: fallback %r failed", name, exc_info=True)
        return False, e
    if inspect.isawaitable(value):
        if inspect.iscoroutine(value):
            value.close()
        logger.warning("levee: fallback %r is async but the call is synchronous", name)
        return False, TypeError(
            f"fallback {name!r} returned an awaitable ({type(value).__name__}): it is async but the call is "
            "synchronous; register a synchronous function for a synchronous call"
        )
    return True, value


async def _run_fallback_async(st: _Call, name: str, reason: Reason) -> tuple[bool, Any]:
    fn = st.engine._fallbacks.get(name)
    if fn is None:
        return _unregistered(st, name)
    try:
        value = fn(_fallback_context(st, name, reason))
        if inspect.isawaitable(value):
            value = await value
    except Exception as e:
        logger.warning("levee: fallback %r failed", name, exc_info=True)
        return False, e
    return True, value


def _attempt_sync(st: _Call, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
                  timeout: int) -> _AttemptResult:  # fmt: skip
    now = st.engine._now
    start = now()
    scope = _AttemptScope(st.engine, start, timeout)
    try:
        value = fn(*args, **kwargs)
        exc: BaseException | None = None
    except Exception as e:
        value, exc = None, e
    finally:
        scope.close()
    return st.outcome_of(value, exc, start, now(), timeout)


def timed_out(e: TimeoutError, number: int, timeout_ns: int) -> TimeoutError:
    """The error of an asyncio attempt cut by its timeout: asyncio's `TimeoutError` has no
    message, so the attempt's says which attempt and after how long (as JS's does)."""
    if e.args:
        return e
    out = TimeoutError(f"attempt {number} timed out after {timeout_ns / 1e6:g} ms")
    out.__context__ = e.__context__  # the cancellation asyncio turned into it
    out.__suppress_context__ = e.__suppress_context__
    return out.with_traceback(e.__traceback__)


async def _attempt_async(st: _Call, fn: Callable[..., Awaitable[Any]], args: tuple[Any, ...],
                         kwargs: dict[str, Any], timeout: int, number: int = 0) -> _AttemptResult:  # fmt: skip
    eng = st.engine
    now = eng._now
    start = now()
    exc: BaseException | None = None
    value: Any = None
    if timeout:
        scope = _AttemptScope(eng, start, timeout)
        cm = attempt_timeout_cm(eng, timeout)
        try:
            async with cm:
                value = await fn(*args, **kwargs)
        except TimeoutError as e:
            exc = e
            if getattr(cm, "expired", lambda: True)():
                return _AttemptResult(Outcome.timeout(), None, timed_out(e, number, timeout), start, now())
        except Exception as e:
            exc = e
        finally:
            scope.close()
    else:
        try:
            value = await fn(*args, **kwargs)
        except Exception as e:
            exc = e
    return st.outcome_of(value, exc, start, now(), timeout)


# ---------------------------------------------------------------------------- hedged calls

#: asyncio attempts the core cancelled that are still closing after their call ended (a
#: reference, so that the event loop does not lose them before they are reported)
_CLOSING: set[asyncio.Future[Any]] = set()


def _hedge_stuck(h: _Hedge) -> None:
    """The core left a hedged call with nothing in flight and nothing to wait for."""
    h.st.engine._guest_fault(h.st, "contract", "a hedged call with no attempt in flight, no wait and no end")
    raise _HedgeStop()


def _task_result(h: _Hedge, n: int, t: asyncio.Future[_AttemptResult]) -> _AttemptResult:
    if t.cancelled():
        import asyncio

        return h.cancelled_result(n, asyncio.CancelledError())
    exc = t.exception()
    if exc is None:
        return t.result()
    if isinstance(exc, Exception):  # the attempt runner reports errors; this is a guard
        return _AttemptResult(outcome_for_exception(exc), None, exc, h.started.get(n, 0), h.st.engine._now())
    raise exc


def _close_later(h: _Hedge, n: int, t: asyncio.Future[_AttemptResult]) -> None:
    _CLOSING.discard(t)
    try:
        res = _task_result(h, n, t)
    except BaseException as e:
        res = h.cancelled_result(n, e)
    h.closed_late(n, res)


async def run_hedge_async(h: _Hedge, run: Callable[[int, int], Awaitable[_AttemptResult]]) -> None:
    """Carry out a hedged call's commands with asyncio tasks (docs/policy.md, "Hedging"): each
    attempt is a task (`run(number, timeout_ns)`) cancelled by `task.cancel()`; a `wait` sleeps
    on the engine's clock until it elapses or an attempt closes, whichever is first; a closed
    attempt is reported (the one that ended first when several have closed, the lowest number
    on a tie), else `hedge-step`.
    Returns at `end` or after a guest fault; attempts the core cancelled are reported as they
    close, without the caller waiting for them. The caller's cancel cancels every attempt."""
    import asyncio

    st = h.st
    eng = st.engine
    tasks: dict[int, asyncio.Future[_AttemptResult]] = {}
    sleeper: asyncio.Future[None] | None = None

    def launch(n: int, timeout: int) -> None:
        h.begin(n, timeout)
        tasks[n] = asyncio.ensure_future(run(n, timeout))

    results: dict[int, _AttemptResult] = {}

    def closed() -> int:
        """The attempt to report next: of those that have closed, the one that ended first (the
        lowest number on a tie)."""
        best = 0
        for k in sorted(h.open):
            if tasks[k].done():
                if k not in results:
                    results[k] = _task_result(h, k, tasks[k])
                if not best or results[k].end < results[best].end:
                    best = k
        return best

    try:
        try:
            launch(1, h.first_timeout)
            plan: HedgePlan = h.step()
            while True:
                for n, timeout in plan.starts:
                    launch(n, timeout)
                for n in plan.cancels:
                    if n in h.open:
                        tasks[n].cancel()
                if h.over:
                    break
                n = closed()
                if not n:
                    waiting: list[asyncio.Future[Any]] = [tasks[k] for k in sorted(h.open)]
                    if plan.wait is None and not waiting:
                        _hedge_stuck(h)
                    if plan.wait is not None:
                        sleeper = asyncio.ensure_future(eng._clock.sleep_async(plan.wait / 1e9))
                        waiting.append(sleeper)
                    await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                    if sleeper is not None:
                        sleeper.cancel()
                        sleeper = None
                    n = closed()
                plan = h.report(n, results.pop(n)) if n else h.step()
        except _HedgeStop as stop:
            # the one recovery path: the attempt whose report faulted keeps its own result;
            # else the oldest attempt in flight goes on alone (the degraded attempt, already
            # running); else the protocol runs one degraded attempt
            h.over = h.abandoned = True
            keep = stop.attempt or min((k for k in h.open if k not in h.cancelled), default=0)
            for k in sorted(h.open):
                if k != keep:
                    tasks[k].cancel()
            if keep in h.open:
                await asyncio.wait((tasks[keep],))
                res = _task_result(h, keep, tasks[keep])
                h.open.discard(keep)
                h.results[keep] = res
                h._end_span(keep, res)
            h.fault_attempt = keep if keep in h.results else 0
    except BaseException:
        # the caller cancelled the call (or the loop is going away): every attempt is aborted;
        # the protocol's close cancels the call in the core, which frees them all
        h.over = h.abandoned = True
        for t in tasks.values():
            t.cancel()
        raise
    finally:
        if sleeper is not None:
            sleeper.cancel()
        for k in sorted(h.open):
            t = tasks[k]
            _CLOSING.add(t)
            t.add_done_callback(functools.partial(_close_later, h, k))


def run_hedge_sync(h: _Hedge, run: Callable[[int, int], _AttemptResult]) -> None:
    """`run_hedge_async` for synchronous code: each attempt runs in a thread of its own (the
    calling thread carries out the commands). A thread cannot be aborted: `cancel` stops
    waiting for the attempt, which goes on until its function returns; it is reported then,
    and holds its bulkhead slot until then (which is what the core asks). A `wait` waits on the
    attempts' completions with a timeout on the system clock (on another clock, it sleeps on
    that clock and then looks)."""
    st = h.st
    eng = st.engine
    done: queue.SimpleQueue[tuple[int, _AttemptResult]] = queue.SimpleQueue()
    system = type(eng._clock) is SystemClock

    cancels: dict[int, _CancelEvent] = {}

    def worker(n: int, timeout: int, ctx: contextvars.Context) -> None:
        try:
            res = ctx.run(run, n, timeout)
        except BaseException as e:  # run reports Exceptions; this one closed the attempt
            res = h.cancelled_result(n, e)
        with h.lock:
            if not h.over:
                done.put((n, res))
                return
        h.closed_late(n, res)

    def launch(n: int, timeout: int) -> None:
        h.begin(n, timeout)
        ctx = contextvars.copy_context()
        ev = cancels[n] = _CancelEvent()
        ctx.run(_ATTEMPT_CANCEL.set, ev)
        th = threading.Thread(target=worker, args=(n, timeout, ctx), name=f"levee-hedge-{st.call}-{n}",
                              daemon=True)  # fmt: skip
        th.start()

    def cancel_all() -> None:
        for ev in cancels.values():
            ev.set()

    def take(wait: int | None) -> tuple[int, _AttemptResult] | None:
        try:
            if wait is None:
                return done.get()
            if system:
                return done.get(timeout=wait / 1e9)
            try:
                return done.get_nowait()
            except queue.Empty:
                eng._clock.sleep(wait / 1e9)
                return done.get_nowait()
        except queue.Empty:
            return None

    try:
        try:
            launch(1, h.first_timeout)
            plan = h.step()
            while True:
                for n, timeout in plan.starts:
                    launch(n, timeout)
                for n in plan.cancels:
                    ev = cancels.get(n)
                    if ev is not None:
                        ev.set()
                if h.over:
                    break
                if plan.wait is None and not h.open:
                    _hedge_stuck(h)
                got = take(plan.wait)
                plan = h.report(*got) if got is not None else h.step()
        except _HedgeStop as stop:
            keep = stop.attempt or min((k for k in h.open if k not in h.cancelled), default=0)
            h.abandoned = True
            for k, ev in cancels.items():
                if k != keep:
                    ev.set()
            while keep in h.open:
                n, res = done.get()
                if n == keep:
                    h.open.discard(n)
                    h.results[keep] = res
                    h._end_span(keep, res)
                else:
                    h.report(n, res)  # abandoned: ends its span and closes what it returned
            h.fault_attempt = keep if keep in h.results else 0
    except BaseException:
        h.abandoned = True
        cancel_all()
        raise
    finally:
        with h.lock:
            h.over = True
            late: list[tuple[int, _AttemptResult]] = []
            while True:
                try:
                    late.append(done.get_nowait())
                except queue.Empty:
                    break
        for n, res in late:
            h.closed_late(n, res)


def _drive_sync(st: _Call, v: int, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
                first: _AttemptResult | None = None) -> Any:  # fmt: skip
    """Run the protocol from the verdict `v` of `start`, doing its I/O synchronously; `first` is
    the result of the first attempt when the hot path already ran it."""
    gen = _protocol(st, v)
    try:
        action = next(gen)
        if first is not None:
            action = gen.send(first)
        while True:
            op = action[0]
            if op == ATTEMPT:
                action = gen.send(_attempt_sync(st, fn, args, kwargs, action[2]))
            elif op == HEDGE:
                run_hedge_sync(action[1], lambda n, t: _attempt_sync(st, fn, args, kwargs, t))
                action = gen.send(None)
            elif op == _SLEEP:
                sleep_sync(st.engine, action[1], action[2])
                action = gen.send(None)
            else:
                action = gen.send(_run_fallback_sync(st, action[1], action[2]))
    except StopIteration as stop:
        return stop.value
    except BaseException:
        gen.close()
        raise


async def _drive_async(st: _Call, v: int, fn: Callable[..., Awaitable[Any]], args: tuple[Any, ...],
                       kwargs: dict[str, Any], first: _AttemptResult | None = None) -> Any:  # fmt: skip
    """`_drive_sync` for coroutines: attempts are awaited and cancelled by their timeout."""
    gen = _protocol(st, v)
    try:
        action = next(gen)
        if first is not None:
            action = gen.send(first)
        while True:
            op = action[0]
            if op == ATTEMPT:
                action = gen.send(await _attempt_async(st, fn, args, kwargs, action[2], action[1]))
            elif op == HEDGE:
                await run_hedge_async(action[1], lambda n, t: _attempt_async(st, fn, args, kwargs, t, n))
                action = gen.send(None)
            elif op == _SLEEP:
                await sleep_async(st.engine, action[1], action[2])
                action = gen.send(None)
            else:
                action = gen.send(await _run_fallback_async(st, action[1], action[2]))
    except StopIteration as stop:
        return stop.value
    except BaseException:
        gen.close()
        raise

"""The I/O the driver asks for, for synchronous and asyncio code: attempts (with the attempt's
deadline in a context variable, and asyncio's cancellation at its timeout), sleeps and
fallbacks."""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import time
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING, Any

from . import _clock
from ._clock import SystemClock
from ._driver import _SLEEP, ATTEMPT, _AttemptResult, _Call, _fallback_context, _protocol, _unregistered
from ._events import logger
from .outcomes import Outcome
from .types import Reason

if TYPE_CHECKING:
    from ._runtime import EngineRuntime

_monotonic_ns = time.monotonic_ns


# ---------------------------------------------------------------------------- attempt context

# The absolute deadline (ns, on the engine's clock) of the attempt in progress, set only when it
# has one, and the clock it is on when that is not the system's (`levee.testing.VirtualClock`).
_ATTEMPT_DEADLINE: contextvars.ContextVar[int] = contextvars.ContextVar("levee_attempt_deadline", default=0)
_ATTEMPT_CLOCK: contextvars.ContextVar[Callable[[], int]] = contextvars.ContextVar(
    "levee_attempt_clock", default=_monotonic_ns
)


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


def sleep_sync(eng: EngineRuntime, ns: int) -> None:
    """A wait the core asked for, on the engine's clock (none under `levee.testing.no_waits`)."""
    if ns > 0 and _clock._waits[0]:
        eng._clock.sleep(ns / 1e9)


async def sleep_async(eng: EngineRuntime, ns: int) -> None:
    if ns > 0 and _clock._waits[0]:
        await eng._clock.sleep_async(ns / 1e9)


def attempt_timeout_cm(eng: EngineRuntime, ns: int) -> AbstractAsyncContextManager[Any]:
    """The timeout of an asyncio attempt, on the engine's clock."""
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
        return False, None
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


async def _attempt_async(st: _Call, fn: Callable[..., Awaitable[Any]], args: tuple[Any, ...],
                         kwargs: dict[str, Any], timeout: int) -> _AttemptResult:  # fmt: skip
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
                return _AttemptResult(Outcome.timeout(), None, e, start, now())
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
            elif op == _SLEEP:
                sleep_sync(st.engine, action[1])
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
                action = gen.send(await _attempt_async(st, fn, args, kwargs, action[2]))
            elif op == _SLEEP:
                await sleep_async(st.engine, action[1])
                action = gen.send(None)
            else:
                action = gen.send(await _run_fallback_async(st, action[1], action[2]))
    except StopIteration as stop:
        return stop.value
    except BaseException:
        gen.close()
        raise

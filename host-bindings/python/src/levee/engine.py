"""The public API: `Engine` (one component instance shared by every thread and task),
`Policy` (decorator, `call`/`acall`, attempt iterators) and `load`/`loads`.

Every decision comes from the component. The layers below: `_driver` (the step protocol,
sans I/O), `_io` (the attempts, sleeps and fallbacks it asks for) and `_runtime` (the
component instance, its lock, snapshots and trap recovery).
"""

from __future__ import annotations

import functools
import inspect
import os
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Generator, Mapping
from pathlib import Path
from typing import Any, ParamSpec, TypeVar, cast

from ._abi import ComponentFault, Core, event_from_raw
from ._clock import SystemClock
from ._constants import METHOD_OTHER, METHODS, START_METHOD_SHIFT
from ._driver import (
    _SLEEP,
    ATTEMPT,
    HEDGE,
    FallbackContext,
    RetryHook,
    RetryInfo,
    RetryPredicate,
    _AttemptResult,
    _Call,
    _protocol,
    hedge_serial,
)
from ._events import Listener
from ._io import (
    _ATTEMPT_DEADLINE,
    _AttemptScope,
    _drive_async,
    _drive_sync,
    _run_fallback_async,
    _run_fallback_sync,
    attempt_cancelled,
    attempt_timeout,
    attempt_timeout_cm,
    sleep_async,
    sleep_sync,
    timed_out,
)
from ._runtime import EngineRuntime, TraceStep, _PolicySlot, _runtime, check_key, component_path, document_text
from .errors import EngineClosed, LeveeError, PolicyError, UnknownFallback, UnknownPolicy
from .outcomes import _RESULT_IS_RESPONSE, Classifier, Outcome, outcome_for_result
from .types import Analysis, BreakerState, CallInfo, DurableStep, Event, LoadError, PolicyInfo

# re-exported: the public names live here, the tests reach the internals through this module
__all__ = [
    "AsyncAttempts",
    "Attempt",
    "Attempts",
    "Engine",
    "FallbackContext",
    "Policy",
    "RetryInfo",
    "RetryPredicate",
    "TraceStep",
    "_Call",
    "_drive_sync",
    "_runtime",
    "attempt_cancelled",
    "attempt_timeout",
    "call",
    "component_path",
    "load",
    "loads",
    "method_flags",
]

P = ParamSpec("P")
T = TypeVar("T")

_monotonic_ns = time.monotonic_ns


#: The HTTP method codes of `start`'s flags (bits 8-11), generated from wit/constants.json.
HTTP_METHODS = METHODS


def method_flags(method: str | None) -> int:
    """`start` flags bits 8-11 for an HTTP method (15 for any other method, 0 for none). Methods
    are case-sensitive (RFC 9110): `"get"` is an unknown method, not `GET` (docs/hosts.md)."""
    if not method:
        return 0
    return METHODS.get(method, METHOD_OTHER) << START_METHOD_SHIFT


# ---------------------------------------------------------------------------- the engine


class Engine(EngineRuntime):
    """A loaded policy document and its live state (breakers, budgets, buckets).

    One engine is meant to be shared: every thread and every asyncio task may use it at once
    (crossings into the component are serialised by a lock; each takes a few microseconds).
    """

    @classmethod
    def from_file(cls, path: str | os.PathLike[str], **kwargs: Any) -> Engine:
        """Load a policy document from a file (YAML or JSON, UTF-8)."""
        return cls(document_text(Path(path).read_bytes(), os.fspath(path)), **kwargs)

    @classmethod
    def from_string(cls, document: str | bytes | bytearray | Mapping[str, Any], **kwargs: Any) -> Engine:
        """Load a policy document from its text (or its UTF-8 bytes, or a dict)."""
        return cls(document, **kwargs)

    # -------------------------------------------------------------- public API

    def policy(
        self,
        name: str,
        *,
        key: str | Callable[..., str] = "",
        idempotent: bool = True,
        idempotency_key: bool = False,
        method: str | None = None,
        classify: Classifier | None = None,
        on_retry: RetryHook | None = None,
        retry_if: RetryPredicate | None = None,
    ) -> Policy:
        """A handle on the named policy: a decorator, `call`/`acall`, and `attempts()`.

        `key` selects the breaker/limiter state (a string, or a function of the decorated
        call's arguments). `idempotent=False` marks the operation non-idempotent unless it
        carries an idempotency key (`idempotency_key=True` or the key itself, a non-empty
        string); `method` is the HTTP method, case-sensitive as RFC 9110 says (`"get"` is not
        `GET`). `classify` maps a result or exception to an `Outcome` (return `None` for the
        default). `on_retry(info)` runs before the sleep of each retry (a `RetryInfo`), after
        the hooks registered for the policy with `Engine.on_retry`. `retry_if(result_or_error)`
        is the retry predicate (docs/hosts.md, section 9): called once per attempt with what it
        returned or raised, it answers True (retry), False (do not) or None (the policy's rules
        decide); it wins over the policy's (`Engine.retry_if`). The core still applies pushback,
        idempotency, the attempts, Retry-After, the deadline and the budget.
        """
        if self._closed:
            raise EngineClosed()
        slot = self._slots.get(name)
        if slot is None or slot.index < 0:
            raise UnknownPolicy(name, self._names)
        if not isinstance(key, str) and not callable(key):
            raise TypeError(f"key must be a str or a function of the call's arguments, not {type(key).__name__}")
        if isinstance(key, str):
            check_key(key)  # a key function's keys are checked at each call's start
        flags = (0 if idempotent else 1) | (2 if idempotency_key else 0) | method_flags(method)
        return Policy(self, slot, key, flags, classify, on_retry, retry_if)

    def retry_if(self, policy: str, predicate: RetryPredicate | None) -> None:
        """The retry predicate of every handle on `policy` that has none of its own (see
        `policy(retry_if=)`); `None` removes it."""
        self._index(policy)
        self._slots[policy].retry_if = predicate

    def on_retry(self, policy: str, hook: RetryHook) -> None:
        """Call `hook(info)` before the sleep of every retry of `policy` (every handle on it)."""
        self._index(policy)
        self._retry_hooks[policy] = (*self._retry_hooks.get(policy, ()), hook)

    @property
    def policies(self) -> list[str]:
        """The names of the document's policies, in order."""
        return list(self._names)

    def policy_info(self, name: str) -> PolicyInfo:
        slot = self._slots.get(name)
        if slot is None or slot.index < 0:
            raise UnknownPolicy(name, self._names)
        return slot.info

    def policy_json(self, name: str) -> str:
        """The policy with every default filled in, as JSON."""
        idx = self._index(name)
        out = self._locked_op(lambda c: c.policy_json(idx))
        if out is None:
            raise UnknownPolicy(name, self._names)
        return out

    def analyze(self, name: str, layers: int = 1) -> Analysis:
        """Worst cases of a policy when `layers` layers run it."""
        idx = self._index(name)
        out = self._locked_op(lambda c: c.analyze(idx, layers))
        if out is None:
            raise UnknownPolicy(name, self._names)
        return out

    def _index(self, name: str) -> int:
        slot = self._slots.get(name)
        if slot is None or slot.index < 0:
            raise UnknownPolicy(name, self._names)
        return slot.index

    def reload(self, document: str | bytes | bytearray | Mapping[str, Any]) -> None:
        """Replace the policies, keeping the state that still applies. On error (a
        `PolicyError`) the engine is left as it was. `document` is taken as `loads` takes it."""
        document = document_text(document)

        def op(c: Core) -> list[LoadError] | None:
            errors = c.reload(document)
            if errors is None:
                # under the same lock hold: no call may start with a stale policy index
                self._document = document
                self._refresh_policies()
            return errors

        errors = self._locked_op(op, snapshot_if=lambda r: r is None)
        if errors is not None:
            raise PolicyError(errors)

    def breaker_state(self, name: str, key: str = "") -> BreakerState | None:
        """The breaker state of a policy and key now (`None` when the policy has no breaker)."""
        check_key(key)
        idx = self._index(name)
        return self._locked_op(lambda c: c.breaker_state(idx, key, self._now()))

    def set_breaker_state(self, name: str, state: BreakerState, key: str = "") -> None:
        """Force a breaker state (an operator's switch); `CLOSED` returns to normal operation."""
        check_key(key)
        idx = self._index(name)
        err = self._locked_op(
            lambda c: c.set_breaker_state(idx, key, state, self._now()), snapshot_if=lambda r: r is None
        )
        if err is not None:
            raise LeveeError(err)
        self._emit(self._drain_now())

    def _drain_now(self) -> list[Event]:
        return self._locked_op(lambda c: [event_from_raw(r, self._names) for r in c.drain_events()])

    def call_info(self, call: int) -> CallInfo | None:
        return self._locked_op(lambda c: c.call_info(call))

    def export_state(self) -> bytes:
        """The whole engine state as versioned bytes (breakers, budgets, buckets)."""
        return self._locked_op(lambda c: c.export_state())

    def import_state(self, state: bytes) -> None:
        """Restore exported state; what no longer applies is dropped. On error nothing changes."""
        err = self._locked_op(lambda c: c.import_state(bytes(state)), snapshot_if=lambda r: r is None)
        if err is not None:
            raise PolicyError([err])

    # ------------------------------------------------------------ durable calls
    # Thin: the core decides; an error names what is wrong with the record (`LoadError`).

    def durable_begin(
        self, policy: str, key: str, idempotency_key: str, flags: int, wall_now: int
    ) -> DurableStep | LoadError:
        check_key(key)
        idx = self._index(policy)
        return self._locked_op(lambda c: c.durable_begin(idx, key, idempotency_key, flags, wall_now))

    def durable_step(self, record: bytes, owner: str, wall_now: int, elapsed: int) -> DurableStep | LoadError:
        return self._locked_op(lambda c: c.durable_step(record, owner, wall_now, elapsed))

    def durable_renew(self, record: bytes, owner: str, wall_now: int, elapsed: int) -> DurableStep | LoadError:
        return self._locked_op(lambda c: c.durable_renew(record, owner, wall_now, elapsed))

    def durable_outcome(
        self, record: bytes, owner: str, wall_now: int, elapsed: int, outcome: Outcome, message: str
    ) -> DurableStep | LoadError:
        flags = 1 if outcome.overloaded else 0
        return self._locked_op(
            lambda c: c.durable_outcome(
                record, owner, wall_now, elapsed, outcome.kind, outcome.code, outcome.text, message, flags
            )
        )

    def durable_cancel(self, record: bytes, wall_now: int) -> DurableStep | LoadError:
        return self._locked_op(lambda c: c.durable_cancel(record, wall_now))

    def durable_revive(self, record: bytes, wall_now: int) -> DurableStep | LoadError:
        return self._locked_op(lambda c: c.durable_revive(record, wall_now))

    def durable_inspect(self, record: bytes) -> str | LoadError:
        return self._locked_op(lambda c: c.durable_inspect(record))

    def flush(self) -> None:
        """Send a held-back success report now (normally settled by the next call)."""
        self._locked_op(lambda c: None)

    def add_listener(self, listener: Listener) -> None:
        """Call `listener(event)` for every event (after the engine's lock is released)."""
        self._listeners.append(listener)

    def remove_listener(self, listener: Listener) -> None:
        self._listeners.remove(listener)

    def register_fallback(self, name: str, fn: Callable[[FallbackContext], Any]) -> None:
        """Register the function run when the policy's fallback chain names `name`. It gets a
        `FallbackContext` and returns the call's value (an `async def` for async calls). A name
        no policy's chain names raises `UnknownFallback` (reload the document that names it
        first)."""
        known = list(dict.fromkeys(f for n in self._names for f in self._slots[n].info.fallbacks))
        if name not in known:
            raise UnknownFallback(name, known)
        self._fallbacks[name] = fn

    def fallback(self, name: str) -> Callable[[Callable[[FallbackContext], T]], Callable[[FallbackContext], T]]:
        """Decorator form of `register_fallback`."""

        def deco(fn: Callable[[FallbackContext], T]) -> Callable[[FallbackContext], T]:
            self.register_fallback(name, fn)
            return fn

        return deco

    @property
    def trace(self) -> Callable[[TraceStep], None] | None:
        return self._tracer

    @trace.setter
    def trace(self, tracer: Callable[[TraceStep], None] | None) -> None:
        """Call `tracer(step)` at every step (slower: no success is held back while set)."""
        self._tracer = tracer
        self._hot = tracer is None and type(self._clock) is SystemClock and self._spans is None

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Flush and drop the component instance; the engine cannot be used afterwards: a new call
        raises `EngineClosed`. A graceful shutdown, never a fault: a call in flight keeps what has
        happened (an attempt that returned gives its value) and starts nothing more (README,
        "Closing"); one waiting in a bulkhead queue or sleeping before a retry is woken at once
        and ends with `EngineClosed`."""
        events: list[Event] = []
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                self._flush_locked(events)
            except ComponentFault:
                pass
            self._core.close()
            with self._park_lock:
                parked = [*self._parked.values(), *self._sleeping]
                self._parked.clear()
                self._sleeping.clear()
        for parker in parked:
            parker.wake()
        self._emit(events)


def load(path: str | os.PathLike[str], **kwargs: Any) -> Engine:
    """Load the policy document in the file at `path` (YAML or JSON) into a new `Engine`.
    A missing file raises `FileNotFoundError` naming the path. To load a document's text, use
    `loads`: the two are never guessed from the argument."""
    try:
        return Engine.from_file(path, **kwargs)
    except FileNotFoundError as e:
        text = os.fspath(path)
        if isinstance(text, str) and ("\n" in text or ":" in text.split("/")[-1]):
            raise FileNotFoundError(
                e.errno, f"{e.strerror}; this looks like a policy document, not a path: use levee.loads(text)", text
            ) from None
        raise


def loads(document: str | bytes | bytearray | Mapping[str, Any], **kwargs: Any) -> Engine:
    """Load a policy document from its text (YAML or JSON) into a new `Engine` (`load` reads a
    file). UTF-8 bytes of the text, and a dict (as `json.load` or `yaml.safe_load` give it),
    are taken too; anything else raises `TypeError`."""
    return Engine.from_string(document, **kwargs)


# ---------------------------------------------------------------------------- policies


class Policy:
    """A named policy of an engine, with per-use options. Use it as a decorator (sync or
    `async def`), with `call`/`acall`, or with `attempts()`/`attempts_async()`."""

    __slots__ = ("_classify", "_flags", "_holdable", "_key", "_key_fn", "_on_retry", "_retry_if", "_slot", "engine")

    def __init__(self, engine: Engine, slot: _PolicySlot, key: str | Callable[..., str], flags: int,
                 classify: Classifier | None, on_retry: RetryHook | None = None,
                 retry_if: RetryPredicate | None = None) -> None:  # fmt: skip
        self.engine = engine
        self._retry_if = retry_if
        #: whether a first success may be held back (reported by the next call): not when a
        #: classifier or a predicate of this handle must see it
        self._holdable = classify is None and retry_if is None
        self._on_retry = on_retry
        self._slot = slot
        self._key_fn: Callable[..., str] | None = None
        self._key = ""
        if callable(key):
            self._key_fn = key
        else:
            self._key = key
        self._flags = flags
        self._classify = classify

    @property
    def name(self) -> str:
        return self._slot.info.name

    @property
    def info(self) -> PolicyInfo:
        return self._slot.info

    def _key_for(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        fn = self._key_fn
        return self._key if fn is None else str(fn(*args, **kwargs))

    def _hooks(self) -> tuple[RetryHook, ...]:
        hooks = self.engine._retry_hooks.get(self._slot.info.name, ())
        return hooks if self._on_retry is None else (*hooks, self._on_retry)

    def _state(self, call: int, gen: int, started: int, key: str, args: tuple[Any, ...],
               kwargs: dict[str, Any], span: Any = None) -> _Call:  # fmt: skip
        slot = self._slot
        return _Call(self.engine, slot, call, gen, started, self._classify, args, kwargs, key, self._hooks(),
                     self._retry_if or slot.retry_if, span)  # fmt: skip

    # -------------------------------------------------------------- sync

    def call(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
        """Run `fn(*args, **kwargs)` under the policy (synchronously)."""
        return self._run(fn, args, kwargs)

    def _run(self, fn: Callable[..., T], args: tuple[Any, ...], kwargs: dict[str, Any]) -> T:
        eng = self.engine
        slot = self._slot
        key = self._key if self._key_fn is None else self._key_for(args, kwargs)
        span = eng._open_span(slot, key) if eng._spans is not None else None
        call, gen, v, now = eng._start(slot, key, self._flags, span)
        timeout = v >> 16
        tmax = slot.tmax
        if v & 0xFF1F == 0x100 and eng._hot and (not tmax or 0 < timeout <= tmax):
            # The hot path: attempt 1 within the contract, no events pending. One crossing if it
            # succeeds.
            start = _monotonic_ns()
            if timeout:
                token = _ATTEMPT_DEADLINE.set(start + timeout)
                try:
                    value = fn(*args, **kwargs)
                except Exception as e:
                    st = self._state(call, gen, now, key, args, kwargs, span)
                    return cast(T, self._after_first(st, v, timeout, None, e, start, fn, args, kwargs))
                except BaseException:
                    self._state(call, gen, now, key, (), {}, span).cancel()
                    raise
                finally:
                    _ATTEMPT_DEADLINE.reset(token)
            else:
                try:
                    value = fn(*args, **kwargs)
                except Exception as e:
                    st = self._state(call, gen, now, key, args, kwargs, span)
                    return cast(T, self._after_first(st, v, timeout, None, e, start, fn, args, kwargs))
                except BaseException:
                    self._state(call, gen, now, key, (), {}, span).cancel()
                    raise
            end = _monotonic_ns()
            if (
                (timeout == 0 or end - start < timeout)  # a late success is never held back
                and self._holdable
                and slot.retry_if is None
                and (_RESULT_IS_RESPONSE.get(type(value)) is False or outcome_for_result(value) is None)
            ):
                eng._pending.append((call, end, end - start, gen))
                if eng._parked:  # calls wait in a bulkhead queue: settle, so the slot is granted now
                    eng._settle_parked()
                if eng._sink is not None:
                    eng._count_success(slot, end - start)
                if end >= eng._snapshot_due:
                    eng._snapshot_tick(end)
                return value
            st = self._state(call, gen, now, key, args, kwargs, span)
            return cast(T, self._after_first(st, v, timeout, value, None, start, fn, args, kwargs))
        st = self._state(call, gen, now, key, args, kwargs, span)
        return cast(T, _drive_sync(st, v, fn, args, kwargs))

    def _after_first(self, st: _Call, v: int, timeout: int, value: Any, exc: BaseException | None, start: int,
                     fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:  # fmt: skip
        """Continue the protocol after a first attempt that ran on the hot path."""
        return _drive_sync(st, v, fn, args, kwargs, st.outcome_of(value, exc, start, _monotonic_ns(), timeout))

    # -------------------------------------------------------------- async

    async def acall(self, fn: Callable[P, Awaitable[T]], /, *args: P.args, **kwargs: P.kwargs) -> T:
        """Await `fn(*args, **kwargs)` under the policy; per-attempt timeouts cancel the attempt."""
        eng = self.engine
        slot = self._slot
        key = self._key if self._key_fn is None else self._key_for(args, kwargs)
        span = eng._open_span(slot, key) if eng._spans is not None else None
        call, gen, v, now = eng._start(slot, key, self._flags, span)
        timeout = v >> 16
        tmax = slot.tmax
        if v & 0xFF1F == 0x100 and eng._hot and (not tmax or 0 < timeout <= tmax):
            # The hot path, as in `call`; the attempt's timeout cancels it.
            start = _monotonic_ns()
            try:
                if timeout:
                    token = _ATTEMPT_DEADLINE.set(start + timeout)
                    try:
                        import asyncio  # not at the top: see _clock.SystemClock

                        cm = asyncio.timeout(timeout / 1e9)
                        async with cm:
                            value = await fn(*args, **kwargs)
                    finally:
                        _ATTEMPT_DEADLINE.reset(token)
                else:
                    value = await fn(*args, **kwargs)
            except Exception as e:
                if timeout and isinstance(e, TimeoutError) and cm.expired():
                    e = timed_out(e, 1, timeout)
                st = self._state(call, gen, now, key, args, kwargs, span)
                return cast(T, await self._after_first_async(st, v, timeout, None, e, start, fn, args, kwargs))
            except BaseException:
                self._state(call, gen, now, key, (), {}, span).cancel()
                raise
            end = _monotonic_ns()
            if (
                (timeout == 0 or end - start < timeout)
                and self._holdable
                and slot.retry_if is None
                and outcome_for_result(value) is None
            ):
                eng._pending.append((call, end, end - start, gen))
                if eng._parked:
                    eng._settle_parked()
                if eng._sink is not None:
                    eng._count_success(slot, end - start)
                if end >= eng._snapshot_due:
                    eng._snapshot_tick(end)
                return value
            st = self._state(call, gen, now, key, args, kwargs, span)
            return cast(T, await self._after_first_async(st, v, timeout, value, None, start, fn, args, kwargs))
        st = self._state(call, gen, now, key, args, kwargs, span)
        return cast(T, await _drive_async(st, v, fn, args, kwargs))

    async def _after_first_async(self, st: _Call, v: int, timeout: int, value: Any, exc: BaseException | None,
                                 start: int, fn: Callable[..., Awaitable[Any]], args: tuple[Any, ...],
                                 kwargs: dict[str, Any]) -> Any:  # fmt: skip
        res = st.outcome_of(value, exc, start, _monotonic_ns(), timeout)
        return await _drive_async(st, v, fn, args, kwargs, res)

    # -------------------------------------------------------------- decorator

    def __call__(self, fn: Callable[P, T]) -> Callable[P, T]:
        """Decorate a function (or an `async def`) so every call runs under the policy. A
        generator function raises `TypeError`: calling it only makes the generator, so its
        body would run outside the policy."""
        if inspect.isgeneratorfunction(fn) or inspect.isasyncgenfunction(fn):
            raise TypeError(
                f"{getattr(fn, '__qualname__', fn)!r} is a generator function: calling it only makes the generator "
                "and its body would run outside the policy; decorate a function that returns the values, or "
                "use policy.attempts() around the iteration"
            )
        if inspect.iscoroutinefunction(fn):
            afn = cast(Callable[P, Awaitable[Any]], fn)
            acall = self.acall

            @functools.wraps(fn)
            async def async_wrapper(*args: P.args, **kwargs: P.kwargs) -> Any:
                return await acall(afn, *args, **kwargs)

            return cast(Callable[P, T], async_wrapper)

        run = self._run

        @functools.wraps(fn)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> T:
            return run(fn, args, kwargs)

        return wrapper

    # -------------------------------------------------------------- iterators

    def attempts(self) -> Attempts:
        """`for attempt in policy.attempts(): with attempt: ...` (see `Attempts`)."""
        return Attempts(self)

    def attempts_async(self) -> AsyncAttempts:
        """`async for attempt in policy.attempts_async(): async with attempt: ...`."""
        return AsyncAttempts(self)


class Attempt:
    """One attempt of an `attempts()` loop. Use `with attempt:` (sync) or `async with attempt:`
    (asyncio: the per-attempt timeout cancels the block). An exception in the block is
    reported and swallowed when the policy retries; set `attempt.result` to the block's value
    (an HTTP response is classified by its status)."""

    __slots__ = ("_cm", "_ns", "_res", "_scope", "_st", "_start", "number", "result", "timeout")

    def __init__(self, st: _Call, number: int, timeout: int) -> None:
        self.number = number
        #: seconds allowed for this attempt, or None
        self.timeout: float | None = timeout / 1e9 if timeout else None
        self.result: Any = None
        self._ns = timeout
        self._st = st
        self._start = 0
        self._res: _AttemptResult | None = None
        self._scope: _AttemptScope | None = None
        self._cm: Any = None

    def __enter__(self) -> Attempt:
        self._start = self._st.engine._now()
        self._scope = _AttemptScope(self._st.engine, self._start, self._ns)
        return self

    def _leave(self) -> None:
        if self._scope is not None:
            self._scope.close()
            self._scope = None

    def __exit__(self, et: type[BaseException] | None, exc: BaseException | None, tb: Any) -> bool:
        self._leave()
        if exc is not None and not isinstance(exc, Exception):
            return False
        self._res = self._st.outcome_of(self.result, exc, self._start, self._st.engine._now(), self._ns)
        return True

    async def __aenter__(self) -> Attempt:
        self.__enter__()
        if self._ns:
            self._cm = attempt_timeout_cm(self._st.engine, self._ns)
            await self._cm.__aenter__()
        return self

    async def __aexit__(self, et: type[BaseException] | None, exc: BaseException | None, tb: Any) -> bool:
        if self._cm is not None:
            cm, self._cm = self._cm, None
            try:
                await cm.__aexit__(et, exc, tb)
            except TimeoutError as e:
                self._leave()
                self._res = _AttemptResult(Outcome.timeout(), None, timed_out(e, self.number, self._ns), self._start,
                                           self._st.engine._now())  # fmt: skip
                return True
        return self.__exit__(et, exc, tb)

    def _outcome(self) -> _AttemptResult:
        if self._res is None:  # the block was not entered: its `result` is the outcome
            now = self._st.engine._now()
            return self._st.outcome_of(self.result, None, now, now, 0)
        return self._res


class Attempts:
    """Iterate attempts of one call: `for attempt in policy.attempts(): with attempt: ...`.
    After the loop, `result` holds the successful attempt's `result` or the fallback's value.
    When the core gives up the loop raises a `CallFailed` subclass."""

    def __init__(self, policy: Policy) -> None:
        self._policy = policy
        self.result: Any = None

    def __iter__(self) -> Generator[Attempt, None, None]:
        pol = self._policy
        eng = pol.engine
        key = pol._key_for((), {})
        span = eng._open_span(pol._slot, key)
        call, gen_no, v, now = eng._start(pol._slot, key, pol._flags, span)
        st = pol._state(call, gen_no, now, key, (), {}, span)
        proto = _protocol(st, v)
        try:
            action = next(proto)
            while True:
                op = action[0]
                if op == ATTEMPT:
                    attempt = Attempt(st, action[1], action[2])
                    yield attempt
                    action = proto.send(attempt._outcome())
                elif op == HEDGE:
                    # a loop runs one block at a time: hedges run one after another
                    serial = hedge_serial(action[1])
                    try:
                        step = next(serial)
                        while True:
                            if step[0] == ATTEMPT:
                                attempt = Attempt(st, step[1], step[2])
                                yield attempt
                                step = serial.send(attempt._outcome())
                            else:
                                eng._clock.sleep(step[1] / 1e9)
                                step = serial.send(None)
                    except StopIteration:
                        pass
                    finally:
                        serial.close()
                    action = proto.send(None)
                elif op == _SLEEP:
                    sleep_sync(eng, action[1], action[2])
                    action = proto.send(None)
                else:
                    action = proto.send(_run_fallback_sync(st, action[1], action[2]))
        except StopIteration as stop:
            self.result = stop.value
        finally:
            proto.close()


class AsyncAttempts:
    """`async for attempt in policy.attempts_async(): async with attempt: ...`."""

    def __init__(self, policy: Policy) -> None:
        self._policy = policy
        self.result: Any = None

    def __aiter__(self) -> AsyncGenerator[Attempt, None]:
        return self._iterate()

    async def _iterate(self) -> AsyncGenerator[Attempt, None]:
        pol = self._policy
        eng = pol.engine
        key = pol._key_for((), {})
        span = eng._open_span(pol._slot, key)
        call, gen_no, v, now = eng._start(pol._slot, key, pol._flags, span)
        st = pol._state(call, gen_no, now, key, (), {}, span)
        proto = _protocol(st, v)
        try:
            action = next(proto)
            while True:
                op = action[0]
                if op == ATTEMPT:
                    attempt = Attempt(st, action[1], action[2])
                    yield attempt
                    action = proto.send(attempt._outcome())
                elif op == HEDGE:
                    serial = hedge_serial(action[1])
                    try:
                        step = next(serial)
                        while True:
                            if step[0] == ATTEMPT:
                                attempt = Attempt(st, step[1], step[2])
                                yield attempt
                                step = serial.send(attempt._outcome())
                            else:
                                await eng._clock.sleep_async(step[1] / 1e9)
                                step = serial.send(None)
                    except StopIteration:
                        pass
                    finally:
                        serial.close()
                    action = proto.send(None)
                elif op == _SLEEP:
                    await sleep_async(eng, action[1], action[2])
                    action = proto.send(None)
                else:
                    action = proto.send(await _run_fallback_async(st, action[1], action[2]))
        except StopIteration as stop:
            self.result = stop.value
        finally:
            proto.close()


# ---------------------------------------------------------------------------- call()


def call(policy: Policy, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
    """Run `fn(*args, **kwargs)` under `policy`; for an `async def`, return an awaitable (of the
    same type as `fn`'s coroutine)."""
    if inspect.iscoroutinefunction(fn):
        return cast(T, policy.acall(cast(Callable[P, Awaitable[Any]], fn), *args, **kwargs))
    return policy.call(fn, *args, **kwargs)

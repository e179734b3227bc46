"""The driver: the step protocol as a sans-I/O generator, from the core's verdicts to I/O
actions (run an attempt with a timeout, sleep, run a fallback) and to the call's end (a
value, an error, or the degraded attempt after a fault). Every executor runs it: sync and
asyncio calls, the attempt iterators and the httpx transports (`_io`, `engine`, `http`).
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ._events import logger
from ._runtime import _Fault
from .errors import failure_for
from .outcomes import Classifier, Outcome, outcome_for_exception, outcome_for_result
from .types import OutcomeKind, Reason, Verdict

if TYPE_CHECKING:
    from ._abi import Core
    from ._runtime import EngineRuntime, _PolicySlot

ATTEMPT, WAIT, DONE, RETRY, FALLBACK, FAIL, INVALID = range(7)
_SLEEP = 7  # protocol action: sleep


@dataclass(frozen=True, slots=True)
class FallbackContext:
    """What a fallback function receives: the policy, the fallback's name, what triggered it,
    and the last attempt's error or result, plus the original arguments when known."""

    policy: str
    fallback: str
    reason: Reason
    error: BaseException | None
    result: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


class _AttemptResult:
    __slots__ = ("end", "exc", "outcome", "start", "value")

    def __init__(self, outcome: Outcome, value: Any, exc: BaseException | None, start: int, end: int) -> None:
        self.outcome = outcome
        self.value = value
        self.exc = exc
        self.start = start
        self.end = end


class _Call:
    """The host side of one call: what the protocol needs to remember."""

    __slots__ = (
        "args",
        "attempts",
        "call",
        "classify",
        "deadline_at",
        "engine",
        "fallback_value",
        "fell_back",
        "finished",
        "gen",
        "kwargs",
        "last",
        "slot",
        "started",
        "unregistered",
    )  # fmt: skip

    def __init__(self, engine: EngineRuntime, slot: _PolicySlot, call: int, gen: int, started: int,
                 classify: Classifier | None, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:  # fmt: skip
        self.engine = engine
        self.slot = slot
        self.call = call
        self.gen = gen
        self.attempts = 0
        self.classify = classify
        self.args = args
        self.kwargs = kwargs
        self.started = started
        d = slot.info.deadline
        self.deadline_at = started + d if d else 0
        self.last: _AttemptResult | None = None
        self.fallback_value: Any = None
        self.fell_back = False
        self.finished = False
        self.unregistered: tuple[str, ...] = ()

    def outcome_of(self, value: Any, exc: BaseException | None, start: int, end: int, timeout: int) -> _AttemptResult:
        if timeout and end - start > timeout:
            return _AttemptResult(Outcome.timeout(), value, exc, start, end)
        classify = self.classify
        subject = exc if exc is not None else value
        outcome = classify(subject) if classify is not None else None
        if outcome is None:
            if exc is not None:
                outcome = outcome_for_exception(exc)
            else:
                outcome = outcome_for_result(value) or Outcome.success()
        return _AttemptResult(outcome, value, exc, start, end)

    def failure(self, reason: Reason, hint_ns: int) -> BaseException:
        last = self.last
        return failure_for(
            reason,
            policy=self.slot.info.name,
            attempts=self.attempts,
            last_error=last.exc if last is not None else None,
            last_result=last.value if last is not None and last.exc is None else None,
            retry_after=hint_ns / 1e9 if hint_ns else None,
            unregistered=self.unregistered,
        )

    def cancel(self) -> None:
        """Abandon the call in the engine (the caller was cancelled)."""
        if self.finished:
            return
        self.finished = True
        call = self.call

        def op(c: Core) -> int:
            c.cancel(call, self.engine._now())
            return 0

        try:
            self.engine._cross(self.gen, op)
        except _Fault:
            pass

    def report(self, res: _AttemptResult) -> int:
        eng = self.engine
        o = res.outcome
        wall = int(eng._clock.time()) if o.kind is OutcomeKind.HTTP_STATUS and o.text else 0
        flags = 1 if o.overloaded else 0
        call = self.call
        v = eng._cross(
            self.gen, lambda c: c.report(call, res.end, res.end - res.start, o.kind, o.code, o.text, wall, flags)
        )
        if eng._tracer is not None:
            eng._trace("report", self, o, v)
        return v

    def acquire(self) -> int:
        call = self.call
        v = self.engine._cross(self.gen, lambda c: c.acquire(call, self.engine._now()))
        if self.engine._tracer is not None:
            self.engine._trace("acquire", self, None, v)
        return v

    def report_fallback(self, ok: bool) -> int:
        call = self.call
        v = self.engine._cross(self.gen, lambda c: c.report_fallback(call, self.engine._now(), ok))
        if self.engine._tracer is not None:
            self.engine._trace("report-fallback", self, None, v)
        return v

    def degraded_value(self) -> Any:
        """After an engine fault: the last attempt's outcome stands, without retries."""
        last = self.last
        assert last is not None
        if last.exc is not None:
            raise last.exc
        return last.value


# A protocol action: (ATTEMPT, number, timeout_ns) | (_SLEEP, ns, 0) | (FALLBACK, name, reason)
Action = tuple[int, Any, Any]


def _protocol(st: _Call, v: int) -> Generator[Action, Any, Any]:
    """The step protocol as a generator of I/O actions, shared by every executor (sync, asyncio,
    iterators, the httpx transport). It only relays the core's verdicts, clamped."""
    info = st.slot.info
    if v >= 0 and st.engine._tracer is not None:
        st.engine._trace("start", st, None, v)
    if v < 0:
        # the engine faulted at `start`: one unguarded attempt
        st.last = yield (ATTEMPT, 1, 0)
        st.finished = True
        return st.degraded_value()
    try:
        while True:
            kind = v & 0xF
            if kind == ATTEMPT:
                st.attempts += 1
                if st.attempts > info.max_attempts:
                    # never past the policy's maximum, whatever the guest says
                    st.cancel()
                    raise st.failure(Reason.RETRIES_EXHAUSTED, 0)
                timeout = v >> 16
                if st.deadline_at:
                    left = max(1, st.deadline_at - st.engine._now())
                    timeout = left if timeout == 0 else min(timeout, left)
                res: _AttemptResult = yield (ATTEMPT, st.attempts, timeout)
                st.last = res
                try:
                    v = st.report(res)
                except _Fault:
                    st.finished = True
                    return st.degraded_value()
            elif kind == RETRY or kind == WAIT:
                delay = v >> 16
                if st.deadline_at:
                    delay = min(delay, max(0, st.deadline_at - st.engine._now()))
                if delay:
                    yield (_SLEEP, delay, 0)
                try:
                    v = st.acquire()
                except _Fault:
                    st.finished = True
                    if st.last is None:
                        st.last = yield (ATTEMPT, st.attempts + 1, 0)
                    return st.degraded_value()
            elif kind == FALLBACK:
                idx = v >> 16
                name = info.fallbacks[idx] if idx < len(info.fallbacks) else f"#{idx}"
                ok, value = yield (FALLBACK, name, Reason.from_code((v >> 8) & 0xFF))
                if ok:
                    st.fell_back = True
                    st.fallback_value = value
                try:
                    v = st.report_fallback(ok)
                except _Fault:
                    st.finished = True
                    if ok:
                        return value
                    return st.degraded_value()
            elif kind == DONE:
                st.finished = True
                st.engine._maybe_snapshot()
                if st.fell_back:
                    return st.fallback_value
                last = st.last
                if last is not None and last.exc is not None:
                    raise last.exc
                return last.value if last is not None else None
            elif kind == FAIL:
                st.finished = True
                st.engine._maybe_snapshot()
                raise st.failure(Reason.from_code((v >> 8) & 0xFF), v >> 16)
            else:
                # `invalid` (say, the call was evicted from the engine's bounded call table) or a
                # kind no contract knows: an untrusted answer. The call goes on without the policy:
                # the attempt that ran stands, or one attempt runs.
                st.finished = True
                logger.warning(
                    "levee: the engine answered %s for call %d of policy %r; the call proceeds unguarded",
                    Verdict.unpack(v),
                    st.call,
                    info.name,
                )
                if st.last is None:
                    st.last = yield (ATTEMPT, st.attempts + 1, 0)
                return st.degraded_value()
    except GeneratorExit:
        st.cancel()
        raise


def _fallback_context(st: _Call, name: str, reason: Reason) -> FallbackContext:
    last = st.last
    return FallbackContext(
        policy=st.slot.info.name,
        fallback=name,
        reason=reason,
        error=last.exc if last is not None else None,
        result=last.value if last is not None and last.exc is None else None,
        args=st.args,
        kwargs=st.kwargs,
    )


def _unregistered(st: _Call, name: str) -> tuple[bool, Any]:
    """A fallback the chain names but nobody registered: it fails, and the error says why."""
    if name not in st.unregistered:
        st.unregistered = (*st.unregistered, name)
    logger.warning("levee: fallback %r of policy %r is not registered", name, st.slot.info.name)
    return False, None

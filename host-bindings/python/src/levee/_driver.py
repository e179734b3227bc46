"""The driver: the step protocol as a sans-I/O generator, from the core's verdicts to I/O
actions (run an attempt with a timeout, sleep, run a fallback) and to the call's end (a
value, an error, or the degraded attempt after a fault). Every executor runs it: sync and
asyncio calls, the attempt iterators and the httpx transports (`_io`, `engine`, `http`).
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ._events import logger
from ._runtime import _Fault
from .errors import failure_for
from .outcomes import Classifier, Outcome, outcome_for_exception, outcome_for_result
from .telemetry import emit_attempt, emit_call
from .types import OutcomeKind, Reason, Verdict

if TYPE_CHECKING:
    from ._abi import Core
    from ._runtime import EngineRuntime, _PolicySlot

ATTEMPT, WAIT, DONE, RETRY, FALLBACK, FAIL, INVALID = range(7)
_SLEEP = 7  # protocol action: sleep


@dataclass(frozen=True, slots=True)
class FallbackContext:
    """What a fallback function receives: the policy, the fallback's name, what triggered it,
    the attempts made and the last attempt's error or result, plus the original arguments
    when known."""

    policy: str
    fallback: str
    reason: Reason
    error: BaseException | None
    result: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    attempts: int = 0


@dataclass(frozen=True, slots=True)
class RetryInfo:
    """What an `on_retry` hook receives, before the sleep of each retry (docs/telemetry.md):
    the call's policy and key, the attempt that failed (1 for the first), the delay about to
    start in seconds, and what that attempt raised (`error`) or returned (`result`)."""

    policy: str
    key: str
    attempt: int
    delay: float
    error: BaseException | None
    result: Any
    reason: Reason = Reason.NONE


RetryHook = Callable[[RetryInfo], None]


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
        "fallback_error",
        "fallback_value",
        "fell_back",
        "finished",
        "gen",
        "http",
        "key",
        "kwargs",
        "last",
        "on_retry",
        "slot",
        "span",
        "started",
        "t",
        "unregistered",
    )  # fmt: skip

    def __init__(self, engine: EngineRuntime, slot: _PolicySlot, call: int, gen: int, started: int,
                 classify: Classifier | None, args: tuple[Any, ...], kwargs: dict[str, Any], key: str = "",
                 on_retry: tuple[RetryHook, ...] = ()) -> None:  # fmt: skip
        self.engine = engine
        self.slot = slot
        self.call = call
        self.gen = gen
        self.key = key
        self.attempts = 0
        self.classify = classify
        self.args = args
        self.kwargs = kwargs
        #: the `now` given to `start`; `t` is the `now` of the last crossing
        self.started = started
        self.t = started
        d = slot.info.deadline
        self.deadline_at = started + d if d else 0
        self.last: _AttemptResult | None = None
        self.fallback_value: Any = None
        self.fallback_error: BaseException | None = None
        self.fell_back = False
        self.finished = False
        self.unregistered: tuple[str, ...] = ()
        self.on_retry = on_retry
        #: an HTTP integration's call (its attempt spans carry http.request.resend_count)
        self.http = False
        spans = engine._spans
        self.span: Any = spans.start_call(slot.info.name, key) if spans is not None else None

    def outcome_of(self, value: Any, exc: BaseException | None, start: int, end: int, timeout: int) -> _AttemptResult:
        """Describe what an attempt did (never whether it was late: the core decides that from
        `elapsed`, docs/hosts.md section 4)."""
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

    def ended(self, result: str, reason: Reason | None = None) -> None:
        """The call is over: `levee.calls` and the end of its span (docs/telemetry.md)."""
        self.finished = True
        spans = self.engine._spans
        if spans is not None and self.span is not None:
            span, self.span = self.span, None
            try:
                spans.end_call(span, result, reason.wit if reason else None)
            except Exception:
                logger.exception("levee: telemetry sink %r failed", spans)
        sink = self.engine._sink
        if sink is not None:
            try:
                emit_call(sink, self.slot.info.name, result, self.attempts > 1, reason.wit if reason else None)
            except Exception:
                logger.exception("levee: telemetry sink %r failed", sink)

    def cancel(self) -> None:
        """Abandon the call in the engine (the caller was cancelled)."""
        if self.finished:
            return
        self.ended("cancelled")
        if self.gen != self.engine._generation:
            return  # its instance was replaced: nothing to cancel
        call = self.call
        now = self.engine._now()

        def op(c: Core) -> int:
            c.cancel(call, now)
            return 0

        try:
            self.engine._cross(self, op)
        except _Fault:
            pass

    def report(self, res: _AttemptResult) -> int:
        eng = self.engine
        o = res.outcome
        wall = int(eng._clock.time()) if o.kind is OutcomeKind.HTTP_STATUS and o.text else 0
        flags = 1 if o.overloaded else 0
        call = self.call
        self.t = res.end
        elapsed = res.end - res.start
        v = eng._cross(self, lambda c: c.report(call, res.end, elapsed, o.kind, o.code, o.text, wall, flags))
        sink = eng._sink
        if sink is not None:
            try:
                emit_attempt(sink, self.slot.info.name, o.kind.wit, elapsed)
            except Exception:
                logger.exception("levee: telemetry sink %r failed", sink)
        if eng._tracer is not None:
            eng._trace("report", self, o, v)
        return v

    def acquire(self) -> int:
        call = self.call
        now = self.t = self.engine._now()
        v = self.engine._cross(self, lambda c: c.acquire(call, now))
        if self.engine._tracer is not None:
            self.engine._trace("acquire", self, None, v)
        return v

    def report_fallback(self, ok: bool) -> int:
        call = self.call
        now = self.t = self.engine._now()
        v = self.engine._cross(self, lambda c: c.report_fallback(call, now, ok))
        if self.engine._tracer is not None:
            self.engine._trace("report-fallback", self, None, v)
        return v

    def degraded_value(self) -> Any:
        """After a guest fault: the last attempt's own result stands, without retries."""
        last = self.last
        assert last is not None
        if last.exc is not None:
            self.ended("failure")
            raise last.exc
        self.ended("success")
        return last.value

    def attempt_span(self, number: int, degraded: bool) -> Any:
        spans = self.engine._spans
        if spans is None:
            return None
        try:
            return spans.start_attempt(self.span, number, degraded, self.http)
        except Exception:
            logger.exception("levee: telemetry sink %r failed", spans)
            return None

    def end_attempt_span(self, token: Any, res: _AttemptResult | None) -> None:
        spans = self.engine._spans
        if spans is None or token is None:
            return
        try:
            spans.end_attempt(token, res.outcome.kind.wit if res is not None else None)
        except Exception:
            logger.exception("levee: telemetry sink %r failed", spans)

    def retry_hooks(self, delay: int) -> None:
        last = self.last
        info = RetryInfo(
            policy=self.slot.info.name,
            key=self.key,
            attempt=self.attempts,
            delay=delay / 1e9,
            error=last.exc if last is not None else None,
            result=last.value if last is not None and last.exc is None else None,
        )
        for hook in self.on_retry:
            try:
                hook(info)
            except Exception:
                logger.exception("levee: on_retry hook %r failed", hook)


# A protocol action: (ATTEMPT, number, timeout_ns) | (_SLEEP, ns, 0) | (FALLBACK, name, reason)
Action = tuple[int, Any, Any]

_MAX_REASON = max(Reason)


def contract_breach(st: _Call, v: int, op: str) -> str | None:
    """Whether verdict `v` of crossing `op` breaks the contract (docs/hosts.md, section 2);
    `st.t` is the `now` that crossing was given. Returns what is wrong, or None."""
    info = st.slot.info
    kind = v & 0xF
    if kind > INVALID or v & 0xE0:
        return f"unknown verdict kind {kind} or reserved bits set ({v:#x})"
    detail = (v >> 8) & 0xFF
    payload = v >> 16
    if kind == ATTEMPT:
        n = st.attempts + 1
        if detail != min(n, 255) or n > info.max_attempts:
            return f"attempt {detail} when attempt {n} of at most {info.max_attempts} was due"
        left = st.deadline_at - st.t if st.deadline_at else 0
        if info.attempt_timeout and payload > info.attempt_timeout:
            return f"attempt timeout {payload} ns above the policy's {info.attempt_timeout} ns"
        if st.deadline_at and payload > left:
            return f"attempt timeout {payload} ns past the deadline ({left} ns left)"
        if payload == 0 and (info.attempt_timeout or st.deadline_at):
            return "no attempt timeout under a policy with an attempt timeout or a deadline"
    elif kind == RETRY or kind == WAIT:
        if st.deadline_at and st.t + payload > st.deadline_at:
            return f"a delay of {payload} ns ends past the deadline"
        if detail > _MAX_REASON:
            return f"unknown reason {detail}"
    elif kind == FALLBACK:
        if payload >= len(info.fallbacks):
            return f"fallback index {payload} of a chain of {len(info.fallbacks)}"
    elif kind == FAIL:
        if detail == 0 or detail > _MAX_REASON:
            return f"fail with reason {detail}"
    elif kind == DONE and op in ("start", "acquire"):
        return f"done answered to {op}"
    return None


def _degraded(st: _Call, op: str) -> Generator[Action, Any, Any]:
    """The end of a call after a guest fault at crossing `op` (docs/hosts.md, section 3): no
    retry, no fallback; the attempt's or the fallback's own result, or one degraded attempt."""
    st.finished = True
    if op == "report":
        return st.degraded_value()
    if op == "report-fallback":
        if st.fallback_error is not None:
            st.ended("failure")
            raise st.fallback_error
        st.ended("fallback")
        return st.fallback_value
    info = st.slot.info
    timeout = info.attempt_timeout
    if st.deadline_at:
        left = st.deadline_at - st.engine._now()
        if left <= 0:
            st.ended("failure", Reason.DEADLINE)
            raise st.failure(Reason.DEADLINE, 0)
        timeout = left if timeout == 0 else min(timeout, left)
    span = st.attempt_span(st.attempts + 1, True)
    try:
        st.last = yield (ATTEMPT, st.attempts + 1, timeout)
    finally:
        st.end_attempt_span(span, st.last if span is not None else None)
    st.attempts += 1
    return st.degraded_value()


def _protocol(st: _Call, v: int) -> Generator[Action, Any, Any]:
    """The step protocol as a generator of I/O actions, shared by every executor (sync, asyncio,
    iterators, the httpx transport). It relays the core's verdicts after checking them against
    the contract; a guest fault of any kind ends the call on the one recovery path."""
    info = st.slot.info
    eng = st.engine
    if v >= 0 and eng._tracer is not None:
        eng._trace("start", st, None, v)
    op = "start"
    try:
        if v < 0:  # the guest trapped at `start` (recovered, reported)
            return (yield from _degraded(st, op))
        while True:
            kind = v & 0xF
            if kind == INVALID:
                eng._guest_fault(st, "invalid", f"{Verdict.unpack(v)} answered to {op}")
                return (yield from _degraded(st, op))
            breach = contract_breach(st, v, op)
            if breach is not None:
                eng._guest_fault(st, "contract", f"{breach} (verdict {v:#x} answered to {op})")
                return (yield from _degraded(st, op))
            if kind == ATTEMPT:
                st.attempts += 1
                span = st.attempt_span(st.attempts, False) if eng._spans is not None else None
                res: _AttemptResult | None = None
                try:
                    res = yield (ATTEMPT, st.attempts, v >> 16)
                finally:
                    if span is not None:
                        st.end_attempt_span(span, res)
                assert res is not None
                st.last = res
                op = "report"
                try:
                    v = st.report(res)
                except _Fault:
                    return (yield from _degraded(st, op))
            elif kind == RETRY or kind == WAIT:
                delay = v >> 16
                if kind == RETRY and st.on_retry:
                    st.retry_hooks(delay)
                if delay:
                    yield (_SLEEP, delay, 0)
                op = "acquire"
                try:
                    v = st.acquire()
                except _Fault:
                    return (yield from _degraded(st, op))
            elif kind == FALLBACK:
                name = info.fallbacks[v >> 16]
                ok, value = yield (FALLBACK, name, Reason.from_code((v >> 8) & 0xFF))
                if ok:
                    st.fell_back = True
                    st.fallback_value = value
                    st.fallback_error = None
                else:
                    st.fallback_error = value
                op = "report-fallback"
                try:
                    v = st.report_fallback(ok)
                except _Fault:
                    return (yield from _degraded(st, op))
            elif kind == DONE:
                eng._maybe_snapshot()
                if st.fell_back:
                    st.ended("fallback")
                    return st.fallback_value
                last = st.last
                if last is not None and last.exc is not None:
                    st.ended("failure")
                    raise last.exc
                st.ended("success")
                return last.value if last is not None else None
            else:  # FAIL
                eng._maybe_snapshot()
                reason = Reason.from_code((v >> 8) & 0xFF)
                st.ended("failure", reason)
                raise st.failure(reason, v >> 16)
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
        attempts=st.attempts,
    )


def _unregistered(st: _Call, name: str) -> tuple[bool, Any]:
    """A fallback the chain names but nobody registered: it fails, and the error says why."""
    if name not in st.unregistered:
        st.unregistered = (*st.unregistered, name)
    logger.warning("levee: fallback %r of policy %r is not registered", name, st.slot.info.name)
    return False, None

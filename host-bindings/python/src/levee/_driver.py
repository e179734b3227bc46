"""The driver: the step protocol as a sans-I/O generator, from the core's verdicts to I/O
actions (run an attempt with a timeout, sleep, run a fallback) and to the call's end (a
value, an error, or the degraded attempt after a fault). Every executor runs it: sync and
asyncio calls, the attempt iterators and the httpx transports (`_io`, `engine`, `http`).
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ._constants import HEDGE_MAX_ATTEMPTS, REPORT_CALLER_NO_RETRY, REPORT_CALLER_RETRY, VERDICT_RESERVED_MASK
from ._events import logger
from ._runtime import PARK_MASK, PARK_VERDICT, WAKES_BIT, _Fault
from .errors import EngineClosed, failure_for
from .outcomes import Classifier, Outcome, outcome_for_exception, outcome_for_result
from .telemetry import emit_attempt, emit_call
from .types import OutcomeKind, Reason, Verdict

if TYPE_CHECKING:
    from ._abi import Core
    from ._runtime import EngineRuntime, _PolicySlot

ATTEMPT, WAIT, DONE, RETRY, FALLBACK, FAIL, INVALID, HEDGE = range(8)
#: `_Call(span=)` not given: the call opens its span itself
_OPEN: Any = object()
_SLEEP = 8  # protocol action: sleep


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

#: A retry predicate (docs/hosts.md, section 9): called once per reported attempt with what the
#: attempt returned, or the exception it raised; `True` retry, `False` do not, `None` the
#: policy's rules decide. The core puts the answer in its place in the retry ladder.
RetryPredicate = Callable[[Any], "bool | None"]


def predicate_flags(pred: RetryPredicate, subject: Any, policy: str) -> int:
    """The `report` flags of a predicate's answer; one that raises, or answers anything but
    True, False or None, is logged and counts as None (the host decides nothing from it)."""
    try:
        answer = pred(subject)
    except Exception:
        logger.exception("levee: retry_if predicate %r of policy %r failed; the policy's rules decide", pred, policy)
        return 0
    if answer is None:
        return 0
    if answer is True:
        return REPORT_CALLER_RETRY
    if answer is False:
        return REPORT_CALLER_NO_RETRY
    if inspect.iscoroutine(answer):
        answer.close()
    logger.error(
        "levee: retry_if predicate %r of policy %r answered %r, not True, False or None; the policy's rules decide",
        pred, policy, answer,
    )  # fmt: skip
    return 0


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
        "fallback_failures",
        "fallback_reason",
        "fallback_value",
        "fell_back",
        "finished",
        "gen",
        "http",
        "key",
        "kwargs",
        "last",
        "on_retry",
        "retry_if",
        "slot",
        "span",
        "started",
        "t",
        "unregistered",
    )  # fmt: skip

    def __init__(self, engine: EngineRuntime, slot: _PolicySlot, call: int, gen: int, started: int,
                 classify: Classifier | None, args: tuple[Any, ...], kwargs: dict[str, Any], key: str = "",
                 on_retry: tuple[RetryHook, ...] = (), retry_if: RetryPredicate | None = None,
                 span: Any = _OPEN) -> None:  # fmt: skip
        self.engine = engine
        #: the retry predicate (the handle's, else the policy's)
        self.retry_if = retry_if
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
        #: why each fallback that ran failed (its name, what it raised or what was wrong)
        self.fallback_failures: list[tuple[str, BaseException]] = []
        #: the reason of the fallback verdict (the call span's `levee.reason` when it falls back)
        self.fallback_reason: Reason | None = None
        self.fell_back = False
        self.finished = False
        self.unregistered: tuple[str, ...] = ()
        self.on_retry = on_retry
        #: an HTTP integration's call (its attempt spans carry http.request.resend_count)
        self.http = False
        #: the call's span (`EngineRuntime._open_span`, opened before `start`)
        self.span: Any = engine._open_span(slot, key) if span is _OPEN else span

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
            fallback_failures=self.fallback_failures,
        )

    def ended(self, result: str, reason: Reason | None = None) -> None:
        """The call is over: `levee.calls` and the end of its span (docs/telemetry.md); the span
        of a call that fell back also says why (`levee.reason`), the counter does not."""
        self.finished = True
        spans = self.engine._spans
        if spans is not None and self.span is not None:
            span, self.span = self.span, None
            why = reason or (self.fallback_reason if result == "fallback" else None)
            try:
                spans.end_call(span, result, why.wit if why else None)
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

        eng = self.engine

        def op(c: Core) -> int:
            c.cancel(call, now)
            # `cancel` answers no verdict: while calls are parked, ask for the wakes (the slot
            # or the grant it held goes to the oldest waiter)
            return WAKES_BIT if eng._parked else 0

        try:
            eng._cross(self, op)
        except (_Fault, EngineClosed):
            pass
        if eng._parked:
            eng._unpark(call)

    def report(self, res: _AttemptResult) -> int:
        eng = self.engine
        o = res.outcome
        wall = int(eng._clock.time()) if o.kind is OutcomeKind.HTTP_STATUS and o.text else 0
        flags = 1 if o.overloaded else 0
        pred = self.retry_if
        if pred is not None:
            flags |= predicate_flags(pred, res.exc if res.exc is not None else res.value, self.slot.info.name)
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


# ---------------------------------------------------------------------------- hedged calls


class _HedgeStop(Exception):
    """Internal: a hedged call left the core (a guest fault, recovered and reported, or the
    engine was closed: `_Hedge.closed`). `attempt` is the attempt whose own result stands (the
    one whose report faulted), or 0."""

    def __init__(self, attempt: int = 0) -> None:
        super().__init__(attempt)
        self.attempt = attempt


class HedgePlan:
    """What one answer of the core asks the executor to do, in order: start these attempts
    (number, timeout ns), cancel these, then wait (ns; None: until an attempt ends)."""

    __slots__ = ("cancels", "starts", "wait")

    def __init__(self) -> None:
        self.starts: list[tuple[int, int]] = []
        self.cancels: list[int] = []
        self.wait: int | None = None


class _Hedge:
    """The host side of a hedged call (docs/policy.md, "Hedging", host contract), sans I/O: the
    crossings (`hedge-step`, `report-attempt`), the checks of the guest's commands, and which
    attempts are open, cancelled and reported. An executor (asyncio tasks, threads, the serial
    iterator) runs the attempts and the waits the plans ask for; nothing here decides anything
    the core decides: no timer of its own, no choice of a winner."""

    __slots__ = (
        "abandoned",
        "cancelled",
        "closed",
        "end_attempt",
        "end_verdict",
        "fault_attempt",
        "first_timeout",
        "lock",
        "on_discard",
        "open",
        "over",
        "results",
        "spans",
        "st",
        "started",
    )  # fmt: skip

    def __init__(self, st: _Call, first_timeout: int) -> None:
        self.st = st
        self.first_timeout = first_timeout
        #: attempt -> its start (ns on the engine's clock)
        self.started: dict[int, int] = {}
        #: started and not yet reported
        self.open: set[int] = set()
        self.cancelled: set[int] = set()
        #: the outcomes of attempts reported while the core still looked at them
        self.results: dict[int, _AttemptResult] = {}
        self.spans: dict[int, Any] = {}
        #: the `end` command: its attempt and packed verdict (-1 until then)
        self.end_attempt = 0
        self.end_verdict = -1
        #: the call is over for the driver: `end` came, a fault, or the caller cancelled
        self.over = False
        #: the core no longer knows the call (a fault, or the caller cancelled): nothing more is
        #: reported to it
        self.abandoned = False
        #: after a fault: the attempt whose own result stands (0: none, run a degraded one)
        self.fault_attempt = 0
        #: the engine was closed during the call (not a fault: nothing degraded starts)
        self.closed = False
        #: called with the value of an attempt whose result the call does not return (an HTTP
        #: integration closes the response)
        self.on_discard: Callable[[Any], None] | None = None
        #: serialises reports from attempts closing after `end` (threads) with the driver
        self.lock = threading.Lock()

    # -------------------------------------------------------------- attempts

    def begin(self, n: int, timeout: int) -> None:
        """The executor starts attempt `n` now (the core started it: `hedge` or `start`)."""
        self.started[n] = self.st.engine._now()
        self.open.add(n)
        self.st.attempts = len(self.started)
        if self.st.engine._spans is not None:
            self.spans[n] = self.st.attempt_span(n, False)

    def cancelled_result(self, n: int, exc: BaseException | None) -> _AttemptResult:
        """The outcome of attempt `n` that closed by its cancellation (never looked at by the
        core: any outcome will do; this one says what happened)."""
        start = self.started.get(n, 0)
        return _AttemptResult(Outcome.error(type(exc).__name__ if exc is not None else "CancelledError"),
                              None, exc, start, self.st.engine._now())  # fmt: skip

    def _end_span(self, n: int, res: _AttemptResult | None) -> None:
        token = self.spans.pop(n, None)
        if token is not None:
            self.st.end_attempt_span(token, res)

    # -------------------------------------------------------------- crossings

    def step(self) -> HedgePlan:
        """`hedge-step` now. Raises `_HedgeStop` after a guest fault (recovered and reported)."""
        st = self.st
        call = st.call
        now = st.t = st.engine._now()
        try:
            raw = st.engine._cross_hedge(st, lambda c: c.hedge_step(call, now))
        except _Fault:
            raise _HedgeStop() from None
        except EngineClosed:
            self.closed = True
            raise _HedgeStop() from None
        if st.engine._tracer is not None:
            st.engine._trace_hedge("hedge-step", st, 0, None, raw)
        return self.plan(raw, now, "hedge-step", 0)

    def report(self, n: int, res: _AttemptResult) -> HedgePlan:
        """Attempt `n` closed with `res`: `report-attempt` it (its outcome is looked at only when
        the core did not cancel it). Raises `_HedgeStop` after a guest fault."""
        st = self.st
        eng = st.engine
        self.open.discard(n)
        live = n not in self.cancelled and not self.over
        self._end_span(n, res if live else None)
        if self.abandoned:
            self._discard(res)
            return HedgePlan()
        o = res.outcome
        flags = 0
        wall = 0
        if live:
            self.results[n] = res
            wall = int(eng._clock.time()) if o.kind is OutcomeKind.HTTP_STATUS and o.text else 0
            flags = 1 if o.overloaded else 0
            pred = st.retry_if
            if pred is not None:
                flags |= predicate_flags(pred, res.exc if res.exc is not None else res.value, st.slot.info.name)
        else:
            self._discard(res)
        call = st.call
        now = res.end
        elapsed = res.end - res.start
        if live:
            st.t = now
        try:
            raw = eng._cross_hedge(st, lambda c: c.report_attempt(call, n, now, elapsed, o.kind, o.code, o.text,
                                                                  wall, flags))  # fmt: skip
        except _Fault:
            raise _HedgeStop(n if live else 0) from None
        except EngineClosed:
            self.closed = True
            raise _HedgeStop(n if live else 0) from None
        if live and eng._sink is not None:
            try:
                emit_attempt(eng._sink, st.slot.info.name, o.kind.wit, elapsed)
            except Exception:
                logger.exception("levee: telemetry sink %r failed", eng._sink)
        if eng._tracer is not None:
            eng._trace_hedge("report-attempt", st, n, o, raw)
        if self.over:
            return HedgePlan()  # a cancelled attempt of an ended call: nothing more to do
        return self.plan(raw, now, "report-attempt", n if live else 0)

    def closed_late(self, n: int, res: _AttemptResult) -> None:
        """An attempt the core cancelled closed after the call ended: report it (frees what it
        held). Called from whichever task or thread saw it close."""
        with self.lock:
            try:
                self.report(n, res)
            except _HedgeStop:
                pass  # recovered and reported; the call is over anyway

    def _discard(self, res: _AttemptResult) -> None:
        if self.on_discard is not None and res.value is not None:
            try:
                self.on_discard(res.value)
            except Exception:
                logger.exception("levee: closing the result of a cancelled attempt failed")

    def discard_losers(self) -> None:
        """Close what every attempt but the one the call returns produced (HTTP responses)."""
        keep = self.end_attempt if self.end_verdict >= 0 else self.fault_attempt
        for k, r in self.results.items():
            if k != keep:
                self._discard(r)

    # -------------------------------------------------------------- checks

    def plan(self, raw: list[Any], now: int, op: str, reported: int) -> HedgePlan:
        """Check the guest's commands (docs/hosts.md, section 2, for hedged calls) and turn them
        into a plan. A command that breaks the contract, or `end` with `invalid`, is a guest
        fault: reported, and `_HedgeStop` raised (`reported`: the attempt whose own result
        then stands)."""
        st = self.st
        seen: set[int] = set()
        for cmd in raw:  # the whole answer is checked before any of it is carried out
            breach = self._breach(cmd, now, seen)
            if breach is not None:
                st.engine._guest_fault(st, "contract", f"{breach} (answered to {op})")
                raise _HedgeStop(reported)
            if cmd[0] == "end":
                break
        plan = HedgePlan()
        for case, val in raw:
            if case == "start":
                # started for the core from now on (it holds a slot), whenever the executor runs it
                n = int(val["attempt"])
                self.started[n] = now
                self.open.add(n)
                st.attempts = len(self.started)
                plan.starts.append((n, int(val["timeout"])))
            elif case == "cancel":
                self.cancelled.add(val)
                plan.cancels.append(val)
            elif case == "wait":
                plan.wait = val
            else:
                v = int(val["verdict"])
                if v & 0xF == INVALID:
                    st.engine._guest_fault(st, "invalid", f"{Verdict.unpack(v)} answered to {op}")
                    raise _HedgeStop(reported)
                self.end_attempt = int(val["attempt"])
                self.end_verdict = v
                self.over = True
                break
        return plan

    def _breach(self, cmd: Any, now: int, seen: set[int]) -> str | None:
        st = self.st
        if not isinstance(cmd, tuple) or len(cmd) != 2:
            return f"a malformed command {cmd!r}"
        case, val = cmd
        if case == "start":
            if (
                not isinstance(val, dict)
                or not isinstance(val.get("attempt"), int)
                or not isinstance(val.get("timeout"), int)
            ):
                return f"a malformed start {val!r}"
            n, timeout = val["attempt"], val["timeout"]
            if n in self.started or n in seen or n < 2 or n > HEDGE_MAX_ATTEMPTS:
                return f"start of attempt {n}, already started or not in 2..{HEDGE_MAX_ATTEMPTS}"
            seen.add(n)
            if st.deadline_at and timeout > st.deadline_at - now:
                return f"attempt {n}'s timeout {timeout} ns ends past the deadline"
            if st.deadline_at and timeout == 0:
                return f"attempt {n} without a timeout under a deadline"
            return None
        if case == "cancel":
            if not isinstance(val, int) or (val not in self.started and val not in seen):
                return f"cancel of attempt {val!r}, never started"
            return None
        if case == "wait":
            if not isinstance(val, int) or val < 0:
                return f"a malformed wait {val!r}"
            if st.deadline_at and now + val > st.deadline_at:
                return f"a wait of {val} ns ends past the deadline"
            return None
        if case == "end":
            if (
                not isinstance(val, dict)
                or not isinstance(val.get("attempt"), int)
                or not isinstance(val.get("verdict"), int)
            ):
                return f"a malformed end {val!r}"
            n, v = val["attempt"], val["verdict"]
            kind = v & 0xF
            if kind == INVALID:
                return None
            if kind not in (DONE, FAIL, FALLBACK):
                return f"end with a {Verdict.unpack(v)} verdict"
            if n not in self.results:
                return f"end with attempt {n}, which has not been reported"
            saved = st.t
            st.t = now
            try:
                return contract_breach(st, v, "report")
            finally:
                st.t = saved
        return f"an unknown command {case!r}"

    # -------------------------------------------------------------- the end

    def finish(self) -> int:
        """The packed verdict the call ends with (as `report` answers it), or -1 after a
        fault; fills in the call's attempts and last result for the verdict handling."""
        st = self.st
        st.attempts = len(self.started)
        if self.end_verdict >= 0:
            st.last = self.results.get(self.end_attempt)
            return self.end_verdict
        st.last = self.results.get(self.fault_attempt)
        return -1


def hedge_serial(h: _Hedge) -> Generator[Action, Any, None]:
    """A hedged call for an executor that runs one attempt at a time (the `attempts()` loops,
    whose attempts are the caller's own blocks): yields `(ATTEMPT, n, timeout)` (send its
    result) and `(_SLEEP, ns, 0)` for a `wait` with nothing in flight. Nothing runs
    concurrently, so a hedge the core starts runs when the attempt before it has ended; a
    started attempt the core cancels before it ran is reported closed at once."""
    todo: list[tuple[int, int]] = [(1, h.first_timeout)]
    eng = h.st.engine

    def carry_out(plan: HedgePlan) -> int | None:
        """Queue the plan's starts; a cancel of a queued attempt reports it closed (whose
        answer is carried out in turn). Returns the wait of the last answer."""
        plans = [plan]
        wait = plan.wait
        while plans:
            p = plans.pop(0)
            wait = p.wait
            todo.extend(p.starts)
            for k in p.cancels:
                if any(m == k for m, _ in todo):
                    todo[:] = [(m, t) for m, t in todo if m != k]
                    plans.append(h.report(k, h.cancelled_result(k, None)))
        return wait

    try:
        while todo and not h.over:
            n, timeout = todo.pop(0)
            h.begin(n, timeout)
            res = yield (ATTEMPT, n, timeout)
            wait = carry_out(h.report(n, res))
            while not h.over and not todo:
                if wait is None:
                    eng._guest_fault(h.st, "contract", "a hedged call with no attempt in flight, no wait and no end")
                    raise _HedgeStop()
                yield (_SLEEP, wait, 0)
                wait = carry_out(h.step())
    except _HedgeStop as stop:
        h.over = h.abandoned = True
        h.fault_attempt = stop.attempt if stop.attempt in h.results else 0
        return
    except GeneratorExit:
        h.over = h.abandoned = True
        raise
    for n, _ in todo:  # started by the core, never run: closed now
        h.closed_late(n, h.cancelled_result(n, None))


# A protocol action: (ATTEMPT, number, timeout_ns) | (_SLEEP, ns, 0) | (FALLBACK, name, reason)
# | (HEDGE, _Hedge, 0): run the hedged attempts until the core ends the call (the executor sends
# None back; the `_Hedge` holds how it ended)
Action = tuple[int, Any, Any]

_MAX_REASON = max(Reason)


def contract_breach(st: _Call, v: int, op: str) -> str | None:
    """Whether verdict `v` of crossing `op` breaks the contract (docs/hosts.md, section 2);
    `st.t` is the `now` that crossing was given. Returns what is wrong, or None."""
    info = st.slot.info
    kind = v & 0xF
    if kind > HEDGE or v & VERDICT_RESERVED_MASK:
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
    elif kind == HEDGE:
        # a hedged policy makes one call-level attempt: the hedge verdict admits attempt 1
        if op not in ("start", "acquire") or st.attempts or detail != 1:
            return f"hedge verdict for attempt {detail} answered to {op} after {st.attempts} attempts"
        if st.deadline_at and payload > st.deadline_at - st.t:
            return f"attempt timeout {payload} ns past the deadline ({st.deadline_at - st.t} ns left)"
        if payload == 0 and st.deadline_at:
            return "no attempt timeout under a policy with a deadline"
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
            elif kind == HEDGE:
                # a hedged call (docs/policy.md, "Hedging"): the executor runs attempt 1 and
                # whatever the core's commands start, until `end`, whose verdict is handled
                # below exactly like a `report` answer
                h = _Hedge(st, v >> 16)
                yield (HEDGE, h, 0)
                v = h.finish()
                op = "report"
                if v < 0 and h.closed:
                    return _closed(st, "report" if st.last is not None else "acquire")
                if v < 0:  # a guest fault in the hedged section (recovered and reported)
                    if st.last is not None:
                        st.finished = True
                        return st.degraded_value()
                    return (yield from _degraded(st, "acquire"))
            elif kind == RETRY or kind == WAIT:
                delay = v >> 16
                if kind == RETRY and st.on_retry:
                    st.retry_hooks(delay)
                if v & PARK_MASK == PARK_VERDICT:
                    # queued for a bulkhead slot: sleep until the payload elapses or the core
                    # grants the call a slot and names it (docs/policy.md, "The queue")
                    parker = eng._parker(st.call)
                    if parker is not None and delay:
                        try:
                            yield (_SLEEP, delay, parker)
                        finally:
                            eng._unpark(st.call)
                elif delay:
                    yield (_SLEEP, delay, 0)
                op = "acquire"
                try:
                    v = st.acquire()
                except _Fault:
                    return (yield from _degraded(st, op))
            elif kind == FALLBACK:
                name = info.fallbacks[v >> 16]
                st.fallback_reason = Reason.from_code((v >> 8) & 0xFF)
                ok, value = yield (FALLBACK, name, st.fallback_reason)
                if ok:
                    st.fell_back = True
                    st.fallback_value = value
                    st.fallback_error = None
                else:
                    st.fallback_error = value
                    if isinstance(value, BaseException):
                        st.fallback_failures.append((name, value))
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
    except EngineClosed:
        # the engine was closed during the call (a graceful shutdown, not a fault)
        return _closed(st, op)
    except GeneratorExit:
        st.cancel()
        raise


def _closed(st: _Call, op: str) -> Any:
    """The end of a call whose crossing `op` found the engine closed: what has happened stands
    and nothing more starts (README, "Closing"). An attempt that returned gives its value, a
    fallback that returned gives its value; else `EngineClosed`, carrying the last attempt's (or
    fallback's) error or result."""
    last = st.last
    if op == "report-fallback":
        if st.fallback_error is None:
            st.ended("fallback")
            return st.fallback_value
        st.ended("failure")
        raise EngineClosed(policy=st.slot.info.name, attempts=st.attempts, last_error=st.fallback_error)
    if op == "report" and last is not None and last.exc is None:
        st.ended("success")
        return last.value
    st.ended("failure")
    raise EngineClosed(
        policy=st.slot.info.name,
        attempts=st.attempts,
        last_error=last.exc if last is not None else None,
        last_result=last.value if last is not None and last.exc is None else None,
    )


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

"""Typed exceptions. A call that the core ends with *fail* raises a `CallFailed` subclass chosen
by the reason; it carries the reason, the attempts made, the last error (also `__cause__`) and
the last result (say, the last HTTP response)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .types import LoadError, Reason

__all__ = [
    "BreakerOpen",
    "BudgetExhausted",
    "BulkheadFull",
    "CallCancelled",
    "CallFailed",
    "DeadlineExceeded",
    "EngineClosed",
    "FallbacksFailed",
    "LeveeError",
    "NonIdempotent",
    "NotRetryable",
    "PolicyError",
    "ProtocolError",
    "PushbackRefused",
    "RateLimited",
    "RetriesExhausted",
    "RetryAfterTooLong",
    "UnknownFallback",
    "UnknownPolicy",
]


class LeveeError(Exception):
    """Base of every Levee exception."""


class PolicyError(LeveeError, ValueError):
    """A policy document (or imported state) was refused; `errors` name each field path."""

    def __init__(self, errors: list[LoadError]) -> None:
        self.errors = list(errors)
        lines = "\n".join(f"  {e}" for e in self.errors)
        super().__init__(f"invalid policy document:\n{lines}" if lines else "invalid policy document")


class UnknownPolicy(LeveeError, KeyError):
    """No policy of that name in the engine's document. `name` is the name asked for and
    `known` the document's policy names; the message lists them (the first 20) and the
    closest one."""

    def __init__(self, name: str, known: list[str] | tuple[str, ...] = ()) -> None:
        super().__init__(name)
        self.name = name
        self.known = tuple(known)

    def __str__(self) -> str:
        return unknown_policy_message(self.name, self.known)


def unknown_policy_message(name: str, known: list[str] | tuple[str, ...]) -> str:
    """`no policy named 'upstrem' (did you mean 'upstream'?); the document's policies: ...`,
    the same words in every host."""
    import difflib

    msg = f"no policy named {name!r}"
    close = difflib.get_close_matches(name, known, n=1)
    if close:
        msg += f" (did you mean {close[0]!r}?)"
    if not known:
        return msg + "; the document has no policies"
    shown = ", ".join(repr(k) for k in known[:20])
    more = f" and {len(known) - 20} more" if len(known) > 20 else ""
    return f"{msg}; the document's policies: {shown}{more}"


class EngineClosed(LeveeError):
    """The engine was closed (`Engine.close()`): no call starts and no attempt starts after it.
    A call in flight at the close ends with this error when it would have needed the engine
    again (to retry, to run a fallback after a failure); `last_error` (also the `__cause__`) and
    `last_result` are its last attempt's, as in `CallFailed`. An attempt that succeeded, or a
    fallback that returned, still gives the call its value."""

    def __init__(self, *, policy: str = "", attempts: int = 0, last_error: BaseException | None = None,
                 last_result: Any = None) -> None:  # fmt: skip
        self.policy = policy
        self.attempts = attempts
        self.last_error = last_error
        self.last_result = last_result
        detail = "the engine is closed"
        if policy:
            detail += f"; the call of policy {policy!r} ended after {attempts} attempt(s)"
        if last_error is not None:
            detail += f"; last error: {type(last_error).__name__}: {last_error}"
        elif last_result is not None:
            detail += f"; last result: {last_result!r}"
        super().__init__(detail)
        self.__cause__ = last_error


class UnknownFallback(LeveeError, KeyError):
    """A fallback registered under a name no policy's chain names (most likely a typo). `name`
    is the name given and `known` the fallback names the document's policies use."""

    def __init__(self, name: str, known: list[str] | tuple[str, ...] = ()) -> None:
        super().__init__(name)
        self.name = name
        self.known = tuple(known)

    def __str__(self) -> str:
        import difflib

        msg = f"no policy names the fallback {self.name!r}"
        close = difflib.get_close_matches(self.name, self.known, n=1)
        if close:
            msg += f" (did you mean {close[0]!r}?)"
        if not self.known:
            return msg + "; the document's policies have no fallbacks"
        return msg + "; the document's fallbacks: " + ", ".join(repr(k) for k in self.known)


class ProtocolError(LeveeError):
    """The engine answered something the contract rules out (an untrusted guest misbehaving)."""


class CallFailed(LeveeError):
    """The core ended the call with *fail*.

    Attributes: `reason` (a `Reason`), `policy` (its name), `attempts` (attempts made),
    `last_error` (the last attempt's exception, or `None`), `last_result` (the last attempt's
    returned value, e.g. an HTTP response with status 503, or `None`), `retry_after` (seconds,
    a hint from a breaker or limiter, or `None`), `unregistered` (fallbacks the policy's
    chain named that no function was registered for: they count as failed), `fallback_errors`
    (why each fallback that ran failed, in chain order: what it raised, or a `TypeError` for a
    value it could not give). When a fallback failed, the last one's error is the `__cause__`;
    else the last attempt's error is.
    """

    def __init__(
        self,
        reason: Reason,
        *,
        policy: str,
        attempts: int,
        last_error: BaseException | None = None,
        last_result: Any = None,
        retry_after: float | None = None,
        unregistered: tuple[str, ...] = (),
        fallback_failures: Sequence[tuple[str, BaseException]] = (),
    ) -> None:
        self.reason = reason
        self.fallback_errors = tuple(e for _, e in fallback_failures)
        self.unregistered = unregistered
        self.policy = policy
        self.attempts = attempts
        self.last_error = last_error
        self.last_result = last_result
        self.retry_after = retry_after
        detail = f"policy {policy!r} gave up ({reason.wit}) after {attempts} attempt(s)"
        if last_error is not None:
            detail += f"; last error: {type(last_error).__name__}: {last_error}"
        elif last_result is not None:
            detail += f"; last result: {last_result!r}"
        if retry_after is not None:
            detail += f"; retry after {retry_after:.3f}s"
        if unregistered:
            detail += "; " + unregistered_message(unregistered)
        for name, e in fallback_failures:
            detail += f"; fallback {name!r} failed: {type(e).__name__}: {e}"
        super().__init__(detail)


def unregistered_message(names: tuple[str, ...]) -> str:
    """The words every host uses for fallbacks named by a policy but never registered."""
    listed = ", ".join(repr(n) for n in names)
    return (
        f"fallback {listed} is named by the policy but not registered"
        if len(names) == 1
        else (f"fallbacks {listed} are named by the policy but not registered")
    )


class RetriesExhausted(CallFailed):
    """The last allowed attempt failed."""


class DeadlineExceeded(CallFailed):
    """The total deadline passed, or the next retry could not start before it."""


class NotRetryable(CallFailed):
    """The outcome is classified as never to be retried."""


class BudgetExhausted(CallFailed):
    """The retry budget refused the retry."""


class BreakerOpen(CallFailed):
    """The circuit breaker is open."""


class RateLimited(CallFailed):
    """The rate limiter has no token that fits the deadline and the policy's max wait."""


class BulkheadFull(CallFailed):
    """The concurrency limit is full."""


class NonIdempotent(CallFailed):
    """Retryable, but the operation is not idempotent and carries no idempotency key."""


class RetryAfterTooLong(CallFailed):
    """The server asked (Retry-After) for a wait above the policy's cap."""


class PushbackRefused(CallFailed):
    """gRPC pushback said do not retry."""


class CallCancelled(CallFailed):
    """The call was cancelled."""


class FallbacksFailed(CallFailed):
    """Every fallback of the chain failed."""


_BY_REASON: dict[Reason, type[CallFailed]] = {
    Reason.DEADLINE: DeadlineExceeded,
    Reason.RETRIES_EXHAUSTED: RetriesExhausted,
    Reason.NON_RETRYABLE: NotRetryable,
    Reason.BUDGET: BudgetExhausted,
    Reason.BREAKER_OPEN: BreakerOpen,
    Reason.RATE_LIMITED: RateLimited,
    Reason.BULKHEAD_FULL: BulkheadFull,
    Reason.NON_IDEMPOTENT: NonIdempotent,
    Reason.RETRY_AFTER_TOO_LONG: RetryAfterTooLong,
    Reason.PUSHBACK: PushbackRefused,
    Reason.CANCELLED: CallCancelled,
    Reason.FALLBACKS_FAILED: FallbacksFailed,
}


def failure_for(
    reason: Reason,
    *,
    policy: str,
    attempts: int,
    last_error: BaseException | None,
    last_result: Any,
    retry_after: float | None,
    unregistered: tuple[str, ...] = (),
    fallback_failures: Sequence[tuple[str, BaseException]] = (),
) -> CallFailed:
    cls = _BY_REASON.get(reason, CallFailed)
    exc = cls(
        reason,
        policy=policy,
        attempts=attempts,
        last_error=last_error,
        last_result=last_result,
        retry_after=retry_after,
        unregistered=unregistered,
        fallback_failures=fallback_failures,
    )
    exc.__cause__ = fallback_failures[-1][1] if fallback_failures else last_error
    return exc

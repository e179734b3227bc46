"""gRPC client interceptors (grpcio, sync and `grpc.aio`) that apply a policy to every call.

```python
engine = levee.load("policies.yaml")
channel = levee.grpc.intercept_channel(
    grpc.insecure_channel(target, options=levee.grpc.NO_RETRY_OPTIONS),
    levee.grpc.LeveeClientInterceptor(engine, "backend", target=target),
)
# asyncio
channel = grpc.aio.insecure_channel(target, options=levee.grpc.NO_RETRY_OPTIONS,
                                    interceptors=levee.grpc.aio_interceptors(engine, "backend", target=target))
```

Each RPC is one call (docs/grpc.md). Its key is the target's authority (`grpc_key`) or what
`key(client_call_details)` returns; its policy is the one named, or `policy(method)` for a
function of the method (`"/pkg.Service/Method"`). Every attempt is reported to the core as its
gRPC status with the raw `grpc-retry-pushback-ms` trailer (a transport failure is the status
grpcio reports, UNAVAILABLE usually); the core decides. Each attempt's gRPC deadline is the
per-attempt timeout the core granted, cut to the caller's own deadline, which also bounds the
call: an attempt that ends past it is not retried, nor is a call whose next wait would end past
it. Attempts after the first carry `grpc-previous-rpc-attempts` (gRPC A6). Turn gRPC's own retry
off on the channel (`NO_RETRY_OPTIONS`): retry in one layer only.

When the core gives up after an answer (the third UNAVAILABLE, an INVALID_ARGUMENT it never
retries) the caller gets that answer, the RpcError grpcio raised. When there is none (the
breaker is open, the rate limit or the bulkhead rejected the call) the caller gets a
`LeveeRpcError` (sync) or `LeveeAioRpcError` (aio): an RpcError whose code is the status in
`REJECTION_STATUS` (RESOURCE_EXHAUSTED for a rate limit or a full bulkhead, UNAVAILABLE for an
open breaker) and whose `failure` (also `__cause__`) is Levee's typed `CallFailed`.

Streams (A6's commit rule): a call with a response stream is retried only until its first
response message arrives; from then on the attempt is committed, its messages go to the caller
and its end, OK or not, is reported as final (a failure is never retried). A call with a request
stream is retried only when its requests are buffered: pass `buffered([...])` (or a `list` or
`tuple`) of messages; any other iterator is sent once, as a non-idempotent call (the core admits
it and counts its outcome, but never resends it). A streaming call under a hedging policy runs
its attempts one after another, never two streams at once.

Hedged unary calls run their attempts concurrently and cancel the losers (the server sees the
cancellation): under `grpc.aio` always; with sync grpcio when the channel is wrapped by this
module's `intercept_channel`, which makes every unary attempt a cancellable future (grpcio's own
`intercept_channel` runs `__call__`'s attempts to their end, so a loser would be abandoned, not
cancelled). The sync interceptor runs the call in the calling thread: `.future()` returns when
the call is over. A fallback registered on the engine returns the response message (for a
response stream: an iterable of messages).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncGenerator, AsyncIterable, AsyncIterator, Callable, Generator, Iterable, Iterator
from typing import TYPE_CHECKING, Any, TypeVar

import grpc
import grpc.aio

from ._constants import (
    GRPC_PREVIOUS_ATTEMPTS_HEADER,
    GRPC_REJECTED_STATUS,
    GRPC_REJECTED_STATUS_OTHER,
    HTTP_ATTEMPT_HEADER,
    HTTP_PUSHBACK_TRAILER,
    REASONS,
    START_NON_IDEMPOTENT,
)
from ._driver import _SLEEP, ATTEMPT, HEDGE, _AttemptResult, _Call, _protocol, hedge_serial
from ._io import (
    _run_fallback_async,
    _run_fallback_sync,
    on_attempt_cancel,
    run_hedge_async,
    run_hedge_sync,
    sleep_async,
    sleep_sync,
)
from .engine import Engine, Policy
from .errors import CallFailed, EngineClosed, LeveeError
from .outcomes import Outcome, outcome_for_exception
from .types import PolicyInfo, Reason

__all__ = [
    "NO_RETRY_OPTIONS",
    "ATTEMPT_HEADER",
    "PREVIOUS_ATTEMPTS",
    "PUSHBACK",
    "REJECTION_STATUS",
    "Buffered",
    "AsyncLeveeStreamStreamInterceptor",
    "AsyncLeveeStreamUnaryInterceptor",
    "AsyncLeveeUnaryStreamInterceptor",
    "AsyncLeveeUnaryUnaryInterceptor",
    "LeveeAioRpcError",
    "LeveeClientInterceptor",
    "LeveeRpcError",
    "aio_interceptors",
    "buffered",
    "grpc_key",
    "intercept_channel",
]

#: Channel options that turn gRPC's built-in retry off: Levee's interceptor retries, gRPC must not
#: retry each of its attempts again (`grpc.insecure_channel(target, options=NO_RETRY_OPTIONS)`).
NO_RETRY_OPTIONS: tuple[tuple[str, int], ...] = (("grpc.enable_retries", 0),)
#: The request metadata of attempts after the first (gRPC A6): the attempts already sent.
PREVIOUS_ATTEMPTS = GRPC_PREVIOUS_ATTEMPTS_HEADER
#: The request metadata of every attempt: its number (1 on the first), for a Levee filter on the way.
ATTEMPT_HEADER = HTTP_ATTEMPT_HEADER
#: The trailer whose raw value goes to the core with the status (docs/policy.md).
PUSHBACK = HTTP_PUSHBACK_TRAILER
#: The status a call gets when the core rejected it with no answer to give back (the contract's
#: table, the same in every host: wit/constants.json `grpc.REJECTED_STATUS`).
_STATUS_BY_CODE: dict[int, grpc.StatusCode] = {s.value[0]: s for s in grpc.StatusCode}
REJECTION_STATUS: dict[Reason, grpc.StatusCode] = {
    Reason(REASONS.index(name)): _STATUS_BY_CODE[code] for name, code in GRPC_REJECTED_STATUS.items()
}

# grpcio's classes are generic in its type stubs only
if TYPE_CHECKING:
    _Future = grpc.Future[Any]
    _UnaryUnaryMultiCallable = grpc.UnaryUnaryMultiCallable[Any, Any]
    _StreamUnaryMultiCallable = grpc.StreamUnaryMultiCallable[Any, Any]
    _UnaryStreamCall = grpc.aio.UnaryStreamCall[Any, Any]
    _StreamStreamCall = grpc.aio.StreamStreamCall[Any, Any]
else:
    _Future = grpc.Future
    _UnaryUnaryMultiCallable = grpc.UnaryUnaryMultiCallable
    _StreamUnaryMultiCallable = grpc.StreamUnaryMultiCallable
    _UnaryStreamCall = grpc.aio.UnaryStreamCall
    _StreamStreamCall = grpc.aio.StreamStreamCall

_monotonic_ns = time.monotonic_ns
_OK = Outcome.grpc(0)
_UNKNOWN = grpc.StatusCode.UNKNOWN.value[0]
_CANCELLED = grpc.StatusCode.CANCELLED.value[0]

PolicyChoice = str | Policy | Callable[[str], "str | Policy"]
KeyFunction = Callable[[grpc.ClientCallDetails], str]


def grpc_key(target: str) -> str:
    """The key of a channel's calls: the authority its target names, lower-cased
    (`dns:///api.example:443` and `api.example:443` give `api.example:443`; `ipv4:` and `ipv6:`
    targets their first address; a Unix socket `localhost`, as gRPC's default authority)."""
    t = target.strip()
    scheme, sep, rest = t.partition(":")
    if sep:
        s = scheme.lower()
        if s in ("unix", "unix-abstract", "vsock"):
            return "localhost"
        if rest.startswith("//"):  # scheme://authority/endpoint
            return rest[2:].partition("/")[2].lower()
        if s in ("ipv4", "ipv6"):
            return rest.split(",")[0].lower()
        if s == "dns":
            return rest.lower()
    return t.lower()


def _status_code(value: Any) -> int | None:
    code = getattr(value, "code", None)
    if not callable(code):
        return None
    try:
        status = code()
    except Exception:
        return None
    if isinstance(status, grpc.StatusCode):
        return int(status.value[0])
    return _UNKNOWN if status is None else None


def _pushback(trailing: Any) -> str:
    for item in trailing or ():
        try:
            k, v = item
        except (TypeError, ValueError):
            continue
        if k == PUSHBACK:
            return v.decode("latin-1") if isinstance(v, bytes) else str(v)
    return ""


def _outcome(exc: BaseException | None) -> Outcome:
    """What an attempt ended with, as the core hears it: OK, or the status and raw pushback of
    the RpcError; anything else (a serializer's error) by its class."""
    if exc is None:
        return _OK
    code = _status_code(exc)
    if code is None:
        return outcome_for_exception(exc)
    trailing: Any = None
    if not isinstance(exc, grpc.aio.AioRpcError):
        try:
            trailing = exc.trailing_metadata()  # type: ignore[attr-defined]
        except Exception:
            trailing = None
    else:
        trailing = exc.trailing_metadata()
    return Outcome.grpc(code, _pushback(trailing))


def _committed(subject: Any) -> bool | None:
    """The retry predicate of a call that may not be retried any more (a stream that has
    delivered a message, a caller whose deadline has passed): a failure is final, a success is
    left to the policy's rules (a no-retry answer would count it as a failure). A sync call
    that ended OK is itself an RpcError object: its status says which it is."""
    if not isinstance(subject, BaseException):
        return None
    if isinstance(subject, grpc.Call) and _status_code(subject) == 0:
        return None
    return False


def _metadata(metadata: Any, number: int) -> list[tuple[str, Any]] | None:
    """The request metadata of attempt `number`: the caller's, with its number
    (`x-levee-attempt`) and, on attempts after the first, `grpc-previous-rpc-attempts`."""
    pairs = [(k, v) for k, v in (metadata or ()) if k not in (PREVIOUS_ATTEMPTS, ATTEMPT_HEADER)]
    pairs.append((ATTEMPT_HEADER, str(number)))
    if number > 1:
        pairs.append((PREVIOUS_ATTEMPTS, str(number - 1)))
    return pairs


def _seconds(timeout_ns: int, caller_end: int | None, now: int) -> float | None:
    """The gRPC deadline of an attempt (seconds): the core's per-attempt timeout (already within
    the policy's time left), cut to what is left of the caller's own deadline."""
    t = timeout_ns / 1e9 if timeout_ns else None
    if caller_end is not None:
        left = max(0.0, (caller_end - now) / 1e9)
        t = left if t is None else min(t, left)
    return t


def _failure_status(failed: LeveeError) -> grpc.StatusCode:
    """The status of a call that ends with no RpcError to give back: a rejection's, UNAVAILABLE
    for a closed engine, else UNKNOWN (the attempts failed locally, say in a serializer)."""
    if isinstance(failed, CallFailed):
        return REJECTION_STATUS.get(failed.reason, _STATUS_BY_CODE[GRPC_REJECTED_STATUS_OTHER])
    return grpc.StatusCode.UNAVAILABLE


T = TypeVar("T")


class Buffered(Iterator[T]):
    """Request messages kept in memory, so that a retry can send them again: a request stream
    is retried only when buffered (`stub.Upload(levee.grpc.buffered([m1, m2]))`; a `list` or
    `tuple` is taken as buffered too, `buffered` is the form grpcio's type stubs accept). As
    an iterator it gives the messages once, as grpcio expects."""

    def __init__(self, messages: Iterable[T]) -> None:
        self.messages: tuple[T, ...] = tuple(messages)
        self._it = iter(self.messages)

    def __iter__(self) -> Buffered[T]:
        return self

    def __next__(self) -> T:
        return next(self._it)


def buffered(messages: Iterable[T]) -> Buffered[T]:
    """A request stream that a retry may send again (see `Buffered`)."""
    return Buffered(messages)


def _replay(requests: Any) -> Callable[[], Iterator[Any]] | None:
    """How each attempt sends a buffered request stream anew; None for any other iterator."""
    if isinstance(requests, Buffered):
        kept = requests.messages
        return lambda: iter(kept)
    if isinstance(requests, (list, tuple)):
        seq = requests
        return lambda: iter(seq)
    return None


class _Details(grpc.ClientCallDetails):
    """The `ClientCallDetails` of one attempt (sync grpcio)."""

    def __init__(self, base: grpc.ClientCallDetails, timeout: float | None, metadata: Any) -> None:
        self.method = base.method
        self.timeout = timeout
        self.metadata = metadata
        self.credentials = getattr(base, "credentials", None)
        self.wait_for_ready = getattr(base, "wait_for_ready", None)
        self.compression = getattr(base, "compression", None)


class _Started:
    """A call `start` answered: the verdict `v`, and what its `_Call` needs."""

    __slots__ = ("call", "caller_end", "gen", "key", "now", "pol", "span", "v")

    def __init__(self, pol: Policy, key: str, span: Any, call: int, gen: int, v: int, now: int,
                 caller_end: int | None) -> None:  # fmt: skip
        self.pol = pol
        self.key = key
        self.span = span
        self.call = call
        self.gen = gen
        self.v = v
        self.now = now
        self.caller_end = caller_end

    def state(self, request: Any) -> _Call:
        return self.pol._state(self.call, self.gen, self.now, self.key, (request,), {}, self.span)

    def hot(self) -> int:
        """The timeout (ns) of attempt 1 when it may run on the hot path (a plain first attempt
        within the contract, on the system clock, no trace, no spans): its success is then held
        back and reported by the next crossing, as `Policy.call` does. -1 otherwise."""
        v = self.v
        eng = self.pol.engine
        if v & 0xFF1F != 0x100 or not eng._hot:
            return -1
        timeout = v >> 16
        tmax = self.pol._slot.tmax
        if tmax and not 0 < timeout <= tmax:
            return -1
        return timeout

    def hold(self, start: int, end: int, timeout: int) -> bool:
        """Hold back attempt 1's success (one crossing for the call), when the contract allows:
        not late, and no classifier or predicate of the handle or policy must see it."""
        pol = self.pol
        slot = pol._slot
        if (timeout and end - start >= timeout) or not pol._holdable or slot.retry_if is not None:
            return False
        if self.caller_end is not None and end >= self.caller_end:
            return False
        eng = pol.engine
        eng._pending.append((self.call, end, end - start, self.gen))
        if eng._parked:  # calls wait in a bulkhead queue: settle, so the slot is granted now
            eng._settle_parked()
        if eng._sink is not None:
            eng._count_success(slot, end - start)
        if end >= eng._snapshot_due:
            eng._snapshot_tick(end)
        return True


class _Base:
    def __init__(self, engine: Engine, policy: PolicyChoice, target: str | None, key: KeyFunction | None) -> None:
        if target is None and key is None:
            raise TypeError("give the channel's target (the calls' key is its authority) or a key function")
        if key is not None and not callable(key):
            raise TypeError(f"key must be a function of the call's ClientCallDetails, not {type(key).__name__}")
        self._engine = engine
        self._fixed: Policy | None = None
        self._choose: Callable[[str], str | Policy] | None = None
        if isinstance(policy, Policy):
            self._fixed = policy
        elif isinstance(policy, str):
            self._fixed = engine.policy(policy)
        elif callable(policy):
            self._choose = policy
        else:
            raise TypeError(f"policy must be a name, a Policy or a function of the method, not {type(policy).__name__}")
        self._policies: dict[str, Policy] = {}
        self._target_key = grpc_key(target) if target is not None else ""
        self._key = key
        self._hedging: dict[str, tuple[PolicyInfo, bool]] = {}

    def _policy_for(self, method: str) -> Policy:
        if self._fixed is not None:
            return self._fixed
        p = self._policies.get(method)
        if p is None:
            assert self._choose is not None
            chosen = self._choose(method)
            p = chosen if isinstance(chosen, Policy) else self._engine.policy(chosen)
            if len(self._policies) < 4096:
                self._policies[method] = p
        return p

    def _start(self, details: Any, replayable: bool) -> _Started:
        """`start` the call of an RPC (its `_Call` is made only when the protocol runs)."""
        method: Any = details.method
        if isinstance(method, bytes):
            method = method.decode("utf-8", "replace")
        pol = self._policy_for(method)
        eng = pol.engine
        key = str(self._key(details)) if self._key is not None else self._target_key
        flags = pol._flags | (0 if replayable else START_NON_IDEMPOTENT)
        span = eng._open_span(pol._slot, key) if eng._spans is not None else None
        call, gen, v, now = eng._start(pol._slot, key, flags, span)
        timeout = details.timeout
        caller_end = now + int(timeout * 1e9) if timeout is not None else None
        return _Started(pol, key, span, call, gen, v, now, caller_end)

    def _begin(self, details: Any, request: Any, replayable: bool) -> tuple[_Call, int, int | None]:
        s = self._start(details, replayable)
        return s.state(request), s.v, s.caller_end

    def _hedges(self, method: str) -> bool:
        """Whether the policy of `method` hedges (read from its document, again after a reload)."""
        pol = self._policy_for(method)
        info = pol._slot.info
        seen = self._hedging.get(pol.name)
        if seen is None or seen[0] is not info:
            hedges = json.loads(pol.engine.policy_json(pol.name)).get("hedge") is not None
            seen = self._hedging[pol.name] = (info, hedges)
        return seen[1]

    @staticmethod
    def _past(st: _Call, caller_end: int | None, delay: int) -> bool:
        """Whether a wait of `delay` ns would end at or past the caller's deadline."""
        return caller_end is not None and st.engine._now() + delay >= caller_end

    @staticmethod
    def _ended(st: _Call, caller_end: int | None, end: int) -> None:
        """An attempt ended at `end`: past the caller's deadline the call may not retry."""
        if caller_end is not None and end >= caller_end:
            st.retry_if = _committed


# ---------------------------------------------------------------------------- sync grpcio


class LeveeRpcError(grpc.RpcError, grpc.Call, _Future):
    """The error of a call the core rejected with no answer to give back (sync grpcio): an
    RpcError with the status `REJECTION_STATUS` gives the reason, and the finished call and
    future the interceptor API returns. `failure` is Levee's typed error."""

    def __init__(self, code: grpc.StatusCode, failure: LeveeError) -> None:
        super().__init__(str(failure))
        self._code = code
        self.failure = failure
        self.__cause__ = failure

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return str(self.failure)

    def initial_metadata(self) -> Any:
        return ()

    def trailing_metadata(self) -> Any:
        return ()

    def is_active(self) -> bool:
        return False

    def time_remaining(self) -> Any:
        return None

    def cancel(self) -> bool:
        return False

    def add_callback(self, callback: Callable[[], None]) -> bool:
        return False

    def cancelled(self) -> bool:
        return False

    def running(self) -> bool:
        return False

    def done(self) -> bool:
        return True

    def result(self, timeout: float | None = None) -> Any:
        raise self

    def exception(self, timeout: float | None = None) -> Exception:
        return self

    def traceback(self, timeout: float | None = None) -> Any:
        return self.__traceback__

    def add_done_callback(self, fn: Callable[[Any], None]) -> None:
        fn(self)


class _Response(grpc.Call, _Future):
    """The finished call of a response a fallback gave."""

    def __init__(self, response: Any) -> None:
        self._response = response

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.OK

    def details(self) -> str:
        return ""

    def initial_metadata(self) -> Any:
        return ()

    def trailing_metadata(self) -> Any:
        return ()

    def is_active(self) -> bool:
        return False

    def time_remaining(self) -> Any:
        return None

    def cancel(self) -> bool:
        return False

    def add_callback(self, callback: Callable[[], None]) -> bool:
        return False

    def cancelled(self) -> bool:
        return False

    def running(self) -> bool:
        return False

    def done(self) -> bool:
        return True

    def result(self, timeout: float | None = None) -> Any:
        return self._response

    def exception(self, timeout: float | None = None) -> Exception | None:
        return None

    def traceback(self, timeout: float | None = None) -> Any:
        return None

    def add_done_callback(self, fn: Callable[[Any], None]) -> None:
        fn(self)


def _caller_deadline(st: _Call) -> CallFailed:
    """The failure of a call whose caller's deadline comes before its next attempt could."""
    return CallFailed(Reason.DEADLINE, policy=st.slot.info.name, attempts=st.attempts)


def _give_back(st: _Call, failed: LeveeError) -> Any:
    """What a sync call ends with when the core gives up: the last attempt's RpcError (the
    caller sees grpcio's own error), else a `LeveeRpcError` for the reason."""
    call = _last_call(st)
    return call if call is not None else LeveeRpcError(_failure_status(failed), failed)


def _last_error(st: _Call) -> BaseException | None:
    """The RpcError of the attempt the core ended on (`grpc.aio`: the call is not the error)."""
    last = st.last
    return last.exc if last is not None and isinstance(last.exc, grpc.RpcError) else None


def _last_call(st: _Call) -> Any:
    """The call of the attempt the core ended on, when it ended with an RpcError."""
    last = st.last
    if last is not None and last.value is not None and isinstance(last.exc, grpc.RpcError):
        return last.value
    return None


class _Stream(grpc.Call):
    """A response stream under the policy (sync grpcio): iterate it for the messages; `code()`,
    `details()` and the metadata are the current (at the end: the last) attempt's, `cancel()`
    cancels the call (not retried)."""

    def __init__(self) -> None:
        self._call: Any = None
        self._cancelled = False
        self._it: Iterator[Any] = iter(())

    def __iter__(self) -> _Stream:
        return self

    def __next__(self) -> Any:
        return next(self._it)

    def cancel(self) -> bool:
        self._cancelled = True
        call = self._call
        if call is not None:
            call.cancel()
        return True

    def code(self) -> Any:
        call = self._call
        return call.code() if call is not None else None

    def details(self) -> Any:
        call = self._call
        return call.details() if call is not None else None

    def initial_metadata(self) -> Any:
        call = self._call
        return call.initial_metadata() if call is not None else ()

    def trailing_metadata(self) -> Any:
        call = self._call
        return call.trailing_metadata() if call is not None else ()

    def is_active(self) -> bool:
        call = self._call
        return bool(call.is_active()) if call is not None else not self._cancelled

    def time_remaining(self) -> Any:
        call = self._call
        return call.time_remaining() if call is not None else None

    def add_callback(self, callback: Callable[[], None]) -> bool:
        call = self._call
        return bool(call.add_callback(callback)) if call is not None else False


class LeveeClientInterceptor(
    _Base,
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """A sync grpcio client interceptor applying a policy to every call (all four kinds).

    `policy` is a policy name, a `Policy` handle, or a function of the method
    (`"/pkg.Service/Method"`) answering either. The calls' key is `grpc_key(target)`, or
    `key(client_call_details)` when given. Wrap the channel with `intercept_channel` (this
    module's) so that hedged attempts can be cancelled."""

    def __init__(self, engine: Engine, policy: PolicyChoice, *, target: str | None = None,
                 key: KeyFunction | None = None) -> None:  # fmt: skip
        _Base.__init__(self, engine, policy, target, key)

    # -------------------------------------------------------------- the four kinds

    def intercept_unary_unary(self, continuation: Callable[[grpc.ClientCallDetails, Any], Any],
                              client_call_details: grpc.ClientCallDetails, request: Any) -> Any:  # fmt: skip
        return self._unary(continuation, client_call_details, request, lambda: request, True)

    def intercept_stream_unary(self, continuation: Callable[[grpc.ClientCallDetails, Any], Any],
                               client_call_details: grpc.ClientCallDetails, request_iterator: Any) -> Any:  # fmt: skip
        requests, replayable = _requests(request_iterator)
        return self._unary(continuation, client_call_details, request_iterator, requests, replayable)

    def intercept_unary_stream(self, continuation: Callable[[grpc.ClientCallDetails, Any], Any],
                               client_call_details: grpc.ClientCallDetails, request: Any) -> Any:  # fmt: skip
        stream = _Stream()
        stream._it = self._stream(stream, continuation, client_call_details, request, lambda: request, True)
        return stream

    def intercept_stream_stream(self, continuation: Callable[[grpc.ClientCallDetails, Any], Any],
                                client_call_details: grpc.ClientCallDetails, request_iterator: Any) -> Any:  # fmt: skip
        requests, replayable = _requests(request_iterator)
        stream = _Stream()
        stream._it = self._stream(stream, continuation, client_call_details, request_iterator, requests, replayable)
        return stream

    # -------------------------------------------------------------- unary responses

    def _unary(self, continuation: Callable[[grpc.ClientCallDetails, Any], Any], details: grpc.ClientCallDetails,
               request: Any, requests: Callable[[], Any], replayable: bool) -> Any:  # fmt: skip
        started = self._start(details, replayable)
        caller_end = started.caller_end
        first: _AttemptResult | None = None
        timeout = started.hot()
        if timeout >= 0:
            start = _monotonic_ns()
            d = _Details(details, _seconds(timeout, caller_end, start), details.metadata)
            try:
                call = continuation(d, requests())
                exc = call.exception()
            except Exception as e:
                call, exc = None, e
            except BaseException:
                started.state(request).cancel()
                raise
            end = _monotonic_ns()
            if exc is None and started.hold(start, end, timeout):
                return call
            first = _AttemptResult(_outcome(exc), call, exc, start, end)
        st = started.state(request)
        if first is not None:
            self._ended(st, caller_end, first.end)
        proto = _protocol(st, started.v)

        def attempt(n: int, timeout: int) -> _AttemptResult:
            return self._attempt(st, continuation, details, requests, n, timeout, caller_end)

        try:
            action = next(proto)
            if first is not None:
                action = proto.send(first)
            while True:
                op = action[0]
                if op == ATTEMPT:
                    action = proto.send(attempt(action[1], action[2]))
                elif op == HEDGE:
                    run_hedge_sync(action[1], attempt)
                    action = proto.send(None)
                elif op == _SLEEP:
                    if self._past(st, caller_end, action[1]):
                        return _give_back(st, _caller_deadline(st))
                    sleep_sync(st.engine, action[1], action[2])
                    action = proto.send(None)
                else:
                    action = proto.send(_run_fallback_sync(st, action[1], action[2]))
        except StopIteration as stop:
            return _Response(stop.value) if st.fell_back else stop.value
        except (CallFailed, EngineClosed) as failed:
            return _give_back(st, failed)
        except grpc.RpcError:
            call = _last_call(st)  # the one attempt of a degraded call
            if call is None:
                raise
            return call
        finally:
            proto.close()

    def _attempt(self, st: _Call, continuation: Callable[[grpc.ClientCallDetails, Any], Any],
                 details: grpc.ClientCallDetails, requests: Callable[[], Any], number: int, timeout: int,
                 caller_end: int | None) -> _AttemptResult:  # fmt: skip
        eng = st.engine
        start = eng._now()
        d = _Details(details, _seconds(timeout, caller_end, start), _metadata(details.metadata, number))
        try:
            call = continuation(d, requests())
        except Exception as e:
            return _AttemptResult(outcome_for_exception(e), None, e, start, eng._now())
        on_attempt_cancel(call.cancel)  # a hedged attempt the core cancels: the server sees it
        try:
            exc = call.exception()
        except grpc.FutureCancelledError as e:
            return _AttemptResult(Outcome.grpc(_CANCELLED), call, e, start, eng._now())
        end = eng._now()
        self._ended(st, caller_end, end)
        return _AttemptResult(_outcome(exc), call, exc, start, end)

    # -------------------------------------------------------------- response streams

    def _stream(self, stream: _Stream, continuation: Callable[[grpc.ClientCallDetails, Any], Any],
                details: grpc.ClientCallDetails, request: Any, requests: Callable[[], Any],
                replayable: bool) -> Iterator[Any]:  # fmt: skip
        st, v, caller_end = self._begin(details, request, replayable)
        proto = _protocol(st, v)

        def attempt(n: int, timeout: int) -> Generator[Any, None, _AttemptResult]:
            return self._stream_attempt(stream, st, continuation, details, requests, n, timeout, caller_end)

        try:
            action = next(proto)
            while True:
                op = action[0]
                if op == ATTEMPT:
                    res = yield from attempt(action[1], action[2])
                    action = proto.send(res)
                elif op == HEDGE:
                    # one stream at a time: a hedge starts when the attempt before it has ended
                    serial = hedge_serial(action[1])
                    try:
                        step = next(serial)
                        while True:
                            if step[0] == ATTEMPT:
                                res = yield from attempt(step[1], step[2])
                                step = serial.send(res)
                            else:
                                st.engine._clock.sleep(step[1] / 1e9)
                                step = serial.send(None)
                    except StopIteration:
                        pass
                    finally:
                        serial.close()
                    action = proto.send(None)
                elif op == _SLEEP:
                    if self._past(st, caller_end, action[1]):
                        raise _give_back(st, _caller_deadline(st))
                    sleep_sync(st.engine, action[1], action[2])
                    action = proto.send(None)
                else:
                    action = proto.send(_iterable_fallback(*_run_fallback_sync(st, action[1], action[2])))
        except StopIteration as stop:
            if st.fell_back:
                yield from stop.value
        except (CallFailed, EngineClosed) as failed:
            error = _give_back(st, failed)
            stream._call = error
            raise error from None
        except grpc.RpcError:
            call = _last_call(st)
            if call is None:
                raise
            raise call from None
        finally:
            proto.close()

    def _stream_attempt(self, stream: _Stream, st: _Call, continuation: Callable[[grpc.ClientCallDetails, Any], Any],
                        details: grpc.ClientCallDetails, requests: Callable[[], Any], number: int, timeout: int,
                        caller_end: int | None) -> Generator[Any, None, _AttemptResult]:  # fmt: skip
        eng = st.engine
        start = eng._now()
        d = _Details(details, _seconds(timeout, caller_end, start), _metadata(details.metadata, number))
        try:
            call = continuation(d, requests())
        except Exception as e:
            return _AttemptResult(outcome_for_exception(e), None, e, start, eng._now())
        stream._call = call
        if stream._cancelled:
            call.cancel()
        exc: BaseException | None = None
        try:
            first = next(call)
        except StopIteration:
            return self._stream_end(stream, st, call, None, start, caller_end)
        except Exception as e:
            return self._stream_end(stream, st, call, e, start, caller_end)
        st.retry_if = _committed  # A6: a response has arrived, the call is committed to this attempt
        yield first
        try:
            yield from call
        except Exception as e:
            exc = e
        return self._stream_end(stream, st, call, exc, start, caller_end)

    def _stream_end(self, stream: _Stream, st: _Call, call: Any, exc: BaseException | None, start: int,
                    caller_end: int | None) -> _AttemptResult:  # fmt: skip
        end = st.engine._now()
        self._ended(st, caller_end, end)
        if stream._cancelled:
            st.retry_if = _committed  # the caller cancelled: not retried
        return _AttemptResult(_outcome(exc), call, exc, start, end)


def _requests(request_iterator: Any) -> tuple[Callable[[], Any], bool]:
    """What each attempt sends of a request stream: a buffered one anew; any other iterator
    once (its call is non-idempotent: the core never asks for a second)."""
    replay = _replay(request_iterator)
    if replay is not None:
        return replay, True
    return (lambda: request_iterator), False


def _iterable_fallback(ok: bool, value: Any) -> tuple[bool, Any]:
    """A fallback of a response stream gives the messages: an iterable (not a str or bytes)."""
    if ok and (isinstance(value, (str, bytes)) or not isinstance(value, (Iterable, AsyncIterable))):
        return False, TypeError(
            f"a fallback of a gRPC response stream must return an iterable of messages, not {type(value).__name__}"
        )
    return ok, value


# ---------------------------------------------------------------------------- intercept_channel


class _Cancellable:
    """A unary multicallable of `intercept_channel`: a call whose policy hedges goes through
    `future()`, so that each attempt's continuation is a cancellable future (grpcio's `__call__`
    and `with_call` run it to its end); any other call takes grpcio's cheaper blocking path."""

    def __init__(self, inner: Any, method: str, levee: list[LeveeClientInterceptor]) -> None:
        self._inner = inner
        self._method = method
        self._levee = levee

    def _hedged(self) -> bool:
        return any(i._hedges(self._method) for i in self._levee)

    def __call__(self, request: Any, /, *args: Any, **kwargs: Any) -> Any:
        if self._hedged():
            return self._inner.future(request, *args, **kwargs).result()
        return self._inner(request, *args, **kwargs)

    def with_call(self, request: Any, /, *args: Any, **kwargs: Any) -> tuple[Any, grpc.Call]:
        if self._hedged():
            call = self._inner.future(request, *args, **kwargs)
            return call.result(), call
        result: tuple[Any, grpc.Call] = self._inner.with_call(request, *args, **kwargs)
        return result

    def future(self, request: Any, /, *args: Any, **kwargs: Any) -> Any:
        return self._inner.future(request, *args, **kwargs)


class _UnaryUnary(_Cancellable, _UnaryUnaryMultiCallable):  # type: ignore[misc]  # grpcio's signatures, *args
    pass


class _StreamUnary(_Cancellable, _StreamUnaryMultiCallable):  # type: ignore[misc]
    pass


class _Channel(grpc.Channel):
    def __init__(self, inner: grpc.Channel, levee: list[LeveeClientInterceptor]) -> None:
        self._inner = inner
        self._levee = levee

    def subscribe(self, callback: Callable[[grpc.ChannelConnectivity], None], try_to_connect: bool = False) -> None:
        self._inner.subscribe(callback, try_to_connect)

    def unsubscribe(self, callback: Callable[[grpc.ChannelConnectivity], None]) -> None:
        self._inner.unsubscribe(callback)

    def unary_unary(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return _UnaryUnary(self._inner.unary_unary(method, *args, **kwargs), method, self._levee)

    def unary_stream(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return self._inner.unary_stream(method, *args, **kwargs)

    def stream_unary(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return _StreamUnary(self._inner.stream_unary(method, *args, **kwargs), method, self._levee)

    def stream_stream(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return self._inner.stream_stream(method, *args, **kwargs)

    def close(self) -> None:
        self._inner.close()

    def __enter__(self) -> _Channel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def intercept_channel(channel: grpc.Channel, *interceptors: Any) -> grpc.Channel:
    """`grpc.intercept_channel(channel, *interceptors)`, whose unary calls under a hedging
    policy run through `future()`, so that every attempt a `LeveeClientInterceptor` starts can
    be cancelled (a hedged call's losers: the server sees the cancellation). The calls behave
    as grpcio's."""
    levee = [i for i in interceptors if isinstance(i, LeveeClientInterceptor)]
    return _Channel(grpc.intercept_channel(channel, *interceptors), levee)


# ---------------------------------------------------------------------------- grpc.aio


class LeveeAioRpcError(grpc.aio.AioRpcError):
    """`LeveeRpcError` for `grpc.aio`: the status in `REJECTION_STATUS`; `failure` (also the
    `__cause__`) is Levee's typed error."""

    def __init__(self, code: grpc.StatusCode, failure: LeveeError) -> None:
        super().__init__(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=str(failure))
        self.failure = failure
        self.__cause__ = failure


def _aio_failure(failed: LeveeError) -> LeveeAioRpcError:
    return LeveeAioRpcError(_failure_status(failed), failed)


def _aio_details(details: grpc.aio.ClientCallDetails, timeout: float | None, number: int) -> grpc.aio.ClientCallDetails:
    pairs = _metadata(details.metadata, number)
    metadata = None if pairs is None else grpc.aio.Metadata(*pairs)
    return grpc.aio.ClientCallDetails(details.method, timeout, metadata, details.credentials, details.wait_for_ready)


class _AioStream(_UnaryStreamCall):
    """A response stream under the policy (`grpc.aio`): `async for` it; the status and metadata
    are the current (at the end: the last) attempt's; `cancel()` cancels it (not retried)."""

    def __init__(self) -> None:
        self._call: Any = None
        self._cancelled = False
        self._gen: AsyncIterator[Any] | None = None

    def __aiter__(self) -> AsyncIterator[Any]:
        assert self._gen is not None
        return self._gen

    async def read(self) -> Any:
        try:
            return await self.__aiter__().__anext__()
        except StopAsyncIteration:
            return grpc.aio.EOF

    def cancel(self) -> bool:
        self._cancelled = True
        call = self._call
        if call is not None:
            call.cancel()
        return True

    def cancelled(self) -> bool:
        return self._cancelled

    def done(self) -> bool:
        call = self._call
        return bool(call.done()) if call is not None else False

    def time_remaining(self) -> Any:
        call = self._call
        return call.time_remaining() if call is not None else None

    def add_done_callback(self, callback: Any) -> None:
        call = self._call
        if call is not None:
            call.add_done_callback(callback)

    async def initial_metadata(self) -> Any:
        call = self._call
        return await call.initial_metadata() if call is not None else grpc.aio.Metadata()

    async def trailing_metadata(self) -> Any:
        call = self._call
        return await call.trailing_metadata() if call is not None else grpc.aio.Metadata()

    async def code(self) -> grpc.StatusCode:
        call = self._call
        return await call.code() if call is not None else grpc.StatusCode.UNKNOWN

    async def details(self) -> str:
        call = self._call
        return await call.details() if call is not None else ""

    async def wait_for_connection(self) -> None:
        call = self._call
        if call is not None:
            await call.wait_for_connection()


class _AioBidi(_AioStream, _StreamStreamCall):
    """`_AioStream` for a bidi call (grpc.aio wraps anything else in an iterator without a call).
    grpc.aio's own call object takes the caller's `write()`s and hands them to the interceptor
    as the request iterator; these forward to the attempt in flight."""

    async def write(self, request: Any) -> None:
        call = self._call
        if call is None:
            raise grpc.aio.UsageError("the call has not started yet")
        await call.write(request)

    async def done_writing(self) -> None:
        call = self._call
        if call is not None:
            await call.done_writing()


class _AsyncCore(_Base):
    """What the four `grpc.aio` interceptors share (grpc.aio takes one class per kind)."""

    def __init__(self, engine: Engine, policy: PolicyChoice, *, target: str | None = None,
                 key: KeyFunction | None = None) -> None:  # fmt: skip
        _Base.__init__(self, engine, policy, target, key)

    # -------------------------------------------------------------- unary responses

    async def _unary(self, continuation: Callable[..., Any], details: grpc.aio.ClientCallDetails, request: Any,
                     requests: Callable[[], Any], replayable: bool) -> Any:  # fmt: skip
        started = self._start(details, replayable)
        caller_end = started.caller_end
        first: _AttemptResult | None = None
        timeout = started.hot()
        if timeout >= 0:
            start = _monotonic_ns()
            d = _aio_details(details, _seconds(timeout, caller_end, start), 1)
            try:
                call = await continuation(d, requests())
                exc: BaseException | None = None
                try:
                    await call
                except asyncio.CancelledError:
                    call.cancel()
                    raise
                except Exception as e:
                    exc = e
            except BaseException:
                started.state(request).cancel()
                raise
            end = _monotonic_ns()
            if exc is None and started.hold(start, end, timeout):
                return call
            first = _AttemptResult(_outcome(exc), call, exc, start, end)
        st = started.state(request)
        if first is not None:
            self._ended(st, caller_end, first.end)
        proto = _protocol(st, started.v)

        async def attempt(n: int, timeout: int) -> _AttemptResult:
            return await self._attempt(st, continuation, details, requests, n, timeout, caller_end)

        try:
            action = next(proto)
            if first is not None:
                action = proto.send(first)
            while True:
                op = action[0]
                if op == ATTEMPT:
                    action = proto.send(await attempt(action[1], action[2]))
                elif op == HEDGE:
                    await run_hedge_async(action[1], attempt)
                    action = proto.send(None)
                elif op == _SLEEP:
                    if self._past(st, caller_end, action[1]):
                        call = _last_call(st)
                        if call is not None:
                            return call
                        raise _aio_failure(_caller_deadline(st))
                    await sleep_async(st.engine, action[1], action[2])
                    action = proto.send(None)
                else:
                    action = proto.send(await _run_fallback_async(st, action[1], action[2]))
        except StopIteration as stop:
            return stop.value  # the winning attempt's call, or the fallback's response
        except (CallFailed, EngineClosed) as failed:
            call = _last_call(st)
            if call is not None:
                return call
            raise _aio_failure(failed) from failed
        except grpc.RpcError:
            call = _last_call(st)
            if call is None:
                raise
            return call
        finally:
            proto.close()

    async def _attempt(self, st: _Call, continuation: Callable[..., Any], details: grpc.aio.ClientCallDetails,
                       requests: Callable[[], Any], number: int, timeout: int,
                       caller_end: int | None) -> _AttemptResult:  # fmt: skip
        eng = st.engine
        start = eng._now()
        d = _aio_details(details, _seconds(timeout, caller_end, start), number)
        try:
            call = await continuation(d, requests())
        except Exception as e:
            return _AttemptResult(_outcome(e), None, e, start, eng._now())
        exc: BaseException | None = None
        try:
            await call
        except asyncio.CancelledError:
            call.cancel()  # a hedged loser or the caller's cancellation: the server sees it
            raise
        except Exception as e:
            exc = e
        end = eng._now()
        self._ended(st, caller_end, end)
        return _AttemptResult(_outcome(exc), call, exc, start, end)

    # -------------------------------------------------------------- response streams

    async def _stream(self, stream: _AioStream, continuation: Callable[..., Any], details: grpc.aio.ClientCallDetails,
                      request: Any, requests: Callable[[], Any], replayable: bool) -> AsyncIterator[Any]:  # fmt: skip
        st, v, caller_end = self._begin(details, request, replayable)
        proto = _protocol(st, v)
        try:
            action = next(proto)
            while True:
                op = action[0]
                if op == ATTEMPT:
                    inner = self._stream_attempt(stream, st, continuation, details, requests, action[1], action[2],
                                                 caller_end)  # fmt: skip
                    res: _AttemptResult | None = None
                    try:
                        async for item in inner:
                            if isinstance(item, _AttemptResult):
                                res = item
                            else:
                                yield item
                    finally:
                        await inner.aclose()
                    action = proto.send(res)
                elif op == HEDGE:
                    serial = hedge_serial(action[1])
                    try:
                        step = next(serial)
                        while True:
                            if step[0] == ATTEMPT:
                                inner = self._stream_attempt(stream, st, continuation, details, requests, step[1],
                                                             step[2], caller_end)  # fmt: skip
                                res = None
                                try:
                                    async for item in inner:
                                        if isinstance(item, _AttemptResult):
                                            res = item
                                        else:
                                            yield item
                                finally:
                                    await inner.aclose()
                                step = serial.send(res)
                            else:
                                await st.engine._clock.sleep_async(step[1] / 1e9)
                                step = serial.send(None)
                    except StopIteration:
                        pass
                    finally:
                        serial.close()
                    action = proto.send(None)
                elif op == _SLEEP:
                    if self._past(st, caller_end, action[1]):
                        error = _last_error(st)
                        raise error if error is not None else _aio_failure(_caller_deadline(st))
                    await sleep_async(st.engine, action[1], action[2])
                    action = proto.send(None)
                else:
                    ok, value = _iterable_fallback(*await _run_fallback_async(st, action[1], action[2]))
                    action = proto.send((ok, value))
        except StopIteration as stop:
            if st.fell_back:
                value = stop.value
                if isinstance(value, AsyncIterable):
                    async for m in value:
                        yield m
                else:
                    for m in value:
                        yield m
        except (CallFailed, EngineClosed) as failed:
            error = _last_error(st)
            if error is not None:
                raise error from None
            raise _aio_failure(failed) from failed
        finally:
            proto.close()

    async def _stream_attempt(self, stream: _AioStream, st: _Call, continuation: Callable[..., Any],
                              details: grpc.aio.ClientCallDetails, requests: Callable[[], Any], number: int,
                              timeout: int, caller_end: int | None) -> AsyncGenerator[Any, None]:  # fmt: skip
        """Yields the attempt's messages, then its `_AttemptResult` (last)."""
        eng = st.engine
        start = eng._now()
        d = _aio_details(details, _seconds(timeout, caller_end, start), number)
        try:
            call = await continuation(d, requests())
        except Exception as e:
            yield _AttemptResult(_outcome(e), None, e, start, eng._now())
            return
        stream._call = call
        if stream._cancelled:
            call.cancel()
        exc: BaseException | None = None
        messages = call.__aiter__()
        try:
            try:
                first = await messages.__anext__()
            except StopAsyncIteration:
                yield self._stream_end(stream, st, call, None, start, caller_end)
                return
            except asyncio.CancelledError:
                raise
            except Exception as e:
                yield self._stream_end(stream, st, call, e, start, caller_end)
                return
            st.retry_if = _committed  # A6: committed to this attempt
            yield first
            try:
                async for m in messages:
                    yield m
            except asyncio.CancelledError:
                raise
            except Exception as e:
                exc = e
        except BaseException:
            call.cancel()  # the caller went away (cancelled, or stopped iterating)
            raise
        yield self._stream_end(stream, st, call, exc, start, caller_end)

    def _stream_end(self, stream: _AioStream, st: _Call, call: Any, exc: BaseException | None, start: int,
                    caller_end: int | None) -> _AttemptResult:  # fmt: skip
        end = st.engine._now()
        self._ended(st, caller_end, end)
        if stream._cancelled:
            st.retry_if = _committed
        return _AttemptResult(_outcome(exc), call, exc, start, end)


class AsyncLeveeUnaryUnaryInterceptor(_AsyncCore, grpc.aio.UnaryUnaryClientInterceptor):
    """The `grpc.aio` unary-unary interceptor: `aio_interceptors` makes the four."""

    async def intercept_unary_unary(self, continuation: Callable[..., Any], client_call_details: Any,
                                    request: Any) -> Any:  # fmt: skip
        return await self._unary(continuation, client_call_details, request, lambda: request, True)


class AsyncLeveeStreamUnaryInterceptor(_AsyncCore, grpc.aio.StreamUnaryClientInterceptor):
    """The `grpc.aio` stream-unary interceptor (a request stream is retried when buffered)."""

    async def intercept_stream_unary(self, continuation: Callable[..., Any], client_call_details: Any,
                                     request_iterator: Any) -> Any:  # fmt: skip
        requests, replayable = _requests(request_iterator)
        return await self._unary(continuation, client_call_details, request_iterator, requests, replayable)


class AsyncLeveeUnaryStreamInterceptor(_AsyncCore, grpc.aio.UnaryStreamClientInterceptor):
    """The `grpc.aio` unary-stream interceptor (retried until the first message arrives)."""

    async def intercept_unary_stream(self, continuation: Callable[..., Any], client_call_details: Any,
                                     request: Any) -> Any:  # fmt: skip
        stream = _AioStream()
        stream._gen = self._stream(stream, continuation, client_call_details, request, lambda: request, True)
        return stream


class AsyncLeveeStreamStreamInterceptor(_AsyncCore, grpc.aio.StreamStreamClientInterceptor):
    """The `grpc.aio` stream-stream interceptor (retried until the first message arrives, when
    the requests are buffered)."""

    async def intercept_stream_stream(self, continuation: Callable[..., Any], client_call_details: Any,
                                      request_iterator: Any) -> Any:  # fmt: skip
        requests, replayable = _requests(request_iterator)
        stream = _AioBidi()
        stream._gen = self._stream(stream, continuation, client_call_details, request_iterator, requests, replayable)
        return stream


def aio_interceptors(engine: Engine, policy: PolicyChoice, *, target: str | None = None,
                     key: KeyFunction | None = None) -> list[grpc.aio.ClientInterceptor]:  # fmt: skip
    """The four `grpc.aio` interceptors applying `policy` (as `LeveeClientInterceptor` takes
    it), for `grpc.aio.insecure_channel(target, interceptors=...)`: grpc.aio files an
    interceptor under one kind only, so each kind has its own."""
    return [
        AsyncLeveeUnaryUnaryInterceptor(engine, policy, target=target, key=key),
        AsyncLeveeUnaryStreamInterceptor(engine, policy, target=target, key=key),
        AsyncLeveeStreamUnaryInterceptor(engine, policy, target=target, key=key),
        AsyncLeveeStreamStreamInterceptor(engine, policy, target=target, key=key),
    ]

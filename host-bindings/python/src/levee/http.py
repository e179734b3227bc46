"""httpx transports that apply a policy to every request.

```python
engine = levee.load("policies.yaml")
client = httpx.Client(transport=levee.http.LeveeTransport(engine, "api"))
```

Each request is one call (docs/hosts.md, section 6): the key is the request's origin as
`host:port` (the port always written, the scheme's default when the URL has none), the HTTP
method travels in the call's flags exactly as httpx sends it, a request carrying a non-empty
`Idempotency-Key` or `X-Idempotency-Key` header is marked as such. Every attempt is reported
by its status and raw `Retry-After` header (or as a timeout or connection error); the core
decides. The per-attempt timeout becomes the request's timeout.

An attempt is the whole response (docs/http.md): its body is read inside the attempt, under
the attempt's timeout, so a body that trickles past it is a timeout and a connection closed
mid-body a connection error of that attempt; the response handed back is already read. A
request body that cannot be replayed (a generator) starts the call as non-idempotent, whatever
its headers say: the core never asks for a second attempt.

When the core gives up after a response (say the third 503, or a 400 it never retries),
the transport returns that response: the client sees it as usual. When there is no response
to return (a breaker open, a connection error on the last attempt) it raises the
`CallFailed` subclass for the reason. A fallback registered on the engine receives a
`FallbackContext` whose `args` is `(request,)` and must return an `httpx.Response`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx

from ._constants import (
    DEFAULT_PORTS,
    HTTP_ATTEMPT_HEADER,
    IDEMPOTENCY_HEADERS,
    START_IDEMPOTENCY_KEY,
    START_NON_IDEMPOTENT,
)
from ._driver import _SLEEP, ATTEMPT, HEDGE, RetryPredicate, _AttemptResult, _Call, _Hedge, _protocol
from ._events import logger
from ._io import (
    _AttemptScope,
    _run_fallback_async,
    _run_fallback_sync,
    attempt_timeout_cm,
    run_hedge_async,
    run_hedge_sync,
    sleep_async,
    sleep_sync,
    timed_out,
)
from .engine import Engine, Policy, method_flags
from .errors import CallFailed, EngineClosed
from .outcomes import outcome_for_exception, outcome_for_response

__all__ = ["AsyncLeveeTransport", "LeveeTransport", "http_key", "request_flags"]


def request_flags(request: httpx.Request) -> int:
    """`start` flags for a request: its method (bits 8-11, as httpx sends it), and either an
    idempotency key (a non-empty `Idempotency-Key` or `X-Idempotency-Key`) or, for a body that
    cannot be sent twice, the non-idempotent flag without it."""
    flags = method_flags(request.method)
    if not _replayable(request):
        return flags | START_NON_IDEMPOTENT
    headers = request.headers
    if any(headers.get(name) for name in IDEMPOTENCY_HEADERS):
        flags |= START_IDEMPOTENCY_KEY
    return flags


def http_key(url: httpx.URL) -> str:
    """The key of an HTTP call: `host:port`, the host lower-cased, an IPv6 literal in brackets,
    no userinfo, the port always written (the scheme's default when the URL has none)."""
    host = url.host.lower()
    if ":" in host:
        host = f"[{host}]"
    port = url.port if url.port is not None else DEFAULT_PORTS.get(url.scheme, 0)
    return f"{host}:{port}"


# The cross-layer rule (docs/envoy.md): every attempt carries its number; the application
# decides the request's retries, so a Levee filter in an Envoy on the way adds none.
HEADER_ATTEMPT = HTTP_ATTEMPT_HEADER


def _mark_attempt(request: httpx.Request, number: int) -> None:
    request.headers[HEADER_ATTEMPT] = str(number)


def _with_timeout(request: httpx.Request, timeout_ns: int) -> None:
    if not timeout_ns:
        return
    seconds = timeout_ns / 1e9
    current = dict(request.extensions.get("timeout") or {})
    for phase in ("connect", "read", "write", "pool"):
        value = current.get(phase)
        current[phase] = seconds if value is None else min(float(value), seconds)
    request.extensions = {**request.extensions, "timeout": current}


def _default_key(request: httpx.Request) -> str:
    return http_key(request.url)


def _replayable(request: httpx.Request) -> bool:
    """Whether the request's body can be sent again (bytes can; a generator cannot)."""
    return isinstance(request.stream, httpx.ByteStream)


def _read_within(response: httpx.Response, timeout_ns: int, start: int, now: Callable[[], int]) -> None:
    """Read the body, cut at the attempt's timeout: the deadline is checked after every
    chunk (a read that waits longer is bounded by the read timeout, at most the attempt's) and
    once the body has ended, so that a response that came late as a whole, body or not, is a
    timeout as in the async transport, whose attempt is cancelled at its timeout (docs/hosts.md,
    section 4: a host that cannot stop waiting finds out afterwards)."""
    if not timeout_ns:
        response.read()
        return
    end = start + timeout_ns
    chunks = []
    late = False
    try:
        for chunk in response.iter_bytes():
            chunks.append(chunk)
            if now() >= end:
                late = True
                break
        late = late or now() >= end
        if late:
            raise httpx.ReadTimeout("the response did not arrive within the attempt's timeout")
    finally:
        if late or not response.is_stream_consumed:
            response.close()
    response._content = b"".join(chunks)  # as httpx's own read() keeps it


class _Base:
    def __init__(self, engine: Engine, policy: str | Policy, key: Callable[[httpx.Request], str] | None,
                 retry_if: RetryPredicate | None = None) -> None:  # fmt: skip
        self._policy = policy if isinstance(policy, Policy) else engine.policy(policy)
        self._engine = self._policy.engine
        self._key = key or _default_key
        #: the retry predicate, given the `httpx.Response` or the transport's exception
        self._retry_if = retry_if

    def _begin(self, request: httpx.Request) -> tuple[_Call, int]:
        pol = self._policy
        key = self._key(request)
        span = self._engine._open_span(pol._slot, key)
        call, gen, v, now = self._engine._start(pol._slot, key, request_flags(request) | pol._flags, span)
        st = pol._state(call, gen, now, key, (request,), {}, span)
        st.http = True
        if self._retry_if is not None:
            st.retry_if = self._retry_if
        return st, v

    def _result(self, request: httpx.Request, response: httpx.Response | None, exc: BaseException | None,
                start: int, timeout: int) -> _AttemptResult:  # fmt: skip
        end = self._engine._now()
        if exc is not None:
            return _AttemptResult(outcome_for_exception(exc), None, exc, start, end)
        assert response is not None
        # a response past the attempt's timeout never gets here: the async transport stops waiting at
        # the timeout, the sync one raises ReadTimeout once it has it (`_read_within`)
        return _AttemptResult(outcome_for_response(response), response, None, start, end)


class LeveeTransport(_Base, httpx.BaseTransport):
    """A sync httpx transport applying `policy` to each request through `transport`."""

    def __init__(self, engine: Engine, policy: str | Policy, *, transport: httpx.BaseTransport | None = None,
                 key: Callable[[httpx.Request], str] | None = None,
                 retry_if: RetryPredicate | None = None) -> None:  # fmt: skip
        super().__init__(engine, policy, key, retry_if)
        self._transport = transport or httpx.HTTPTransport()

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        st, v = self._begin(request)
        proto = _protocol(st, v)
        last: httpx.Response | None = None
        try:
            action = next(proto)
            while True:
                op = action[0]
                if last is not None:
                    last.close()
                    last = None
                if op == ATTEMPT:
                    res = self._attempt(request, action[1], action[2])
                    last = res.value
                    action = proto.send(res)
                elif op == HEDGE:
                    # each hedged attempt is its own request (docs/policy.md, "Hedging")
                    h: _Hedge = action[1]
                    h.on_discard = _close_response
                    run_hedge_sync(h, lambda n, t: self._attempt(_copy(request), n, t))
                    h.discard_losers()
                    action = proto.send(None)
                elif op == _SLEEP:
                    sleep_sync(self._engine, action[1], action[2])
                    action = proto.send(None)
                else:
                    action = proto.send(_checked(action[1], *_run_fallback_sync(st, action[1], action[2])))
        except StopIteration as stop:
            return _as_response(stop.value)
        except (CallFailed, EngineClosed) as failed:
            if isinstance(failed.last_result, httpx.Response):
                return failed.last_result
            raise
        finally:
            proto.close()

    def _attempt(self, request: httpx.Request, number: int, timeout: int) -> _AttemptResult:
        _mark_attempt(request, number)
        _with_timeout(request, timeout)
        start = self._engine._now()
        scope = _AttemptScope(self._engine, start, timeout)
        try:
            response = self._transport.handle_request(request)
            _read_within(response, timeout, start, self._engine._now)
            return self._result(request, response, None, start, timeout)
        except Exception as e:
            return self._result(request, None, e, start, timeout)
        finally:
            scope.close()

    def close(self) -> None:
        self._transport.close()


class AsyncLeveeTransport(_Base, httpx.AsyncBaseTransport):
    """An asyncio httpx transport applying `policy` to each request through `transport`."""

    def __init__(self, engine: Engine, policy: str | Policy, *, transport: httpx.AsyncBaseTransport | None = None,
                 key: Callable[[httpx.Request], str] | None = None,
                 retry_if: RetryPredicate | None = None) -> None:  # fmt: skip
        super().__init__(engine, policy, key, retry_if)
        self._transport = transport or httpx.AsyncHTTPTransport()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        st, v = self._begin(request)
        proto = _protocol(st, v)
        last: httpx.Response | None = None
        try:
            action = next(proto)
            while True:
                op = action[0]
                if last is not None:
                    await last.aclose()
                    last = None
                if op == ATTEMPT:
                    res = await self._attempt(request, action[1], action[2])
                    last = res.value
                    action = proto.send(res)
                elif op == HEDGE:
                    # each hedged attempt is its own request, cancelled by cancelling its task
                    h: _Hedge = action[1]
                    h.on_discard = _close_response
                    await run_hedge_async(h, lambda n, t: self._attempt(_copy(request), n, t))
                    h.discard_losers()
                    action = proto.send(None)
                elif op == _SLEEP:
                    await sleep_async(self._engine, action[1], action[2])
                    action = proto.send(None)
                else:
                    action = proto.send(_checked(action[1], *await _run_fallback_async(st, action[1], action[2])))
        except StopIteration as stop:
            return _as_response(stop.value)
        except (CallFailed, EngineClosed) as failed:
            if isinstance(failed.last_result, httpx.Response):
                return failed.last_result
            raise
        finally:
            proto.close()

    async def _attempt(self, request: httpx.Request, number: int, timeout: int) -> _AttemptResult:
        _mark_attempt(request, number)
        _with_timeout(request, timeout)
        start = self._engine._now()
        try:
            if timeout:
                scope = _AttemptScope(self._engine, start, timeout)
                cm = attempt_timeout_cm(self._engine, timeout)
                try:
                    async with cm:
                        response = await self._transport.handle_async_request(request)
                        await response.aread()
                except TimeoutError as e:
                    if getattr(cm, "expired", lambda: True)():
                        raise timed_out(e, number, timeout) from None
                    raise
                finally:
                    scope.close()
            else:
                response = await self._transport.handle_async_request(request)
                await response.aread()
            return self._result(request, response, None, start, timeout)
        except Exception as e:
            return self._result(request, None, e, start, timeout)

    async def aclose(self) -> None:
        await self._transport.aclose()


def _copy(request: httpx.Request) -> httpx.Request:
    """A hedged attempt's own request: the same method, URL, headers and (replayable) body, so
    that concurrent attempts never share one request's headers or stream."""
    return httpx.Request(request.method, request.url, headers=request.headers.copy(), stream=request.stream,
                         extensions=dict(request.extensions))  # fmt: skip


def _close_response(value: Any) -> None:
    """Close the response of an attempt whose result the call does not return."""
    if isinstance(value, httpx.Response):
        value.close()


def _checked(name: str, ok: bool, value: Any) -> tuple[bool, Any]:
    """A fallback of a transport must give a response; anything else is a failed fallback."""
    if ok and not isinstance(value, httpx.Response):
        logger.warning("levee: fallback %r returned %r, not an httpx.Response: counted as failed", name, type(value))
        return False, TypeError(
            f"fallback {name!r} of an httpx transport returned {type(value).__name__}, not an httpx.Response"
        )
    return ok, value


def _as_response(value: Any) -> httpx.Response:
    if isinstance(value, httpx.Response):
        return value
    raise TypeError(f"a Levee fallback for an httpx transport must return an httpx.Response, got {type(value)!r}")

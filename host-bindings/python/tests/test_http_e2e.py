"""End-to-end: real HTTP servers on 127.0.0.1, httpx (sync and async transports) and requests."""

from __future__ import annotations

import email.utils
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
import requests

import levee
from levee import BreakerState, Event, EventKind
from levee.http import AsyncLeveeTransport, LeveeTransport

from .conftest import Reply, Server

DOC = """
policies:
  http:
    attempts: 3
    backoff: { kind: constant, base: 10ms, jitter: none }
  timed:
    attempts: 3
    attempt-timeout: 200ms
    backoff: { kind: constant, base: 10ms, jitter: none }
  breaker:
    attempts: 1
    breaker:
      window: { kind: count, size: 4 }
      minimum-calls: 4
      failure-rate: 50
      open-duration: 300ms
      half-open-permits: 1
  fallback:
    attempts: 2
    backoff: { kind: constant, base: 10ms, jitter: none }
    fallbacks: [{ name: cached, on: [retries-exhausted, breaker-open] }]
"""


@pytest.fixture
def engine() -> levee.Engine:
    return levee.Engine(DOC, seed=3)


def test_503_then_200_httpx(engine: levee.Engine, server: Server) -> None:
    server.script("/a", Reply(503), Reply(200, body=b"hello"))
    with httpx.Client(transport=LeveeTransport(engine, "http")) as client:
        r = client.get(server.url("/a"))
    assert r.status_code == 200 and r.text == "hello"
    assert len(server.hits("/a")) == 2


def test_every_attempt_carries_x_levee_attempt(engine: levee.Engine, server: Server) -> None:
    # The cross-layer rule (docs/envoy.md): the proxy's filter adds no retries to these.
    server.script("/marked", Reply(503), Reply(503), Reply(200))
    with httpx.Client(transport=LeveeTransport(engine, "http")) as client:
        r = client.get(server.url("/marked"))
    assert r.status_code == 200
    assert [h.headers.get("x-levee-attempt") for h in server.hits("/marked")] == ["1", "2", "3"]


async def test_every_async_attempt_carries_x_levee_attempt(engine: levee.Engine, server: Server) -> None:
    server.script("/marked-async", Reply(503), Reply(200))
    async with httpx.AsyncClient(transport=AsyncLeveeTransport(engine, "http")) as client:
        r = await client.get(server.url("/marked-async"))
    assert r.status_code == 200
    assert [h.headers.get("x-levee-attempt") for h in server.hits("/marked-async")] == ["1", "2"]


def test_503_then_200_requests_decorator(engine: levee.Engine, server: Server) -> None:
    server.script("/b", Reply(503), Reply(503), Reply(200, body=b"fine"))

    @engine.policy("http", method="GET")
    def get() -> requests.Response:
        return requests.get(server.url("/b"), timeout=5)

    r = get()
    assert r.status_code == 200 and r.text == "fine"
    assert len(server.hits("/b")) == 3


def test_429_retry_after_seconds(engine: levee.Engine, server: Server) -> None:
    server.script("/c", Reply(429, {"Retry-After": "1"}), Reply(200))
    with httpx.Client(transport=LeveeTransport(engine, "http")) as client:
        assert client.get(server.url("/c")).status_code == 200
    hits = server.hits("/c")
    assert len(hits) == 2
    assert 0.9 <= hits[1].at - hits[0].at < 3.0


def test_429_retry_after_http_date(engine: levee.Engine, server: Server) -> None:
    def reply() -> Reply:
        when = email.utils.formatdate(time.time() + 2, usegmt=True)
        return Reply(429, {"Retry-After": when})

    server.script("/d", reply, Reply(200))
    with httpx.Client(transport=LeveeTransport(engine, "http")) as client:
        assert client.get(server.url("/d")).status_code == 200
    hits = server.hits("/d")
    assert len(hits) == 2
    # the date has a resolution of one second: between 1 and 2 s from now
    assert 0.9 <= hits[1].at - hits[0].at < 3.5


def test_400_not_retried(engine: levee.Engine, server: Server) -> None:
    server.script("/e", Reply(400))
    with httpx.Client(transport=LeveeTransport(engine, "http")) as client:
        assert client.get(server.url("/e")).status_code == 400
    assert len(server.hits("/e")) == 1

    @engine.policy("http")
    def get() -> requests.Response:
        r = requests.get(server.url("/e"), timeout=5)
        r.raise_for_status()
        return r

    with pytest.raises(levee.NotRetryable) as info:
        get()
    assert isinstance(info.value.last_error, requests.HTTPError)
    assert len(server.hits("/e")) == 2


def test_connection_refused_is_retried_then_typed(engine: levee.Engine, server: Server) -> None:
    url = server.url("/x")
    server.close()
    with httpx.Client(transport=LeveeTransport(engine, "http")) as client:
        with pytest.raises(levee.RetriesExhausted) as info:
            client.get(url)
    assert info.value.attempts == 3
    assert isinstance(info.value.last_error, httpx.ConnectError)


def test_per_attempt_timeout_sync(engine: levee.Engine, server: Server) -> None:
    server.script("/slow", Reply(200, delay=1.0, body=b"late"), Reply(200, body=b"quick"))
    t0 = time.monotonic()
    with httpx.Client(transport=LeveeTransport(engine, "timed")) as client:
        r = client.get(server.url("/slow"))
    assert r.text == "quick"
    assert time.monotonic() - t0 < 0.9
    assert len(server.hits("/slow")) == 2


async def test_per_attempt_timeout_async(engine: levee.Engine, server: Server) -> None:
    server.script("/aslow", Reply(200, delay=1.0, body=b"late"), Reply(503), Reply(200, body=b"quick"))
    t0 = time.monotonic()
    async with httpx.AsyncClient(transport=AsyncLeveeTransport(engine, "timed")) as client:
        r = await client.get(server.url("/aslow"))
    assert r.text == "quick"
    assert time.monotonic() - t0 < 0.9
    assert len(server.hits("/aslow")) == 3


async def test_async_decorator_timeout_requests_style(engine: levee.Engine, server: Server) -> None:
    server.script("/adec", Reply(200, delay=1.0), Reply(200, body=b"second"))

    @engine.policy("timed")
    async def get() -> httpx.Response:
        async with httpx.AsyncClient() as c:
            return await c.get(server.url("/adec"))

    t0 = time.monotonic()
    r = await get()
    assert r.text == "second" and time.monotonic() - t0 < 0.9


def test_breaker_trip_and_recovery_through_half_open(engine: levee.Engine, server: Server) -> None:
    events: list[Event] = []
    engine.add_listener(events.append)
    server.script("/f", Reply(500))
    host = f"127.0.0.1:{server.port}"  # the HTTP key is host:port (docs/hosts.md)
    with httpx.Client(transport=LeveeTransport(engine, "breaker")) as client:
        for _ in range(4):
            assert client.get(server.url("/f")).status_code == 500
        assert engine.breaker_state("breaker", host) is BreakerState.OPEN
        with pytest.raises(levee.BreakerOpen):
            client.get(server.url("/f"))
        assert len(server.hits("/f")) == 4  # rejected without a request
        time.sleep(0.35)
        assert engine.breaker_state("breaker", host) is BreakerState.HALF_OPEN
        server.script("/f", Reply(200, body=b"back"))
        assert client.get(server.url("/f")).text == "back"
    engine.flush()
    assert engine.breaker_state("breaker", host) is BreakerState.CLOSED
    transitions = [(e.state_from, e.state_to) for e in events if e.kind is EventKind.BREAKER_TRANSITION]
    assert (BreakerState.CLOSED, BreakerState.OPEN) in transitions
    assert (BreakerState.HALF_OPEN, BreakerState.CLOSED) in transitions


def test_fallback_used_and_reported(engine: levee.Engine, server: Server) -> None:
    events: list[Event] = []
    engine.add_listener(events.append)
    server.script("/g", Reply(503))

    @engine.fallback("cached")
    def cached(ctx: levee.FallbackContext) -> httpx.Response:
        request = ctx.args[0]
        assert isinstance(request, httpx.Request)
        return httpx.Response(200, text="from cache", request=request)

    with httpx.Client(transport=LeveeTransport(engine, "fallback")) as client:
        r = client.get(server.url("/g"))
    assert r.text == "from cache"
    assert len(server.hits("/g")) == 2
    chosen = [e for e in events if e.kind is EventKind.FALLBACK_CHOSEN]
    assert len(chosen) == 1 and chosen[0].name == "cached" and chosen[0].reason is levee.Reason.RETRIES_EXHAUSTED


def test_fallback_with_decorator_and_requests(engine: levee.Engine, server: Server) -> None:
    server.script("/h", Reply(503))
    engine.register_fallback("cached", lambda ctx: {"cached": True, "status": ctx.result.status_code})

    @engine.policy("fallback")
    def get() -> object:
        return requests.get(server.url("/h"), timeout=5)

    assert get() == {"cached": True, "status": 503}


def test_demo_prints_each_decision(server: Server, capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    import runpy

    server.script("/demo", Reply(503, {"Retry-After": "0"}), Reply(200))
    policy = tmp_path / "demo.yaml"
    policy.write_text(DOC)
    demo = runpy.run_path(str(Path(__file__).resolve().parents[1] / "demo.py"))
    assert demo["main"](["demo.py", server.url("/demo"), str(policy), "http"]) == 0
    out = capsys.readouterr().out
    assert "outcome=http-status 503" in out and "verdict=retry" in out
    assert "outcome=http-status 200" in out and "verdict=done" in out
    assert "result: HTTP 200" in out


def test_transport_fallback_of_the_wrong_type_counts_as_failed(engine: levee.Engine, server: Server) -> None:
    """The core then gives up (fallbacks-failed) and, as for any give-up after a response, the
    transport returns the last response."""
    events: list[Event] = []
    engine.add_listener(events.append)
    server.script("/wrong", Reply(503))
    engine.register_fallback("cached", lambda ctx: "not a response")
    with httpx.Client(transport=LeveeTransport(engine, "fallback")) as client:
        assert client.get(server.url("/wrong")).status_code == 503
    kinds = [e.kind for e in events]
    assert EventKind.FALLBACK_CHOSEN in kinds and EventKind.GAVE_UP in kinds


def test_a_transport_fallback_of_the_wrong_type_is_the_cause_when_there_is_no_response(engine: levee.Engine) -> None:
    """Issue 39: with no response to return, the error says the fallback gave the wrong type."""

    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("[Errno 111] Connection refused", request=request)

    engine.register_fallback("cached", lambda ctx: "not a response")
    transport = LeveeTransport(engine, "fallback", transport=httpx.MockTransport(refuse))
    with httpx.Client(transport=transport) as client, pytest.raises(levee.FallbacksFailed) as info:
        client.get("http://127.0.0.1:9/refused")
    cause = info.value.__cause__
    assert isinstance(cause, TypeError) and "httpx.Response" in str(cause) and "str" in str(cause)
    assert isinstance(info.value.last_error, httpx.ConnectError)


# ------------------------------------------------------------------ what an attempt covers (docs/http.md, issue 14)

BODY_DOC = """
policies:
  deadline:
    attempts: 3
    deadline: 2s
    backoff: { kind: constant, base: 10ms, jitter: none }
  retry:
    attempts: 3
    backoff: { kind: constant, base: 10ms, jitter: none }
"""


def test_sync_the_deadline_covers_the_body(server: Server) -> None:
    engine = levee.loads(BODY_DOC, seed=1)
    server.script("/trickle", Reply(200, body=b"x" * 50, trickle=0.2))  # 10 s of body
    t0 = time.monotonic()
    with httpx.Client(transport=LeveeTransport(engine, "deadline")) as client, pytest.raises(levee.CallFailed) as info:
        client.get(server.url("/trickle"))
    took = time.monotonic() - t0
    assert took < 3.0, f"returned after {took:.1f}s under a 2 s deadline"
    assert info.value.reason in (levee.Reason.DEADLINE, levee.Reason.RETRIES_EXHAUSTED)


async def test_async_the_deadline_covers_the_body(server: Server) -> None:
    engine = levee.loads(BODY_DOC, seed=1)
    server.script("/trickle-a", Reply(200, body=b"x" * 50, trickle=0.2))
    t0 = time.monotonic()
    async with httpx.AsyncClient(transport=AsyncLeveeTransport(engine, "deadline")) as client:
        with pytest.raises(levee.CallFailed):
            await client.get(server.url("/trickle-a"))
    assert time.monotonic() - t0 < 3.0


def test_a_connection_closed_mid_body_is_a_connection_error_retried(server: Server) -> None:
    engine = levee.loads(BODY_DOC, seed=1)
    server.script("/cut", Reply(200, body=b"y" * 1000, cut=True), Reply(200, body=b"whole"))
    with httpx.Client(transport=LeveeTransport(engine, "retry")) as client:
        r = client.get(server.url("/cut"))
    assert r.status_code == 200 and r.text == "whole"
    assert len(server.hits("/cut")) == 2


def test_a_body_that_cannot_be_replayed_is_sent_once_and_its_503_returned(server: Server) -> None:
    engine = levee.loads(BODY_DOC, seed=1)
    server.script("/put", Reply(503), Reply(200))

    def body() -> Iterator[bytes]:
        yield b"part one, "
        yield b"part two"

    with httpx.Client(transport=LeveeTransport(engine, "retry")) as client:
        r = client.put(server.url("/put"), content=body())
    assert r.status_code == 503
    assert len(server.hits("/put")) == 1
    # bytes can be replayed: the same PUT is retried to its 200
    server.script("/put2", Reply(503), Reply(200))
    with httpx.Client(transport=LeveeTransport(engine, "retry")) as client:
        assert client.put(server.url("/put2"), content=b"bytes").status_code == 200
    assert len(server.hits("/put2")) == 2


async def test_async_a_body_that_cannot_be_replayed_is_sent_once(server: Server) -> None:
    engine = levee.loads(BODY_DOC, seed=1)
    server.script("/aput", Reply(503), Reply(200))

    async def body() -> AsyncIterator[bytes]:
        yield b"only once"

    async with httpx.AsyncClient(transport=AsyncLeveeTransport(engine, "retry")) as client:
        r = await client.put(server.url("/aput"), content=body())
    assert r.status_code == 503
    assert len(server.hits("/aput")) == 1


def test_sync_a_late_response_is_a_timeout_with_or_without_a_body() -> None:
    """Issue 39: a response that arrives after the attempt's timeout is a timeout (a sync
    transport cannot stop waiting, so it finds out after): the deadline it ran past fails the
    call with `DeadlineExceeded`, as the async transport and JS do. A late response with no
    body was returned as a success."""
    from levee.testing import VirtualClock

    for body in (b"late", b""):
        clock = VirtualClock()
        engine = levee.loads("policies:\n  p:\n    attempts: 3\n    deadline: 1s\n", seed=1, clock=clock)

        def handler(request: httpx.Request, body: bytes = body, clock: VirtualClock = clock) -> httpx.Response:
            clock.sleep(2)  # headers and body arrive 2 s after the request, past the deadline
            return httpx.Response(200, content=body)

        transport = LeveeTransport(engine, "p", transport=httpx.MockTransport(handler))
        with httpx.Client(transport=transport) as client, pytest.raises(levee.DeadlineExceeded) as info:
            client.get("http://127.0.0.1:9/late")
        assert isinstance(info.value.last_error, httpx.TimeoutException), body
        assert info.value.last_result is None, body


def test_a_key_longer_than_the_bound_is_refused_before_the_request(engine: levee.Engine, server: Server) -> None:
    from levee._constants import GUARD_MAX_KEY_BYTES

    server.script("/long", Reply(200))
    long = "h" * (GUARD_MAX_KEY_BYTES + 1)
    with httpx.Client(transport=LeveeTransport(engine, "http", key=lambda request: long)) as client:
        with pytest.raises(ValueError, match=f"key: {GUARD_MAX_KEY_BYTES + 1} bytes, longer than the"):
            client.get(server.url("/long"))
    assert server.seen == []

"""gRPC end to end (issue 43): `levee.grpc`'s interceptors, sync grpcio and `grpc.aio`, against
the scripted Flaky server (grpc/flaky.proto, `tests/flaky_server.py`) on 127.0.0.1. gRPC's own
retry is off on every channel (`NO_RETRY_OPTIONS`): retry in one layer only. Times are tens of
milliseconds; the assertions are on order and counts, never on how fast the machine is."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, cast

import grpc
import grpc.aio
import pytest

import levee
import levee.grpc as lg
from levee import BulkheadFull, RateLimited
from levee.errors import BreakerOpen

from .flaky.flaky_pb2 import Reply, Request, StatsReply, StatsRequest, Step
from .flaky_server import AioClient, Client, FlakyServer

DOC = """
policies:
  grpc:
    attempts: 3
    backoff: { kind: constant, base: 10ms, jitter: none }
  timed:
    attempts: 3
    attempt-timeout: 150ms
    backoff: { kind: constant, base: 10ms, jitter: none }
  limited:
    attempts: 1
    rate-limit: { rate: 1, per: 60s, burst: 1 }
  bulkhead:
    attempts: 1
    bulkhead: { max-concurrent: 1 }
  breaker:
    attempts: 1
    breaker:
      window: { kind: count, size: 2 }
      minimum-calls: 2
      failure-rate: 50
      open-duration: 60s
      half-open-permits: 1
  hedged:
    hedge: { attempts: 2, delay: 40ms }
  fallback:
    attempts: 2
    backoff: { kind: constant, base: 10ms, jitter: none }
    fallbacks: [{ name: cached, on: [retries-exhausted] }]
"""

UNAVAILABLE = grpc.StatusCode.UNAVAILABLE.value[0]
INVALID_ARGUMENT = grpc.StatusCode.INVALID_ARGUMENT.value[0]
RESOURCE_EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]


@pytest.fixture(scope="module")
def flaky() -> Iterator[FlakyServer]:
    with FlakyServer() as s:
        yield s


@pytest.fixture
def engine() -> Iterator[levee.Engine]:
    with levee.loads(DOC, seed=7) as eng:
        yield eng


def _script() -> str:
    return uuid.uuid4().hex


def _sync(engine: levee.Engine, target: str, policy: str) -> tuple[Client, grpc.Channel]:
    channel = grpc.insecure_channel(target, options=lg.NO_RETRY_OPTIONS)
    interceptor = lg.LeveeClientInterceptor(engine, policy, target=target)
    return Client(lg.intercept_channel(channel, interceptor)), channel


def _aio(engine: levee.Engine, target: str, policy: str) -> tuple[AioClient, grpc.aio.Channel]:
    channel = grpc.aio.insecure_channel(
        target, options=lg.NO_RETRY_OPTIONS, interceptors=lg.aio_interceptors(engine, policy, target=target)
    )
    return AioClient(channel), channel


def _stats(flaky: FlakyServer, script: str) -> StatsReply:
    with grpc.insecure_channel(flaky.target) as ch:
        return Client(ch).stats(StatsRequest(script=script))


async def _until(check: Callable[[], bool]) -> None:
    """Wait (on the event loop) until the server has seen what the test waits for."""
    for _ in range(500):
        if check():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the server never saw it")


def _eventually(check: Callable[[], bool]) -> bool:
    """Poll the server's counters (its handler sees a cancellation on its own thread)."""
    for _ in range(200):
        if check():
            return True
        time.sleep(0.01)
    return check()


# ---------------------------------------------------------------------------- unary, sync


def test_unavailable_is_retried_with_previous_attempts(engine: levee.Engine, flaky: FlakyServer) -> None:
    client, ch = _sync(engine, flaky.target, "grpc")
    s = _script()
    with ch:
        reply = client.unary(Request(script=s, steps=[Step(code=UNAVAILABLE), Step(code=UNAVAILABLE), Step()]))
    assert reply.attempt == 3
    assert reply.previous_attempts == "2"  # A6: attempts already sent for this call
    assert flaky.script(s).started == 3


def test_with_call_and_future_return_the_winning_call(engine: levee.Engine, flaky: FlakyServer) -> None:
    client, ch = _sync(engine, flaky.target, "grpc")
    s = _script()
    with ch:
        reply, call = client.unary.with_call(Request(script=s, steps=[Step(code=UNAVAILABLE), Step()]))
        assert reply.attempt == 2 and call.code() == grpc.StatusCode.OK
        fut = client.unary.future(Request(script=_script()))
        assert fut.result().attempt == 1


def test_grpcios_own_intercept_channel(engine: levee.Engine, flaky: FlakyServer) -> None:
    """Without levee.grpc.intercept_channel, grpcio runs `__call__`'s attempts to their end: the
    retries are the same."""
    channel = grpc.insecure_channel(flaky.target, options=lg.NO_RETRY_OPTIONS)
    client = Client(grpc.intercept_channel(channel, lg.LeveeClientInterceptor(engine, "grpc", target=flaky.target)))
    s = _script()
    with channel:
        reply, call = client.unary.with_call(Request(script=s, steps=[Step(code=UNAVAILABLE), Step()]))
        with pytest.raises(grpc.RpcError) as err:
            client.unary(Request(script=_script(), steps=[Step(code=INVALID_ARGUMENT)]))
    assert reply.attempt == 2 and call.code() == grpc.StatusCode.OK
    assert isinstance(err.value, grpc.Call) and err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_invalid_argument_is_not_retried(engine: levee.Engine, flaky: FlakyServer) -> None:
    client, ch = _sync(engine, flaky.target, "grpc")
    s = _script()
    with ch, pytest.raises(grpc.RpcError) as err:
        client.unary(Request(script=s, steps=[Step(code=INVALID_ARGUMENT, message="bad")]))
    assert isinstance(err.value, grpc.Call)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # grpcio's own error, as without Levee
    assert flaky.script(s).started == 1


def test_retries_exhausted_gives_the_last_status(engine: levee.Engine, flaky: FlakyServer) -> None:
    client, ch = _sync(engine, flaky.target, "grpc")
    s = _script()
    with ch, pytest.raises(grpc.RpcError) as err:
        client.unary(Request(script=s, steps=[Step(code=UNAVAILABLE, message="down")]))
    assert isinstance(err.value, grpc.Call) and err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert flaky.script(s).started == 3


def test_pushback_is_honoured(engine: levee.Engine, flaky: FlakyServer) -> None:
    client, ch = _sync(engine, flaky.target, "grpc")
    s = _script()
    with ch:
        reply = client.unary(
            Request(script=s, steps=[Step(code=RESOURCE_EXHAUSTED, pushback="120"), Step()])
        )  # resource-exhausted is retried only with a valid pushback (the default retry-on)
    assert reply.attempt == 2
    arrivals = flaky.script(s).arrivals
    assert arrivals[1] - arrivals[0] >= 0.120  # the next attempt no earlier than the pushback


def test_a_negative_pushback_stops_retries(engine: levee.Engine, flaky: FlakyServer) -> None:
    client, ch = _sync(engine, flaky.target, "grpc")
    s = _script()
    with ch, pytest.raises(grpc.RpcError) as err:
        client.unary(Request(script=s, steps=[Step(code=UNAVAILABLE, pushback="-1"), Step()]))
    assert isinstance(err.value, grpc.Call) and err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert flaky.script(s).started == 1


def test_rate_limit_rejects_locally_as_resource_exhausted(engine: levee.Engine, flaky: FlakyServer) -> None:
    client, ch = _sync(engine, flaky.target, "limited")
    s = _script()
    with ch:
        client.unary(Request(script=s))
        with pytest.raises(lg.LeveeRpcError) as err:
            client.unary(Request(script=s))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert isinstance(err.value.failure, RateLimited) and err.value.__cause__ is err.value.failure
    assert isinstance(err.value, grpc.RpcError)
    assert flaky.script(s).started == 1  # the second call never left the process


def test_the_breaker_opens_per_target(engine: levee.Engine, flaky: FlakyServer) -> None:
    with FlakyServer() as other:
        down, ch1 = _sync(engine, flaky.target, "breaker")
        up, ch2 = _sync(engine, other.target, "breaker")
        s, t = _script(), _script()
        with ch1, ch2:
            for _ in range(2):
                with pytest.raises(grpc.RpcError):
                    down.unary(Request(script=s, steps=[Step(code=UNAVAILABLE)]))
            with pytest.raises(lg.LeveeRpcError) as err:
                down.unary(Request(script=s, steps=[Step(code=UNAVAILABLE)]))
            for _ in range(3):
                assert up.unary(Request(script=t)).attempt >= 1  # the other authority's calls pass
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and isinstance(err.value.failure, BreakerOpen)
        assert flaky.script(s).started == 2
        assert other.script(t).started == 3
        assert engine.breaker_state("breaker", lg.grpc_key(flaky.target)) == levee.BreakerState.OPEN
        assert engine.breaker_state("breaker", lg.grpc_key(other.target)) == levee.BreakerState.CLOSED


def test_hedging_cancels_the_loser_at_the_server(engine: levee.Engine, flaky: FlakyServer) -> None:
    client, ch = _sync(engine, flaky.target, "hedged")
    s = _script()
    with ch:
        reply = client.unary(Request(script=s, steps=[Step(delay_ms=2000), Step()]))
    assert reply.attempt == 2 and reply.previous_attempts == "1"
    assert _eventually(lambda: flaky.script(s).cancelled == 1)  # the slow first attempt, cancelled
    assert flaky.script(s).finished == 1


def test_deadline_propagation(engine: levee.Engine, flaky: FlakyServer) -> None:
    client, ch = _sync(engine, flaky.target, "timed")
    with ch:
        reply = client.unary(Request(script=_script()))
        assert 0 <= reply.deadline_ms <= 150  # the attempt timeout the core granted
        reply = client.unary(Request(script=_script()), timeout=0.08)
        assert 0 <= reply.deadline_ms <= 80  # the caller's own deadline, when earlier
        s = _script()
        reply = client.unary(Request(script=s, steps=[Step(delay_ms=1000), Step()]))
    assert reply.attempt == 2  # the first attempt's deadline passed: a timeout, retried
    assert _eventually(lambda: flaky.script(s).cancelled == 1)


def test_the_callers_deadline_bounds_the_call(engine: levee.Engine, flaky: FlakyServer) -> None:
    client, ch = _sync(engine, flaky.target, "timed")
    s = _script()
    with ch, pytest.raises(grpc.RpcError) as err:
        client.unary(Request(script=s, steps=[Step(delay_ms=1000)]), timeout=0.05)
    assert isinstance(err.value, grpc.Call) and err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert flaky.script(s).started == 1  # the caller's deadline passed: no retry


def test_a_fallback_gives_the_response(engine: levee.Engine, flaky: FlakyServer) -> None:
    engine.register_fallback("cached", lambda ctx: Reply(attempt=99, payload=b"cached"))
    client, ch = _sync(engine, flaky.target, "fallback")
    with ch:
        reply = client.unary(Request(script=_script(), steps=[Step(code=UNAVAILABLE)]))
    assert reply.attempt == 99 and reply.payload == b"cached"


# ---------------------------------------------------------------------------- streams, sync


def test_a_server_stream_is_retried_before_its_first_message(engine: levee.Engine, flaky: FlakyServer) -> None:
    client, ch = _sync(engine, flaky.target, "grpc")
    s = _script()
    with ch:
        replies = list(client.server_stream(Request(script=s, steps=[Step(code=UNAVAILABLE), Step(messages=3)])))
    assert [r.attempt for r in replies] == [2, 2, 2]
    assert replies[0].previous_attempts == "1"


def test_a_server_stream_is_not_retried_after_its_first_message(engine: levee.Engine, flaky: FlakyServer) -> None:
    client, ch = _sync(engine, flaky.target, "grpc")
    s = _script()
    got: list[Reply] = []
    with ch, pytest.raises(grpc.RpcError) as err:
        for r in client.server_stream(Request(script=s, steps=[Step(messages=1, code=UNAVAILABLE), Step(messages=3)])):
            got.append(r)
    assert [r.attempt for r in got] == [1]
    assert isinstance(err.value, grpc.Call) and err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert flaky.script(s).started == 1  # committed to the first attempt (A6)


def test_a_server_stream_fallback_gives_the_messages(engine: levee.Engine, flaky: FlakyServer) -> None:
    engine.register_fallback("cached", lambda ctx: [Reply(attempt=98), Reply(attempt=99)])
    client, ch = _sync(engine, flaky.target, "fallback")
    with ch:
        replies = list(client.server_stream(Request(script=_script(), steps=[Step(code=UNAVAILABLE)])))
    assert [r.attempt for r in replies] == [98, 99]


def test_a_server_stream_cancelled_by_the_caller(engine: levee.Engine, flaky: FlakyServer) -> None:
    client, ch = _sync(engine, flaky.target, "grpc")
    s = _script()
    with ch:
        stream = client.server_stream(Request(script=s, steps=[Step(messages=5, delay_ms=50)]))
        assert next(stream).attempt == 1
        stream.cancel()
        with pytest.raises(grpc.RpcError) as err:
            list(stream)
    assert isinstance(err.value, grpc.Call) and err.value.code() == grpc.StatusCode.CANCELLED
    assert _eventually(lambda: flaky.script(s).cancelled == 1)
    assert flaky.script(s).started == 1


def test_a_buffered_client_stream_is_retried(engine: levee.Engine, flaky: FlakyServer) -> None:
    client, ch = _sync(engine, flaky.target, "grpc")
    s = _script()
    steps = [Step(code=UNAVAILABLE), Step()]
    with ch:
        reply = client.client_stream(
            lg.buffered([Request(script=s, steps=steps), Request(script=s), Request(script=s)])
        )
    assert reply.attempt == 2 and reply.received == 3


def test_an_unbuffered_client_stream_is_sent_once(engine: levee.Engine, flaky: FlakyServer) -> None:
    client, ch = _sync(engine, flaky.target, "grpc")
    s = _script()

    def requests() -> Iterator[Request]:
        yield Request(script=s, steps=[Step(code=UNAVAILABLE), Step()])
        yield Request(script=s)

    with ch, pytest.raises(grpc.RpcError) as err:
        client.client_stream(requests())
    assert isinstance(err.value, grpc.Call) and err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert flaky.script(s).started == 1


def test_a_bidi_stream_is_retried_before_its_first_message_when_buffered(
    engine: levee.Engine, flaky: FlakyServer
) -> None:
    client, ch = _sync(engine, flaky.target, "grpc")
    s, t = _script(), _script()
    steps = [Step(code=UNAVAILABLE), Step(messages=2)]

    def once() -> Iterator[Request]:
        yield Request(script=t, steps=steps)

    with ch:
        replies = list(client.bidi(lg.buffered([Request(script=s, steps=steps)])))
        with pytest.raises(grpc.RpcError) as err:
            list(client.bidi(once()))
    assert [r.attempt for r in replies] == [2, 2]
    assert isinstance(err.value, grpc.Call) and err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert flaky.script(t).started == 1  # an unbuffered request stream is sent once


def test_policy_and_key_functions(engine: levee.Engine, flaky: FlakyServer) -> None:
    seen: list[str] = []

    def choose(method: str) -> str:
        seen.append(method)
        return "limited" if method.endswith("/Unary") else "grpc"

    channel = grpc.insecure_channel(flaky.target, options=lg.NO_RETRY_OPTIONS)
    interceptor = lg.LeveeClientInterceptor(engine, choose, key=lambda details: "tenant-a")
    client = Client(lg.intercept_channel(channel, interceptor))
    with channel:
        client.unary(Request(script=_script()))
        with pytest.raises(lg.LeveeRpcError):
            client.unary(Request(script=_script()))  # the rate limit of key tenant-a
        assert list(client.server_stream(Request(script=_script(), steps=[Step(messages=1)])))
    assert seen == ["/levee.flaky.v1.Flaky/Unary", "/levee.flaky.v1.Flaky/ServerStream"]  # chosen once per method


def test_grpc_key() -> None:
    assert lg.grpc_key("127.0.0.1:50051") == "127.0.0.1:50051"
    assert lg.grpc_key("dns:///API.example:443") == "api.example:443"
    assert lg.grpc_key("dns://8.8.8.8/api.example:443") == "api.example:443"
    assert lg.grpc_key("dns:api.example:443") == "api.example:443"
    assert lg.grpc_key("ipv4:10.0.0.1:80,10.0.0.2:80") == "10.0.0.1:80"
    assert lg.grpc_key("unix:///tmp/s.sock") == "localhost"
    assert lg.grpc_key("[::1]:8080") == "[::1]:8080"


def test_an_interceptor_needs_a_target_or_a_key(engine: levee.Engine) -> None:
    with pytest.raises(TypeError, match="target"):
        lg.LeveeClientInterceptor(engine, "grpc")
    with pytest.raises(levee.UnknownPolicy):
        lg.LeveeClientInterceptor(engine, "nope", target="x:1")


# ---------------------------------------------------------------------------- grpc.aio


async def test_aio_unavailable_is_retried(engine: levee.Engine, flaky: FlakyServer) -> None:
    client, ch = _aio(engine, flaky.target, "grpc")
    s = _script()
    async with ch:
        call = client.unary(Request(script=s, steps=[Step(code=UNAVAILABLE), Step(code=UNAVAILABLE), Step()]))
        reply = await call
        assert await call.code() == grpc.StatusCode.OK
    assert reply.attempt == 3 and reply.previous_attempts == "2"


async def test_aio_invalid_argument_is_not_retried(engine: levee.Engine, flaky: FlakyServer) -> None:
    client, ch = _aio(engine, flaky.target, "grpc")
    s = _script()
    async with ch:
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await client.unary(Request(script=s, steps=[Step(code=INVALID_ARGUMENT)]))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert flaky.script(s).started == 1


async def test_aio_pushback(engine: levee.Engine, flaky: FlakyServer) -> None:
    client, ch = _aio(engine, flaky.target, "grpc")
    s, t = _script(), _script()
    async with ch:
        reply = await client.unary(Request(script=s, steps=[Step(code=UNAVAILABLE, pushback="100"), Step()]))
        with pytest.raises(grpc.aio.AioRpcError):
            await client.unary(Request(script=t, steps=[Step(code=UNAVAILABLE, pushback="-1"), Step()]))
    assert reply.attempt == 2
    arrivals = flaky.script(s).arrivals
    assert arrivals[1] - arrivals[0] >= 0.100
    assert flaky.script(t).started == 1


async def test_aio_rejections_are_rpc_errors(engine: levee.Engine, flaky: FlakyServer) -> None:
    client, ch = _aio(engine, flaky.target, "limited")
    s = _script()
    async with ch:
        await client.unary(Request(script=s))
        with pytest.raises(lg.LeveeAioRpcError) as err:
            await client.unary(Request(script=s))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and isinstance(err.value.failure, RateLimited)
    assert isinstance(err.value, grpc.aio.AioRpcError)
    assert flaky.script(s).started == 1


async def test_aio_bulkhead_full_is_resource_exhausted(engine: levee.Engine, flaky: FlakyServer) -> None:
    client, ch = _aio(engine, flaky.target, "bulkhead")
    s = _script()
    async with ch:
        slow = asyncio.ensure_future(client.unary(Request(script=s, steps=[Step(delay_ms=300)])))
        await _until(lambda: flaky.script(s).started == 1)
        with pytest.raises(lg.LeveeAioRpcError) as err:
            await client.unary(Request(script=_script()))
        assert (await slow).attempt == 1
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and isinstance(err.value.failure, BulkheadFull)


async def test_aio_hedging_cancels_the_loser(engine: levee.Engine, flaky: FlakyServer) -> None:
    client, ch = _aio(engine, flaky.target, "hedged")
    s = _script()
    async with ch:
        reply = await client.unary(Request(script=s, steps=[Step(delay_ms=2000), Step()]))
    assert reply.attempt == 2 and reply.previous_attempts == "1"
    assert _eventually(lambda: flaky.script(s).cancelled == 1)
    assert flaky.script(s).finished == 1


async def test_aio_deadline_propagation(engine: levee.Engine, flaky: FlakyServer) -> None:
    client, ch = _aio(engine, flaky.target, "timed")
    s = _script()
    async with ch:
        reply = await client.unary(Request(script=_script()))
        assert 0 <= reply.deadline_ms <= 150
        reply = await client.unary(Request(script=_script()), timeout=0.08)
        assert 0 <= reply.deadline_ms <= 80
        reply = await client.unary(Request(script=s, steps=[Step(delay_ms=1000), Step()]))
    assert reply.attempt == 2
    assert _eventually(lambda: flaky.script(s).cancelled == 1)


async def test_aio_cancellation_by_the_caller(engine: levee.Engine, flaky: FlakyServer) -> None:
    client, ch = _aio(engine, flaky.target, "grpc")
    s = _script()
    async with ch:
        call = client.unary(Request(script=s, steps=[Step(delay_ms=2000), Step()]))
        task = asyncio.ensure_future(call)
        await _until(lambda: flaky.script(s).started == 1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert _eventually(lambda: flaky.script(s).cancelled == 1)
    assert flaky.script(s).started == 1  # not retried


async def test_aio_server_stream_commit_rule(engine: levee.Engine, flaky: FlakyServer) -> None:
    client, ch = _aio(engine, flaky.target, "grpc")
    s, t = _script(), _script()
    async with ch:
        replies = [r async for r in client.server_stream(Request(script=s, steps=[Step(code=UNAVAILABLE),
                                                                                 Step(messages=2)]))]  # fmt: skip
        got: list[Reply] = []
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for r in client.server_stream(Request(script=t, steps=[Step(messages=1, code=UNAVAILABLE),
                                                                         Step(messages=2)])):  # fmt: skip
                got.append(r)
    assert [r.attempt for r in replies] == [2, 2]
    assert [r.attempt for r in got] == [1] and err.value.code() == grpc.StatusCode.UNAVAILABLE
    assert flaky.script(t).started == 1


async def test_aio_server_stream_cancelled_by_the_caller(engine: levee.Engine, flaky: FlakyServer) -> None:
    client, ch = _aio(engine, flaky.target, "grpc")
    s = _script()
    async with ch:
        stream = client.server_stream(Request(script=s, steps=[Step(messages=5, delay_ms=50)]))

        async def read() -> list[Reply]:
            return [r async for r in stream]

        task = asyncio.ensure_future(read())
        await _until(lambda: flaky.script(s).started == 1)
        await asyncio.sleep(0.06)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert _eventually(lambda: flaky.script(s).cancelled == 1)
    assert flaky.script(s).started == 1


async def test_aio_client_streams(engine: levee.Engine, flaky: FlakyServer) -> None:
    client, ch = _aio(engine, flaky.target, "grpc")
    s, t = _script(), _script()
    steps = [Step(code=UNAVAILABLE), Step()]

    async def requests() -> AsyncIterator[Request]:
        yield Request(script=t, steps=steps)

    async with ch:
        reply = await client.client_stream(cast(Any, [Request(script=s, steps=steps), Request(script=s)]))  # a list
        with pytest.raises(grpc.aio.AioRpcError):
            await client.client_stream(requests())
    assert reply.attempt == 2 and reply.received == 2
    assert flaky.script(t).started == 1  # an unbuffered request stream is sent once


async def test_aio_bidi_stream(engine: levee.Engine, flaky: FlakyServer) -> None:
    client, ch = _aio(engine, flaky.target, "grpc")
    s, t = _script(), _script()
    async with ch:
        steps = [Step(code=UNAVAILABLE), Step(messages=2)]
        replies = [r async for r in client.bidi(lg.buffered([Request(script=s, steps=steps)]))]
        got: list[Reply] = []
        with pytest.raises(grpc.aio.AioRpcError):
            async for r in client.bidi(lg.buffered([Request(script=t, steps=[Step(messages=1, code=UNAVAILABLE)])])):
                got.append(r)
    assert [r.attempt for r in replies] == [2, 2]
    assert [r.attempt for r in got] == [1] and flaky.script(t).started == 1

"""The scripted gRPC server of `grpc/flaky.proto`, in Python, for the gRPC tests: a real grpcio
server on 127.0.0.1 (a port the OS picks), started and stopped by the tests. Each request
carries its script (what attempt N does); `Stats` says what the server saw.

The service's handlers use grpc's generic API (`method_handlers_generic_handler`) with the
generated messages (`tests/gen_flaky.py`), and `Client` makes the client side's
multicallables the same way.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc
import grpc.aio

from .flaky.flaky_pb2 import Reply, Request, StatsReply, StatsRequest, Step

SERVICE = "levee.flaky.v1.Flaky"
PUSHBACK = "grpc-retry-pushback-ms"
PREVIOUS = "grpc-previous-rpc-attempts"


@dataclass
class Script:
    """What the server saw for one script id."""

    attempts: int = 0
    started: int = 0
    finished: int = 0
    cancelled: int = 0
    #: the monotonic time each attempt arrived (seconds)
    arrivals: list[float] = field(default_factory=list)
    #: the deadline each attempt arrived with (ms left; -1 for none)
    deadlines: list[int] = field(default_factory=list)


def _metadata(context: grpc.ServicerContext, name: str) -> str:
    for k, v in context.invocation_metadata() or ():
        if k == name:
            return v if isinstance(v, str) else v.decode()
    return ""


class FlakyServer:
    """`with FlakyServer() as s:` serves Flaky on `s.target` until the block ends."""

    def __init__(self) -> None:
        self.scripts: dict[str, Script] = {}
        self.lock = threading.Lock()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=32))
        handlers: dict[str, grpc.RpcMethodHandler[Any, Any]] = {
            "Unary": grpc.unary_unary_rpc_method_handler(self._unary, Request.FromString, Reply.SerializeToString),
            "ServerStream": grpc.unary_stream_rpc_method_handler(
                self._server_stream, Request.FromString, Reply.SerializeToString
            ),
            "ClientStream": grpc.stream_unary_rpc_method_handler(
                self._client_stream, Request.FromString, Reply.SerializeToString
            ),
            "Stats": grpc.unary_unary_rpc_method_handler(
                self._stats, StatsRequest.FromString, StatsReply.SerializeToString
            ),
        }
        self.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.target = f"127.0.0.1:{self.port}"

    def __enter__(self) -> FlakyServer:
        self.server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.stop(grace=None).wait()

    def script(self, name: str) -> Script:
        with self.lock:
            return self.scripts.setdefault(name, Script())

    # ------------------------------------------------------------------ handlers

    def _begin(self, request: Request, context: grpc.ServicerContext) -> tuple[Script, Step, int, int]:
        remaining = context.time_remaining()
        # grpcio answers a huge number, not None, for a call without a deadline
        deadline = -1 if remaining is None or remaining > 1e6 else int(remaining * 1000)
        with self.lock:
            s = self.scripts.setdefault(request.script, Script())
            s.attempts += 1
            s.started += 1
            s.arrivals.append(time.monotonic())
            s.deadlines.append(deadline)
            n = s.attempts
        steps = list(request.steps) or [Step()]
        return s, steps[min(n, len(steps)) - 1], n, deadline

    def _wait(self, s: Script, step: Step, context: grpc.ServicerContext) -> bool:
        """Wait the step's delay; False (and counted) when the client cancelled meanwhile."""
        if step.delay_ms:
            ended = threading.Event()
            context.add_callback(ended.set)
            ended.wait(step.delay_ms / 1000)
        if not context.is_active():
            with self.lock:
                s.cancelled += 1
            return False
        return True

    def _end(self, s: Script, step: Step, context: grpc.ServicerContext) -> None:
        if step.pushback or step.HasField("pushback"):
            context.set_trailing_metadata(((PUSHBACK, step.pushback),))
        if step.code:
            context.set_code(grpc.StatusCode(_codes[step.code]))
            context.set_details(step.message or f"scripted status {step.code}")
        with self.lock:
            s.finished += 1

    def _reply(self, n: int, deadline: int, context: grpc.ServicerContext, request: Request) -> Reply:
        return Reply(attempt=n, previous_attempts=_metadata(context, PREVIOUS), deadline_ms=deadline,
                     payload=request.payload, authority=_metadata(context, ":authority"))  # fmt: skip

    def _unary(self, request: Request, context: grpc.ServicerContext) -> Reply:
        s, step, n, deadline = self._begin(request, context)
        if not self._wait(s, step, context):
            return Reply()
        self._end(s, step, context)
        return self._reply(n, deadline, context, request)

    def _server_stream(self, request: Request, context: grpc.ServicerContext) -> Iterator[Reply]:
        s, step, n, deadline = self._begin(request, context)
        try:
            for _ in range(step.messages):
                if not self._wait(s, step, context):
                    return
                yield self._reply(n, deadline, context, request)
        except GeneratorExit:  # grpcio stopped pulling: the client cancelled while a reply waited
            with self.lock:
                s.cancelled += 1
            raise
        if not step.messages and not self._wait(s, step, context):
            return
        self._end(s, step, context)

    def _client_stream(self, requests: Iterator[Request], context: grpc.ServicerContext) -> Reply:
        received = list(requests)
        first = received[0] if received else Request()
        s, step, n, deadline = self._begin(first, context)
        if not self._wait(s, step, context):
            return Reply()
        self._end(s, step, context)
        reply = self._reply(n, deadline, context, first)
        reply.received = len(received)
        return reply

    def _stats(self, request: StatsRequest, context: grpc.ServicerContext) -> StatsReply:
        with self.lock:
            s = self.scripts.get(request.script, Script())
            return StatsReply(started=s.started, finished=s.finished, cancelled=s.cancelled)


# grpc.StatusCode's values are (number, name) pairs
_codes = {code.value[0]: code.value for code in grpc.StatusCode}


class Client:
    """The client side of Flaky on a channel (sync or aio): one multicallable per method."""

    def __init__(self, channel: grpc.Channel) -> None:
        path = f"/{SERVICE}/"
        self.unary = channel.unary_unary(path + "Unary", Request.SerializeToString, Reply.FromString)
        self.server_stream = channel.unary_stream(path + "ServerStream", Request.SerializeToString, Reply.FromString)
        self.client_stream = channel.stream_unary(path + "ClientStream", Request.SerializeToString, Reply.FromString)
        self.stats = channel.unary_unary(path + "Stats", StatsRequest.SerializeToString, StatsReply.FromString)
        self.bidi = channel.stream_stream(path + "ServerStream", Request.SerializeToString, Reply.FromString)
        # the proto has no bidi method: ServerStream called as a bidi stream that sends one request
        # (the wire does not tell the two apart), for the stream-stream interceptor
        self.bidi = channel.stream_stream(path + "ServerStream", Request.SerializeToString, Reply.FromString)


class AioClient:
    """`Client` for a `grpc.aio` channel."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        path = f"/{SERVICE}/"
        self.unary = channel.unary_unary(path + "Unary", Request.SerializeToString, Reply.FromString)
        self.server_stream = channel.unary_stream(path + "ServerStream", Request.SerializeToString, Reply.FromString)
        self.client_stream = channel.stream_unary(path + "ClientStream", Request.SerializeToString, Reply.FromString)
        self.stats = channel.unary_unary(path + "Stats", StatsRequest.SerializeToString, StatsReply.FromString)
        self.bidi = channel.stream_stream(path + "ServerStream", Request.SerializeToString, Reply.FromString)

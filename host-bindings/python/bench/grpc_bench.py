"""CPU per unary gRPC call over a local connection (issue 43): no interceptor, Levee's interceptor
(`levee.grpc`) and gRPC's built-in retry configured through the service config, side by side in
one run, sync grpcio and `grpc.aio`.

    python bench/grpc_bench.py              # full run (~1 min)
    python bench/grpc_bench.py --quick      # a short run

The server runs in a child process (its CPU is not counted) and answers every call at once, so
what is measured is the client's own work per call: the client process's CPU time (all its
threads, grpcio's included) divided by the calls. Each round runs every contender back to back;
the table gives the best and the median round, and the median of the per-round ratios to the
plain channel of the same API.
Not part of ./dev test (needs grpcio: `pip install "levee-resilience[grpc]"`).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import json
import multiprocessing
import platform
import statistics
import time
from collections.abc import Awaitable, Callable
from concurrent import futures
from typing import Any

import grpc
import grpc.aio

import levee
import levee.grpc as lg

POLICY = """
policies:
  bench:
    attempts: 3
    attempt-timeout: 5s
    backoff: { kind: exponential, base: 100ms, cap: 1s, jitter: full }
    breaker:
      window: { kind: count, size: 100 }
      failure-rate: 50
      minimum-calls: 20
      open-duration: 30s
"""

METHOD = "/bench.Echo/Ping"

# gRPC's own retry for the same calls: 3 attempts on UNAVAILABLE, exponential backoff
SERVICE_CONFIG = json.dumps(
    {
        "methodConfig": [
            {
                "name": [{"service": "bench.Echo"}],
                "timeout": "5s",
                "retryPolicy": {
                    "maxAttempts": 3,
                    "initialBackoff": "0.1s",
                    "maxBackoff": "1s",
                    "backoffMultiplier": 2,
                    "retryableStatusCodes": ["UNAVAILABLE"],
                },
            }
        ]
    }
)


class NoOp(grpc.UnaryUnaryClientInterceptor):
    """An interceptor that only continues: what grpcio's interceptor machinery costs alone."""

    def intercept_unary_unary(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        return continuation(client_call_details, request)


class AioNoOp(grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        return await continuation(client_call_details, request)


def _serve(port: Any, stop: Any) -> None:
    def ping(request: bytes, context: grpc.ServicerContext) -> bytes:
        return b"pong"

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    handler = grpc.method_handlers_generic_handler("bench.Echo", {"Ping": grpc.unary_unary_rpc_method_handler(ping)})
    server.add_generic_rpc_handlers((handler,))
    bound = server.add_insecure_port("127.0.0.1:0")
    server.start()
    port.value = bound
    stop.wait()
    server.stop(None)


def cpu_per_call(fn: Callable[[bytes], Any], n: int) -> tuple[float, float]:
    """(CPU µs, wall µs) per call over `n` calls."""
    c0, w0 = time.process_time_ns(), time.perf_counter_ns()
    for _ in range(n):
        fn(b"ping")
    return (time.process_time_ns() - c0) / n / 1e3, (time.perf_counter_ns() - w0) / n / 1e3


async def acpu_per_call(fn: Callable[[bytes], Awaitable[Any]], n: int) -> tuple[float, float]:
    c0, w0 = time.process_time_ns(), time.perf_counter_ns()
    for _ in range(n):
        await fn(b"ping")
    return (time.process_time_ns() - c0) / n / 1e3, (time.perf_counter_ns() - w0) / n / 1e3


def report(title: str, results: dict[str, list[tuple[float, float]]]) -> None:
    """Per contender: CPU per call, best and median round, and the median over rounds of the
    per-round ratio to the plain channel (each round runs every contender back to back, so the
    ratio holds up better than either figure on a loaded machine)."""
    plain = results["no interceptor"]
    print(f"\n{title}")
    print(f"| {'client':<44} | CPU µs/call, best | median | wall µs/call | CPU vs plain |")
    print(f"|{'-' * 46}|------------------:|-------:|------------:|-------------:|")
    for name, rounds in results.items():
        best = min(c for c, _ in rounds)
        cpu = statistics.median(c for c, _ in rounds)
        wall = statistics.median(w for _, w in rounds)
        ratio = statistics.median(c / p for (c, _), (p, _) in zip(rounds, plain, strict=True))
        print(f"| {name:<44} | {best:17.1f} | {cpu:6.1f} | {wall:11.1f} | {ratio:11.2f}x |")


def bench_sync(target: str, engine: levee.Engine, n: int, rounds: int) -> None:
    plain = grpc.insecure_channel(target)
    builtin = grpc.insecure_channel(
        target, options=[("grpc.enable_retries", 1), ("grpc.service_config", SERVICE_CONFIG)]
    )
    raw = grpc.insecure_channel(target, options=lg.NO_RETRY_OPTIONS)
    raw2 = grpc.insecure_channel(target, options=lg.NO_RETRY_OPTIONS)
    raw3 = grpc.insecure_channel(target, options=lg.NO_RETRY_OPTIONS)
    noop = grpc.intercept_channel(raw3, NoOp())
    levee_ch = lg.intercept_channel(raw, lg.LeveeClientInterceptor(engine, "bench", target=target))
    levee_grpcio = grpc.intercept_channel(raw2, lg.LeveeClientInterceptor(engine, "bench", target=target))
    contenders: dict[str, Any] = {
        "no interceptor": plain.unary_unary(METHOD).__call__,
        "a no-op interceptor (grpcio's machinery)": noop.unary_unary(METHOD).__call__,
        "Levee (levee.grpc.intercept_channel)": levee_ch.unary_unary(METHOD).__call__,
        "Levee (grpc.intercept_channel)": levee_grpcio.unary_unary(METHOD).__call__,
        "gRPC built-in retry (service config)": builtin.unary_unary(METHOD).__call__,
    }
    for ch in (plain, builtin, raw, raw2, raw3):
        grpc.channel_ready_future(ch).result(timeout=60)
    for fn in contenders.values():  # warm up: first calls
        for _ in range(200):
            assert fn(b"ping") == b"pong"
    results: dict[str, list[tuple[float, float]]] = {k: [] for k in contenders}
    for _ in range(rounds):
        for name, fn in contenders.items():
            results[name].append(cpu_per_call(fn, n))
    report(f"sync grpcio, {n} calls x {rounds} rounds (median round)", results)
    for ch in (plain, builtin, raw, raw2, raw3):
        ch.close()


async def bench_aio(target: str, engine: levee.Engine, n: int, rounds: int) -> None:
    plain = grpc.aio.insecure_channel(target)
    builtin = grpc.aio.insecure_channel(
        target, options=[("grpc.enable_retries", 1), ("grpc.service_config", SERVICE_CONFIG)]
    )
    levee_ch = grpc.aio.insecure_channel(
        target, options=lg.NO_RETRY_OPTIONS, interceptors=lg.aio_interceptors(engine, "bench", target=target)
    )
    noop = grpc.aio.insecure_channel(target, options=lg.NO_RETRY_OPTIONS, interceptors=[AioNoOp()])
    contenders: dict[str, Any] = {
        "no interceptor": plain.unary_unary(METHOD).__call__,
        "a no-op interceptor (grpcio's machinery)": noop.unary_unary(METHOD).__call__,
        "Levee (levee.grpc.aio_interceptors)": levee_ch.unary_unary(METHOD).__call__,
        "gRPC built-in retry (service config)": builtin.unary_unary(METHOD).__call__,
    }
    for ch in (plain, builtin, levee_ch, noop):
        await asyncio.wait_for(ch.channel_ready(), 60)
    for fn in contenders.values():
        for _ in range(200):
            assert await fn(b"ping") == b"pong"
    results: dict[str, list[tuple[float, float]]] = {k: [] for k in contenders}
    for _ in range(rounds):
        for name, fn in contenders.items():
            results[name].append(await acpu_per_call(fn, n))
    report(f"grpc.aio, {n} calls x {rounds} rounds (median round)", results)
    for ch in (plain, builtin, levee_ch, noop):
        await ch.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--calls", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=0)
    args = ap.parse_args()
    n = args.calls or (300 if args.quick else 3000)
    rounds = args.rounds or (3 if args.quick else 9)
    ctx = multiprocessing.get_context("spawn")
    port = ctx.Value("i", 0)
    stop = ctx.Event()
    server = ctx.Process(target=_serve, args=(port, stop), daemon=True)
    server.start()
    try:
        while not port.value:
            time.sleep(0.01)
        target = f"127.0.0.1:{port.value}"
        print(
            f"Python {platform.python_version()}, grpcio {importlib.metadata.version('grpcio')}, "
            f"levee {importlib.metadata.version('levee-resilience')}, {platform.machine()}; server in a child process"
        )
        with levee.loads(POLICY) as engine:
            bench_sync(target, engine, n, rounds)
            asyncio.run(bench_aio(target, engine, n, rounds))
    finally:
        stop.set()
        server.join(10)


if __name__ == "__main__":
    main()

"""The clock an engine runs on: `now` for the core, sleeps between attempts, and the timeout of
an asyncio attempt. `SystemClock` is the default; `levee.testing.VirtualClock` is the one for
tests. A process-wide switch (`levee.testing.no_waits`) turns every wait off."""

from __future__ import annotations

import time as _time
from contextlib import AbstractAsyncContextManager
from typing import Any, Protocol, runtime_checkable

__all__ = ["Clock", "SystemClock", "waits_enabled"]


@runtime_checkable
class Clock(Protocol):
    """What an engine needs from time. Every method is called outside the engine's lock.

    - `monotonic_ns()`: now, in nanoseconds, never going back (what the core is given);
    - `time()`: the wall clock in seconds since the epoch (only to read an HTTP-date
      `Retry-After`);
    - `sleep(seconds)`: wait between attempts, in synchronous code;
    - `sleep_async(seconds)`: the same for asyncio code;
    - `timeout(seconds)`: an async context manager that cancels its block after `seconds` on
      this clock and then raises `TimeoutError` (what `asyncio.timeout` does on the loop's
      clock): the per-attempt timeout of asyncio attempts.
    """

    def monotonic_ns(self) -> int: ...

    def time(self) -> float: ...

    def sleep(self, seconds: float) -> None: ...

    async def sleep_async(self, seconds: float) -> None: ...

    def timeout(self, seconds: float) -> AbstractAsyncContextManager[Any]: ...


class SystemClock:
    """The real clocks: `time.monotonic_ns`, `time.time`, `time.sleep`, `asyncio.sleep` and
    `asyncio.timeout` (the event loop's clock)."""

    monotonic_ns = staticmethod(_time.monotonic_ns)
    time = staticmethod(_time.time)
    sleep = staticmethod(_time.sleep)

    # asyncio is imported where it is used, so that `import levee` does not import it (nor ssl
    # and concurrent.futures with it) for synchronous code: most of the ~35 ms this took off a
    # CLI's or a serverless function's start (docs/performance.md, "Cold start"). Code that
    # reaches these already has it imported.
    async def sleep_async(self, seconds: float) -> None:
        import asyncio

        await asyncio.sleep(seconds)

    def timeout(self, seconds: float) -> AbstractAsyncContextManager[Any]:
        import asyncio

        return asyncio.timeout(seconds)


SYSTEM = SystemClock()

# The switch of `levee.testing.no_waits()` / `set_waits()`: when off, every sleep an engine asks
# for (retry delays, rate-limiter waits) returns at once. Process-wide, like stamina's.
_waits = [True]


def waits_enabled() -> bool:
    """Whether engines wait between attempts (`levee.testing.no_waits()` turns this off)."""
    return _waits[0]

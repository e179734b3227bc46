"""Test support: virtual time for engines, and a switch that turns waits off.

```python
from levee.testing import VirtualClock, no_waits

clock = VirtualClock()
engine = levee.loads(DOC, clock=clock)      # every now, sleep and asyncio attempt timeout
charge = engine.policy("checkout")(charge)  # runs on `clock`: a 2 s backoff takes no time
charge("o-1")
assert clock.monotonic() == 2.0             # ... but moves the clock by 2 s

with no_waits():                            # or set_waits(False): for every engine, like
    charge("o-1")                           # stamina's set_testing; the core still decides
```

`VirtualClock` works from synchronous code (a sleep moves the clock forward at once) and from
asyncio code: a coroutine sleeping on it waits for the clock, and with `autojump=True` (the
default) the clock jumps to the next timer as soon as every task is waiting, as trio's
`MockClock(autojump_threshold=0)` does. `advance()` moves it by hand. An asyncio attempt's
timeout runs on the same clock, so an attempt that hangs is cancelled at its timeout in
virtual time.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import heapq
import itertools
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from . import _clock
from ._abi import Core
from ._clock import Clock, SystemClock
from ._runtime import EngineRuntime
from .telemetry import AttributeValue
from .types import OutcomeKind

__all__ = [
    "Clock",
    "Fault",
    "RecordingSink",
    "SystemClock",
    "VirtualClock",
    "faults",
    "inject_fault",
    "no_waits",
    "set_waits",
    "waits_enabled",
]

waits_enabled = _clock.waits_enabled


def set_waits(enabled: bool) -> None:
    """Turn every engine's waits (retry delays, rate-limiter waits) off (`False`) or back on.
    The core still decides and counts every retry; only the sleeping is skipped."""
    _clock._waits[0] = bool(enabled)


@contextlib.contextmanager
def no_waits() -> Iterator[None]:
    """`with no_waits(): ...`: engines do not wait inside the block (see `set_waits`)."""
    before = _clock._waits[0]
    _clock._waits[0] = False
    try:
        yield
    finally:
        _clock._waits[0] = before


class _Timer:
    __slots__ = ("cancelled", "due", "fire")

    def __init__(self, due: int, fire: Callable[[], None]) -> None:
        self.due = due
        self.fire = fire
        self.cancelled = False


class VirtualClock:
    """A clock that moves only when told to: by `advance`, by a synchronous `sleep`, or (with
    `autojump`) to the next asyncio timer once every task waits. Times are in nanoseconds
    (`monotonic_ns`) from `start` seconds; `time()` is the wall clock, `wall` seconds since
    the epoch at `start` (for HTTP-date `Retry-After`). Thread-safe."""

    def __init__(self, start: float = 0.0, *, wall: float = 1_767_225_600.0, autojump: bool = True) -> None:
        self._ns = round(start * 1e9)
        self._start_ns = self._ns
        self._wall = float(wall)
        self.autojump = autojump
        self._timers: list[tuple[int, int, _Timer]] = []
        self._seq = itertools.count()
        self._lock = threading.RLock()
        self._jump_armed: set[int] = set()

    # ------------------------------------------------------------ reading

    def monotonic_ns(self) -> int:
        return self._ns

    def monotonic(self) -> float:
        """Now, in seconds."""
        return self._ns / 1e9

    def time(self) -> float:
        """The wall clock: `wall` plus the virtual time elapsed since `start`."""
        return self._wall + (self._ns - self._start_ns) / 1e9

    # ------------------------------------------------------------ moving

    def advance(self, seconds: float) -> None:
        """Move forward by `seconds`, firing every timer that falls due on the way, in order."""
        if seconds < 0:
            raise ValueError("a monotonic clock never goes back")
        self._advance_to(self._ns + round(seconds * 1e9))

    def _advance_to(self, target: int) -> None:
        while True:
            with self._lock:
                if not self._timers or self._timers[0][0] > target:
                    self._ns = max(self._ns, target)
                    return
                due, _, timer = heapq.heappop(self._timers)
                self._ns = max(self._ns, due)
            if not timer.cancelled:
                timer.fire()

    def _add(self, due: int, fire: Callable[[], None]) -> _Timer:
        timer = _Timer(due, fire)
        with self._lock:
            heapq.heappush(self._timers, (due, next(self._seq), timer))
        return timer

    def pending(self) -> int:
        """How many timers are waiting (asyncio sleeps and attempt timeouts)."""
        with self._lock:
            return sum(1 for _, _, t in self._timers if not t.cancelled)

    # ------------------------------------------------------------ the Clock protocol

    def sleep(self, seconds: float) -> None:
        """A synchronous sleep: the time passes at once (nothing else could move the clock)."""
        if seconds > 0:
            self._advance_to(self._ns + round(seconds * 1e9))

    async def sleep_async(self, seconds: float) -> None:
        """Wait until the clock has moved `seconds` forward."""
        loop = asyncio.get_running_loop()
        if seconds <= 0:
            await asyncio.sleep(0)
            return
        fut: asyncio.Future[None] = loop.create_future()

        def wake() -> None:
            if not fut.done():
                loop.call_soon_threadsafe(_resolve, fut)

        timer = self._add(self._ns + round(seconds * 1e9), wake)
        self._arm(loop)
        try:
            await fut
        finally:
            timer.cancelled = True

    def timeout(self, seconds: float) -> _VirtualTimeout:
        """`async with clock.timeout(s):` cancels the block after `s` of virtual time and raises
        `TimeoutError`, like `asyncio.timeout`."""
        return _VirtualTimeout(self, seconds)

    # ------------------------------------------------------------ autojump

    def _arm(self, loop: asyncio.AbstractEventLoop) -> None:
        if not self.autojump:
            return
        key = id(loop)
        with self._lock:
            if key in self._jump_armed:
                return
            self._jump_armed.add(key)
        loop.call_soon(self._jump, loop, 0)

    def _jump(self, loop: asyncio.AbstractEventLoop, rounds: int) -> None:
        """Jump to the next timer once the loop has nothing else ready to run."""
        ready = getattr(loop, "_ready", None)  # CPython's loops; others: a fixed number of rounds
        busy = len(ready) > 0 if ready is not None else rounds < 50
        if busy and rounds < 100_000:
            loop.call_soon(self._jump, loop, rounds + 1)
            return
        with self._lock:
            while self._timers and self._timers[0][2].cancelled:
                heapq.heappop(self._timers)
            if not self._timers:
                self._jump_armed.discard(id(loop))
                return
            due = self._timers[0][0]
        self._advance_to(due)
        loop.call_soon(self._jump, loop, 0)


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class _VirtualTimeout:
    """`asyncio.timeout` on a `VirtualClock`: an `asyncio.Timeout` rescheduled to "now" when the
    virtual deadline passes, so cancellation and `TimeoutError` are asyncio's own."""

    def __init__(self, clock: VirtualClock, seconds: float) -> None:
        self._clock = clock
        self._seconds = seconds
        self._cm: asyncio.Timeout | None = None
        self._timer: _Timer | None = None

    def expired(self) -> bool:
        return self._cm is not None and self._cm.expired()

    async def __aenter__(self) -> _VirtualTimeout:
        loop = asyncio.get_running_loop()
        cm = self._cm = asyncio.timeout(None)
        await cm.__aenter__()

        def fire() -> None:
            loop.call_soon_threadsafe(_expire, cm, loop)

        self._timer = self._clock._add(self._clock._ns + round(self._seconds * 1e9), fire)
        self._clock._arm(loop)
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool | None:
        if self._timer is not None:
            self._timer.cancelled = True
        assert self._cm is not None
        await self._cm.__aexit__(et, exc, tb)
        return None


def _expire(cm: asyncio.Timeout, loop: asyncio.AbstractEventLoop) -> None:
    try:
        if cm.when() is None:
            cm.reschedule(loop.time())
    except RuntimeError:
        pass  # the block already ended


# ---------------------------------------------------------------------------- telemetry


@dataclass(frozen=True)
class Recorded:
    """One thing a `RecordingSink` received: `kind` is `event`, `add`, `record` or `gauge`;
    `label` the value of the sink's context variable when it was received."""

    kind: str
    name: str
    value: float
    attributes: dict[str, AttributeValue]
    label: object = None


class RecordingSink:
    """A `TelemetrySink` that keeps everything, in order (thread-safe). With `label`, each
    entry also records that context variable's value: a test can tell whose call emitted what."""

    def __init__(self, label: contextvars.ContextVar[Any] | None = None) -> None:
        self._label = label
        self._lock = threading.Lock()
        self.entries: list[Recorded] = []

    def _add(self, kind: str, name: str, value: float, attributes: Mapping[str, AttributeValue]) -> None:
        label = self._label.get() if self._label is not None else None
        with self._lock:
            self.entries.append(Recorded(kind, name, value, dict(attributes), label))

    def event(self, name: str, attributes: Mapping[str, AttributeValue]) -> None:
        self._add("event", name, 0, attributes)

    def add(self, counter: str, value: int, attributes: Mapping[str, AttributeValue]) -> None:
        self._add("add", counter, value, attributes)

    def record(self, histogram: str, value: float, attributes: Mapping[str, AttributeValue]) -> None:
        self._add("record", histogram, value, attributes)

    def gauge(self, gauge: str, value: float, attributes: Mapping[str, AttributeValue]) -> None:
        self._add("gauge", gauge, value, attributes)

    def events(self) -> list[tuple[str, dict[str, AttributeValue]]]:
        return [(e.name, e.attributes) for e in self.entries if e.kind == "event"]

    def counters(self) -> dict[str, float]:
        """Counter totals by `name{attr=value,...}` (attributes sorted by name)."""
        out: dict[str, float] = {}
        for e in self.entries:
            if e.kind == "add":
                k = metric_key(e.name, e.attributes)
                out[k] = out.get(k, 0) + e.value
        return out


def metric_key(name: str, attributes: Mapping[str, AttributeValue]) -> str:
    """`name{a=1,b=x}`, attributes sorted by name; booleans as `true`/`false`."""
    parts = []
    for k in sorted(attributes):
        v = attributes[k]
        parts.append(f"{k}={str(v).lower() if isinstance(v, bool) else v}")
    return f"{name}{{{','.join(parts)}}}"


# ---------------------------------------------------------------------------- fault injection


def inject_fault(engine: EngineRuntime, op: str, count: int = 1) -> None:
    """Make the next `count` crossings named `op` (`start`, `acquire`, `report` or
    `report-fallback`) of any call trap inside the component: a real trap (the guest is left
    with no fuel), recovered by the engine's one recovery path (re-instantiate, restore the
    last snapshot, end the call degraded). For tests of that path; the counts survive the
    recovery. `faults()` targets the crossings of one call instead."""
    _check_op(op)
    _faulty(engine).faults[op] += count


@dataclass(frozen=True)
class Fault:
    """A guest fault on the `nth` crossing named `op` of a call: a trap (`verdict` and
    `commands` None), or the guest's answer replaced by the packed `verdict` (one that breaks
    the contract), or, for `hedge-step` and `report-attempt`, by `commands`: a hedged call's
    commands in the vectors' JSON form (`{"start": {"attempt", "timeout"}}`, `{"cancel": n}`,
    `{"wait": ns}`, `{"end": {"attempt", "verdict"}}`)."""

    op: str
    nth: int = 1
    verdict: int | None = None
    commands: tuple[dict[str, Any], ...] | None = None


class _Plan:
    __slots__ = ("counts", "faults")

    def __init__(self, faults: tuple[Fault, ...]) -> None:
        self.faults = faults
        self.counts = dict.fromkeys(_CROSSINGS, 0)

    def next(self, op: str) -> Fault | None:
        self.counts[op] += 1
        n = self.counts[op]
        for f in self.faults:
            if f.op == op and f.nth == n:
                return f
        return None


_PLAN: contextvars.ContextVar[_Plan | None] = contextvars.ContextVar("levee_fault_plan", default=None)


@contextlib.contextmanager
def faults(engine: EngineRuntime, *plan: Fault) -> Iterator[None]:
    """`with faults(engine, Fault("report", nth=2)): ...`: the crossings made by the code in
    the block (this thread or task, and tasks it starts) count per operation, and the ones the
    plan names fault. A call's crossings run in its caller's context, so the plan follows the
    call. The crossing must run on the engine's driver path (a virtual clock, a tracer, or any
    call that does not succeed first time)."""
    for f in plan:
        _check_op(f.op)
        if f.commands is not None and f.op not in _HEDGE_CROSSINGS:
            raise ValueError(f"commands replace the answer of hedge-step or report-attempt, not of {f.op}")
        if f.verdict is not None and f.op in _HEDGE_CROSSINGS:
            raise ValueError(f"{f.op} answers commands, not a verdict")
    _faulty(engine)
    token = _PLAN.set(_Plan(tuple(plan)))
    try:
        yield
    finally:
        _PLAN.reset(token)


_CROSSINGS = ("start", "acquire", "report", "report-fallback", "hedge-step", "report-attempt")
_HEDGE_CROSSINGS = ("hedge-step", "report-attempt")


def _check_op(op: str) -> None:
    if op not in _CROSSINGS:
        raise ValueError(f"unknown crossing {op!r}: {', '.join(_CROSSINGS)}")


def _faulty(engine: EngineRuntime) -> type[_FaultyCore]:
    current = engine._core_class
    if issubclass(current, _FaultyCore):
        return current
    cls: type[_FaultyCore] = type("FaultyCore", (_FaultyCore,), {"faults": dict.fromkeys(_CROSSINGS, 0)})
    engine._core_class = cls
    engine._core.__class__ = cls
    return cls


class _FaultyCore(Core):
    """A `Core` whose crossings fault on demand (see `inject_fault` and `faults`)."""

    faults: dict[str, int]

    #: a slow crossing armed to trap (its fuel is set inside `_slow`)
    _trap_slow = False

    def _slow_fuel(self, work: int) -> int:
        if self._trap_slow:
            self._trap_slow = False
            return 0
        return super()._slow_fuel(work)

    def _arm_hedge(self, op: str) -> tuple[dict[str, Any], ...] | None:
        """`_arm` for the crossings of a hedged call: arm a trap, or return the commands."""
        trap = False
        if self.faults[op] > 0:
            self.faults[op] -= 1
            trap = True
        plan = _PLAN.get()
        if plan is not None:
            f = plan.next(op)
            if f is not None:
                if f.commands is not None:
                    return f.commands
                trap = True
        if trap:
            self._trap_slow = True
        return None

    def hedge_step(self, call: int, now: int) -> tuple[list[Any], bool]:
        replace = self._arm_hedge("hedge-step")
        answer = super().hedge_step(call, now)
        return answer if replace is None else (_lifted(replace), False)

    def report_attempt(self, call: int, attempt: int, now: int, elapsed: int, kind: OutcomeKind, code: int,
                       text: str, wall_secs: int, flags: int) -> tuple[list[Any], bool]:  # fmt: skip
        replace = self._arm_hedge("report-attempt")
        answer = super().report_attempt(call, attempt, now, elapsed, kind, code, text, wall_secs, flags)
        # the answer replaced whole, events bit included (as a replaced verdict's): the events
        # of the real crossing are lost with the instance, as a trap's are
        return answer if replace is None else (_lifted(replace), False)

    def _arm(self, op: str) -> int | None:
        """Before crossing `op`: arm a trap, or return the verdict to answer instead."""
        trap = False
        if self.faults[op] > 0:
            self.faults[op] -= 1
            trap = True
        plan = _PLAN.get()
        if plan is not None:
            f = plan.next(op)
            if f is not None:
                if f.verdict is not None:
                    return f.verdict
                trap = True
        if trap:
            self.store.set_fuel(0)
            self._hot_left = 1 << 62  # no refill before the crossing: it runs out of fuel
        return None

    def start(self, call: int, policy: int, key: str, flags: int, now: int, settle_call: int, settle_at: int,
              settle_elapsed: int) -> int:  # fmt: skip
        replace = self._arm("start")
        v = super().start(call, policy, key, flags, now, settle_call, settle_at, settle_elapsed)
        return v if replace is None else replace

    def acquire(self, call: int, now: int) -> int:
        replace = self._arm("acquire")
        v = super().acquire(call, now)
        return v if replace is None else replace

    def report(self, call: int, now: int, elapsed: int, kind: OutcomeKind, code: int, text: str, wall_secs: int,
               flags: int) -> int:  # fmt: skip
        replace = self._arm("report")
        v = super().report(call, now, elapsed, kind, code, text, wall_secs, flags)
        return v if replace is None else replace

    def report_fallback(self, call: int, now: int, ok: bool) -> int:
        replace = self._arm("report-fallback")
        v = super().report_fallback(call, now, ok)
        return v if replace is None else replace


def _lifted(commands: tuple[dict[str, Any], ...]) -> list[Any]:
    """Commands in the vectors' JSON form, as the binding lifts them from the component."""
    out: list[Any] = []
    for c in commands:
        ((case, val),) = c.items()
        out.append((case, dict(val) if isinstance(val, dict) else val))
    return out

"""Runtime glue: the component instance behind an engine, the lock that serialises crossings,
held-back successes, snapshots and trap recovery.

Nothing here decides anything: `_driver` relays the core's verdicts, `_io` does the I/O they
ask for, and `engine` is the public API.
"""

from __future__ import annotations

import collections
import os
import threading
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from ._abi import ComponentFault, Core, LoadErrors, Runtime, event_from_raw
from ._clock import SYSTEM, Clock, SystemClock
from ._constants import GUARD_MAX_KEY_BYTES, GUARD_SNAPSHOT_INTERVAL_MS, TEXT_KEY_TOO_LONG, VERDICT_WAKES_BIT
from ._events import Listener, dispatch, logger
from .errors import EngineClosed, LeveeError, PolicyError, ProtocolError, UnknownPolicy
from .outcomes import Outcome
from .telemetry import SpanSink, TelemetrySink, emit_attempt, emit_call
from .types import (
    BreakerState,
    Event,
    EventKind,
    ExecCommand,
    ExecEvent,
    ExecutorConfig,
    LoadError,
    OutcomeKind,
    PolicyInfo,
    Reason,
    RowWrite,
    Verdict,
)

if TYPE_CHECKING:
    from ._driver import FallbackContext, RetryHook, RetryPredicate, _Call

T = TypeVar("T")


EVENTS_BIT = 0x10
#: calls were granted a bulkhead slot: `take-wakes` names them (docs/policy.md, "The queue")
WAKES_BIT = VERDICT_WAKES_BIT
#: a `wait` verdict with reason bulkhead-full (kind 1, detail 7): the call joined the bulkhead's
#: queue and is parked (docs/policy.md, "The queue"); `v & PARK_MASK == PARK_VERDICT`
PARK_MASK = 0xFF0F
PARK_VERDICT = 0x0701


def check_key(key: str) -> str:
    """`key`, when the core may take it: a key longer than `GUARD_MAX_KEY_BYTES` (UTF-8) is
    refused here, before the core, which would decide it against the shared overflow entry
    (docs/policy.md, "Keys"). A str of at most a quarter of the bound in characters fits
    whatever it holds (UTF-8 takes at most 4 bytes a character), so most keys cost one `len`."""
    if len(key) > GUARD_MAX_KEY_BYTES // 4:
        n = len(key.encode("utf-8", "surrogatepass"))
        if n > GUARD_MAX_KEY_BYTES:
            raise ValueError(TEXT_KEY_TOO_LONG.format(bytes=n, max=GUARD_MAX_KEY_BYTES))
    return key


class _Parker:
    """A call parked in a bulkhead queue: woken (`wake`) when the core names it in `take-wakes`
    (it granted the call a freed slot), from any thread, whichever executor (thread or asyncio
    task) sleeps on it. `wake` before the sleeper has attached itself is kept in `woken`."""

    __slots__ = ("event", "fut", "loop", "woken")

    def __init__(self) -> None:
        self.woken = False
        self.event: threading.Event | None = None
        self.loop: Any = None
        self.fut: Any = None

    def wake(self) -> None:
        self.woken = True  # before reading event/fut: the sleeper attaches them, then reads woken
        ev = self.event
        if ev is not None:
            ev.set()
        fut = self.fut
        if fut is not None:
            try:
                self.loop.call_soon_threadsafe(_resolve, fut)
            except RuntimeError:  # its loop is closed: nobody is waiting any more
                pass


def _resolve(fut: Any) -> None:
    if not fut.done():
        fut.set_result(None)


# ---------------------------------------------------------------------------- the component

_runtime_lock = threading.Lock()
_runtimes: dict[str, Runtime] = {}


def component_path() -> str:
    """Where the component is read from: `$LEVEE_COMPONENT` if set, else the copy in the wheel."""
    env = os.environ.get("LEVEE_COMPONENT")
    if env:
        return env
    # Beside this module, as the wheel installs it; wasmtime reads a file by path, so the package
    # is on disk (importlib.resources would cost ~10 ms of `import levee` to say the same).
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "_wasm", "levee_policy.wasm")


def _runtime(path: str | None) -> Runtime:
    path = path or component_path()
    with _runtime_lock:
        rt = _runtimes.get(path)
        if rt is None:
            try:
                wasm = Path(path).read_bytes()
            except OSError as e:
                raise LeveeError(
                    f"cannot read the Levee component at {path}: {e}. Reinstall the package (its build "
                    "copies levee_policy.wasm into it) or set LEVEE_COMPONENT to the component's path."
                ) from e
            rt = _runtimes[path] = Runtime(wasm)
        return rt


@dataclass(frozen=True, slots=True)
class TraceStep:
    """One crossing, for `Engine.trace` (debugging and the demo): the operation, the call, the
    outcome reported (for `report`) and the verdict."""

    op: str
    call: int
    policy: str
    attempt: int
    outcome: Outcome | None
    verdict: Verdict
    #: a hedged call's crossings (`hedge-step`, `report-attempt`): the commands answered, as
    #: text (`start 2 timeout=0`, `cancel 3`, `wait 500000000`, `end 2`); `verdict` is then the
    #: `end`'s verdict, or a `hedge` verdict for attempt `attempt` while the call goes on
    commands: tuple[str, ...] = ()

    def __str__(self) -> str:
        what = ""
        if self.outcome is not None:
            o = self.outcome
            what = f" outcome={o.kind.wit}" + (
                f":{o.code}" if o.kind in (OutcomeKind.HTTP_STATUS, OutcomeKind.GRPC_STATUS) else ""
            )
            if o.text:
                what += f" text={o.text!r}"
        if self.commands:
            return f"call={self.call} {self.op} attempt={self.attempt}{what} -> [{', '.join(self.commands)}]"
        return f"call={self.call} {self.op} attempt={self.attempt}{what} -> {self.verdict}"


class _Fault(Exception):
    """Internal: the engine faulted (trap) during this call's crossing; it has been recovered."""


class _PolicySlot:
    __slots__ = ("index", "info", "retry_if", "tmax")

    def __init__(self, index: int, info: PolicyInfo) -> None:
        self.index = index
        #: the policy's retry predicate (`Engine.retry_if`); a handle's own wins
        self.retry_if: RetryPredicate | None = None
        self.set(info)

    def set(self, info: PolicyInfo) -> None:
        self.info = info
        #: the largest first-attempt timeout the contract allows (0: any, including none)
        t, d = info.attempt_timeout, info.deadline
        self.tmax = min(t, d) if t and d else t or d


class ExecutorGone(LeveeError):
    """The component instance a durable executor's machine lived in is gone: it was replaced
    after a trap (or a contract fault), or the engine was closed. Its calls are abandoned; a
    new machine is made in the new instance (docs/durable.md, "The executor")."""


@dataclass(frozen=True, slots=True)
class ExecutorRef:
    """A durable executor's machine: its resource handle in `core`, made at `generation`
    (the instance's, which a recovery moves on). Private to `levee.durable`."""

    core: Core
    handle: int
    generation: int


class EngineRuntime:
    """The runtime half of an `Engine` (see `engine.Engine` for the public API)."""

    def __init__(
        self,
        document: str | bytes | bytearray | Mapping[str, Any],
        *,
        seed: int | None = None,
        component: str | os.PathLike[str] | None = None,
        snapshot_interval: float = GUARD_SNAPSHOT_INTERVAL_MS / 1000,
        clock: Clock | None = None,
        telemetry: TelemetrySink | None = None,
    ) -> None:
        """Load `document` (YAML or JSON text; UTF-8 bytes of it; or a dict, as JSON would
        give it). `seed` fixes the jitter PRNG (default: from
        `os.urandom`). Raises `PolicyError` naming every invalid field.

        `clock` is the clock of every `now`, sleep and asyncio attempt timeout (default the
        system's; `levee.testing.VirtualClock` in tests). `telemetry` receives the events and
        metrics of docs/telemetry.md (`levee.telemetry.OpenTelemetrySink`, or your own
        `TelemetrySink`). `snapshot_interval` is the guard of docs/hosts.md section 7: at most
        one snapshot per interval of the engine's clock on the call path, besides the ones
        taken after every breaker transition."""
        document = document_text(document)
        self._document = document
        #: the clock of every `now`, sleep and asyncio attempt timeout (`levee.testing.VirtualClock`
        #: in tests); the hot path is kept for the system clock only
        self._clock: Clock = SYSTEM if clock is None else clock
        self._now: Callable[[], int] = self._clock.monotonic_ns
        self._seed = int.from_bytes(os.urandom(8), "little") if seed is None else seed & 0xFFFFFFFFFFFFFFFF
        self._runtime = _runtime(os.fspath(component) if component is not None else None)
        self._lock = threading.Lock()
        #: what an instance is (levee.testing swaps in one that traps on demand)
        self._core_class: type[Core] = Core
        self._core = self._make_core()
        self._generation = 0
        self._next_call = 1
        # Held-back successes (call, at, elapsed, generation): appended without the lock (a
        # deque's append is atomic); the next `start` settles one, any extra are reported first.
        self._pending: collections.deque[tuple[int, int, int, int]] = collections.deque()
        self._snapshot: bytes | None = None
        self._snapshots_stopped = False
        self._snapshot_every = max(0, int(snapshot_interval * 1e9))
        self._snapshot_due = 0 if self._snapshot_every else 1 << 63
        self._fallbacks: dict[str, Callable[[FallbackContext], Any]] = {}
        self._listeners: list[Listener] = []
        #: events and metrics (docs/telemetry.md); None: logging and listeners only
        self._sink: TelemetrySink | None = telemetry
        spans = (
            telemetry if isinstance(telemetry, SpanSink) and callable(getattr(telemetry, "start_call", None)) else None
        )
        #: the sink's spans (every call then takes the driver path: one span per attempt)
        self._spans: SpanSink | None = spans
        self._retry_hooks: dict[str, tuple[RetryHook, ...]] = {}
        #: calls parked in a bulkhead queue, by call id (a wake is one lookup); empty (and
        #: checked only for emptiness) while nobody is parked: the hot path pays one truth test
        self._parked: dict[int, _Parker] = {}
        self._park_lock = threading.Lock()
        #: calls sleeping before a retry or a rate-limit wait: `close()` wakes them (they cannot
        #: go on); under `_park_lock`
        self._sleeping: set[_Parker] = set()
        self._tracer: Callable[[TraceStep], None] | None = None
        # whether calls take the one-crossing hot path (no tracer, the system clock)
        self._hot = type(self._clock) is SystemClock and self._spans is None
        self._slots: dict[str, _PolicySlot] = {}
        self._names: list[str] = []
        self._refresh_policies()
        self._closed = False
        #: how many times the component trapped and was re-instantiated
        self.faults = 0
        _ENGINES.add(self)

    # -------------------------------------------------------------- internals

    def _after_fork_in_child(self) -> None:
        """In a child process just forked (the README, "Fork"): the only thread left
        is the one that forked. Another thread of the parent may have been inside the engine: its
        lock is then held forever, and the instance may be half-way through a crossing. The child
        takes locks of its own and an instance of its own, with the state it inherited (exported
        from the inherited instance when no crossing was under way, else the last snapshot, which
        is taken after every breaker transition): protection is kept. The calls the parent's
        threads have in flight belong to the parent (live calls are not state), so their
        bulkhead slots and held-back successes stay there."""
        busy = self._lock.locked()
        self._lock = threading.Lock()
        self._park_lock = threading.Lock()
        self._parked = {}
        self._sleeping = set()
        if self._closed:
            return
        old = self._core
        state = self._snapshot
        if not busy and not old.dead:
            try:
                state = old.export_state()
            except Exception as e:
                logger.warning("levee: the state inherited by a forked child could not be exported (%s); "
                               "the last snapshot is restored", e)  # fmt: skip
        self._generation += 1
        self._pending.clear()
        try:
            core = self._core_class(self._runtime, self._document, self._seed)
            bad = core.import_state(state) if state is not None else None
        except Exception as e:
            logger.error("levee: the engine could not be re-instantiated in a forked child: %s", e)
            return
        if bad is not None:
            logger.error("levee: a forked child could not restore the engine's state: %s", bad)
        self._core = core
        self._snapshot = state
        if busy:
            # half-way through a crossing of a thread that is gone: never touched again
            _ABANDONED.append(old)
        else:
            try:
                old.close()
            except Exception:
                pass

    def _make_core(self) -> Core:
        try:
            return self._core_class(self._runtime, self._document, self._seed)
        except LoadErrors as e:
            raise PolicyError(e.errors + _path_hint(self._document)) from None
        except ComponentFault as e:
            raise LeveeError(f"the Levee component failed to load the document: {e}") from e

    def _refresh_policies(self) -> None:
        core = self._core
        names: list[str] = []
        for i in range(core.policy_count()):
            info = core.policy_info(i)
            if info is None:
                raise ProtocolError(f"policy-info({i}) returned none for an existing policy")
            names.append(info.name)
            slot = self._slots.get(info.name)
            if slot is None:
                self._slots[info.name] = _PolicySlot(i, info)
            else:
                slot.index = i
                slot.set(info)
        for name, slot in self._slots.items():
            if name not in names:
                slot.index = -1
        self._names = names

    def _events_locked(self, v: int, out: list[Event]) -> None:
        if v & EVENTS_BIT:
            trip = False
            for raw in self._core.drain_events():
                ev = event_from_raw(raw, self._names)
                trip = trip or ev.kind is EventKind.BREAKER_TRANSITION
                out.append(ev)
            if trip:
                # A breaker changed state: snapshot now, so that a trap never brings back an
                # older state (docs/architecture.md, "Recovery never forgets a trip").
                self._snapshot_locked(out)

    def _snapshot_locked(self, out: list[Event]) -> None:
        """Take the snapshot a recovery restores (held-back successes are sent first): the
        keys holding protection only (`export-snapshot`, docs/hosts.md section 7), so that its
        cost follows them, not the number of keys at rest."""
        if self._snapshots_stopped:
            return
        self._flush_locked(out)
        try:
            self._snapshot = self._core.export_snapshot()
        except ComponentFault as e:
            if "too much data" in str(e):
                # wasmtime-py cannot lift a snapshot this large (docs/architecture.md, "Bounds on
                # the guest"): every later one would fault the same way. Stop snapshots rather
                # than fault every second; a trap restores the last one taken.
                self._snapshots_stopped = True
                logger.error(
                    "levee: the keys holding protection are too many for wasmtime-py to export (%s); "
                    "snapshots stop, and a trap will restore the state of the last one",
                    e,
                )
            raise
        if self._snapshot_every:
            self._snapshot_due = self._now() + self._snapshot_every

    def _flush_locked(self, out: list[Event], keep: int = 0) -> None:
        """Report held-back successes (they must precede any other operation), leaving `keep`."""
        pending = self._pending
        gen = self._generation
        while len(pending) > keep:
            call, at, elapsed, g = pending.popleft()
            if g == gen:
                v = self._core.report(call, at, elapsed, OutcomeKind.SUCCESS, 0, "", 0, 0)
                self._events_locked(v, out)
                if v & WAKES_BIT:
                    self._wakes_locked()

    def _recover_locked(self, err: BaseException, out: list[Event], fault: str = "trap", policy: str = "",
                        key: str = "", call: int = 0) -> None:  # fmt: skip
        """The one recovery path (docs/hosts.md, section 3), steps 1 and 2: for a trap or a verdict
        that breaks the contract, re-instantiate, reload and restore the last snapshot (events of
        the failed crossing are lost); for `invalid`, nothing to replace. Then report it."""
        self.faults += 1
        restored = ""
        if fault != "invalid":
            self._generation += 1
            self._pending.clear()
            old = self._core
            try:
                old.close()
            except Exception:
                pass
            try:
                core = self._core_class(self._runtime, self._document, self._seed)
                if self._snapshot is not None:
                    bad = core.import_state(self._snapshot)
                    restored = "; state restored" if bad is None else f"; state not restored ({bad})"
                self._core = core
            except Exception as e2:
                restored = f"; re-instantiation failed: {e2}"
        logger.warning("levee: guest fault (%s) in call %d of policy %r: %s%s", fault, call, policy, err, restored)
        out.append(
            Event(
                at=self._now(), kind=EventKind.ENGINE_FAULT, policy=policy, policy_index=-1, key=key, call=call,
                attempt=0, reason=Reason.NONE, duration=0, state_from=BreakerState.CLOSED,
                state_to=BreakerState.CLOSED, name=f"{err}{restored}", value=self.faults, fault=fault,
            )
        )  # fmt: skip

    def _guest_fault(self, st: _Call, fault: str, message: str) -> None:
        """A verdict the host cannot act on: `contract` (it breaks the contract: the instance is
        replaced, as after a trap) or `invalid` (the core does not know the call)."""
        events: list[Event] = []
        with self._lock:
            if self._closed:
                return  # the instance is gone on purpose: nothing to recover
            if fault == "invalid" or st.gen == self._generation:
                self._recover_locked(ProtocolError(message), events, fault, st.slot.info.name, st.key, st.call)
        if events:
            dispatch(events, self._listeners, self._sink, st.span, st.call)

    def _maybe_snapshot_locked(self, now: int, out: list[Event]) -> None:
        if self._snapshot_every and now >= self._snapshot_due:
            self._snapshot_locked(out)

    def _count_success(self, slot: _PolicySlot, elapsed: int) -> None:
        """The metrics of a first-time success on the hot path (its report is held back)."""
        sink = self._sink
        if sink is None:
            return
        try:
            emit_attempt(sink, slot.info.name, "success", elapsed)
            emit_call(sink, slot.info.name, "success", False, None)
        except Exception:
            logger.exception("levee: telemetry sink %r failed", sink)

    def _emit(self, events: list[Event]) -> None:
        if events:
            dispatch(events, self._listeners, self._sink)

    def _trace(self, op: str, st: _Call, outcome: Outcome | None, v: int) -> None:
        tracer = self._tracer
        if tracer is not None:
            self._call_tracer(tracer, TraceStep(op, st.call, st.slot.info.name, st.attempts, outcome,
                                                Verdict.unpack(v)))  # fmt: skip

    @staticmethod
    def _call_tracer(tracer: Callable[[TraceStep], None], step: TraceStep) -> None:
        """An observer: one that raises is reported and ignored (it never reaches the call, which
        goes on, and so never keeps what the call holds)."""
        try:
            tracer(step)
        except Exception:
            logger.exception("levee: trace callback %r failed", tracer)

    def _trace_hedge(self, op: str, st: _Call, attempt: int, outcome: Outcome | None, commands: list[Any]) -> None:
        tracer = self._tracer
        if tracer is None:
            return
        text: list[str] = []
        verdict = Verdict.unpack(7 | (min(attempt, 255) << 8))
        for c in commands:
            case, val = c if isinstance(c, tuple) and len(c) == 2 else ("?", c)
            if case == "start" and isinstance(val, dict):
                text.append(f"start {val.get('attempt')} timeout={val.get('timeout')}")
            elif case == "end" and isinstance(val, dict):
                text.append(f"end {val.get('attempt')}")
                if isinstance(val.get("verdict"), int):
                    verdict = Verdict.unpack(val["verdict"])
            else:
                text.append(f"{case} {val}")
        self._call_tracer(tracer, TraceStep(op, st.call, st.slot.info.name, attempt, outcome, verdict,
                                            tuple(text) or ("-",)))  # fmt: skip

    def _open_span(self, slot: _PolicySlot, key: str) -> Any:
        """The `levee.call` span of a call about to start (None without a span sink), opened
        before `start` so that the events of that crossing land on it."""
        spans = self._spans
        if spans is None:
            return None
        try:
            return spans.start_call(slot.info.name, key)
        except Exception:
            logger.exception("levee: telemetry sink %r failed", spans)
            return None

    def _start(self, slot: _PolicySlot, key: str, flags: int, span: Any = None) -> tuple[int, int, int, int]:
        """`start` a call, settling the held-back success. Returns (call, generation, verdict,
        now); the verdict is -1 when the guest trapped (recovered: the call ends degraded).
        `span` is the call's span (`_open_span`): ended here when the call cannot start."""
        events: list[Event] = []
        try:
            check_key(key)
            with self._lock:
                call = self._next_call
                self._next_call = call + 1
                core = self._core
                now = self._now()  # the call's start: its deadline counts from here
                try:
                    if self._closed:
                        raise EngineClosed()
                    if core.dead:
                        self._recover_locked(ComponentFault("the previous recovery failed"), events)
                        core = self._core
                        if core.dead:
                            raise ComponentFault("the component is unavailable")
                    if slot.index < 0:
                        raise UnknownPolicy(next(n for n, s in self._slots.items() if s is slot), self._names)
                    pending = self._pending
                    sc = sa = se = 0
                    if pending:
                        if len(pending) > 1:
                            self._flush_locked(events, keep=1)
                        sc, sa, se, sg = pending.popleft()
                        if sg != self._generation:
                            sc = sa = se = 0
                    v = core.start(call, slot.index, key, flags, now, sc, sa, se)
                    if v & EVENTS_BIT:
                        self._events_locked(v, events)
                        if v & PARK_MASK == PARK_VERDICT:  # a queued wait always carries its event
                            self._park_locked(call)
                    if v & WAKES_BIT:  # after the park: the core may name the call it just queued
                        self._wakes_locked()
                except ComponentFault as e:
                    if not core.dead:
                        raise
                    self._recover_locked(e, events, "trap", slot.info.name, key, call)
                    v = -1
                gen = self._generation
        except BaseException:
            if span is not None:  # the call never started: its span ends here
                try:
                    assert self._spans is not None
                    self._spans.end_call(span, "failure", None)
                except Exception:
                    logger.exception("levee: telemetry sink %r failed", self._spans)
            raise
        if events:
            dispatch(events, self._listeners, self._sink, span, call)
        return call, gen, v, now

    def _cross(self, st: _Call, fn: Callable[[Core], int]) -> int:
        """A hot crossing for call `st`. Raises `_Fault` after a trap (recovered), or when the
        call's instance was replaced since it started (the new one would answer `invalid`)."""
        events: list[Event] = []
        try:
            with self._lock:
                if self._closed:  # a graceful shutdown, not a fault: the driver ends the call
                    raise EngineClosed()
                if st.gen != self._generation:
                    self._recover_locked(
                        ProtocolError("the call's instance was replaced"), events, "invalid", st.slot.info.name,
                        st.key, st.call,
                    )  # fmt: skip
                    raise _Fault()
                core = self._core
                try:
                    self._flush_locked(events)
                    v = fn(core)
                    self._events_locked(v, events)
                    if v & PARK_MASK == PARK_VERDICT:
                        self._park_locked(st.call)
                    if v & WAKES_BIT:
                        self._wakes_locked()
                except ComponentFault as e:
                    if not core.dead:
                        raise
                    self._recover_locked(e, events, "trap", st.slot.info.name, st.key, st.call)
                    raise _Fault() from e
                return v
        finally:
            if events:
                dispatch(events, self._listeners, self._sink, st.span, st.call)

    def _cross_hedge(self, st: _Call, fn: Callable[[Core], tuple[list[Any], bool]]) -> list[Any]:
        """`_cross` for `hedge-step` and `report-attempt`, whose answer is a list of commands
        (returned unchecked: the driver checks them) with its own events bit."""
        events: list[Event] = []
        try:
            with self._lock:
                if self._closed:  # a graceful shutdown, not a fault: the driver ends the call
                    raise EngineClosed()
                if st.gen != self._generation:
                    self._recover_locked(
                        ProtocolError("the call's instance was replaced"), events, "invalid", st.slot.info.name,
                        st.key, st.call,
                    )  # fmt: skip
                    raise _Fault()
                core = self._core
                try:
                    self._flush_locked(events)
                    commands, pending = fn(core)
                    if pending:
                        self._events_locked(EVENTS_BIT, events)
                    if self._parked:
                        # the answer has no wakes bit: a closed attempt may have freed a slot
                        self._wakes_locked()
                except ComponentFault as e:
                    if not core.dead:
                        raise
                    self._recover_locked(e, events, "trap", st.slot.info.name, st.key, st.call)
                    raise _Fault() from e
                return commands
        finally:
            if events:
                dispatch(events, self._listeners, self._sink, st.span, st.call)

    # -------------------------------------------------------------- the bulkhead queue

    def _park_locked(self, call: int) -> None:
        """Register `call` as parked, under the engine's lock in the crossing that queued it: the
        crossing that grants it a slot comes after it and finds it (no lost wake-up)."""
        parker = _Parker()
        with self._park_lock:
            self._parked[call] = parker
        if self._pending:
            # a held-back success appended since this crossing's flush holds a slot: its call
            # may have looked at `_parked` before this registration; the woken call's acquire
            # settles it (and waits again if the slot is granted to another)
            parker.wake()

    def _wakes_locked(self) -> None:
        """Wake the calls the core granted a slot (`take-wakes`, under the engine's lock), and
        only them: one lookup each. An id this host has not parked is ignored."""
        calls = self._core.take_wakes()
        if not calls:
            return
        with self._park_lock:
            woken = [p for p in (self._parked.pop(c, None) for c in calls) if p is not None]
        for parker in woken:
            parker.wake()

    def _sleeper(self) -> _Parker | None:
        """A sleep before a retry or a rate-limit wait is about to start: its wake-up for
        `close()` (None: the engine is closed already, do not sleep). `_awake` when it ends."""
        sleeper = _Parker()
        with self._park_lock:
            self._sleeping.add(sleeper)
        if self._closed:  # read after registering: a close in between has woken it, or is seen
            self._awake(sleeper)
            return None
        return sleeper

    def _awake(self, sleeper: _Parker) -> None:
        with self._park_lock:
            self._sleeping.discard(sleeper)

    def _parker(self, call: int) -> _Parker | None:
        """The parker of a call told to wait in the queue (None: already woken)."""
        parker = self._parked.get(call)
        return None if parker is None or parker.woken else parker

    def _unpark(self, call: int) -> None:
        """The call's park is over (its payload elapsed, or it was woken or cancelled)."""
        with self._park_lock:
            self._parked.pop(call, None)

    def _settle_parked(self) -> None:
        """A success was held back while calls are parked: settle it now, so that the slot it
        frees is granted, and the granted call woken, at once."""
        events: list[Event] = []
        try:
            with self._lock:
                if self._closed:
                    return
                core = self._core
                try:
                    self._flush_locked(events)
                except ComponentFault as e:
                    if not core.dead:
                        raise
                    self._recover_locked(e, events)
        finally:
            if events:
                dispatch(events, self._listeners, self._sink)

    def _maybe_snapshot(self) -> None:
        now = self._now()
        if now >= self._snapshot_due:
            self._snapshot_tick(now)

    def _snapshot_tick(self, at: int) -> None:
        """Export the state for trap recovery (at most once per `snapshot_interval`)."""
        events: list[Event] = []
        with self._lock:
            core = self._core
            try:
                if not core.dead:
                    self._maybe_snapshot_locked(at, events)
            except ComponentFault as e:
                if not core.dead:
                    raise
                self._recover_locked(e, events)
        if events:
            dispatch(events, self._listeners, self._sink)

    def _locked_op(
        self,
        fn: Callable[[Core], T],
        snapshot_if: Callable[[T], bool] | None = None,
        *,
        machine: ExecutorRef | None = None,
    ) -> T:
        """Any other operation: flush the held-back success first, recover on a trap. When
        `snapshot_if(result)` holds, the state it left is snapshotted under the same lock. With
        `machine`, an operation of that durable executor's machine: a closed engine, an
        instance replaced since it was made, and a trap are each `ExecutorGone`."""
        events: list[Event] = []
        try:
            with self._lock:
                core = self._core
                if self._closed:
                    raise ExecutorGone("the engine is closed") if machine is not None else EngineClosed()
                if machine is not None and (machine.core is not core or machine.generation != self._generation):
                    raise ExecutorGone("the component instance was replaced after a fault")
                try:
                    if core.dead:
                        raise ComponentFault("the component is unavailable")
                    self._flush_locked(events)
                    result = fn(core)
                    if snapshot_if is not None and snapshot_if(result):
                        self._snapshot_locked(events)
                    return result
                except ComponentFault as e:
                    self._recover_locked(e, events)
                    fault = ExecutorGone if machine is not None else LeveeError
                    raise fault(f"the Levee engine faulted and was re-instantiated: {e}") from e
        finally:
            if events:
                dispatch(events, self._listeners, self._sink)

    # ------------------------------------------------------------ the durable executor's machine
    # `levee.durable` drives it; the machine lives in the current instance, so every method
    # checks that the instance it was made in is still the engine's (else `ExecutorGone`).

    def _executor_new(self, config: ExecutorConfig, handlers: list[str]) -> ExecutorRef:
        """A new machine in the current instance, with `handlers` registered."""

        def op(c: Core) -> ExecutorRef:
            x = c.executor_new(config)
            for name in handlers:
                c.executor_register(x, name)
            return ExecutorRef(c, x, self._generation)

        return self._locked_op(op)

    def _executor_op(self, x: ExecutorRef, fn: Callable[[Core, int], T]) -> T:
        """`fn(core, handle)` under the lock, if `x` lives in the current instance; a trap is
        recovered (the one path) and raised as `ExecutorGone`, as is a replaced instance."""
        return self._locked_op(lambda core: fn(core, x.handle), machine=x)

    def _executor_feed(self, x: ExecutorRef, now: int, event: ExecEvent) -> list[ExecCommand]:
        return self._executor_op(x, lambda c, h: c.executor_feed(h, now, event))

    def _executor_running(self, x: ExecutorRef) -> int:
        return self._executor_op(x, lambda c, h: c.executor_running(h))

    def _executor_register(self, x: ExecutorRef, name: str) -> None:
        self._executor_op(x, lambda c, h: c.executor_register(h, name))

    def _executor_forget(self, x: ExecutorRef, call_id: int) -> None:
        self._executor_op(x, lambda c, h: c.executor_forget(h, call_id))

    def _executor_fault(self, x: ExecutorRef, message: str) -> None:
        """The machine answered a command the host cannot carry out (a contract fault): the
        instance is replaced, as after a trap, unless that happened already."""
        events: list[Event] = []
        with self._lock:
            if not self._closed and x.core is self._core and x.generation == self._generation:
                self._recover_locked(ProtocolError(message), events, "contract")
        if events:
            dispatch(events, self._listeners, self._sink)

    def _executor_close(self, x: ExecutorRef) -> None:
        """Drop the machine (an instance already replaced or closed dropped it with itself)."""
        with self._lock:
            if not self._closed and x.core is self._core and not x.core.dead:
                x.core.executor_drop(x.handle)

    def _executor_operator(self, call_id: int, record: bytes, revive: bool, wall_now: int) -> RowWrite | LoadError:
        """`executor.operator` (static): what an operator's cancel or retry writes."""
        return self._locked_op(lambda c: c.executor_operator(call_id, record, revive, wall_now))


#: every live engine, for the fork handler
_ENGINES: weakref.WeakSet[EngineRuntime] = weakref.WeakSet()
#: instances a forked child inherited half-way through a crossing (kept, never dropped: their
#: destructor would run on a store a vanished thread was using)
_ABANDONED: list[Core] = []


def _after_fork_in_child() -> None:
    global _runtime_lock
    _runtime_lock = threading.Lock()
    for eng in list(_ENGINES):
        try:
            eng._after_fork_in_child()
        except Exception:
            logger.exception("levee: an engine could not be prepared for a forked child")


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def document_text(document: object, source: str = "") -> str:
    """A policy document as the text the core reads: a str as it is, bytes decoded as UTF-8, a
    dict (what `json.load` or `yaml.safe_load` give) written as JSON. `source` names the file
    the bytes came from, for the error."""
    if isinstance(document, str):
        return document
    if isinstance(document, bytes | bytearray | memoryview):
        try:
            return bytes(document).decode("utf-8")
        except UnicodeDecodeError as e:
            where = f"{source} is" if source else "the document is"
            raise PolicyError([LoadError("", f"{where} not UTF-8 text: {e.reason} at byte {e.start}")]) from None
    if isinstance(document, Mapping):
        import json

        try:
            return json.dumps(document)
        except (TypeError, ValueError) as e:
            raise TypeError(f"a policy document given as a dict must be what JSON can hold: {e}") from e
    raise TypeError(
        f"a policy document is a str (YAML or JSON), bytes (UTF-8) or a dict, not {type(document).__name__}"
    )


def _path_hint(document: str) -> list[LoadError]:
    """When a refused document is one line with no `:` and no `{` (no policy document is),
    it is most likely a file name given as text: say so, and whether such a file exists."""
    text = document.strip()
    if not text or "\n" in text or ":" in text or "{" in text or len(text) > 4096:
        return []
    if os.path.exists(text):
        return [LoadError("", f"the document is the text {text!r}, the name of a file: load it with levee.load(path)")]
    return [LoadError("", f"the document is the text {text!r}, which looks like a file name, and no such file exists")]

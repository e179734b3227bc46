"""The engine: one component instance shared by every thread and task, and the step protocol.

Every decision comes from the component. This module only does the I/O (runs attempts,
sleeps, fallbacks), clamps what comes out of the guest, and recovers from traps.
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import functools
import inspect
import os
import threading
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Generator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any, ParamSpec, TypeVar, cast

from ._abi import ComponentFault, Core, LoadErrors, Runtime, event_from_raw
from ._events import Listener, dispatch, logger
from .errors import LeveeError, PolicyError, ProtocolError, UnknownPolicy, failure_for
from .outcomes import _RESULT_IS_RESPONSE, Classifier, Outcome, outcome_for_exception, outcome_for_result
from .types import (
    Analysis,
    BreakerState,
    CallInfo,
    DurableStep,
    Event,
    EventKind,
    LoadError,
    OutcomeKind,
    PolicyInfo,
    Reason,
    Verdict,
)

P = ParamSpec("P")
T = TypeVar("T")

_monotonic_ns = time.monotonic_ns

ATTEMPT, WAIT, DONE, RETRY, FALLBACK, FAIL, INVALID = range(7)
EVENTS_BIT = 0x10
_SLEEP = 7  # protocol action: sleep

#: The HTTP method codes of `start`'s flags (bits 8-11).
HTTP_METHODS = {
    "GET": 1, "HEAD": 2, "POST": 3, "PUT": 4, "DELETE": 5, "PATCH": 6, "OPTIONS": 7, "TRACE": 8, "CONNECT": 9,
}  # fmt: skip


def method_flags(method: str | None) -> int:
    """`start` flags bits 8-11 for an HTTP method (15 for any other method, 0 for none)."""
    if not method:
        return 0
    return HTTP_METHODS.get(method.upper(), 15) << 8


# ---------------------------------------------------------------------------- the component

_runtime_lock = threading.Lock()
_runtimes: dict[str, Runtime] = {}


def component_path() -> str:
    """Where the component is read from: `$LEVEE_COMPONENT` if set, else the copy in the wheel."""
    env = os.environ.get("LEVEE_COMPONENT")
    if env:
        return env
    return str(resources.files("levee").joinpath("_wasm", "levee_policy.wasm"))


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


# ---------------------------------------------------------------------------- attempt context

# The absolute monotonic deadline (ns) of the attempt in progress, set only when it has one.
_ATTEMPT_DEADLINE: contextvars.ContextVar[int] = contextvars.ContextVar("levee_attempt_deadline", default=0)


def attempt_timeout() -> float | None:
    """Seconds left for the attempt in progress, or `None` when it has no timeout (or no attempt
    is in progress). Synchronous code passes this to its I/O (the httpx transport does)."""
    d = _ATTEMPT_DEADLINE.get()
    if not d:
        return None
    return max(0.0, (d - _monotonic_ns()) / 1e9)


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

    def __str__(self) -> str:
        what = ""
        if self.outcome is not None:
            o = self.outcome
            what = f" outcome={o.kind.wit}" + (
                f":{o.code}" if o.kind in (OutcomeKind.HTTP_STATUS, OutcomeKind.GRPC_STATUS) else ""
            )
            if o.text:
                what += f" text={o.text!r}"
        return f"call={self.call} {self.op} attempt={self.attempt}{what} -> {self.verdict}"


@dataclass(frozen=True, slots=True)
class FallbackContext:
    """What a fallback function receives: the policy, the fallback's name, what triggered it,
    and the last attempt's error or result, plus the original arguments when known."""

    policy: str
    fallback: str
    reason: Reason
    error: BaseException | None
    result: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


class _Fault(Exception):
    """Internal: the engine faulted (trap) during this call's crossing; it has been recovered."""


class _PolicySlot:
    __slots__ = ("index", "info")

    def __init__(self, index: int, info: PolicyInfo) -> None:
        self.index = index
        self.info = info


# ---------------------------------------------------------------------------- the engine


class Engine:
    """A loaded policy document and its live state (breakers, budgets, buckets).

    One engine is meant to be shared: every thread and every asyncio task may use it at once
    (crossings into the component are serialised by a lock; each takes a few microseconds).
    """

    def __init__(
        self,
        document: str,
        *,
        seed: int | None = None,
        component: str | os.PathLike[str] | None = None,
        snapshot_interval: float = 1.0,
    ) -> None:
        """Load `document` (YAML or JSON text). `seed` fixes the jitter PRNG (default: from
        `os.urandom`). Raises `PolicyError` naming every invalid field."""
        self._document = document
        self._seed = int.from_bytes(os.urandom(8), "little") if seed is None else seed & 0xFFFFFFFFFFFFFFFF
        self._runtime = _runtime(os.fspath(component) if component is not None else None)
        self._lock = threading.Lock()
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
        self._tracer: Callable[[TraceStep], None] | None = None
        self._slots: dict[str, _PolicySlot] = {}
        self._names: list[str] = []
        self._refresh_policies()
        self._closed = False
        #: how many times the component trapped and was re-instantiated
        self.faults = 0

    @classmethod
    def from_file(cls, path: str | os.PathLike[str], **kwargs: Any) -> Engine:
        """Load a policy document from a file (YAML or JSON)."""
        return cls(Path(path).read_text(encoding="utf-8"), **kwargs)

    @classmethod
    def from_string(cls, document: str, **kwargs: Any) -> Engine:
        """Load a policy document from its text."""
        return cls(document, **kwargs)

    # -------------------------------------------------------------- internals

    def _make_core(self) -> Core:
        try:
            return Core(self._runtime, self._document, self._seed)
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
                slot.index, slot.info = i, info
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
        """Take the snapshot a recovery restores (held-back successes are sent first)."""
        if self._snapshots_stopped:
            return
        self._flush_locked(out)
        try:
            self._snapshot = self._core.export_state()
        except ComponentFault as e:
            if "too much data" in str(e):
                # wasmtime-py cannot lift a state this large (docs/architecture.md, "Bounds on
                # the guest"): every later export would fault the same way. Stop snapshots
                # rather than fault every second; a trap restores the last one taken.
                self._snapshots_stopped = True
                logger.error(
                    "levee: the engine state is too large for wasmtime-py to export (%s); snapshots "
                    "stop, and a trap will restore the state of the last one",
                    e,
                )
            raise
        if self._snapshot_every:
            self._snapshot_due = _monotonic_ns() + self._snapshot_every

    def _flush_locked(self, out: list[Event], keep: int = 0) -> None:
        """Report held-back successes (they must precede any other operation), leaving `keep`."""
        pending = self._pending
        gen = self._generation
        while len(pending) > keep:
            call, at, elapsed, g = pending.popleft()
            if g == gen:
                v = self._core.report(call, at, elapsed, OutcomeKind.SUCCESS, 0, "", 0, 0)
                self._events_locked(v, out)

    def _recover_locked(self, err: BaseException, out: list[Event]) -> None:
        """Replace a trapped instance: re-instantiate, reload, restore the last snapshot."""
        self.faults += 1
        self._generation += 1
        self._pending.clear()
        old = self._core
        try:
            old.close()
        except Exception:
            pass
        restored = ""
        try:
            core = Core(self._runtime, self._document, self._seed)
            if self._snapshot is not None:
                bad = core.import_state(self._snapshot)
                restored = "; state restored" if bad is None else f"; state not restored ({bad})"
            self._core = core
        except Exception as e2:
            restored = f"; re-instantiation failed: {e2}"
        out.append(
            Event(
                at=_monotonic_ns(), kind=EventKind.ENGINE_FAULT, policy="", policy_index=-1, key="", call=0,
                attempt=0, reason=Reason.NONE, duration=0, state_from=BreakerState.CLOSED,
                state_to=BreakerState.CLOSED, name=f"{err}{restored}", value=self.faults,
            )
        )  # fmt: skip

    def _maybe_snapshot_locked(self, now: int, out: list[Event]) -> None:
        if self._snapshot_every and now >= self._snapshot_due:
            self._snapshot_locked(out)

    def _emit(self, events: list[Event]) -> None:
        if events:
            dispatch(events, self._listeners)

    def _trace(self, op: str, st: _Call, outcome: Outcome | None, v: int) -> None:
        tracer = self._tracer
        if tracer is not None:
            tracer(TraceStep(op, st.call, st.slot.info.name, st.attempts, outcome, Verdict.unpack(v)))

    def _start(self, slot: _PolicySlot, key: str, flags: int) -> tuple[int, int, int]:
        """`start` a call, settling the held-back success. Returns (call, generation, verdict);
        the verdict is -1 when the engine faulted (the call then runs unguarded, once)."""
        events: list[Event] = []
        with self._lock:
            call = self._next_call
            self._next_call = call + 1
            core = self._core
            try:
                if self._closed:
                    raise LeveeError("the engine is closed")
                if core.dead:
                    self._recover_locked(ComponentFault("the previous recovery failed"), events)
                    core = self._core
                    if core.dead:
                        raise ComponentFault("the component is unavailable")
                if slot.index < 0:
                    raise UnknownPolicy(next(n for n, s in self._slots.items() if s is slot))
                pending = self._pending
                sc = sa = se = 0
                if pending:
                    if len(pending) > 1:
                        self._flush_locked(events, keep=1)
                    sc, sa, se, sg = pending.popleft()
                    if sg != self._generation:
                        sc = sa = se = 0
                v = core.start(call, slot.index, key, flags, _monotonic_ns(), sc, sa, se)
                if v & EVENTS_BIT:
                    self._events_locked(v, events)
            except ComponentFault as e:
                if not core.dead:
                    raise
                self._recover_locked(e, events)
                v = -1
            gen = self._generation
        if events:
            dispatch(events, self._listeners)
        return call, gen, v

    def _cross(self, gen: int, fn: Callable[[Core], int]) -> int:
        """A hot crossing for a call of generation `gen`. Raises `_Fault` after a trap (or when
        the call's instance was replaced since it started)."""
        events: list[Event] = []
        try:
            with self._lock:
                if gen != self._generation:
                    raise _Fault()
                core = self._core
                try:
                    self._flush_locked(events)
                    v = fn(core)
                    self._events_locked(v, events)
                except ComponentFault as e:
                    if not core.dead:
                        raise
                    self._recover_locked(e, events)
                    raise _Fault() from e
                return v
        finally:
            if events:
                dispatch(events, self._listeners)

    def _maybe_snapshot(self) -> None:
        now = _monotonic_ns()
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
            dispatch(events, self._listeners)

    def _locked_op(self, fn: Callable[[Core], T], snapshot_if: Callable[[T], bool] | None = None) -> T:
        """Any other operation: flush the held-back success first, recover on a trap. When
        `snapshot_if(result)` holds, the state it left is snapshotted under the same lock."""
        events: list[Event] = []
        try:
            with self._lock:
                core = self._core
                if self._closed:
                    raise LeveeError("the engine is closed")
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
                    raise LeveeError(f"the Levee engine faulted and was re-instantiated: {e}") from e
        finally:
            if events:
                dispatch(events, self._listeners)

    # -------------------------------------------------------------- public API

    def policy(
        self,
        name: str,
        *,
        key: str | Callable[..., str] = "",
        idempotent: bool = True,
        idempotency_key: bool = False,
        method: str | None = None,
        classify: Classifier | None = None,
    ) -> Policy:
        """A handle on the named policy: a decorator, `call`/`acall`, and `attempts()`.

        `key` selects the breaker/limiter state (a string, or a function of the decorated
        call's arguments). `idempotent=False` marks the operation non-idempotent unless
        `idempotency_key=True`; `method` is the HTTP method (the core may classify by it).
        `classify` maps a result or exception to an `Outcome` (return `None` for the default).
        """
        slot = self._slots.get(name)
        if slot is None or slot.index < 0:
            raise UnknownPolicy(name, self._names)
        flags = (0 if idempotent else 1) | (2 if idempotency_key else 0) | method_flags(method)
        return Policy(self, slot, key, flags, classify)

    @property
    def policies(self) -> list[str]:
        """The names of the document's policies, in order."""
        return list(self._names)

    def policy_info(self, name: str) -> PolicyInfo:
        slot = self._slots.get(name)
        if slot is None or slot.index < 0:
            raise UnknownPolicy(name, self._names)
        return slot.info

    def policy_json(self, name: str) -> str:
        """The policy with every default filled in, as JSON."""
        idx = self._index(name)
        out = self._locked_op(lambda c: c.policy_json(idx))
        if out is None:
            raise UnknownPolicy(name, self._names)
        return out

    def analyze(self, name: str, layers: int = 1) -> Analysis:
        """Worst cases of a policy when `layers` layers run it."""
        idx = self._index(name)
        out = self._locked_op(lambda c: c.analyze(idx, layers))
        if out is None:
            raise UnknownPolicy(name, self._names)
        return out

    def _index(self, name: str) -> int:
        slot = self._slots.get(name)
        if slot is None or slot.index < 0:
            raise UnknownPolicy(name, self._names)
        return slot.index

    def reload(self, document: str) -> None:
        """Replace the policies, keeping the state that still applies. On error (a
        `PolicyError`) the engine is left as it was."""

        def op(c: Core) -> list[LoadError] | None:
            errors = c.reload(document)
            if errors is None:
                # under the same lock hold: no call may start with a stale policy index
                self._document = document
                self._refresh_policies()
            return errors

        errors = self._locked_op(op, snapshot_if=lambda r: r is None)
        if errors is not None:
            raise PolicyError(errors)

    def breaker_state(self, name: str, key: str = "") -> BreakerState | None:
        """The breaker state of a policy and key now (`None` when the policy has no breaker)."""
        idx = self._index(name)
        return self._locked_op(lambda c: c.breaker_state(idx, key, _monotonic_ns()))

    def set_breaker_state(self, name: str, state: BreakerState, key: str = "") -> None:
        """Force a breaker state (an operator's switch); `CLOSED` returns to normal operation."""
        idx = self._index(name)
        err = self._locked_op(
            lambda c: c.set_breaker_state(idx, key, state, _monotonic_ns()), snapshot_if=lambda r: r is None
        )
        if err is not None:
            raise LeveeError(err)
        self._emit(self._drain_now())

    def _drain_now(self) -> list[Event]:
        return self._locked_op(lambda c: [event_from_raw(r, self._names) for r in c.drain_events()])

    def call_info(self, call: int) -> CallInfo | None:
        return self._locked_op(lambda c: c.call_info(call))

    def export_state(self) -> bytes:
        """The whole engine state as versioned bytes (breakers, budgets, buckets)."""
        return self._locked_op(lambda c: c.export_state())

    def import_state(self, state: bytes) -> None:
        """Restore exported state; what no longer applies is dropped. On error nothing changes."""
        err = self._locked_op(lambda c: c.import_state(bytes(state)), snapshot_if=lambda r: r is None)
        if err is not None:
            raise PolicyError([err])

    # ------------------------------------------------------------ durable calls
    # Thin: the core decides; an error names what is wrong with the record (`LoadError`).

    def durable_begin(
        self, policy: str, key: str, idempotency_key: str, flags: int, wall_now: int
    ) -> DurableStep | LoadError:
        idx = self._index(policy)
        return self._locked_op(lambda c: c.durable_begin(idx, key, idempotency_key, flags, wall_now))

    def durable_step(self, record: bytes, owner: str, wall_now: int, elapsed: int) -> DurableStep | LoadError:
        return self._locked_op(lambda c: c.durable_step(record, owner, wall_now, elapsed))

    def durable_renew(self, record: bytes, owner: str, wall_now: int, elapsed: int) -> DurableStep | LoadError:
        return self._locked_op(lambda c: c.durable_renew(record, owner, wall_now, elapsed))

    def durable_outcome(
        self, record: bytes, owner: str, wall_now: int, elapsed: int, outcome: Outcome, message: str
    ) -> DurableStep | LoadError:
        flags = 1 if outcome.overloaded else 0
        return self._locked_op(
            lambda c: c.durable_outcome(
                record, owner, wall_now, elapsed, outcome.kind, outcome.code, outcome.text, message, flags
            )
        )

    def durable_cancel(self, record: bytes, wall_now: int) -> DurableStep | LoadError:
        return self._locked_op(lambda c: c.durable_cancel(record, wall_now))

    def durable_revive(self, record: bytes, wall_now: int) -> DurableStep | LoadError:
        return self._locked_op(lambda c: c.durable_revive(record, wall_now))

    def durable_inspect(self, record: bytes) -> str | LoadError:
        return self._locked_op(lambda c: c.durable_inspect(record))

    def flush(self) -> None:
        """Send a held-back success report now (normally settled by the next call)."""
        self._locked_op(lambda c: None)

    def add_listener(self, listener: Listener) -> None:
        """Call `listener(event)` for every event (after the engine's lock is released)."""
        self._listeners.append(listener)

    def remove_listener(self, listener: Listener) -> None:
        self._listeners.remove(listener)

    def register_fallback(self, name: str, fn: Callable[[FallbackContext], Any]) -> None:
        """Register the function run when the policy's fallback chain names `name`. It gets a
        `FallbackContext` and returns the call's value (an `async def` for async calls)."""
        self._fallbacks[name] = fn

    def fallback(self, name: str) -> Callable[[Callable[[FallbackContext], T]], Callable[[FallbackContext], T]]:
        """Decorator form of `register_fallback`."""

        def deco(fn: Callable[[FallbackContext], T]) -> Callable[[FallbackContext], T]:
            self.register_fallback(name, fn)
            return fn

        return deco

    @property
    def trace(self) -> Callable[[TraceStep], None] | None:
        return self._tracer

    @trace.setter
    def trace(self, tracer: Callable[[TraceStep], None] | None) -> None:
        """Call `tracer(step)` at every step (slower: no success is held back while set)."""
        self._tracer = tracer

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Flush and drop the component instance; the engine cannot be used afterwards."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            try:
                events: list[Event] = []
                self._flush_locked(events)
            except ComponentFault:
                pass
            self._core.close()


def load(path: str | os.PathLike[str], **kwargs: Any) -> Engine:
    """Load the policy document in the file at `path` (YAML or JSON) into a new `Engine`.
    A missing file raises `FileNotFoundError` naming the path. To load a document's text, use
    `loads`: the two are never guessed from the argument."""
    try:
        return Engine.from_file(path, **kwargs)
    except FileNotFoundError as e:
        text = os.fspath(path)
        if isinstance(text, str) and ("\n" in text or ":" in text.split("/")[-1]):
            raise FileNotFoundError(
                e.errno, f"{e.strerror}; this looks like a policy document, not a path: use levee.loads(text)", text
            ) from None
        raise


def loads(document: str, **kwargs: Any) -> Engine:
    """Load a policy document from its text (YAML or JSON) into a new `Engine` (`load` reads a
    file)."""
    return Engine.from_string(document, **kwargs)


def _path_hint(document: str) -> list[LoadError]:
    """When a refused document is one line with no `:` and no `{` (no policy document is),
    it is most likely a file name given as text: say so, and whether such a file exists."""
    text = document.strip()
    if not text or "\n" in text or ":" in text or "{" in text or len(text) > 4096:
        return []
    if os.path.exists(text):
        return [LoadError("", f"the document is the text {text!r}, the name of a file: load it with levee.load(path)")]
    return [LoadError("", f"the document is the text {text!r}, which looks like a file name, and no such file exists")]


# ---------------------------------------------------------------------------- one call


class _AttemptResult:
    __slots__ = ("end", "exc", "outcome", "start", "value")

    def __init__(self, outcome: Outcome, value: Any, exc: BaseException | None, start: int, end: int) -> None:
        self.outcome = outcome
        self.value = value
        self.exc = exc
        self.start = start
        self.end = end


class _Call:
    """The host side of one call: what the protocol needs to remember."""

    __slots__ = (
        "args",
        "attempts",
        "call",
        "classify",
        "deadline_at",
        "engine",
        "fallback_value",
        "fell_back",
        "finished",
        "gen",
        "kwargs",
        "last",
        "slot",
        "started",
        "unregistered",
    )  # fmt: skip

    def __init__(self, engine: Engine, slot: _PolicySlot, call: int, gen: int, started: int,
                 classify: Classifier | None, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:  # fmt: skip
        self.engine = engine
        self.slot = slot
        self.call = call
        self.gen = gen
        self.attempts = 0
        self.classify = classify
        self.args = args
        self.kwargs = kwargs
        self.started = started
        d = slot.info.deadline
        self.deadline_at = started + d if d else 0
        self.last: _AttemptResult | None = None
        self.fallback_value: Any = None
        self.fell_back = False
        self.finished = False
        self.unregistered: tuple[str, ...] = ()

    def outcome_of(self, value: Any, exc: BaseException | None, start: int, end: int, timeout: int) -> _AttemptResult:
        if timeout and end - start > timeout:
            return _AttemptResult(Outcome.timeout(), value, exc, start, end)
        classify = self.classify
        subject = exc if exc is not None else value
        outcome = classify(subject) if classify is not None else None
        if outcome is None:
            if exc is not None:
                outcome = outcome_for_exception(exc)
            else:
                outcome = outcome_for_result(value) or Outcome.success()
        return _AttemptResult(outcome, value, exc, start, end)

    def failure(self, reason: Reason, hint_ns: int) -> BaseException:
        last = self.last
        return failure_for(
            reason,
            policy=self.slot.info.name,
            attempts=self.attempts,
            last_error=last.exc if last is not None else None,
            last_result=last.value if last is not None and last.exc is None else None,
            retry_after=hint_ns / 1e9 if hint_ns else None,
            unregistered=self.unregistered,
        )

    def cancel(self) -> None:
        """Abandon the call in the engine (the caller was cancelled)."""
        if self.finished:
            return
        self.finished = True
        call = self.call

        def op(c: Core) -> int:
            c.cancel(call, _monotonic_ns())
            return 0

        try:
            self.engine._cross(self.gen, op)
        except _Fault:
            pass

    def report(self, res: _AttemptResult) -> int:
        eng = self.engine
        o = res.outcome
        wall = int(time.time()) if o.kind is OutcomeKind.HTTP_STATUS and o.text else 0
        flags = 1 if o.overloaded else 0
        call = self.call
        v = eng._cross(
            self.gen, lambda c: c.report(call, res.end, res.end - res.start, o.kind, o.code, o.text, wall, flags)
        )
        if eng._tracer is not None:
            eng._trace("report", self, o, v)
        return v

    def acquire(self) -> int:
        call = self.call
        v = self.engine._cross(self.gen, lambda c: c.acquire(call, _monotonic_ns()))
        if self.engine._tracer is not None:
            self.engine._trace("acquire", self, None, v)
        return v

    def report_fallback(self, ok: bool) -> int:
        call = self.call
        v = self.engine._cross(self.gen, lambda c: c.report_fallback(call, _monotonic_ns(), ok))
        if self.engine._tracer is not None:
            self.engine._trace("report-fallback", self, None, v)
        return v

    def degraded_value(self) -> Any:
        """After an engine fault: the last attempt's outcome stands, without retries."""
        last = self.last
        assert last is not None
        if last.exc is not None:
            raise last.exc
        return last.value


# A protocol action: (ATTEMPT, number, timeout_ns) | (_SLEEP, ns, 0) | (FALLBACK, name, reason)
Action = tuple[int, Any, Any]


def _protocol(st: _Call, v: int) -> Generator[Action, Any, Any]:
    """The step protocol as a generator of I/O actions, shared by every executor (sync, asyncio,
    iterators, the httpx transport). It only relays the core's verdicts, clamped."""
    info = st.slot.info
    if v >= 0 and st.engine._tracer is not None:
        st.engine._trace("start", st, None, v)
    if v < 0:
        # the engine faulted at `start`: one unguarded attempt
        st.last = yield (ATTEMPT, 1, 0)
        st.finished = True
        return st.degraded_value()
    try:
        while True:
            kind = v & 0xF
            if kind == ATTEMPT:
                st.attempts += 1
                if st.attempts > info.max_attempts:
                    # never past the policy's maximum, whatever the guest says
                    st.cancel()
                    raise st.failure(Reason.RETRIES_EXHAUSTED, 0)
                timeout = v >> 16
                if st.deadline_at:
                    left = max(1, st.deadline_at - _monotonic_ns())
                    timeout = left if timeout == 0 else min(timeout, left)
                res: _AttemptResult = yield (ATTEMPT, st.attempts, timeout)
                st.last = res
                try:
                    v = st.report(res)
                except _Fault:
                    st.finished = True
                    return st.degraded_value()
            elif kind == RETRY or kind == WAIT:
                delay = v >> 16
                if st.deadline_at:
                    delay = min(delay, max(0, st.deadline_at - _monotonic_ns()))
                if delay:
                    yield (_SLEEP, delay, 0)
                try:
                    v = st.acquire()
                except _Fault:
                    st.finished = True
                    if st.last is None:
                        st.last = yield (ATTEMPT, st.attempts + 1, 0)
                    return st.degraded_value()
            elif kind == FALLBACK:
                idx = v >> 16
                name = info.fallbacks[idx] if idx < len(info.fallbacks) else f"#{idx}"
                ok, value = yield (FALLBACK, name, Reason.from_code((v >> 8) & 0xFF))
                if ok:
                    st.fell_back = True
                    st.fallback_value = value
                try:
                    v = st.report_fallback(ok)
                except _Fault:
                    st.finished = True
                    if ok:
                        return value
                    return st.degraded_value()
            elif kind == DONE:
                st.finished = True
                st.engine._maybe_snapshot()
                if st.fell_back:
                    return st.fallback_value
                last = st.last
                if last is not None and last.exc is not None:
                    raise last.exc
                return last.value if last is not None else None
            elif kind == FAIL:
                st.finished = True
                st.engine._maybe_snapshot()
                raise st.failure(Reason.from_code((v >> 8) & 0xFF), v >> 16)
            else:
                # `invalid` (say, the call was evicted from the engine's bounded call table) or a
                # kind no contract knows: an untrusted answer. The call goes on without the policy:
                # the attempt that ran stands, or one attempt runs.
                st.finished = True
                logger.warning(
                    "levee: the engine answered %s for call %d of policy %r; the call proceeds unguarded",
                    Verdict.unpack(v),
                    st.call,
                    info.name,
                )
                if st.last is None:
                    st.last = yield (ATTEMPT, st.attempts + 1, 0)
                return st.degraded_value()
    except GeneratorExit:
        st.cancel()
        raise


def _fallback_context(st: _Call, name: str, reason: Reason) -> FallbackContext:
    last = st.last
    return FallbackContext(
        policy=st.slot.info.name,
        fallback=name,
        reason=reason,
        error=last.exc if last is not None else None,
        result=last.value if last is not None and last.exc is None else None,
        args=st.args,
        kwargs=st.kwargs,
    )


def _unregistered(st: _Call, name: str) -> tuple[bool, Any]:
    """A fallback the chain names but nobody registered: it fails, and the error says why."""
    if name not in st.unregistered:
        st.unregistered = (*st.unregistered, name)
    logger.warning("levee: fallback %r of policy %r is not registered", name, st.slot.info.name)
    return False, None


def _run_fallback_sync(st: _Call, name: str, reason: Reason) -> tuple[bool, Any]:
    fn = st.engine._fallbacks.get(name)
    if fn is None:
        return _unregistered(st, name)
    try:
        value = fn(_fallback_context(st, name, reason))
    except Exception:
        logger.warning("levee: fallback %r failed", name, exc_info=True)
        return False, None
    if inspect.isawaitable(value):
        if inspect.iscoroutine(value):
            value.close()
        logger.warning("levee: fallback %r is async but the call is synchronous", name)
        return False, None
    return True, value


async def _run_fallback_async(st: _Call, name: str, reason: Reason) -> tuple[bool, Any]:
    fn = st.engine._fallbacks.get(name)
    if fn is None:
        return _unregistered(st, name)
    try:
        value = fn(_fallback_context(st, name, reason))
        if inspect.isawaitable(value):
            value = await value
    except Exception:
        logger.warning("levee: fallback %r failed", name, exc_info=True)
        return False, None
    return True, value


def _attempt_sync(st: _Call, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
                  timeout: int) -> _AttemptResult:  # fmt: skip
    start = _monotonic_ns()
    token = _ATTEMPT_DEADLINE.set(start + timeout) if timeout else None
    try:
        value = fn(*args, **kwargs)
        exc: BaseException | None = None
    except Exception as e:
        value, exc = None, e
    finally:
        if token is not None:
            _ATTEMPT_DEADLINE.reset(token)
    return st.outcome_of(value, exc, start, _monotonic_ns(), timeout)


async def _attempt_async(st: _Call, fn: Callable[..., Awaitable[Any]], args: tuple[Any, ...],
                         kwargs: dict[str, Any], timeout: int) -> _AttemptResult:  # fmt: skip
    start = _monotonic_ns()
    exc: BaseException | None = None
    value: Any = None
    if timeout:
        token = _ATTEMPT_DEADLINE.set(start + timeout)
        try:
            async with asyncio.timeout(timeout / 1e9) as cm:
                value = await fn(*args, **kwargs)
        except TimeoutError as e:
            exc = e
            if cm.expired():
                return _AttemptResult(Outcome.timeout(), None, e, start, _monotonic_ns())
        except Exception as e:
            exc = e
        finally:
            _ATTEMPT_DEADLINE.reset(token)
    else:
        try:
            value = await fn(*args, **kwargs)
        except Exception as e:
            exc = e
    return st.outcome_of(value, exc, start, _monotonic_ns(), timeout)


def _drive_sync(st: _Call, v: int, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
                first: _AttemptResult | None = None) -> Any:  # fmt: skip
    """Run the protocol from the verdict `v` of `start`, doing its I/O synchronously; `first` is
    the result of the first attempt when the hot path already ran it."""
    gen = _protocol(st, v)
    try:
        action = next(gen)
        if first is not None:
            action = gen.send(first)
        while True:
            op = action[0]
            if op == ATTEMPT:
                action = gen.send(_attempt_sync(st, fn, args, kwargs, action[2]))
            elif op == _SLEEP:
                time.sleep(action[1] / 1e9)
                action = gen.send(None)
            else:
                action = gen.send(_run_fallback_sync(st, action[1], action[2]))
    except StopIteration as stop:
        return stop.value
    except BaseException:
        gen.close()
        raise


async def _drive_async(st: _Call, v: int, fn: Callable[..., Awaitable[Any]], args: tuple[Any, ...],
                       kwargs: dict[str, Any], first: _AttemptResult | None = None) -> Any:  # fmt: skip
    """`_drive_sync` for coroutines: attempts are awaited and cancelled by their timeout."""
    gen = _protocol(st, v)
    try:
        action = next(gen)
        if first is not None:
            action = gen.send(first)
        while True:
            op = action[0]
            if op == ATTEMPT:
                action = gen.send(await _attempt_async(st, fn, args, kwargs, action[2]))
            elif op == _SLEEP:
                await asyncio.sleep(action[1] / 1e9)
                action = gen.send(None)
            else:
                action = gen.send(await _run_fallback_async(st, action[1], action[2]))
    except StopIteration as stop:
        return stop.value
    except BaseException:
        gen.close()
        raise


# ---------------------------------------------------------------------------- policies


class Policy:
    """A named policy of an engine, with per-use options. Use it as a decorator (sync or
    `async def`), with `call`/`acall`, or with `attempts()`/`attempts_async()`."""

    __slots__ = ("_classify", "_flags", "_key", "_key_fn", "_slot", "engine")

    def __init__(self, engine: Engine, slot: _PolicySlot, key: str | Callable[..., str], flags: int,
                 classify: Classifier | None) -> None:  # fmt: skip
        self.engine = engine
        self._slot = slot
        self._key_fn: Callable[..., str] | None = None
        self._key = ""
        if callable(key):
            self._key_fn = key
        else:
            self._key = key
        self._flags = flags
        self._classify = classify

    @property
    def name(self) -> str:
        return self._slot.info.name

    @property
    def info(self) -> PolicyInfo:
        return self._slot.info

    def _key_for(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
        fn = self._key_fn
        return self._key if fn is None else str(fn(*args, **kwargs))

    # -------------------------------------------------------------- sync

    def call(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
        """Run `fn(*args, **kwargs)` under the policy (synchronously)."""
        return self._run(fn, args, kwargs)

    def _run(self, fn: Callable[..., T], args: tuple[Any, ...], kwargs: dict[str, Any]) -> T:
        eng = self.engine
        slot = self._slot
        key = self._key if self._key_fn is None else self._key_for(args, kwargs)
        call, gen, v = eng._start(slot, key, self._flags)
        if v & 0x1F == 0 and eng._tracer is None:
            # The hot path: an attempt, no events pending. One crossing if it succeeds.
            timeout = v >> 16
            d = slot.info.deadline
            if d and (timeout == 0 or timeout > d):
                timeout = d  # never trust the guest past the policy's deadline
            start = _monotonic_ns()
            if timeout:
                token = _ATTEMPT_DEADLINE.set(start + timeout)
                try:
                    value = fn(*args, **kwargs)
                except Exception as e:
                    st = _Call(eng, slot, call, gen, start, self._classify, args, kwargs)
                    return cast(T, self._after_first(st, v, timeout, None, e, start, fn, args, kwargs))
                except BaseException:
                    _Call(eng, slot, call, gen, start, None, (), {}).cancel()
                    raise
                finally:
                    _ATTEMPT_DEADLINE.reset(token)
            else:
                try:
                    value = fn(*args, **kwargs)
                except Exception as e:
                    st = _Call(eng, slot, call, gen, start, self._classify, args, kwargs)
                    return cast(T, self._after_first(st, v, timeout, None, e, start, fn, args, kwargs))
                except BaseException:
                    _Call(eng, slot, call, gen, start, None, (), {}).cancel()
                    raise
            end = _monotonic_ns()
            if (
                (timeout == 0 or end - start <= timeout)
                and self._classify is None
                and (_RESULT_IS_RESPONSE.get(type(value)) is False or outcome_for_result(value) is None)
            ):
                eng._pending.append((call, end, end - start, gen))
                if end >= eng._snapshot_due:
                    eng._snapshot_tick(end)
                return value
            st = _Call(eng, slot, call, gen, start, self._classify, args, kwargs)
            return cast(T, self._after_first(st, v, timeout, value, None, start, fn, args, kwargs))
        st = _Call(eng, slot, call, gen, _monotonic_ns(), self._classify, args, kwargs)
        return cast(T, _drive_sync(st, v, fn, args, kwargs))

    def _after_first(self, st: _Call, v: int, timeout: int, value: Any, exc: BaseException | None, start: int,
                     fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:  # fmt: skip
        """Continue the protocol after a first attempt that ran on the hot path."""
        return _drive_sync(st, v, fn, args, kwargs, st.outcome_of(value, exc, start, _monotonic_ns(), timeout))

    # -------------------------------------------------------------- async

    async def acall(self, fn: Callable[P, Awaitable[T]], /, *args: P.args, **kwargs: P.kwargs) -> T:
        """Await `fn(*args, **kwargs)` under the policy; per-attempt timeouts cancel the attempt."""
        eng = self.engine
        slot = self._slot
        key = self._key if self._key_fn is None else self._key_for(args, kwargs)
        call, gen, v = eng._start(slot, key, self._flags)
        if v & 0x1F == 0 and eng._tracer is None:
            # The hot path, as in `call`; the attempt's timeout cancels it.
            timeout = v >> 16
            d = slot.info.deadline
            if d and (timeout == 0 or timeout > d):
                timeout = d  # never trust the guest past the policy's deadline
            start = _monotonic_ns()
            try:
                if timeout:
                    token = _ATTEMPT_DEADLINE.set(start + timeout)
                    try:
                        async with asyncio.timeout(timeout / 1e9):
                            value = await fn(*args, **kwargs)
                    finally:
                        _ATTEMPT_DEADLINE.reset(token)
                else:
                    value = await fn(*args, **kwargs)
            except Exception as e:
                st = _Call(eng, slot, call, gen, start, self._classify, args, kwargs)
                return cast(T, await self._after_first_async(st, v, timeout, None, e, start, fn, args, kwargs))
            except BaseException:
                _Call(eng, slot, call, gen, start, None, (), {}).cancel()
                raise
            end = _monotonic_ns()
            if self._classify is None and outcome_for_result(value) is None:
                eng._pending.append((call, end, end - start, gen))
                if end >= eng._snapshot_due:
                    eng._snapshot_tick(end)
                return value
            st = _Call(eng, slot, call, gen, start, self._classify, args, kwargs)
            return cast(T, await self._after_first_async(st, v, timeout, value, None, start, fn, args, kwargs))
        st = _Call(eng, slot, call, gen, _monotonic_ns(), self._classify, args, kwargs)
        return cast(T, await _drive_async(st, v, fn, args, kwargs))

    async def _after_first_async(self, st: _Call, v: int, timeout: int, value: Any, exc: BaseException | None,
                                 start: int, fn: Callable[..., Awaitable[Any]], args: tuple[Any, ...],
                                 kwargs: dict[str, Any]) -> Any:  # fmt: skip
        res = st.outcome_of(value, exc, start, _monotonic_ns(), timeout)
        return await _drive_async(st, v, fn, args, kwargs, res)

    # -------------------------------------------------------------- decorator

    def __call__(self, fn: Callable[P, T]) -> Callable[P, T]:
        """Decorate a function (or an `async def`) so every call runs under the policy."""
        if inspect.iscoroutinefunction(fn):
            afn = cast(Callable[P, Awaitable[Any]], fn)
            acall = self.acall

            @functools.wraps(fn)
            async def async_wrapper(*args: P.args, **kwargs: P.kwargs) -> Any:
                return await acall(afn, *args, **kwargs)

            return cast(Callable[P, T], async_wrapper)

        run = self._run

        @functools.wraps(fn)
        def wrapper(*args: P.args, **kwargs: P.kwargs) -> T:
            return run(fn, args, kwargs)

        return wrapper

    # -------------------------------------------------------------- iterators

    def attempts(self) -> Attempts:
        """`for attempt in policy.attempts(): with attempt: ...` (see `Attempts`)."""
        return Attempts(self)

    def attempts_async(self) -> AsyncAttempts:
        """`async for attempt in policy.attempts_async(): async with attempt: ...`."""
        return AsyncAttempts(self)


class Attempt:
    """One attempt of an `attempts()` loop. Use `with attempt:` (sync) or `async with attempt:`
    (asyncio: the per-attempt timeout cancels the block). An exception in the block is
    reported and swallowed when the policy retries; set `attempt.result` to the block's value
    (an HTTP response is classified by its status)."""

    __slots__ = ("_cm", "_res", "_st", "_start", "_token", "number", "result", "timeout")

    def __init__(self, st: _Call, number: int, timeout: int) -> None:
        self.number = number
        #: seconds allowed for this attempt, or None
        self.timeout: float | None = timeout / 1e9 if timeout else None
        self.result: Any = None
        self._st = st
        self._start = 0
        self._res: _AttemptResult | None = None
        self._token: contextvars.Token[int] | None = None
        self._cm: Any = None

    def __enter__(self) -> Attempt:
        self._start = _monotonic_ns()
        if self.timeout is not None:
            self._token = _ATTEMPT_DEADLINE.set(self._start + int(self.timeout * 1e9))
        return self

    def __exit__(self, et: type[BaseException] | None, exc: BaseException | None, tb: Any) -> bool:
        if self._token is not None:
            _ATTEMPT_DEADLINE.reset(self._token)
            self._token = None
        if exc is not None and not isinstance(exc, Exception):
            return False
        t = int(self.timeout * 1e9) if self.timeout is not None else 0
        self._res = self._st.outcome_of(self.result, exc, self._start, _monotonic_ns(), t)
        return True

    async def __aenter__(self) -> Attempt:
        self.__enter__()
        if self.timeout is not None:
            self._cm = asyncio.timeout(self.timeout)
            await self._cm.__aenter__()
        return self

    async def __aexit__(self, et: type[BaseException] | None, exc: BaseException | None, tb: Any) -> bool:
        if self._cm is not None:
            cm, self._cm = self._cm, None
            try:
                await cm.__aexit__(et, exc, tb)
            except TimeoutError as e:
                if self._token is not None:
                    _ATTEMPT_DEADLINE.reset(self._token)
                    self._token = None
                self._res = _AttemptResult(Outcome.timeout(), None, e, self._start, _monotonic_ns())
                return True
        return self.__exit__(et, exc, tb)

    def _outcome(self) -> _AttemptResult:
        if self._res is None:  # the block was not entered: its `result` is the outcome
            now = _monotonic_ns()
            return self._st.outcome_of(self.result, None, now, now, 0)
        return self._res


class Attempts:
    """Iterate attempts of one call: `for attempt in policy.attempts(): with attempt: ...`.
    After the loop, `result` holds the successful attempt's `result` or the fallback's value.
    When the core gives up the loop raises a `CallFailed` subclass."""

    def __init__(self, policy: Policy) -> None:
        self._policy = policy
        self.result: Any = None

    def __iter__(self) -> Generator[Attempt, None, None]:
        pol = self._policy
        eng = pol.engine
        call, gen_no, v = eng._start(pol._slot, pol._key_for((), {}), pol._flags)
        st = _Call(eng, pol._slot, call, gen_no, _monotonic_ns(), pol._classify, (), {})
        proto = _protocol(st, v)
        try:
            action = next(proto)
            while True:
                op = action[0]
                if op == ATTEMPT:
                    attempt = Attempt(st, action[1], action[2])
                    yield attempt
                    action = proto.send(attempt._outcome())
                elif op == _SLEEP:
                    time.sleep(action[1] / 1e9)
                    action = proto.send(None)
                else:
                    action = proto.send(_run_fallback_sync(st, action[1], action[2]))
        except StopIteration as stop:
            self.result = stop.value
        finally:
            proto.close()


class AsyncAttempts:
    """`async for attempt in policy.attempts_async(): async with attempt: ...`."""

    def __init__(self, policy: Policy) -> None:
        self._policy = policy
        self.result: Any = None

    def __aiter__(self) -> AsyncGenerator[Attempt, None]:
        return self._iterate()

    async def _iterate(self) -> AsyncGenerator[Attempt, None]:
        pol = self._policy
        eng = pol.engine
        call, gen_no, v = eng._start(pol._slot, pol._key_for((), {}), pol._flags)
        st = _Call(eng, pol._slot, call, gen_no, _monotonic_ns(), pol._classify, (), {})
        proto = _protocol(st, v)
        try:
            action = next(proto)
            while True:
                op = action[0]
                if op == ATTEMPT:
                    attempt = Attempt(st, action[1], action[2])
                    yield attempt
                    action = proto.send(attempt._outcome())
                elif op == _SLEEP:
                    await asyncio.sleep(action[1] / 1e9)
                    action = proto.send(None)
                else:
                    action = proto.send(await _run_fallback_async(st, action[1], action[2]))
        except StopIteration as stop:
            self.result = stop.value
        finally:
            proto.close()


# ---------------------------------------------------------------------------- call()


def call(policy: Policy, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
    """Run `fn(*args, **kwargs)` under `policy`; for an `async def`, return an awaitable (of the
    same type as `fn`'s coroutine)."""
    if inspect.iscoroutinefunction(fn):
        return cast(T, policy.acall(cast(Callable[P, Awaitable[Any]], fn), *args, **kwargs))
    return policy.call(fn, *args, **kwargs)

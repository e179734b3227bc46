"""Events to `logging` (logger ``levee``), to user listeners, and to the engine's telemetry sink
(`levee.telemetry`: the events and the metrics they drive)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from .telemetry import TelemetrySink, emit_event
from .types import BreakerState, Event, EventKind

logger = logging.getLogger("levee")
logger.addHandler(logging.NullHandler())  # a library leaves output to the application's logging setup

Listener = Callable[[Event], None]

_LEVELS = {
    EventKind.RETRY_SCHEDULED: logging.DEBUG,
    EventKind.RATE_LIMIT_WAIT: logging.DEBUG,
    EventKind.KEY_EVICTED: logging.DEBUG,
    EventKind.CALL_EVICTED: logging.DEBUG,
    EventKind.PERMIT_EXPIRED: logging.DEBUG,
    EventKind.HEDGE_STARTED: logging.DEBUG,
    EventKind.GAVE_UP: logging.INFO,
    EventKind.REJECTED: logging.INFO,
    EventKind.BUDGET_REFUSED: logging.INFO,
    EventKind.FALLBACK_CHOSEN: logging.INFO,
    EventKind.BREAKER_TRANSITION: logging.INFO,
    EventKind.KEY_OVERFLOW: logging.INFO,  # one per call while the table overflows: the metric counts them
    EventKind.ENGINE_FAULT: logging.ERROR,
}


def describe(ev: Event) -> str:
    """One line for a log record."""
    where = f"policy={ev.policy}" + (f" key={ev.key}" if ev.key else "") + (f" call={ev.call}" if ev.call else "")
    k = ev.kind
    if k is EventKind.RETRY_SCHEDULED:
        return f"retry scheduled in {ev.duration / 1e6:.3f} ms after attempt {ev.attempt} ({where})"
    if k is EventKind.GAVE_UP:
        return f"gave up after attempt {ev.attempt}: {ev.reason.wit} ({where})"
    if k is EventKind.REJECTED:
        return f"attempt rejected: {ev.reason.wit}, retry after {ev.duration / 1e6:.3f} ms ({where})"
    if k is EventKind.BUDGET_REFUSED:
        return f"retry budget refused a retry, level {ev.value} ({where})"
    if k is EventKind.BREAKER_TRANSITION:
        return f"circuit breaker {ev.state_from.wit} -> {ev.state_to.wit} ({where})"
    if k is EventKind.FALLBACK_CHOSEN:
        return f"fallback {ev.name!r} chosen: {ev.reason.wit} ({where})"
    if k is EventKind.RATE_LIMIT_WAIT:
        return f"rate limiter asks to wait {ev.duration / 1e6:.3f} ms ({where})"
    if k is EventKind.KEY_EVICTED:
        return f"state of key {ev.name!r} evicted ({where})"
    if k is EventKind.CALL_EVICTED:
        return f"unfinished call evicted ({where})"
    if k is EventKind.PERMIT_EXPIRED:
        return f"half-open permit expired unreported ({where})"
    if k is EventKind.HEDGE_STARTED:
        return f"hedge attempt {ev.attempt} started ({where})"
    if k is EventKind.KEY_OVERFLOW:
        return (f"every key holds protection: key {ev.name!r} is decided against the shared entry "
                f"{ev.key!r} ({where})")  # fmt: skip
    return f"engine fault, component re-instantiated: {ev.name}"


def dispatch(events: list[Event], listeners: list[Listener], sink: TelemetrySink | None = None,
             span: Any = None, call: int = 0) -> None:  # fmt: skip
    """Deliver events. `span` is the span of call `call` (its sink's `start_call` token) when the
    events come from that call's crossings: the events of that call, and those of no call (a
    breaker transition its report caused), go to the sink's `call_event(span, ...)` when it has
    one, so that they land on the call's span (docs/telemetry.md, "Spans")."""
    call_event = getattr(sink, "call_event", None) if span is not None else None
    for ev in events:
        level = _LEVELS.get(ev.kind, logging.INFO)
        if ev.kind is EventKind.BREAKER_TRANSITION and ev.state_to in (BreakerState.OPEN, BreakerState.FORCED_OPEN):
            level = logging.WARNING
        if logger.isEnabledFor(level):
            logger.log(level, "%s", describe(ev), extra={"levee_event": ev})
        if sink is not None:
            try:
                if call_event is not None and ev.call in (0, call):
                    emit_event(sink, ev, lambda name, attrs: call_event(span, name, attrs))
                else:
                    emit_event(sink, ev)
            except Exception:
                logger.exception("levee: telemetry sink %r failed", sink)
        for listener in listeners:
            try:
                listener(ev)
            except Exception:
                logger.exception("levee: event listener %r failed", listener)

"""One telemetry schema for every host (docs/telemetry.md): events, counters, histograms and a
gauge, delivered to a `TelemetrySink`.

```python
engine = levee.load("policies.yaml", telemetry=levee.telemetry.OpenTelemetrySink())
```

With no sink (the default) an engine still logs its events (logger ``levee``) and calls its
listeners; the sink adds the metrics. Names and attributes are the generated constants
(`wit/constants.json`); times are in seconds.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, ClassVar, Protocol, runtime_checkable

from . import _constants
from .types import BreakerState, Event, EventKind

__all__ = ["AttributeValue", "OpenTelemetrySink", "SpanSink", "TelemetrySink", "event_attributes"]

AttributeValue = str | int | float | bool

# The names of docs/telemetry.md: the telemetry section of wit/constants.json, generated into _constants.
METRIC_CALLS = _constants.METRIC_CALLS
METRIC_ATTEMPTS = _constants.METRIC_ATTEMPTS
METRIC_ATTEMPT_DURATION = _constants.METRIC_ATTEMPT_DURATION
METRIC_RETRIES = _constants.METRIC_RETRIES
METRIC_RETRY_DELAY = _constants.METRIC_RETRY_DELAY
METRIC_REJECTIONS = _constants.METRIC_REJECTIONS
METRIC_FALLBACKS = _constants.METRIC_FALLBACKS
METRIC_BREAKER_TRANSITIONS = _constants.METRIC_BREAKER_TRANSITIONS
METRIC_BREAKER_STATE = _constants.METRIC_BREAKER_STATE
METRIC_ENGINE_FAULTS = _constants.METRIC_ENGINE_FAULTS
METRIC_HEDGES = _constants.METRIC_HEDGES
METRIC_KEYS_EVICTED = _constants.METRIC_KEYS_EVICTED
METRIC_KEYS_OVERFLOW = _constants.METRIC_KEYS_OVERFLOW
ATTR_POLICY = _constants.ATTR_POLICY
ATTR_KEY = _constants.ATTR_KEY
ATTR_CALL = _constants.ATTR_CALL
ATTR_ATTEMPT = _constants.ATTR_ATTEMPT
ATTR_REASON = _constants.ATTR_REASON
ATTR_DELAY = _constants.ATTR_DELAY
ATTR_BREAKER_FROM = _constants.ATTR_BREAKER_FROM
ATTR_BREAKER_TO = _constants.ATTR_BREAKER_TO
ATTR_FALLBACK = _constants.ATTR_FALLBACK
ATTR_BUDGET_LEVEL = _constants.ATTR_BUDGET_LEVEL
ATTR_FAULT = _constants.ATTR_FAULT
ATTR_RESULT = _constants.ATTR_RESULT
ATTR_RETRIED = _constants.ATTR_RETRIED
ATTR_OUTCOME = _constants.ATTR_OUTCOME
ATTR_DEGRADED = _constants.ATTR_DEGRADED
ATTR_RESEND_COUNT = _constants.ATTR_RESEND_COUNT
SPAN_CALL = _constants.SPAN_CALL
SPAN_ATTEMPT = _constants.SPAN_ATTEMPT

_BREAKER_NUMBER = {s: i for i, s in enumerate(BreakerState)}


@runtime_checkable
class TelemetrySink(Protocol):
    """Where an engine's telemetry goes. Called outside the engine's lock, in the order the core
    recorded the events; a sink that raises is logged and ignored."""

    def event(self, name: str, attributes: Mapping[str, AttributeValue]) -> None: ...

    def add(self, counter: str, value: int, attributes: Mapping[str, AttributeValue]) -> None: ...

    def record(self, histogram: str, value: float, attributes: Mapping[str, AttributeValue]) -> None: ...

    def gauge(self, gauge: str, value: float, attributes: Mapping[str, AttributeValue]) -> None: ...


@runtime_checkable
class SpanSink(Protocol):
    """A sink that also makes spans (docs/telemetry.md, "Spans"): one per call and a child per
    attempt. An engine whose sink has these methods runs every call on the driver path, so that
    each attempt gets its span (the one-crossing hot path has none).

    A span sink may also have `call_event(span, name, attributes)`: the events of a call (and
    those of no call its crossings caused, such as a breaker transition) then go there, with
    the call's span, instead of to `event` (`OpenTelemetrySink` adds them to the span)."""

    def start_call(self, policy: str, key: str) -> Any: ...

    def end_call(self, span: Any, result: str, reason: str | None) -> None: ...

    def start_attempt(self, call_span: Any, number: int, degraded: bool, http: bool) -> Any: ...

    def end_attempt(self, span: Any, outcome: str | None) -> None: ...


def event_attributes(ev: Event) -> dict[str, AttributeValue]:
    """The attributes of an event, as docs/telemetry.md lists them (absent when they do not apply)."""
    a: dict[str, AttributeValue] = {ATTR_POLICY: ev.policy, ATTR_KEY: ev.key}
    if ev.call:
        a[ATTR_CALL] = ev.call
    k = ev.kind
    if k is EventKind.RETRY_SCHEDULED or k is EventKind.RATE_LIMIT_WAIT:
        a[ATTR_ATTEMPT] = ev.attempt
        a[ATTR_DELAY] = ev.duration / 1e9
    elif k is EventKind.GAVE_UP:
        a[ATTR_ATTEMPT] = ev.attempt
        a[ATTR_REASON] = ev.reason.wit
    elif k is EventKind.REJECTED:
        a[ATTR_ATTEMPT] = ev.attempt
        a[ATTR_REASON] = ev.reason.wit
        a[ATTR_DELAY] = ev.duration / 1e9
    elif k is EventKind.BUDGET_REFUSED:
        a[ATTR_ATTEMPT] = ev.attempt
        a[ATTR_BUDGET_LEVEL] = ev.value
    elif k is EventKind.BREAKER_TRANSITION:
        a[ATTR_BREAKER_FROM] = ev.state_from.wit
        a[ATTR_BREAKER_TO] = ev.state_to.wit
    elif k is EventKind.FALLBACK_CHOSEN:
        a[ATTR_FALLBACK] = ev.name
        a[ATTR_REASON] = ev.reason.wit
    elif k is EventKind.HEDGE_STARTED:
        a[ATTR_ATTEMPT] = ev.attempt
    elif k is EventKind.KEY_EVICTED or k is EventKind.KEY_OVERFLOW:
        # the key evicted; the key that got no entry of its own (not the shared `levee:overflow`)
        a[ATTR_KEY] = ev.name or ev.key
    elif k is EventKind.ENGINE_FAULT:
        a[ATTR_FAULT] = ev.fault
    return a


def emit_event(
    sink: TelemetrySink, ev: Event, event: Callable[[str, Mapping[str, AttributeValue]], None] | None = None
) -> None:
    """An event and the metrics it drives; `event` delivers the event instead of `sink.event`
    (a call's events to its span)."""
    attrs = event_attributes(ev)
    (event or sink.event)(ev.kind.wit, attrs)
    k = ev.kind
    pol = {ATTR_POLICY: ev.policy}
    if k is EventKind.RETRY_SCHEDULED:
        sink.add(METRIC_RETRIES, 1, pol)
        sink.record(METRIC_RETRY_DELAY, ev.duration / 1e9, pol)
    elif k is EventKind.REJECTED:
        sink.add(METRIC_REJECTIONS, 1, {ATTR_POLICY: ev.policy, ATTR_REASON: ev.reason.wit})
    elif k is EventKind.FALLBACK_CHOSEN:
        sink.add(METRIC_FALLBACKS, 1, {ATTR_POLICY: ev.policy, ATTR_FALLBACK: ev.name, ATTR_REASON: ev.reason.wit})
    elif k is EventKind.BREAKER_TRANSITION:
        sink.add(
            METRIC_BREAKER_TRANSITIONS,
            1,
            {ATTR_POLICY: ev.policy, ATTR_BREAKER_FROM: ev.state_from.wit, ATTR_BREAKER_TO: ev.state_to.wit},
        )
        sink.gauge(METRIC_BREAKER_STATE, _BREAKER_NUMBER[ev.state_to], {ATTR_POLICY: ev.policy, ATTR_KEY: ev.key})
    elif k is EventKind.HEDGE_STARTED:
        sink.add(METRIC_HEDGES, 1, pol)
    elif k is EventKind.KEY_EVICTED:
        sink.add(METRIC_KEYS_EVICTED, 1, pol)
    elif k is EventKind.KEY_OVERFLOW:
        sink.add(METRIC_KEYS_OVERFLOW, 1, pol)
    elif k is EventKind.ENGINE_FAULT:
        sink.add(METRIC_ENGINE_FAULTS, 1, {ATTR_FAULT: ev.fault})


def emit_attempt(sink: TelemetrySink, policy: str, outcome: str, elapsed_ns: int) -> None:
    """An attempt reported to the core: `levee.attempts` and `levee.attempt.duration`."""
    attrs = {ATTR_POLICY: policy, ATTR_OUTCOME: outcome}
    sink.add(METRIC_ATTEMPTS, 1, attrs)
    sink.record(METRIC_ATTEMPT_DURATION, elapsed_ns / 1e9, attrs)


def emit_call(sink: TelemetrySink, policy: str, result: str, retried: bool, reason: str | None) -> None:
    """A call ended: `levee.calls` (`levee.reason` on a failure the core decided)."""
    attrs: dict[str, AttributeValue] = {ATTR_POLICY: policy, ATTR_RESULT: result, ATTR_RETRIED: retried}
    if reason is not None:
        attrs[ATTR_REASON] = reason
    sink.add(METRIC_CALLS, 1, attrs)


class OpenTelemetrySink:
    """The OpenTelemetry adapter (`pip install levee-resilience[otel]`, which installs the API;
    the SDK, `opentelemetry-sdk`, or a distribution that brings one, is what records and
    exports): metrics on the meter ``levee`` and the spans `levee.call` and `levee.attempt` on
    the tracer ``levee`` (no-ops until an SDK is configured). The events of a call are events of
    its `levee.call` span; other events (an operator's `set_breaker_state`, and every event when
    `spans=False`) are events of the current span, if one is recording. `spans=False` leaves
    spans out (calls then keep the one-crossing hot path)."""

    _UNITS: ClassVar[dict[str, str]] = {
        METRIC_CALLS: "{call}",
        METRIC_ATTEMPTS: "{attempt}",
        METRIC_RETRIES: "{retry}",
        METRIC_REJECTIONS: "{attempt}",
        METRIC_FALLBACKS: "{fallback}",
        METRIC_BREAKER_TRANSITIONS: "{transition}",
        METRIC_ENGINE_FAULTS: "{fault}",
        METRIC_HEDGES: "{attempt}",
        METRIC_KEYS_EVICTED: "{key}",
        METRIC_KEYS_OVERFLOW: "{call}",
        METRIC_ATTEMPT_DURATION: "s",
        METRIC_RETRY_DELAY: "s",
        METRIC_BREAKER_STATE: "1",
    }

    def __init__(self, meter_provider: Any = None, tracer_provider: Any = None, *, gauge_key: bool = True,
                 spans: bool = True) -> None:  # fmt: skip
        """`gauge_key=False` drops `levee.key` from the breaker-state gauge too (one series per
        policy instead of one per downstream key)."""
        from opentelemetry import context, metrics, trace

        self._gauge_key = gauge_key
        self._context = context
        self._tracer = (tracer_provider or trace.get_tracer_provider()).get_tracer("levee")
        if not spans:
            # an instance attribute hides the methods: no longer a SpanSink
            self.start_call = None  # type: ignore[method-assign,assignment]
        self._meter = (meter_provider or metrics.get_meter_provider()).get_meter("levee")
        self._trace = trace
        self._instruments: dict[str, Any] = {}

    def _instrument(self, name: str, kind: str) -> Any:
        inst = self._instruments.get(name)
        if inst is None:
            unit = self._UNITS.get(name, "")
            if kind == "counter":
                inst = self._meter.create_counter(name, unit=unit)
            elif kind == "histogram":
                inst = self._meter.create_histogram(name, unit=unit)
            else:
                inst = self._meter.create_gauge(name, unit=unit)
            self._instruments[name] = inst
        return inst

    def event(self, name: str, attributes: Mapping[str, AttributeValue]) -> None:
        span = self._trace.get_current_span()
        if span.is_recording():
            span.add_event(name, dict(attributes))

    def call_event(self, span: Any, name: str, attributes: Mapping[str, AttributeValue]) -> None:
        """An event of the call whose `levee.call` span is `span` (from `start_call`)."""
        if span.is_recording():
            span.add_event(name, dict(attributes))

    def add(self, counter: str, value: int, attributes: Mapping[str, AttributeValue]) -> None:
        self._instrument(counter, "counter").add(value, dict(attributes))

    def record(self, histogram: str, value: float, attributes: Mapping[str, AttributeValue]) -> None:
        self._instrument(histogram, "histogram").record(value, dict(attributes))

    def gauge(self, gauge: str, value: float, attributes: Mapping[str, AttributeValue]) -> None:
        attrs = dict(attributes)
        if not self._gauge_key:
            attrs.pop(ATTR_KEY, None)
        self._instrument(gauge, "gauge").set(value, attrs)

    # ------------------------------------------------------------ spans

    def start_call(self, policy: str, key: str) -> Any:
        return self._tracer.start_span(SPAN_CALL, attributes={ATTR_POLICY: policy, ATTR_KEY: key})

    def end_call(self, span: Any, result: str, reason: str | None) -> None:
        from opentelemetry.trace import Status, StatusCode

        span.set_attribute(ATTR_RESULT, result)
        if reason is not None:
            span.set_attribute(ATTR_REASON, reason)
        if result == "failure":
            span.set_status(Status(StatusCode.ERROR, reason or "the call failed"))
        span.end()

    def start_attempt(self, call_span: Any, number: int, degraded: bool, http: bool) -> Any:
        attrs: dict[str, AttributeValue] = {ATTR_ATTEMPT: number}
        if degraded:
            attrs[ATTR_DEGRADED] = True
        if http and number > 1:
            attrs[ATTR_RESEND_COUNT] = number - 1
        parent = self._trace.set_span_in_context(call_span) if call_span is not None else None
        span = self._tracer.start_span(SPAN_ATTEMPT, context=parent, attributes=attrs)
        token = self._context.attach(self._trace.set_span_in_context(span))
        return span, token

    def end_attempt(self, span: Any, outcome: str | None) -> None:
        s, token = span
        try:
            self._context.detach(token)
        except Exception:
            pass  # detached in another context: the span still ends
        if outcome is not None:
            s.set_attribute(ATTR_OUTCOME, outcome)
        s.end()

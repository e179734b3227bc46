// Events: a small EventEmitter-style listener registry (it runs in Node and in Worker runtimes, which
// have no `node:events` by default), and OpenTelemetry metrics when a meter is available.

import type { BreakerState, Event, EventKind, OutcomeKind, Reason } from '../wasm/interfaces/levee-policy-types.js';
import {
  ATTR_ATTEMPT,
  ATTR_BREAKER_FROM,
  ATTR_BREAKER_TO,
  ATTR_BUDGET_LEVEL,
  ATTR_CALL,
  ATTR_DELAY,
  ATTR_FALLBACK,
  ATTR_FAULT,
  ATTR_KEY,
  ATTR_OUTCOME,
  ATTR_POLICY,
  ATTR_REASON,
  ATTR_RESULT,
  ATTR_RETRIED,
  BREAKER_STATES,
  EVENT_ENGINE_FAULT,
  INSTRUMENTS,
  METRIC_ATTEMPTS,
  METRIC_ATTEMPT_DURATION,
  METRIC_BREAKER_STATE,
  METRIC_BREAKER_TRANSITIONS,
  METRIC_CALLS,
  METRIC_ENGINE_FAULTS,
  METRIC_FALLBACKS,
  METRIC_HEDGES,
  METRIC_KEYS_EVICTED,
  METRIC_KEYS_OVERFLOW,
  METRIC_REJECTIONS,
  METRIC_RETRIES,
  METRIC_RETRY_DELAY,
  RESULTS,
} from './constants.js';

/** An event recorded by the policy core, with the policy's name resolved. */
export interface LeveeEvent extends Event {
  /** Name of the policy (`policy` is its index). */
  policyName: string;
}

/**
 * The host's own event (docs/hosts.md, section 3): the component trapped (`trap`), answered a
 * verdict that breaks the contract (`contract`; both re-instantiate it), or answered `invalid`
 * for a call this host started (`invalid`).
 */
export interface EngineFaultEvent {
  kind: 'engine-fault';
  fault: 'trap' | 'contract' | 'invalid';
  /** What the host was doing: `start`, `acquire`, `report`, `report-fallback`, `flush`, ... */
  phase: string;
  /** The error the component threw (a `WebAssembly.RuntimeError` for a trap), or what was wrong. */
  error: unknown;
  /** Whether a new instance got the last exported state back (false for `invalid`: none was made). */
  restored: boolean;
  /** Name of the policy of the call in progress ("" if none). */
  policyName: string;
  /** The key of the call in progress ("" if none). */
  key: string;
  /** The call in progress, if any. */
  call: bigint | undefined;
}

export interface LeveeEventMap {
  /** Every event of the core, whatever its kind. */
  event: LeveeEvent;
  'retry-scheduled': LeveeEvent;
  'gave-up': LeveeEvent;
  rejected: LeveeEvent;
  'budget-refused': LeveeEvent;
  'breaker-transition': LeveeEvent;
  'fallback-chosen': LeveeEvent;
  'rate-limit-wait': LeveeEvent;
  'key-evicted': LeveeEvent;
  'call-evicted': LeveeEvent;
  'permit-expired': LeveeEvent;
  'hedge-started': LeveeEvent;
  /** Every key of the policy holds protection: a new key is decided against `levee:overflow` (`name`: its key). */
  'key-overflow': LeveeEvent;
  'engine-fault': EngineFaultEvent;
}

export type LeveeEventName = keyof LeveeEventMap;
export type Listener<K extends LeveeEventName> = (event: LeveeEventMap[K]) => void;

type AnyListener = (event: unknown) => void;

/** A listener registry with the shape of Node's EventEmitter (`on`, `off`, `once`). */
export class Emitter {
  readonly #listeners = new Map<string, AnyListener[]>();
  readonly #report: ObserverErrorHandler | undefined;
  #count = 0;

  /** `report`: where a listener's error goes (default: `defaultObserverError`). */
  constructor(report?: ObserverErrorHandler) {
    this.#report = report;
  }

  /** Whether anybody listens at all (the host skips building event objects otherwise). */
  get listening(): boolean {
    return this.#count > 0;
  }

  on<K extends LeveeEventName>(name: K, listener: Listener<K>): this {
    const list = this.#listeners.get(name);
    // Copy on write: an emit in progress keeps iterating the array it started with.
    this.#listeners.set(name, list ? [...list, listener as AnyListener] : [listener as AnyListener]);
    this.#count++;
    return this;
  }

  off<K extends LeveeEventName>(name: K, listener: Listener<K>): this {
    const list = this.#listeners.get(name);
    if (!list) return this;
    const i = list.indexOf(listener as AnyListener);
    if (i < 0) return this;
    const next = list.slice();
    next.splice(i, 1);
    if (next.length === 0) this.#listeners.delete(name);
    else this.#listeners.set(name, next);
    this.#count--;
    return this;
  }

  once<K extends LeveeEventName>(name: K, listener: Listener<K>): this {
    const wrapper: Listener<K> = (event) => {
      this.off(name, wrapper);
      listener(event);
    };
    return this.on(name, wrapper);
  }

  listenerCount(name: LeveeEventName): number {
    return this.#listeners.get(name)?.length ?? 0;
  }

  emit<K extends LeveeEventName>(name: K, event: LeveeEventMap[K]): void {
    const list = this.#listeners.get(name);
    if (!list) return;
    for (const listener of list) {
      try {
        listener(event);
      } catch (err) {
        // A listener's bug must not change the outcome of the call being decided: reported, ignored.
        reportHookError(err, `listener of "${name}"`, this.#report);
      }
    }
  }
}

// ------------------------------------------------------------------ telemetry (docs/telemetry.md)

export type AttributeValue = string | number | boolean;
export type Attributes = Record<string, AttributeValue>;

/**
 * Where a Levee's telemetry goes (docs/telemetry.md): events in the order the core recorded them,
 * counter increments, histogram samples (seconds) and gauge values, with the names and attributes
 * of the schema. A sink that throws is reported (`LoadOptions.onObserverError`, by default on the
 * console) and ignored: it never changes a call.
 */
export interface TelemetrySink {
  event(name: string, attributes: Attributes): void;
  add(counter: string, value: number, attributes: Attributes): void;
  record(histogram: string, value: number, attributes: Attributes): void;
  gauge(gauge: string, value: number, attributes: Attributes): void;
}

/** What the hook `onRetry` receives, before the sleep of each retry. */
export interface RetryInfo {
  policy: string;
  key: string;
  /** The attempt that failed, 1 for the first. */
  attempt: number;
  /** The sleep about to start, in seconds. */
  delay: number;
  /** What the failed attempt threw (undefined when it returned a value the policy retries). */
  error: unknown;
  /** The value it returned (a 503 response), when it did not throw. */
  result: unknown;
  /** `none` for a retry. */
  reason: Reason;
}

export type RetryHook = (info: RetryInfo) => void;

/**
 * Where the error of observer code goes (`LoadOptions.onObserverError`): `observer` says which
 * (`onRetry hook of policy "http"`, `listener of "retry-scheduled"`, `telemetry sink`, ...).
 */
export type ObserverErrorHandler = (error: unknown, observer: string) => void;

/** The default report of an observer's error: one line on the console (stderr in Node). */
export function defaultObserverError(error: unknown, observer: string): void {
  console.error(`levee: ${observer} threw (ignored: observer code never changes a call):`, error);
}

/**
 * An observer's bug (a hook, listener, sink or trace callback that threw) must not change a call:
 * it is reported to `report` and ignored; it never becomes an uncaught exception, and a `report`
 * that throws in turn is ignored too.
 */
export function reportHookError(
  err: unknown,
  observer: string,
  report: ObserverErrorHandler = defaultObserverError,
): void {
  try {
    report(err, observer);
  } catch {
    // Nowhere left to report it: observer code never changes a call.
  }
}

const BREAKER_NUMBER: Readonly<Record<BreakerState, number>> = Object.fromEntries(
  BREAKER_STATES.map((s, i) => [s, i]),
) as Record<BreakerState, number>;

/** The attributes of a core event, as docs/telemetry.md lists them (absent when they do not apply). */
export function eventAttributes(e: LeveeEvent): Attributes {
  const a: Attributes = { [ATTR_POLICY]: e.policyName, [ATTR_KEY]: e.key };
  if (e.call !== 0n) a[ATTR_CALL] = Number(e.call);
  switch (e.kind) {
    case 'retry-scheduled':
    case 'rate-limit-wait':
      a[ATTR_ATTEMPT] = e.attempt;
      a[ATTR_DELAY] = Number(e.duration) / 1e9;
      break;
    case 'gave-up':
      a[ATTR_ATTEMPT] = e.attempt;
      a[ATTR_REASON] = e.reason;
      break;
    case 'rejected':
      a[ATTR_ATTEMPT] = e.attempt;
      a[ATTR_REASON] = e.reason;
      a[ATTR_DELAY] = Number(e.duration) / 1e9;
      break;
    case 'budget-refused':
      a[ATTR_ATTEMPT] = e.attempt;
      a[ATTR_BUDGET_LEVEL] = Number(e.value);
      break;
    case 'breaker-transition':
      a[ATTR_BREAKER_FROM] = e.stateFrom;
      a[ATTR_BREAKER_TO] = e.stateTo;
      break;
    case 'fallback-chosen':
      a[ATTR_FALLBACK] = e.name;
      a[ATTR_REASON] = e.reason;
      break;
    case 'key-evicted':
    case 'key-overflow':
      // The key evicted, or the caller's key that got no entry of its own (docs/telemetry.md).
      a[ATTR_KEY] = e.name !== '' ? e.name : e.key;
      break;
    case 'hedge-started':
      a[ATTR_ATTEMPT] = e.attempt;
      break;
  }
  return a;
}

/** The telemetry of one Levee, on its sink (every method a no-op when there is none). */
export class Telemetry {
  readonly sink: TelemetrySink;
  readonly #report: ObserverErrorHandler | undefined;

  constructor(sink: TelemetrySink, report?: ObserverErrorHandler) {
    this.sink = sink;
    this.#report = report;
  }

  /** A core event and the metrics it drives. */
  event(e: LeveeEvent): void {
    const sink = this.sink;
    try {
      sink.event(e.kind, eventAttributes(e));
      const policy = e.policyName;
      switch (e.kind) {
        case 'retry-scheduled':
          sink.add(METRIC_RETRIES, 1, { [ATTR_POLICY]: policy });
          sink.record(METRIC_RETRY_DELAY, Number(e.duration) / 1e9, { [ATTR_POLICY]: policy });
          break;
        case 'rejected':
          sink.add(METRIC_REJECTIONS, 1, { [ATTR_POLICY]: policy, [ATTR_REASON]: e.reason });
          break;
        case 'fallback-chosen':
          sink.add(METRIC_FALLBACKS, 1, { [ATTR_POLICY]: policy, [ATTR_FALLBACK]: e.name, [ATTR_REASON]: e.reason });
          break;
        case 'breaker-transition':
          sink.add(METRIC_BREAKER_TRANSITIONS, 1, {
            [ATTR_POLICY]: policy,
            [ATTR_BREAKER_FROM]: e.stateFrom,
            [ATTR_BREAKER_TO]: e.stateTo,
          });
          sink.gauge(METRIC_BREAKER_STATE, BREAKER_NUMBER[e.stateTo], { [ATTR_POLICY]: policy, [ATTR_KEY]: e.key });
          break;
        case 'hedge-started':
          sink.add(METRIC_HEDGES, 1, { [ATTR_POLICY]: policy });
          break;
        case 'key-evicted':
          sink.add(METRIC_KEYS_EVICTED, 1, { [ATTR_POLICY]: policy });
          break;
        case 'key-overflow':
          sink.add(METRIC_KEYS_OVERFLOW, 1, { [ATTR_POLICY]: policy });
          break;
      }
    } catch (err) {
      reportHookError(err, 'telemetry sink', this.#report);
    }
  }

  /** The host's `engine-fault` event and `levee.engine.faults`. */
  fault(e: EngineFaultEvent): void {
    try {
      const attrs: Attributes = { [ATTR_POLICY]: e.policyName, [ATTR_KEY]: e.key, [ATTR_FAULT]: e.fault };
      if (e.call !== undefined) attrs[ATTR_CALL] = Number(e.call);
      this.sink.event(EVENT_ENGINE_FAULT, attrs);
      this.sink.add(METRIC_ENGINE_FAULTS, 1, { [ATTR_FAULT]: e.fault });
    } catch (err) {
      reportHookError(err, 'telemetry sink', this.#report);
    }
  }

  /** An attempt reported to the core (its outcome kind and `elapsed`, in ns). */
  attempt(policy: string, outcome: OutcomeKind, elapsedNs: number): void {
    try {
      const attrs = { [ATTR_POLICY]: policy, [ATTR_OUTCOME]: outcome };
      this.sink.add(METRIC_ATTEMPTS, 1, attrs);
      this.sink.record(METRIC_ATTEMPT_DURATION, elapsedNs / 1e9, attrs);
    } catch (err) {
      reportHookError(err, 'telemetry sink', this.#report);
    }
  }

  /** A call ended (`reason` on a failure the core decided). */
  call(policy: string, result: CallResult, retried: boolean, reason: Reason | undefined): void {
    try {
      const attrs: Attributes = { [ATTR_POLICY]: policy, [ATTR_RESULT]: result, [ATTR_RETRIED]: retried };
      if (reason !== undefined) attrs[ATTR_REASON] = reason;
      this.sink.add(METRIC_CALLS, 1, attrs);
    } catch (err) {
      reportHookError(err, 'telemetry sink', this.#report);
    }
  }
}

export type CallResult = (typeof RESULTS)[number];

/** The part of an OpenTelemetry `Meter` that Levee uses (structural, so the API stays optional). */
export interface MeterLike {
  createCounter(
    name: string,
    options?: { description?: string; unit?: string },
  ): {
    add(value: number, attributes?: Attributes): void;
  };
  createHistogram(
    name: string,
    options?: { description?: string; unit?: string },
  ): {
    record(value: number, attributes?: Attributes): void;
  };
  /** `@opentelemetry/api` 1.9 and later. */
  createGauge?(
    name: string,
    options?: { description?: string; unit?: string },
  ): {
    record(value: number, attributes?: Attributes): void;
  };
}

/** The part of an OpenTelemetry `Span` that the sink uses to record events. */
export interface SpanLike {
  addEvent(name: string, attributes?: Attributes): unknown;
  isRecording(): boolean;
}

/** Each instrument's unit and description, as the contract gives them (`INSTRUMENTS`). */
const OPTIONS: ReadonlyMap<string, { unit: string; description: string }> = new Map(
  INSTRUMENTS.map(([name, , unit, description]) => [name, { unit, description }]),
);

/** The options an instrument is created with (none for a name the contract does not have). */
function instrumentOptions(name: string): { unit?: string; description?: string } {
  return OPTIONS.get(name) ?? {};
}

/**
 * The OpenTelemetry adapter: the schema's instruments on `meter` (with `@opentelemetry/api`
 * installed, `load` uses its global meter `levee`, a no-op until an SDK is configured), and
 * events as events of the active span when `activeSpan` gives one.
 */
export class OpenTelemetrySink implements TelemetrySink {
  readonly #meter: MeterLike;
  readonly #activeSpan: (() => SpanLike | undefined) | undefined;
  readonly #counters = new Map<string, { add(value: number, attributes?: Attributes): void }>();
  readonly #histograms = new Map<string, { record(value: number, attributes?: Attributes): void }>();
  readonly #gauges = new Map<string, { record(value: number, attributes?: Attributes): void } | undefined>();

  readonly #gaugeKey: boolean;

  /**
   * `gaugeKey: false` drops `levee.key` from the breaker-state gauge too (one series per policy
   * instead of one per key: keys can number in the millions).
   */
  constructor(
    meter: MeterLike,
    activeSpan?: () => SpanLike | undefined,
    options: { gaugeKey?: boolean | undefined } = {},
  ) {
    this.#meter = meter;
    this.#activeSpan = activeSpan;
    this.#gaugeKey = options.gaugeKey ?? true;
  }

  event(name: string, attributes: Attributes): void {
    const span = this.#activeSpan?.();
    if (span !== undefined && span.isRecording()) span.addEvent(name, attributes);
  }

  add(counter: string, value: number, attributes: Attributes): void {
    let c = this.#counters.get(counter);
    if (c === undefined) {
      c = this.#meter.createCounter(counter, instrumentOptions(counter));
      this.#counters.set(counter, c);
    }
    c.add(value, attributes);
  }

  record(histogram: string, value: number, attributes: Attributes): void {
    let h = this.#histograms.get(histogram);
    if (h === undefined) {
      h = this.#meter.createHistogram(histogram, instrumentOptions(histogram));
      this.#histograms.set(histogram, h);
    }
    h.record(value, attributes);
  }

  gauge(gauge: string, value: number, attributes: Attributes): void {
    if (!this.#gauges.has(gauge)) {
      this.#gauges.set(gauge, this.#meter.createGauge?.(gauge, instrumentOptions(gauge)));
    }
    let attrs = attributes;
    if (!this.#gaugeKey && ATTR_KEY in attrs) {
      attrs = { ...attributes };
      delete attrs[ATTR_KEY];
    }
    this.#gauges.get(gauge)?.record(value, attrs);
  }
}

export type { BreakerState, Event, EventKind, Reason };

// Events: a small EventEmitter-style listener registry (it runs in Node and in Worker runtimes, which
// have no `node:events` by default), and OpenTelemetry metrics when a meter is available.

import type { BreakerState, Event, EventKind, Reason } from '../wasm/interfaces/levee-policy-types.js';

/** An event recorded by the policy core, with the policy's name resolved. */
export interface LeveeEvent extends Event {
  /** Name of the policy (`policy` is its index). */
  policyName: string;
}

/** The host's own event: the component trapped or misbehaved and was re-instantiated. */
export interface EngineFaultEvent {
  kind: 'engine-fault';
  /** What the host was doing: `start`, `acquire`, `report`, `report-fallback`, `flush`, ... */
  phase: string;
  /** The error the component threw (a `WebAssembly.RuntimeError` for a trap). */
  error: unknown;
  /** Whether the new instance got the last exported state back. */
  restored: boolean;
  /** Name of the policy of the call in progress ("" if none). */
  policyName: string;
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
  'engine-fault': EngineFaultEvent;
}

export type LeveeEventName = keyof LeveeEventMap;
export type Listener<K extends LeveeEventName> = (event: LeveeEventMap[K]) => void;

type AnyListener = (event: unknown) => void;

/** A listener registry with the shape of Node's EventEmitter (`on`, `off`, `once`). */
export class Emitter {
  readonly #listeners = new Map<string, AnyListener[]>();
  #count = 0;

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
        // A listener's bug must not change the outcome of the call being decided: surface it
        // the way an unhandled error in a callback surfaces, outside the call.
        queueMicrotask(() => {
          throw err;
        });
      }
    }
  }
}

/** The part of an OpenTelemetry `Meter` that Levee uses (structural, so the API stays optional). */
export interface MeterLike {
  createCounter(
    name: string,
    options?: { description?: string; unit?: string },
  ): {
    add(value: number, attributes?: Record<string, string | number | boolean>): void;
  };
  createHistogram(
    name: string,
    options?: { description?: string; unit?: string },
  ): {
    record(value: number, attributes?: Record<string, string | number | boolean>): void;
  };
}

/** Maps core events to OpenTelemetry instruments. */
export class Metrics {
  readonly #retries;
  readonly #retryDelay;
  readonly #gaveUp;
  readonly #rejected;
  readonly #budgetRefused;
  readonly #transitions;
  readonly #fallbacks;
  readonly #rateWaits;
  readonly #evictions;
  readonly #permitsExpired;
  readonly #faults;

  constructor(meter: MeterLike) {
    this.#retries = meter.createCounter('levee.retries', { description: 'Retries scheduled' });
    this.#retryDelay = meter.createHistogram('levee.retry.delay', {
      description: 'Delay before a retry',
      unit: 'ms',
    });
    this.#gaveUp = meter.createCounter('levee.calls.failed', { description: 'Calls that gave up, by reason' });
    this.#rejected = meter.createCounter('levee.rejections', {
      description: 'Attempts rejected before they ran, by reason',
    });
    this.#budgetRefused = meter.createCounter('levee.budget.refused', {
      description: 'Retries refused by the retry budget',
    });
    this.#transitions = meter.createCounter('levee.breaker.transitions', {
      description: 'Circuit breaker state changes',
    });
    this.#fallbacks = meter.createCounter('levee.fallbacks', { description: 'Fallbacks chosen' });
    this.#rateWaits = meter.createHistogram('levee.rate_limit.wait', {
      description: 'Waits asked by the rate limiter',
      unit: 'ms',
    });
    this.#evictions = meter.createCounter('levee.evictions', { description: 'Keys or calls evicted' });
    this.#permitsExpired = meter.createCounter('levee.breaker.permits_expired', {
      description: 'Half-open permits that expired unreported',
    });
    this.#faults = meter.createCounter('levee.engine.faults', {
      description: 'Traps or misbehaviour of the policy component (re-instantiated)',
    });
  }

  record(e: LeveeEvent): void {
    const policy = e.policyName;
    const kind: EventKind = e.kind;
    switch (kind) {
      case 'retry-scheduled':
        this.#retries.add(1, { policy });
        this.#retryDelay.record(Number(e.duration) / 1e6, { policy });
        break;
      case 'gave-up':
        this.#gaveUp.add(1, { policy, reason: e.reason });
        break;
      case 'rejected':
        this.#rejected.add(1, { policy, reason: e.reason });
        break;
      case 'budget-refused':
        this.#budgetRefused.add(1, { policy });
        break;
      case 'breaker-transition':
        this.#transitions.add(1, { policy, from: e.stateFrom, to: e.stateTo });
        break;
      case 'fallback-chosen':
        this.#fallbacks.add(1, { policy, fallback: e.name, reason: e.reason });
        break;
      case 'rate-limit-wait':
        this.#rateWaits.record(Number(e.duration) / 1e6, { policy });
        break;
      case 'key-evicted':
        this.#evictions.add(1, { policy, what: 'key' });
        break;
      case 'call-evicted':
        this.#evictions.add(1, { policy, what: 'call' });
        break;
      case 'permit-expired':
        this.#permitsExpired.add(1, { policy });
        break;
    }
  }

  fault(e: EngineFaultEvent): void {
    this.#faults.add(1, { phase: e.phase, restored: e.restored });
  }
}

export type { BreakerState, Event, EventKind, Reason };

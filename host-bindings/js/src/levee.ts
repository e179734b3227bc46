// The Levee host's public API: `Levee` (load a document, `run` calls under its policies), on the
// driver (driver.ts: verdict -> action) and the runtime glue (runtime.ts: the component, its
// crossings, snapshots and trap recovery). Every decision (what is retried, how long to wait,
// whether a breaker admits) comes from the core; this file does the I/O: attempts under an
// AbortSignal timeout, sleeps, fallbacks, all on the Levee's clock.

import type { Engine } from '../wasm/interfaces/levee-policy-engine-api.js';
import type { Analysis, BreakerState, CallInfo } from '../wasm/interfaces/levee-policy-types.js';
import { Attempt, FIRST_ATTEMPT, isThenable } from './attempt.js';
import type { AttemptContext } from './attempt.js';
import { clockTimer, clockWait, realClock, sleep } from './clock.js';
import type { Clock } from './clock.js';
import {
  ACT_ATTEMPT,
  ACT_DEGRADED,
  ACT_DONE,
  ACT_END_ATTEMPT,
  ACT_END_FALLBACK,
  ACT_FALLBACK,
  ACT_FAULT,
  ACT_HEDGE,
  ACT_SLEEP,
  CallDriver,
} from './driver.js';
import type { Action } from './driver.js';
import {
  GUARD_MAX_KEY_BYTES,
  GUARD_SNAPSHOT_INTERVAL_MS,
  REPORT_CALLER_NO_RETRY,
  REPORT_CALLER_RETRY,
} from './constants.js';
import { LeveeClosedError, LeveeError, checkKey, keyError, outcomeOfError } from './errors.js';
import type { Outcome, Reason } from './errors.js';
import { Emitter, OpenTelemetrySink, Telemetry, defaultObserverError, reportHookError } from './events.js';
import type {
  CallResult,
  LeveeEventName,
  Listener,
  MeterLike,
  ObserverErrorHandler,
  RetryHook,
  RetryInfo,
  SpanLike,
  TelemetrySink,
} from './events.js';
import { HedgeDriver } from './hedge.js';
import type { HedgeStep } from './hedge.js';
import { DEFAULT_MAX_MEMORY_BYTES, Runtime, startFlags } from './runtime.js';
import { CallSpan, Spans } from './spans.js';
import type { OpenTelemetryApiLike, SpanHandle } from './spans.js';
import type { HedgeAnswer } from '../wasm/interfaces/levee-policy-types.js';
import type { ComponentExports, InstantiateCore, Platform, PolicyEntry, TraceStep } from './runtime.js';

/** The reason a hedged call's wait is aborted with when an attempt ends it (no DOMException to build). */
const HEDGE_WAIT_OVER: unique symbol = Symbol('levee.hedge-wait-over');

/** The reason a parked call's sleep is aborted with when the core names it (a slot was granted to it). */
const WOKEN: unique symbol = Symbol('levee.woken');

/** The reason a call's sleep is aborted with when the Levee is closed. */
const CLOSED: unique symbol = Symbol('levee.closed');

export type { AttemptContext } from './attempt.js';
export type { Clock } from './clock.js';
export { sleep } from './clock.js';
export type { ComponentExports, InstantiateCore, Platform, PolicyEntry, SoonTask, TraceStep } from './runtime.js';
export { DEFAULT_MAX_MEMORY_BYTES, startFlags } from './runtime.js';

/** What a fallback function receives. */
export interface FallbackContext {
  /** The fallback's name, as the policy's chain names it. */
  name: string;
  policy: string;
  /** What triggered it (the core's reason). */
  reason: Reason;
  /** The attempts made. */
  attempts: number;
  /** The error of the last attempt, if it threw. */
  lastError: unknown;
  /** The error of the previous fallback of the chain, if one ran and failed. */
  fallbackError: unknown;
  /** The value of the last attempt when the policy classified it as a failure (a 503 response). */
  lastResult: unknown;
  /** The caller's signal, if any. */
  signal: AbortSignal | undefined;
  /**
   * The HTTP request of the call: `leveeFetch`'s (as built from its arguments, body unread), or
   * the one `run` was given in its options; `undefined` otherwise.
   */
  request: Request | undefined;
}

export type FallbackFn<T = unknown> = (ctx: FallbackContext) => T | Promise<T>;

export interface RunOptions<T> {
  /** A key for per-key state (breakers, buckets), e.g. a downstream host. Default "". */
  key?: string | undefined;
  /** The caller's signal: aborting it cancels the call (attempt and sleeps). */
  signal?: AbortSignal | undefined;
  /** The operation is idempotent (default true). When false the core retries it only with a key. */
  idempotent?: boolean | undefined;
  /**
   * The operation carries an idempotency key (so the core may retry it even if not idempotent):
   * `true`, or the key itself (an empty string counts as none).
   */
  idempotencyKey?: boolean | string | undefined;
  /** The HTTP method of the operation, if it is one (the core knows which methods are idempotent). */
  method?: string | undefined;
  /** Describe a value an attempt returned (e.g. an HTTP response); `undefined` means success. */
  outcomeOf?: ((value: T) => Outcome | undefined) | undefined;
  /** Describe an error an attempt threw (default: `outcomeOfError`). */
  errorOutcome?: ((error: unknown) => Outcome | undefined) | undefined;
  /** Fallbacks for this call, by name (they take precedence over those registered on the engine). */
  fallbacks?: Record<string, FallbackFn<T>> | undefined;
  /** Called with a returned value that a retry supersedes (e.g. to free a response body). */
  discard?: ((value: T) => void) | undefined;
  /** Checks a fallback's value; a value it refuses counts as a failed fallback (e.g. not a Response). */
  acceptFallback?: ((value: unknown) => boolean) | undefined;
  /** Called before the sleep of each retry of this call (before the policy's hooks); see `Levee.onRetry`. */
  onRetry?: RetryHook | undefined;
  /** This call's retry predicate (it wins over the policy's, see `Levee.retryIf`). */
  retryIf?: RetryPredicate<T> | undefined;
  /** The HTTP request the call makes, for its fallbacks (`FallbackContext.request`); `leveeFetch` passes it. */
  request?: Request | undefined;
}

/** What a retry predicate sees: the attempt's value, or the error it threw (a timeout's is a `TimeoutError`). */
export interface AttemptResult<T = unknown> {
  /** The attempt's number, 1 for the first. */
  attempt: number;
  threw: boolean;
  /** The error it threw (when `threw`). */
  error: unknown;
  /** The value it returned (when not `threw`), e.g. a Response. */
  value: T | undefined;
}

/**
 * A retry predicate in code (docs/hosts.md, section 9; tenacity's `retry_if_result`): `true`
 * retry this attempt's failure or result, `false` never retry it, `undefined` let the policy's
 * rules decide. It takes the place of `retry-on` and `never-retry` only: idempotency, the
 * attempts, Retry-After, the deadline and the budget still decide, in the core. One that throws
 * is reported and counts as `undefined`.
 */
export type RetryPredicate<T = unknown> = (result: AttemptResult<T>) => boolean | undefined | void;

export interface LoadOptions {
  /** The seed of the core's PRNG (jitter). Default: from the OS random source. */
  seed?: bigint | number | undefined;
  /** Fallback functions, by the names the policies' chains use. */
  fallbacks?: Record<string, FallbackFn> | undefined;
  /**
   * Where telemetry goes (docs/telemetry.md): events, counters, histograms and the breaker gauge.
   * Default: the OpenTelemetry sink on `meter` (below); `null` for none.
   */
  telemetry?: TelemetrySink | null | undefined;
  /**
   * An OpenTelemetry meter for the default sink; default: `@opentelemetry/api`'s global meter
   * `levee` when the package is present (`load`; `loadSync` looks for none). `null`: no metrics.
   */
  meter?: MeterLike | null | undefined;
  /** `onRetry` hooks per policy name, called before the sleep of each retry (see `Levee.onRetry`). */
  onRetry?: Record<string, RetryHook> | undefined;
  /** Retry predicates per policy name (see `Levee.retryIf`). */
  retryIf?: Record<string, RetryPredicate> | undefined;
  /**
   * Spans `levee.call` and `levee.attempt` (docs/telemetry.md) on OpenTelemetry: pass the
   * `@opentelemetry/api` module, or `true` (with `load`, which imports it). Default: none.
   */
  spans?: OpenTelemetryApiLike | boolean | undefined;
  /**
   * The clock of this Levee: every `now` it gives the core, the sleeps between attempts and the
   * attempts' timeouts. Default: the runtime's monotonic clock and the event loop's timers. Tests
   * pass a `VirtualClock` from `levee-resilience/testing`.
   */
  clock?: Clock | undefined;
  /**
   * How often (at most) the state is exported for trap recovery on the call path, in ms of the
   * Levee's clock. Default 1000, the rule of every host (docs/hosts.md, section 7). Whatever the
   * interval, the state is also exported whenever a breaker changes state, and after
   * `setBreakerState`, `reload` and `importState`, so a trap never forgets a trip.
   */
  checkpointIntervalMs?: number | undefined;
  /** jco's core instantiation hook (instrumentation, fault injection). */
  instantiateCore?: InstantiateCore | undefined;
  /**
   * Bound on the component's memory, in bytes (default 512 MiB, as in every host: see
   * docs/architecture.md, "Bounds on the guest"). Checked at each checkpoint; a component above
   * it is treated as faulty: re-instantiated with the last exported state. (A JavaScript engine
   * cannot interrupt a synchronous Wasm call, so this host bounds no guest call in time.)
   */
  maxMemoryBytes?: number | undefined;
  /**
   * Called after every step of every call with the core's verdict (debugging, demos). Like every
   * observer, one that throws is reported (`onObserverError`) and ignored.
   */
  trace?: ((step: TraceStep) => void) | undefined;
  /**
   * Where the errors of observer code go: `onRetry` hooks, `on()` listeners, the telemetry sink,
   * the `trace` callback, retry predicates and `discard`. Such an error is reported here and
   * ignored: it never changes a call, never reaches its caller and never becomes an uncaught
   * exception. `observer` names the code that threw (`onRetry hook of policy "http"`). Default:
   * one `console.error` line. One that throws in turn is ignored.
   */
  onObserverError?: ObserverErrorHandler | undefined;
}

/**
 * A loaded policy document and its engine (breaker, budget and bucket state).
 * One instance serves any number of concurrent calls.
 */
export class Levee {
  readonly #rt: Runtime;
  readonly #clock: Clock;
  readonly #now: () => bigint;
  readonly #fallbacks = new Map<string, FallbackFn>();
  readonly #emitter: Emitter;
  readonly #observerError: ObserverErrorHandler;
  readonly #telemetry: Telemetry | undefined;
  readonly #retryHooks = new Map<string, RetryHook[]>();
  readonly #predicates = new Map<string, RetryPredicate>();
  readonly #spans: Spans | undefined;
  /** The spans of the calls in progress (spans on), by call id: their events land on them. */
  readonly #callSpans = new Map<bigint, CallSpan>();
  #closed = false;
  /** The sleeps of calls between attempts (and their parks), which `close` ends. */
  readonly #sleepers = new Set<AbortController>();
  #nextCall = 1;

  /** @internal Use `load` from `levee` (Node) or `levee/worker`. */
  constructor(
    platform: Platform,
    document: string,
    options: LoadOptions,
    sink: TelemetrySink | undefined,
    otel?: OpenTelemetryApiLike,
  ) {
    const api = otel ?? (typeof options.spans === 'object' ? options.spans : undefined);
    if (options.spans === true && api === undefined) {
      throw new TypeError(
        'levee: spans: true needs load() (which imports @opentelemetry/api); pass the module instead',
      );
    }
    this.#spans = api === undefined ? undefined : new Spans(api);
    this.#observerError = options.onObserverError ?? defaultObserverError;
    this.#emitter = new Emitter(this.#observerError);
    const clock = options.clock;
    // The platform's clock is read directly: one call on the hot path, not two.
    this.#now = clock === undefined ? platform.now : () => clock.now();
    this.#clock = clock ?? realClock(platform.now);
    const wall = clock?.wallMs;
    this.#rt = new Runtime(
      platform,
      this.#now,
      document,
      {
        seed: options.seed !== undefined ? BigInt.asUintN(64, BigInt(options.seed)) : platform.randomSeed(),
        instantiateCore: options.instantiateCore,
        checkpointNs: BigInt(Math.round((options.checkpointIntervalMs ?? GUARD_SNAPSHOT_INTERVAL_MS) * 1e6)),
        maxMemoryBytes: options.maxMemoryBytes ?? DEFAULT_MAX_MEMORY_BYTES,
        trace: options.trace,
        report: this.#observerError,
        withCall: this.#spans === undefined ? undefined : (call, fn) => this.#inCallSpan(call, fn),
        wallMs: wall === undefined ? Date.now : () => wall.call(clock),
      },
      this.#emitter,
      (this.#telemetry = sink === undefined ? undefined : new Telemetry(sink, this.#observerError)),
    );
    for (const [name, fn] of Object.entries(options.fallbacks ?? {})) this.#fallbacks.set(name, fn);
    for (const [name, hook] of Object.entries(options.onRetry ?? {})) this.onRetry(name, hook);
    for (const [name, predicate] of Object.entries(options.retryIf ?? {})) this.retryIf(name, predicate);
  }

  // ---------------------------------------------------------------- policies and state

  /** The policies of the document, in order. */
  get policies(): readonly PolicyEntry[] {
    return this.#rt.policies;
  }

  /** A policy by name (throws on an unknown name, and `LeveeClosedError` after `close`). */
  policy(name: string): PolicyEntry {
    if (this.#closed) throw new LeveeClosedError();
    const entry = this.#rt.byName.get(name);
    if (entry === undefined) throw this.#rt.unknown(name);
    return entry;
  }

  /** The clock this Levee runs on. */
  get clock(): Clock {
    return this.#clock;
  }

  /** The policy with every default filled in, as the core renders it (JSON). */
  policyJson(name: string): string {
    const index = this.policy(name).index;
    return this.#rt.use('policy-json', (e) => e.policyJson(index)) ?? '';
  }

  /** Worst cases of a policy when `layers` layers run it. */
  analyze(name: string, layers = 1): Analysis | undefined {
    const index = this.policy(name).index;
    return this.#rt.use('analyze', (e) => e.analyze(index, layers));
  }

  /** Replace the policies, keeping the state that still applies; on error nothing changes. */
  reload(document: string): void {
    this.#rt.reload(document);
  }

  /**
   * Add a hook called before the sleep of each retry of a policy's calls (tenacity's
   * `before_sleep`, failsafe-go's `OnRetry`), with the attempt that failed, the delay in seconds
   * and what the attempt threw or returned. A hook that throws is reported and ignored.
   */
  onRetry(policy: string, hook: RetryHook): this {
    const hooks = this.#retryHooks.get(policy);
    this.#retryHooks.set(policy, hooks === undefined ? [hook] : [...hooks, hook]);
    return this;
  }

  /**
   * Set (or replace) a policy's retry predicate: code that sees each attempt's result or error and
   * answers retry (`true`), never retry (`false`) or nothing (`undefined`); a call's own `retryIf`
   * wins. The answer goes to the core as a report flag; the core decides.
   */
  retryIf(policy: string, predicate: RetryPredicate): this {
    this.#predicates.set(policy, predicate);
    return this;
  }

  /** Register (or replace) a fallback function under the name a policy's chain uses. */
  fallback(name: string, fn: FallbackFn): this {
    this.#fallbacks.set(name, fn);
    return this;
  }

  /** The breaker state of a policy and key (an open breaker whose wait has passed reads half-open). */
  breakerState(policy: string, key = ''): BreakerState | undefined {
    const index = this.policy(policy).index;
    checkKey(key);
    return this.#rt.use('breaker-state', (e) => e.breakerState(index, key, this.#now()));
  }

  /** Force a breaker state (forced-open, forced-closed, disabled); `closed` returns to normal. */
  setBreakerState(policy: string, state: BreakerState, key = ''): void {
    const index = this.policy(policy).index;
    checkKey(key);
    this.#rt.use('set-breaker-state', (e) => e.setBreakerState(index, key, state, this.#now()));
    // A breaker changed state: a trap from here on must restore it as it now is.
    this.#rt.checkpoint(this.#now());
  }

  /** What the engine knows of a live call (debugging). */
  callInfo(call: bigint): CallInfo | undefined {
    return this.#rt.use('call-info', (e) => e.callInfo(call));
  }

  /** The whole engine state as versioned bytes (to persist, share, or restore after a restart). */
  exportState(): Uint8Array {
    return this.#rt.exportState();
  }

  /** Restore exported state; what no longer applies is dropped. On error nothing changes. */
  importState(state: Uint8Array): void {
    this.#rt.importState(state);
  }

  /** The low-level engine of the component (the conformance runner drives it directly). */
  get engine(): Engine {
    this.#rt.flush();
    return this.#rt.engine;
  }

  /**
   * @internal The crossings of `levee-resilience/fleet` (fleet-plan, -merge, -apply, -inspect), with
   * this Levee's `now`: the held-back success is sent first, a trap recovers and is rethrown (as for
   * every crossing outside the call protocol), and with `drain` the events the crossing queued (a
   * breaker the fleet's quorum opened) are emitted at once.
   */
  fleetCrossing<R>(phase: string, drain: boolean, fn: (engine: Engine, now: bigint) => R): R {
    const out = this.#rt.use(phase, (e) => fn(e, this.#now()));
    if (drain) this.#rt.drain();
    return out;
  }

  /**
   * @internal The crossings of `levee-resilience/durable` (the executor's machine, an operator's
   * write): the held-back success is sent first, a trap recovers (the instance is replaced) and is
   * rethrown, and `fn` gets the engine with the component instance it lives in. A resource made
   * by one instance (the durable `Executor`) is only valid with that instance: the caller compares
   * `component` with the one its resource was made by, and makes a new one when they differ.
   */
  durableCrossing<R>(phase: string, fn: (engine: Engine, component: ComponentExports) => R): R {
    return this.#rt.use(phase, (e) => fn(e, this.#rt.component));
  }

  /** The instantiated component this host drives (its `Engine` class loads fresh engines). */
  get component(): ComponentExports {
    return this.#rt.component;
  }

  /**
   * Send any held-back success, stop the flush timer and release the component instance: a
   * graceful shutdown. A call in flight goes on until it next needs the engine: an attempt that
   * is running finishes, and if it returned the call returns its value (a fallback that is
   * running, likewise); otherwise, and for a call sleeping before a retry or waiting for a slot
   * (woken at once), the call rejects with `LeveeClosedError`. No attempt starts after close, and
   * nothing of it is an engine fault. Later calls, and the engine's state, reject or throw
   * `LeveeClosedError`.
   */
  close(): void {
    if (this.#closed) return;
    this.#closed = true;
    this.#rt.close();
    for (const sleeper of [...this.#sleepers]) sleeper.abort(CLOSED);
  }

  [Symbol.dispose](): void {
    this.close();
  }

  // ---------------------------------------------------------------- events

  on<K extends LeveeEventName>(name: K, listener: Listener<K>): this {
    this.#emitter.on(name, listener);
    return this;
  }

  off<K extends LeveeEventName>(name: K, listener: Listener<K>): this {
    this.#emitter.off(name, listener);
    return this;
  }

  once<K extends LeveeEventName>(name: K, listener: Listener<K>): this {
    this.#emitter.once(name, listener);
    return this;
  }

  /**
   * Send the success held back for batching (if any) and drain its events. Calls do this by
   * themselves; call it before reading state or events right after a success.
   */
  flush(): void {
    this.#rt.flush();
  }

  // ---------------------------------------------------------------- calls

  /**
   * Run `fn` under a policy: attempts with their timeout, retries after the core's delays, the
   * breaker, limits, deadline and fallbacks as the policy says. Resolves with the value of the
   * attempt (or fallback) that succeeded; rejects with a `LeveeError` that carries the reason and
   * the last error.
   */
  run<T>(
    policy: string | PolicyEntry,
    fn: (ctx: AttemptContext) => T | PromiseLike<T>,
    options?: RunOptions<T>,
  ): Promise<T> {
    const rt = this.#rt;
    const p = typeof policy === 'string' ? rt.byName.get(policy) : policy;
    if (p === undefined) return Promise.reject(rt.unknown(String(policy)));
    const signal = options?.signal;
    // The caller's cancellation is JavaScript's own: the signal's reason (docs/hosts.md, section 5).
    if (signal?.aborted) return Promise.reject(signal.reason);
    if (this.#closed) return Promise.reject(new LeveeClosedError());
    const now = this.#now();
    if (now > rt.nextCheckpoint) {
      rt.flush();
      rt.checkpoint(now);
    }
    const key = options?.key ?? '';
    if (key.length * 3 > GUARD_MAX_KEY_BYTES) {
      const err = keyError(key);
      if (err !== undefined) return Promise.reject(err);
    }
    const call = BigInt(this.#nextCall++);
    if (!rt.healthy && !rt.reinstantiate()) {
      // No instance to ask: the recovery path, as after a trap at `start`.
      return this.#drive(new CallDriver(p, now), this.#state(p, fn, options, key, call, rt.generation), undefined, now);
    }
    const gen = rt.generation;
    let v = rt.start(p, call, key, options === undefined ? 0 : startFlags(options), now);
    if (v !== undefined) {
      // The common case: attempt 1 without timeout (the policy has none, nor a deadline), no
      // events, no caller signal and no value to describe: a short path whose success is held
      // back for batching. (`0x100` is exactly that verdict; anything else goes through the driver.)
      const n = Number(v);
      if (n === 0x100 && p.attemptTimeoutNs === 0 && p.deadlineNs === 0 && signal === undefined) {
        if (
          options?.outcomeOf === undefined &&
          this.#spans === undefined &&
          options?.retryIf === undefined &&
          (this.#predicates.size === 0 || !this.#predicates.has(p.name))
        ) {
          return this.#fast(p, fn, options, key, call, now, gen);
        }
      } else if (n < 0) {
        // The core module's i64, read as the WIT's u64.
        v = BigInt.asUintN(64, v);
      }
    }
    return this.#drive(new CallDriver(p, now), this.#state(p, fn, options, key, call, gen), v, now);
  }

  #state<T>(
    p: PolicyEntry,
    fn: (ctx: AttemptContext) => T | PromiseLike<T>,
    options: RunOptions<T> | undefined,
    key: string,
    call: bigint,
    gen: number,
  ): CallState<T> {
    const st = new CallState(fn, options, key, call, gen);
    if (this.#spans !== undefined) {
      st.span = this.#spans.call(p.name, key);
      this.#callSpans.set(call, st.span);
    }
    return st;
  }

  /**
   * The first attempt of the common case. Not an `async` function: the attempt's promise gets one
   * reaction (read the clock, hold the success back) and the caller awaits the promise it returns,
   * the fewest hops and allocations that can still time the attempt.
   */
  #fast<T>(
    p: PolicyEntry,
    fn: (ctx: AttemptContext) => T | PromiseLike<T>,
    options: RunOptions<T> | undefined,
    key: string,
    call: bigint,
    started: bigint,
    gen: number,
  ): Promise<T> {
    let r: T | PromiseLike<T>;
    try {
      r = fn(FIRST_ATTEMPT);
    } catch (err) {
      return this.#firstDone(p, fn, options, key, call, started, gen, undefined, err, true);
    }
    const onValue = (value: T): T | Promise<T> => {
      const now = this.#now();
      if (this.#rt.generation !== gen)
        return this.#firstDone(p, fn, options, key, call, started, gen, value, undefined, false);
      this.#rt.hold(call, now, now - started);
      const telemetry = this.#telemetry;
      if (telemetry !== undefined) {
        telemetry.attempt(p.name, 'success', Number(now - started));
        telemetry.call(p.name, 'success', false, undefined);
      }
      return value;
    };
    const onError = (err: unknown): Promise<T> =>
      this.#firstDone(p, fn, options, key, call, started, gen, undefined, err, true);
    // A native promise (what an async function returns) gets its reaction directly; another
    // thenable is adopted first, as `await` would.
    if (r instanceof Promise) return (r as Promise<T>).then(onValue, onError);
    if (isThenable(r)) return Promise.resolve(r).then(onValue, onError);
    return Promise.resolve(onValue(r));
  }

  /** The first attempt of the short path ended other than as a held-back success: report it and drive on. */
  #firstDone<T>(
    p: PolicyEntry,
    fn: (ctx: AttemptContext) => T | PromiseLike<T>,
    options: RunOptions<T> | undefined,
    key: string,
    call: bigint,
    started: bigint,
    gen: number,
    value: T | undefined,
    err: unknown,
    threw: boolean,
  ): Promise<T> {
    const now = this.#now();
    const d = new CallDriver(p, started, 1, 'report');
    const st = new CallState(fn, options, key, call, gen);
    let outcome: Outcome;
    try {
      outcome = threw ? (options?.errorOutcome?.(err) ?? outcomeOfError(err)) : { kind: 'success' };
    } catch (failure) {
      return Promise.reject(failure);
    }
    if (threw) st.lastError = err;
    else st.value = st.lastResult = value;
    if (this.#closed) {
      if (!threw) {
        this.#ended(d, st, 'success');
        return Promise.resolve(value as T);
      }
      try {
        this.#closedEnd(d, st);
      } catch (closed) {
        return Promise.reject(closed);
      }
    }
    return this.#drive(d, st, this.#report(d, st, now, now - started, outcome), now);
  }

  /**
   * Park the call in the bulkhead queue (docs/policy.md, "The queue"): sleep the verdict's payload
   * on the Levee's clock, cut short when the core grants the call a slot and names it.
   * Registered before the first await, in the turn of the crossing that queued it, so no wake-up
   * is lost. Rejects with the caller's reason if `signal` aborts. It waits even under `noWaits`:
   * it waits for a slot, not a delay, and skipping it would only ask again at the same instant.
   */
  async #park<T>(d: CallDriver, st: CallState<T>, signal: AbortSignal | undefined): Promise<void> {
    if (signal?.aborted) throw signal.reason;
    const controller = new AbortController();
    const unpark = this.#rt.park(st.call, () => controller.abort(WOKEN));
    try {
      await this.#clock.sleep(
        d.sleepNs / 1e6,
        signal === undefined ? controller.signal : AbortSignal.any([signal, controller.signal]),
      );
    } catch (reason) {
      if (reason !== WOKEN) throw reason;
    } finally {
      unpark();
      // The clock may drop its timer (a woken park, or a sleep that ended by itself).
      controller.abort(WOKEN);
    }
  }

  /** Report an attempt (and count it); `undefined` after a trap. */
  #report<T>(
    d: CallDriver,
    st: CallState<T>,
    now: bigint,
    elapsed: bigint,
    outcome: Outcome,
    callerFlags = 0,
  ): bigint | undefined {
    const v = this.#rt.report(d.policy, st.key, st.call, now, elapsed, outcome, d.attempts, callerFlags);
    // Counted once the core has it (an attempt whose report trapped was never reported).
    if (v !== undefined) this.#telemetry?.attempt(d.policy.name, outcome.kind, Number(elapsed));
    return v;
  }

  /** The call ended: `levee.calls`, and the end of its span. */
  #ended<T>(d: CallDriver, st: CallState<T>, result: CallResult, reason?: Reason): void {
    this.#telemetry?.call(d.policy.name, result, d.attempts > 1, reason);
    const span = st.span;
    if (span !== undefined) {
      // The span of a call a fallback ended says what triggered it (docs/telemetry.md, "Spans").
      span.end(result, reason ?? (result === 'fallback' ? d.reason : undefined));
      this.#callSpans.delete(st.call);
    }
  }

  /** Deliver an event of call `call` in the context of its span, if it is still in progress. */
  #inCallSpan(call: bigint, fn: () => void): void {
    const span = this.#callSpans.get(call);
    if (span === undefined) fn();
    else span.run(fn);
  }

  /**
   * The Levee was closed while the call ran and it needs the engine again: it ends with
   * `LeveeClosedError` (a failure, without a reason of the core's), before any crossing.
   */
  #closedEnd<T>(d: CallDriver, st: CallState<T>): never {
    this.#ended(d, st, 'failure');
    throw new LeveeClosedError(d.policy.name, d.attempts, st.fallbackError ?? st.lastError, st.lastResult);
  }

  /**
   * The step loop, from verdict `v` (the answer of the driver's crossing, `undefined` when that
   * crossing trapped) on: the driver says what to do, this does it.
   */
  #drive<T>(d: CallDriver, st: CallState<T>, v: bigint | undefined, now: bigint): Promise<T> {
    const steps = this.#steps(d, st, v, now);
    // However the call ends (a describer that throws included), its span leaves the table.
    return st.span === undefined ? steps : steps.finally(() => this.#callSpans.delete(st.call));
  }

  async #steps<T>(d: CallDriver, st: CallState<T>, v: bigint | undefined, now: bigint): Promise<T> {
    const rt = this.#rt;
    const clock = this.#clock;
    const p = d.policy;
    const options = st.options;
    const signal = options?.signal;
    for (;;) {
      let act: Action;
      if (v === undefined) {
        act = d.recover(now);
      } else {
        act = d.next(v, now);
        if (act === ACT_FAULT) {
          rt.guestFault(d.fault as 'contract' | 'invalid', d.detail, d.op, p, st.key, st.call);
          act = d.recover(now);
        } else if (d.events) {
          rt.drain(st.call);
        }
      }

      if (act === ACT_ATTEMPT || act === ACT_DEGRADED) {
        if (this.#closed) return this.#closedEnd(d, st);
        const degraded = act === ACT_DEGRADED;
        const timeoutNs = d.timeoutNs;
        const ctx = new Attempt(d.attempts, timeoutNs / 1e6, signal, clock);
        const started = now;
        let outcome: Outcome | undefined;
        let elapsed: bigint;
        let callerFlags = 0;
        const span = st.span?.startAttempt(d.attempts, options?.method !== undefined, degraded);
        try {
          const r = span === undefined ? st.fn(ctx) : st.span!.within(span, () => st.fn(ctx));
          const result = timeoutNs > 0 || signal !== undefined ? await ctx.race(r) : isThenable(r) ? await r : r;
          now = this.#now();
          ctx.dispose();
          if (degraded) {
            // Its own result ends the call, whatever it is (a late success is a success).
            if (span !== undefined) CallSpan.endAttempt(span, options?.outcomeOf?.(result)?.kind ?? 'success');
            this.#ended(d, st, 'success');
            return result;
          }
          elapsed = now - started;
          outcome = options?.outcomeOf?.(result);
          if (span !== undefined) CallSpan.endAttempt(span, outcome?.kind ?? 'success');
          callerFlags = this.#ask(d, st, false, undefined, result);
          if (outcome === undefined || outcome.kind === 'success') {
            // A success is held back to ride on the next `start`, unless it is late (the core
            // must hear it: it is a timeout), its instance was replaced (the core answers), or
            // the caller's predicate wants it retried (the core decides).
            if (
              (timeoutNs === 0 || elapsed < BigInt(timeoutNs)) &&
              rt.generation === st.gen &&
              (callerFlags & REPORT_CALLER_RETRY) === 0
            ) {
              rt.hold(st.call, now, elapsed);
              this.#telemetry?.attempt(p.name, 'success', Number(elapsed));
              this.#ended(d, st, 'success');
              return result;
            }
            outcome = { kind: 'success' };
          }
          st.value = result;
          st.lastResult = result;
          st.lastError = undefined;
        } catch (err) {
          now = this.#now();
          ctx.dispose();
          const cancelled = ctx.callerAborted || (signal?.aborted === true && !ctx.timedOut);
          if (span !== undefined) {
            const kind = ctx.timedOut ? 'timeout' : (options?.errorOutcome?.(err) ?? outcomeOfError(err)).kind;
            CallSpan.endAttempt(span, cancelled ? 'cancelled' : kind);
          }
          if (cancelled) {
            // Cancelled by the caller, who has its answer at once; the attempt is not reported.
            // What it holds in the core (its bulkhead slot) is its own until it has ended: the
            // call is cancelled there once the attempt's promise settles (never, for a function
            // that ignores its signal and never settles).
            if (!degraded) {
              const gen = st.gen;
              void ctx.ended.then(() => rt.cancel(st.call, this.#now(), gen));
            }
            this.#ended(d, st, 'cancelled');
            throw signal!.reason;
          }
          if (degraded) {
            this.#ended(d, st, 'failure');
            throw err;
          }
          if (ctx.timedOut) {
            // Reported once the attempt has ended (its bulkhead slot is held until then), with the
            // time it took (at least the timeout).
            outcome = { kind: 'timeout' };
            elapsed = now - started;
            if (elapsed < BigInt(timeoutNs)) elapsed = BigInt(timeoutNs);
          } else {
            outcome = options?.errorOutcome?.(err) ?? outcomeOfError(err);
            elapsed = now - started;
          }
          callerFlags = this.#ask(d, st, true, err, undefined);
          st.lastError = err;
          st.lastResult = undefined;
          st.value = undefined;
        }
        if (this.#closed) {
          // Closed while the attempt ran: what it returned (in time) is the call's answer, as
          // what has happened stands; an error would need the engine, which is gone.
          if (st.lastError === undefined && !ctx.timedOut) {
            this.#ended(d, st, 'success');
            return st.value as T;
          }
          return this.#closedEnd(d, st);
        }
        v = this.#report(d, st, now, elapsed, outcome, callerFlags);
        continue;
      }

      if (act === ACT_HEDGE) {
        // The hedged attempts run until a command ends the call; its verdict (`undefined`: the
        // recovery path, with the attempt whose own result ends the call in `st`) goes on here.
        const end = await this.#hedged(d, st, now);
        if (end.done) return end.value as T;
        v = end.verdict;
        now = end.now;
        continue;
      }

      if (act === ACT_SLEEP) {
        if (this.#closed) return this.#closedEnd(d, st);
        if (d.retry) this.#onRetry(d, st);
        // `close` ends the sleep (its own controller: a composite on a signal that lives as long
        // as the Levee would pile up in it), as the caller's signal does.
        const sleeper = new AbortController();
        this.#sleepers.add(sleeper);
        const under = signal === undefined ? sleeper.signal : AbortSignal.any([signal, sleeper.signal]);
        try {
          if (d.park) await this.#park(d, st, under);
          else await clockWait(clock, d.sleepNs / 1e6, under);
        } catch (reason) {
          if (reason === CLOSED) return this.#closedEnd(d, st);
          now = this.#now();
          rt.cancel(st.call, now, st.gen);
          this.#ended(d, st, 'cancelled');
          throw reason;
        } finally {
          this.#sleepers.delete(sleeper);
        }
        if (this.#closed) return this.#closedEnd(d, st);
        now = this.#now();
        if (st.value !== undefined && options?.discard !== undefined) {
          options.discard(st.value);
          st.value = undefined;
        }
        v = rt.acquire(p, st.key, st.call, now, d.attempts);
        continue;
      }

      if (act === ACT_FALLBACK) {
        const name = d.fallbackName;
        const fb = options?.fallbacks?.[name] ?? (this.#fallbacks.get(name) as FallbackFn<T> | undefined);
        let ok = false;
        const previous = st.fallbackError;
        st.fallbackError = undefined;
        st.fallbackName = name;
        if (fb === undefined) {
          // Counted as failed; the error that ends the call names it (the attempt's error stands).
          if (!st.unregistered.includes(name)) st.unregistered.push(name);
        } else {
          try {
            const r = fb({
              name,
              policy: p.name,
              reason: d.reason,
              attempts: d.attempts,
              lastError: st.lastError,
              lastResult: st.lastResult,
              fallbackError: previous,
              signal,
              request: options?.request,
            });
            const fallbackValue = isThenable(r) ? await r : r;
            if (options?.acceptFallback !== undefined && !options.acceptFallback(fallbackValue)) {
              st.fallbackError = new TypeError(`levee: fallback "${name}" returned a value of the wrong type`);
            } else {
              st.fallbackValue = fallbackValue;
              st.fellBack = true;
              ok = true;
            }
          } catch (err) {
            st.fallbackError = err;
          }
        }
        if (this.#closed) {
          // Closed while the fallback ran: its value is the call's answer; a failure would need the engine.
          if (ok) {
            this.#ended(d, st, 'fallback');
            return st.fallbackValue as T;
          }
          return this.#closedEnd(d, st);
        }
        now = this.#now();
        v = rt.reportFallback(p, st.key, st.call, now, ok, d.attempts);
        continue;
      }

      if (act === ACT_DONE) {
        if (st.fellBack) {
          this.#ended(d, st, 'fallback');
          return st.fallbackValue as T;
        }
        if (st.lastError !== undefined) {
          // The core ended the call on an attempt that threw: the attempt's own error stands.
          this.#ended(d, st, 'failure');
          throw st.lastError;
        }
        this.#ended(d, st, 'success');
        return st.value as T;
      }

      if (act === ACT_END_ATTEMPT) {
        // Recovery after the report of an attempt: its own result, value or error.
        if (st.lastError !== undefined) {
          this.#ended(d, st, 'failure');
          throw st.lastError;
        }
        this.#ended(d, st, 'success');
        return st.lastResult as T;
      }

      if (act === ACT_END_FALLBACK) {
        // Recovery after the report of a fallback: its own result, value or error.
        if (st.fellBack) {
          this.#ended(d, st, 'fallback');
          return st.fallbackValue as T;
        }
        this.#ended(d, st, 'failure');
        throw st.fallbackError ?? st.lastError;
      }

      // ACT_FAIL: the core's reason.
      this.#ended(d, st, 'failure', d.reason);
      throw new LeveeError(d.reason, {
        policy: p.name,
        attempts: d.attempts,
        lastError: st.lastError,
        lastResult: st.lastResult,
        retryAfterMs: d.hintNs > 0 ? d.hintNs / 1e6 : undefined,
        unregistered: st.unregistered,
        fallbackError: st.fallbackError,
        fallbackName: st.fallbackName,
      });
    }
  }

  /**
   * A hedged call (docs/policy.md, "Hedging", "Host contract"), from its `hedge` verdict at `now`:
   * attempt 1 runs under the verdict's timeout, then the commands of `hedge-step` and
   * `report-attempt`, checked by the hedge driver, are carried out in order: `start` runs an
   * attempt concurrently with its own AbortController (and its timeout), `cancel` aborts one and
   * reports it once it has closed, `wait` sleeps on the Levee's clock until the time comes or an
   * attempt closes, whichever is first, and `end` hands the step loop its verdict, handled as a
   * `report` answer (the attempt it names is the call's last attempt). Attempts the core cancelled
   * are still reported as they close, after the caller has its answer. The caller's abort aborts
   * every attempt and cancels the call. A fault (a trap, an answer that breaks the contract, an
   * `invalid` end) takes the one recovery path: one attempt goes on alone and its own result ends
   * the call (verdict `undefined`).
   */
  async #hedged<T>(
    d: CallDriver,
    st: CallState<T>,
    now: bigint,
  ): Promise<{ verdict: bigint | undefined; now: bigint; done?: boolean; value?: T }> {
    const rt = this.#rt;
    const p = d.policy;
    const options = st.options;
    const signal = options?.signal;
    const http = options?.method !== undefined;
    const hd = new HedgeDriver(d.deadline);
    const flights: Flight<T>[] = [];
    const closed: Flight<T>[] = [];
    /** 0: the core drives; 1: the call ended, closing attempts are reported; 2: recovery or cancelled, they are not. */
    let phase: 0 | 1 | 2 = 0;
    let wake: (() => void) | undefined;
    const notify = (): void => {
      const w = wake;
      wake = undefined;
      w?.();
    };

    // What a closed attempt reports: its outcome, its elapsed time and the caller's predicate.
    const outcomeOf = (f: Flight<T>, ask: boolean): [Outcome, bigint, number] => {
      if (f.threw && f.ctx.timedOut) {
        return [{ kind: 'timeout' }, BigInt(f.timeoutNs), ask ? this.#ask(d, st, true, f.error, undefined, f.n) : 0];
      }
      const elapsed = f.at - f.started;
      let outcome: Outcome;
      try {
        outcome = f.threw
          ? (options?.errorOutcome?.(f.error) ?? outcomeOfError(f.error))
          : (options?.outcomeOf?.(f.value as T) ?? { kind: 'success' });
      } catch (err) {
        if (ask) throw err;
        // A cancelled attempt's outcome is not looked at: a describer that throws on it changes nothing.
        outcome = { kind: 'error-class', name: 'Error' };
      }
      return [outcome, elapsed, ask ? this.#ask(d, st, f.threw, f.error, f.value, f.n) : 0];
    };

    // Report a closed attempt (`live`: one the core did not cancel, whose outcome it looks at,
    // and which counts in `levee.attempts`; a cancelled one only frees what it held).
    const report = (f: Flight<T>, at: bigint, live: boolean): HedgeAnswer | undefined => {
      const [outcome, elapsed, flags] = outcomeOf(f, live);
      const a = rt.reportAttempt(p, st.key, st.call, f.n, at, elapsed, outcome, flags, hd.started);
      if (a !== undefined) {
        hd.closed(f.n);
        if (live) this.#telemetry?.attempt(p.name, outcome.kind, Number(elapsed));
      }
      return a;
    };

    // After the end: an attempt the core cancelled is reported when it closes, and its value freed.
    const reportLate = (f: Flight<T>): void => {
      if (!f.threw && f.value !== undefined && options?.discard !== undefined) {
        try {
          options.discard(f.value);
        } catch (err) {
          // The call is over: nobody to hand the error to.
          reportHookError(err, `discard function of a call of policy "${p.name}"`, this.#observerError);
        }
      }
      if (rt.generation !== st.gen || rt.closed) return;
      const a = report(f, this.#now(), false);
      if (a?.eventsPending) rt.drain(st.call);
    };

    const onClose = (f: Flight<T>, threw: boolean, value: T | undefined, error: unknown): void => {
      f.ctx.dispose();
      f.closed = true;
      f.at = this.#now();
      f.threw = threw;
      f.value = value;
      f.error = error;
      if (f.span !== undefined) {
        let kind: string = hd.cancelled.has(f.n) || phase === 2 ? 'cancelled' : f.ctx.timedOut ? 'timeout' : '';
        if (kind === '') {
          try {
            kind = threw
              ? (options?.errorOutcome?.(error) ?? outcomeOfError(error)).kind
              : (options?.outcomeOf?.(value as T)?.kind ?? 'success');
          } catch {
            // The describer's error surfaces where the attempt is reported.
            kind = 'error-class';
          }
        }
        CallSpan.endAttempt(f.span, kind);
      }
      if (phase === 1) reportLate(f);
      else {
        closed.push(f);
        notify();
      }
    };

    const launch = (n: number, timeoutNs: number, at: bigint): void => {
      const ctx = new Attempt(n, timeoutNs / 1e6, undefined, this.#clock, true);
      const span = st.span?.startAttempt(n, http, false);
      const f = new Flight<T>(n, ctx, at, timeoutNs, span);
      flights[n] = f;
      let r: T | PromiseLike<T>;
      try {
        r = span === undefined ? st.fn(ctx) : st.span!.within(span, () => st.fn(ctx));
      } catch (err) {
        r = Promise.reject(err);
      }
      ctx.race(r).then(
        (value) => onClose(f, false, value, undefined),
        (error: unknown) => onClose(f, true, undefined, error),
      );
    };

    const abortAll = (reason: unknown): void => {
      for (const f of flights) if (f !== undefined && !f.closed) f.ctx.cancel(reason);
    };

    // The call's attempt values that will not be returned are freed (say, response bodies).
    const discardBut = (keep: Flight<T> | undefined): void => {
      const discard = options?.discard;
      if (discard === undefined) return;
      for (const f of flights) {
        if (f !== undefined && f !== keep && f.closed && !f.threw && f.value !== undefined) discard(f.value);
      }
    };

    const cancelled = (): never => {
      phase = 2;
      abortAll(signal!.reason);
      // The caller has its answer at once; what the attempts hold in the core (their bulkhead
      // slots) is theirs until each has ended: the call is cancelled there once they all have.
      const open = flights.filter((f) => f !== undefined && !f.closed).map((f) => f.ctx.ended);
      if (open.length === 0) rt.cancel(st.call, this.#now(), st.gen);
      else void Promise.all(open).then(() => rt.cancel(st.call, this.#now(), st.gen));
      d.attempts = hd.started;
      this.#ended(d, st, 'cancelled');
      throw signal!.reason;
    };

    const use = (f: Flight<T>): void => {
      st.value = f.threw ? undefined : f.value;
      st.lastResult = f.threw ? undefined : f.value;
      st.lastError = f.threw ? f.error : undefined;
    };

    // The Levee was closed while the call ran (`close`): no crossing, no attempt started. An
    // attempt that has already returned is the call's answer (a success first); the others are
    // aborted, and the call ends with `LeveeClosedError` (the last attempt's error as its cause).
    const shut = (): { verdict: undefined; now: bigint; done: true; value: T } => {
      phase = 2;
      const succeeded = (f: Flight<T>): boolean => {
        try {
          return (options?.outcomeOf?.(f.value as T)?.kind ?? 'success') === 'success';
        } catch {
          return false;
        }
      };
      const done = flights.filter((f) => f !== undefined && f.closed && !hd.cancelled.has(f.n));
      const returned = done.filter((f) => !f.threw && !f.ctx.timedOut);
      const ok = returned.find(succeeded) ?? returned[0];
      abortAll(new LeveeClosedError(p.name, hd.started));
      d.attempts = hd.started;
      if (ok !== undefined) {
        use(ok);
        discardBut(ok);
        this.#ended(d, st, 'success');
        return { verdict: undefined, now: this.#now(), done: true, value: ok.value as T };
      }
      const last = done[done.length - 1];
      if (last !== undefined) use(last);
      discardBut(undefined);
      return this.#closedEnd(d, st);
    };

    // The one recovery path (conformance/hosts/README.md, "A fault"): `failed`, a live attempt
    // whose report failed, ends the call with its own result; otherwise the oldest attempt in
    // flight, which runs with the core's leave, goes on alone and its own result ends the call.
    // Every other attempt is aborted, and nothing more is reported to the core. With no attempt
    // in flight, the step loop runs one degraded attempt.
    const recover = async (failed: Flight<T> | undefined): Promise<{ verdict: undefined; now: bigint }> => {
      phase = 2;
      // An `invalid` answer leaves the instance: what the call may still hold there is freed.
      rt.cancel(st.call, this.#now(), st.gen);
      let keep = failed !== undefined && !hd.cancelled.has(failed.n) ? failed : undefined;
      keep ??= flights.find((f) => f !== undefined && !f.closed && !hd.cancelled.has(f.n));
      for (const f of flights) {
        if (f !== undefined && f !== keep && !f.closed) {
          f.ctx.cancel(new DOMException(`levee: attempt ${f.n} aborted: the call goes on degraded`, 'AbortError'));
        }
      }
      d.attempts = hd.started;
      if (keep === undefined) {
        // No attempt in flight with the core's leave: the step loop runs one degraded attempt.
        discardBut(undefined);
        d.op = 'acquire';
        return { verdict: undefined, now: this.#now() };
      }
      const kept = keep;
      if (!kept.closed) {
        await new Promise<void>((resolve) => {
          const check = (): void => {
            if (kept.closed || signal?.aborted) resolve();
            else wake = check;
          };
          check();
        });
        if (!kept.closed) {
          kept.ctx.cancel(signal!.reason);
          d.attempts = hd.started;
          this.#ended(d, st, 'cancelled');
          throw signal!.reason;
        }
      }
      use(kept);
      discardBut(kept);
      d.attempts = hd.started;
      d.op = 'report';
      return { verdict: undefined, now: this.#now() };
    };

    // The caller's abort reaches every attempt at once (each has its own controller, linked here).
    const onAbort = (): void => {
      if (phase !== 1) abortAll(signal!.reason);
      notify();
    };
    signal?.addEventListener('abort', onAbort, { once: true });
    // `close` wakes the call's wait too.
    const closing = new AbortController();
    closing.signal.addEventListener('abort', notify, { once: true });
    this.#sleepers.add(closing);
    try {
      launch(1, d.timeoutNs, now);
      d.op = 'hedge-step';
      let reported: Flight<T> | undefined;
      let a = rt.hedgeStep(p, st.key, st.call, now, hd.started);
      for (;;) {
        if (a === undefined) return await recover(reported);
        if (a.eventsPending) rt.drain(st.call);
        const steps = hd.check(a, now);
        if (typeof steps === 'string') {
          rt.guestFault('contract', `${steps} (answered to ${d.op})`, d.op, p, st.key, st.call);
          return await recover(reported);
        }
        let waitNs = -1;
        let end: (HedgeStep & { kind: 'end' }) | undefined;
        for (const step of steps) {
          hd.apply(step);
          switch (step.kind) {
            case 'start':
              launch(step.attempt, step.timeoutNs, now);
              break;
            case 'cancel': {
              const f = flights[step.attempt];
              if (f !== undefined && !f.closed) {
                f.ctx.cancel(
                  new DOMException(
                    `levee: attempt ${step.attempt} cancelled: the hedged call is done with it`,
                    'AbortError',
                  ),
                );
              }
              break;
            }
            case 'wait':
              waitNs = step.delayNs;
              break;
            case 'end':
              end = step;
              break;
          }
        }
        if (end !== undefined) {
          if (end.attempt === 0) {
            // `invalid`: the engine does not know this hedged call (evicted, or an instance replaced).
            rt.guestFault('invalid', `the engine answered invalid to ${d.op}`, d.op, p, st.key, st.call);
            return await recover(reported);
          }
          // The call is over. An attempt the core left running is aborted as well (it cancels
          // every one it leaves: this only makes sure none runs on unseen).
          for (const f of flights) {
            if (f !== undefined && !f.closed && !hd.cancelled.has(f.n)) {
              hd.cancelled.add(f.n);
              f.ctx.cancel(new DOMException(`levee: attempt ${f.n} cancelled: the hedged call is over`, 'AbortError'));
            }
          }
          phase = 1;
          const chosen = flights[end.attempt]!;
          use(chosen);
          discardBut(chosen);
          d.attempts = hd.started;
          d.op = 'report';
          // Attempts that closed meanwhile are reported now; the others when they close.
          for (const f of closed.splice(0)) reportLate(f);
          return { verdict: end.verdict, now };
        }
        if (closed.length === 0 && waitNs !== 0 && !signal?.aborted) {
          // Sleep the wait's delay on the Levee's clock (under the caller's signal: it is the
          // call's sleep), cut short when an attempt closes; no delay: until an attempt closes.
          let cancelTimer: (() => void) | undefined;
          await new Promise<void>((resolve) => {
            wake = resolve;
            if (waitNs < 0) return;
            // A timer that fires as an attempt closes must not wake the next wait.
            const fire = (): void => {
              if (wake === resolve) notify();
            };
            if (signal === undefined || this.#clock.sleep === sleep) {
              // The event loop's timer on the real clock (the caller's abort wakes the loop itself).
              cancelTimer = clockTimer(this.#clock, waitNs / 1e6, fire);
            } else {
              // Another clock sleeps under the caller's signal: the wait is the call's sleep.
              const timer = new AbortController();
              this.#clock.sleep(waitNs / 1e6, AbortSignal.any([signal, timer.signal])).then(fire, () => undefined);
              cancelTimer = () => timer.abort(HEDGE_WAIT_OVER);
            }
          });
          wake = undefined;
          cancelTimer?.();
          // Attempts that close at the same instant all close before one is reported, and the
          // lowest number goes first (conformance/hosts: the order must not depend on the
          // scheduler): a wait of 0 on the Levee's clock, which a virtual clock ends once the
          // program is idle, before its time moves (the real clock ends it at once).
          if (closed.length > 0 && flights.some((f) => f !== undefined && !f.closed)) await this.#clock.sleep(0);
        }
        if (signal?.aborted) return cancelled();
        if (this.#closed) return shut();
        now = this.#now();
        reported = lowest(closed);
        if (reported !== undefined) {
          d.op = 'report-attempt';
          a = report(reported, now, !hd.cancelled.has(reported.n));
        } else {
          d.op = 'hedge-step';
          a = rt.hedgeStep(p, st.key, st.call, now, hd.started);
        }
      }
    } catch (err) {
      // A describer or the step loop threw: no attempt of this call runs on.
      if (phase === 0) {
        phase = 2;
        abortAll(err);
        rt.cancel(st.call, this.#now(), st.gen);
      }
      throw err;
    } finally {
      signal?.removeEventListener('abort', onAbort);
      this.#sleepers.delete(closing);
    }
  }

  /** The caller's predicate (the call's, else the policy's) on an attempt to report, as report flags. */
  #ask<T>(
    d: CallDriver,
    st: CallState<T>,
    threw: boolean,
    error: unknown,
    value: T | undefined,
    attempt = d.attempts,
  ): number {
    const predicate = st.options?.retryIf ?? (this.#predicates.get(d.policy.name) as RetryPredicate<T> | undefined);
    if (predicate === undefined) return 0;
    let answer: boolean | undefined | void;
    try {
      answer = predicate({ attempt, threw, error, value });
    } catch (err) {
      const whose = st.options?.retryIf !== undefined ? 'retryIf predicate of a call of' : 'retryIf predicate of';
      reportHookError(err, `${whose} policy "${d.policy.name}"`, this.#observerError);
      return 0;
    }
    return answer === true ? REPORT_CALLER_RETRY : answer === false ? REPORT_CALLER_NO_RETRY : 0;
  }

  /** The `onRetry` hooks (the call's, then the policy's), before the sleep of a retry. */
  #onRetry<T>(d: CallDriver, st: CallState<T>): void {
    const own = st.options?.onRetry;
    const hooks = this.#retryHooks.get(d.policy.name);
    if (own === undefined && hooks === undefined) return;
    const info: RetryInfo = {
      policy: d.policy.name,
      key: st.key,
      attempt: d.attempts,
      delay: d.sleepNs / 1e9,
      error: st.lastError,
      result: st.lastError === undefined ? st.lastResult : undefined,
      reason: 'none',
    };
    for (const hook of own === undefined ? (hooks ?? []) : [own, ...(hooks ?? [])]) {
      try {
        hook(info);
      } catch (err) {
        const whose = hook === own ? 'onRetry hook of a call of' : 'onRetry hook of';
        reportHookError(err, `${whose} policy "${d.policy.name}"`, this.#observerError);
      }
    }
  }
}

/** Take the lowest-numbered attempt out of `closed`. */
function lowest<T>(closed: Flight<T>[]): Flight<T> | undefined {
  if (closed.length === 0) return undefined;
  let at = 0;
  for (let i = 1; i < closed.length; i++) if (closed[i]!.n < closed[at]!.n) at = i;
  return closed.splice(at, 1)[0];
}

/** One attempt of a hedged call: its context (its own signal and timeout), span and result. */
class Flight<T> {
  readonly n: number;
  readonly ctx: Attempt;
  /** When it started (ns, the Levee's clock). */
  readonly started: bigint;
  readonly timeoutNs: number;
  readonly span: SpanHandle | undefined;
  /** Its race has settled: the attempt answered, threw, or its timeout fired. */
  closed = false;
  /** When it closed. */
  at = 0n;
  threw = false;
  value: T | undefined = undefined;
  error: unknown = undefined;

  constructor(n: number, ctx: Attempt, started: bigint, timeoutNs: number, span: SpanHandle | undefined) {
    this.n = n;
    this.ctx = ctx;
    this.started = started;
    this.timeoutNs = timeoutNs;
    this.span = span;
  }
}

/** What the step loop keeps of one call. */
class CallState<T> {
  readonly fn: (ctx: AttemptContext) => T | PromiseLike<T>;
  readonly options: RunOptions<T> | undefined;
  readonly key: string;
  readonly call: bigint;
  readonly gen: number;
  /** The value of the last attempt (until a retry discards it). */
  value: T | undefined = undefined;
  lastError: unknown = undefined;
  lastResult: unknown = undefined;
  fellBack = false;
  fallbackValue: T | undefined = undefined;
  fallbackError: unknown = undefined;
  /** The name of the fallback that ran last. */
  fallbackName = '';
  readonly unregistered: string[] = [];
  span: CallSpan | undefined = undefined;

  constructor(
    fn: (ctx: AttemptContext) => T | PromiseLike<T>,
    options: RunOptions<T> | undefined,
    key: string,
    call: bigint,
    gen: number,
  ) {
    this.fn = fn;
    this.options = options;
    this.key = key;
    this.call = call;
    this.gen = gen;
  }
}

/**
 * The OpenTelemetry sink when `@opentelemetry/api` can be imported: its global meter `levee`, and
 * events on the active span.
 */
export async function defaultTelemetry(meter?: MeterLike): Promise<TelemetrySink | undefined> {
  try {
    const api = (await import('@opentelemetry/api')) as {
      metrics: { getMeter(name: string, version?: string): MeterLike };
      trace: { getActiveSpan(): SpanLike | undefined };
    };
    return new OpenTelemetrySink(meter ?? api.metrics.getMeter('levee', '0.1.0'), () => api.trace.getActiveSpan());
  } catch {
    return meter === undefined ? undefined : new OpenTelemetrySink(meter);
  }
}

/** The sink of the load options without looking for OpenTelemetry (`telemetry`, else one on `meter`). */
export function sinkOf(options: LoadOptions): TelemetrySink | undefined {
  if (options.telemetry !== undefined) return options.telemetry ?? undefined;
  return options.meter ? new OpenTelemetrySink(options.meter) : undefined;
}

/** `@opentelemetry/api` for `spans: true`. */
export async function loadSpans(options: LoadOptions): Promise<OpenTelemetryApiLike | undefined> {
  if (options.spans !== true) return undefined;
  return (await import('@opentelemetry/api')) as unknown as OpenTelemetryApiLike;
}

/** The sink of the load options, with `@opentelemetry/api`'s global meter when nothing says otherwise. */
export async function loadSink(options: LoadOptions): Promise<TelemetrySink | undefined> {
  if (options.telemetry !== undefined || options.meter === null) return sinkOf(options);
  return defaultTelemetry(options.meter);
}

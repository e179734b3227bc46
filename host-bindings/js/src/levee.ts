// The Levee host's public API: `Levee` (load a document, `run` calls under its policies), on the
// driver (driver.ts: verdict -> action) and the runtime glue (runtime.ts: the component, its
// crossings, snapshots and trap recovery). Every decision (what is retried, how long to wait,
// whether a breaker admits) comes from the core; this file does the I/O: attempts under an
// AbortSignal timeout, sleeps, fallbacks, all on the Levee's clock.

import type { Engine } from '../wasm/interfaces/levee-policy-engine-api.js';
import type { Analysis, BreakerState, CallInfo } from '../wasm/interfaces/levee-policy-types.js';
import { Attempt, FIRST_ATTEMPT, isThenable } from './attempt.js';
import type { AttemptContext } from './attempt.js';
import { clockWait, realClock } from './clock.js';
import type { Clock } from './clock.js';
import { ACT_ATTEMPT, ACT_DONE, ACT_FALLBACK, ACT_SLEEP, CallDriver } from './driver.js';
import { LeveeError, outcomeOfError } from './errors.js';
import type { FailureReason, Outcome } from './errors.js';
import { Emitter, Metrics } from './events.js';
import type { LeveeEventName, Listener, MeterLike } from './events.js';
import { DEFAULT_MAX_MEMORY_BYTES, Runtime, startFlags } from './runtime.js';
import type { ComponentExports, InstantiateCore, Platform, PolicyEntry, TraceStep } from './runtime.js';
import { KIND_ATTEMPT } from './verdict.js';

export type { AttemptContext } from './attempt.js';
export type { Clock } from './clock.js';
export { sleep } from './clock.js';
export type { ComponentExports, InstantiateCore, Platform, PolicyEntry, TraceStep } from './runtime.js';
export { DEFAULT_MAX_MEMORY_BYTES, startFlags } from './runtime.js';

/** What a fallback function receives. */
export interface FallbackContext {
  /** The fallback's name, as the policy's chain names it. */
  name: string;
  policy: string;
  /** What triggered it (the core's reason). */
  reason: FailureReason;
  /** The error of the last attempt (or of the previous fallback), if any. */
  lastError: unknown;
  /** The value of the last attempt when the policy classified it as a failure (a 503 response). */
  lastResult: unknown;
  /** The caller's signal, if any. */
  signal: AbortSignal | undefined;
}

export type FallbackFn<T = unknown> = (ctx: FallbackContext) => T | Promise<T>;

export interface RunOptions<T> {
  /** A key for per-key state (breakers, buckets), e.g. a downstream host. Default "". */
  key?: string;
  /** The caller's signal: aborting it cancels the call (attempt and sleeps). */
  signal?: AbortSignal;
  /** The operation is idempotent (default true). When false the core retries it only with a key. */
  idempotent?: boolean;
  /** The operation carries an idempotency key (so the core may retry it even if not idempotent). */
  idempotencyKey?: boolean;
  /** The HTTP method of the operation, if it is one (the core knows which methods are idempotent). */
  method?: string;
  /** Describe a value an attempt returned (e.g. an HTTP response); `undefined` means success. */
  outcomeOf?: (value: T) => Outcome | undefined;
  /** Describe an error an attempt threw (default: `outcomeOfError`). */
  errorOutcome?: (error: unknown) => Outcome | undefined;
  /** Fallbacks for this call, by name (they take precedence over those registered on the engine). */
  fallbacks?: Record<string, FallbackFn<T>>;
  /** Called with a returned value that a retry supersedes (e.g. to free a response body). */
  discard?: (value: T) => void;
  /** Checks a fallback's value; a value it refuses counts as a failed fallback (e.g. not a Response). */
  acceptFallback?: (value: unknown) => boolean;
}

export interface LoadOptions {
  /** The seed of the core's PRNG (jitter). Default: from the OS random source. */
  seed?: bigint | number;
  /** Fallback functions, by the names the policies' chains use. */
  fallbacks?: Record<string, FallbackFn>;
  /** An OpenTelemetry meter; default: `@opentelemetry/api`'s global meter when the package is present. */
  meter?: MeterLike | null;
  /**
   * The clock of this Levee: every `now` it gives the core, the sleeps between attempts and the
   * attempts' timeouts. Default: the runtime's monotonic clock and the event loop's timers. Tests
   * pass a `VirtualClock` from `levee-resilience/testing`.
   */
  clock?: Clock;
  /**
   * How often (at most) the state is exported for trap recovery, in ms. Default 1000. Whatever
   * the interval, the state is also exported whenever a breaker changes state, and after
   * `setBreakerState`, `reload` and `importState`, so a trap never forgets a trip.
   */
  checkpointIntervalMs?: number;
  /** jco's core instantiation hook (instrumentation, fault injection). */
  instantiateCore?: InstantiateCore;
  /**
   * Bound on the component's memory, in bytes (default 512 MiB, as in every host: see
   * docs/architecture.md, "Bounds on the guest"). Checked at each checkpoint; a component above
   * it is treated as faulty: re-instantiated with the last exported state. (A JavaScript engine
   * cannot interrupt a synchronous Wasm call, so this host bounds no guest call in time.)
   */
  maxMemoryBytes?: number;
  /** Called after every step of every call with the core's verdict (debugging, demos). */
  trace?: (step: TraceStep) => void;
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
  readonly #emitter = new Emitter();
  #closed = false;
  #nextCall = 1;

  /** @internal Use `load` from `levee` (Node) or `levee/worker`. */
  constructor(platform: Platform, document: string, options: LoadOptions, meter: MeterLike | undefined) {
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
        checkpointNs: BigInt(Math.round((options.checkpointIntervalMs ?? 1000) * 1e6)),
        maxMemoryBytes: options.maxMemoryBytes ?? DEFAULT_MAX_MEMORY_BYTES,
        trace: options.trace,
        wallMs: wall === undefined ? Date.now : () => wall.call(clock),
      },
      this.#emitter,
      meter ? new Metrics(meter) : undefined,
    );
    for (const [name, fn] of Object.entries(options.fallbacks ?? {})) this.#fallbacks.set(name, fn);
  }

  // ---------------------------------------------------------------- policies and state

  /** The policies of the document, in order. */
  get policies(): readonly PolicyEntry[] {
    return this.#rt.policies;
  }

  /** A policy by name (throws on an unknown name). */
  policy(name: string): PolicyEntry {
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

  /** Register (or replace) a fallback function under the name a policy's chain uses. */
  fallback(name: string, fn: FallbackFn): this {
    this.#fallbacks.set(name, fn);
    return this;
  }

  /** The breaker state of a policy and key (an open breaker whose wait has passed reads half-open). */
  breakerState(policy: string, key = ''): BreakerState | undefined {
    const index = this.policy(policy).index;
    return this.#rt.use('breaker-state', (e) => e.breakerState(index, key, this.#now()));
  }

  /** Force a breaker state (forced-open, forced-closed, disabled); `closed` returns to normal. */
  setBreakerState(policy: string, state: BreakerState, key = ''): void {
    const index = this.policy(policy).index;
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

  /** The instantiated component this host drives (its `Engine` class loads fresh engines). */
  get component(): ComponentExports {
    return this.#rt.component;
  }

  /**
   * Send any held-back success, stop the flush timer and release the component instance. The
   * Levee must not be used afterwards.
   */
  close(): void {
    this.#rt.close();
    this.#closed = true;
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
    if (signal?.aborted) {
      return Promise.reject(new LeveeError('cancelled', { policy: p.name, attempts: 0, lastError: signal.reason }));
    }
    if (this.#closed) return Promise.reject(new Error('levee: this Levee was closed'));
    const now = this.#now();
    if (now > rt.nextCheckpoint) {
      rt.flush();
      rt.checkpoint(now);
    }
    if (!rt.healthy && !rt.reinstantiate()) {
      return this.#single(new CallDriver(p, now), fn, options, now, undefined);
    }
    const gen = rt.generation;
    const call = BigInt(this.#nextCall++);
    let v = rt.start(p, call, options?.key ?? '', options === undefined ? 0 : startFlags(options), now);
    if (v === undefined) return this.#single(new CallDriver(p, now), fn, options, now, undefined);
    // The common case: a first attempt without timeout, deadline, caller signal or value to
    // describe, and no events: run it on a short path whose success is held back for batching.
    let n = Number(v);
    if (n < 0) {
      // The core module's i64, read as the WIT's u64.
      v = BigInt.asUintN(64, v);
      n = Number(v);
    }
    if (
      n < 0x10000 &&
      (n & 0x1f) === KIND_ATTEMPT &&
      p.deadlineNs === 0 &&
      signal === undefined &&
      options?.outcomeOf === undefined
    ) {
      return this.#fast(p, fn, options, call, now, gen);
    }
    return this.#drive(new CallDriver(p, now), fn, options, call, v, now, gen, undefined);
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
    call: bigint,
    started: bigint,
    gen: number,
  ): Promise<T> {
    let r: T | PromiseLike<T>;
    try {
      r = fn(FIRST_ATTEMPT);
    } catch (err) {
      return this.#firstFailed(p, fn, options, call, started, gen, err);
    }
    const onValue = (value: T): T => {
      this.#succeeded(call, started, gen);
      return value;
    };
    const onError = (err: unknown): Promise<T> => this.#firstFailed(p, fn, options, call, started, gen, err);
    // A native promise (what an async function returns) gets its reaction directly; another
    // thenable is adopted first, as `await` would.
    if (r instanceof Promise) return (r as Promise<T>).then(onValue, onError);
    if (isThenable(r)) return Promise.resolve(r).then(onValue, onError);
    this.#succeeded(call, started, gen);
    return Promise.resolve(r);
  }

  #succeeded(call: bigint, started: bigint, gen: number): void {
    const now = this.#now();
    if (this.#rt.generation === gen) this.#rt.hold(call, now, now - started);
  }

  #firstFailed<T>(
    p: PolicyEntry,
    fn: (ctx: AttemptContext) => T | PromiseLike<T>,
    options: RunOptions<T> | undefined,
    call: bigint,
    started: bigint,
    gen: number,
    err: unknown,
  ): Promise<T> {
    const now = this.#now();
    const d = new CallDriver(p, started, 1);
    let v: bigint;
    try {
      const outcome = options?.errorOutcome?.(err) ?? outcomeOfError(err);
      v = this.#reportAttempt(d, call, now, now - started, outcome, gen, err, undefined);
    } catch (failure) {
      return Promise.reject(failure);
    }
    return this.#drive(d, fn, options, call, v, now, gen, err);
  }

  /** Report an attempt's outcome; on a fault (or if the engine was replaced) the call ends here. */
  #reportAttempt(
    d: CallDriver,
    call: bigint,
    now: bigint,
    elapsed: bigint,
    outcome: Outcome,
    gen: number,
    lastError: unknown,
    lastResult: unknown,
  ): bigint {
    const p = d.policy;
    // The engine was replaced while this attempt ran (or replaced now): that was the single attempt.
    const v = this.#rt.generation === gen ? this.#rt.report(p, call, now, elapsed, outcome, d.attempts) : undefined;
    if (v === undefined) {
      throw new LeveeError('engine-fault', { policy: p.name, attempts: d.attempts, lastError, lastResult });
    }
    return v;
  }

  /** The step loop, from verdict `v` on: the driver says what to do, this does it. */
  async #drive<T>(
    d: CallDriver,
    fn: (ctx: AttemptContext) => T | PromiseLike<T>,
    options: RunOptions<T> | undefined,
    call: bigint,
    v: bigint,
    now: bigint,
    gen: number,
    lastError: unknown,
  ): Promise<T> {
    const rt = this.#rt;
    const clock = this.#clock;
    const p = d.policy;
    const signal = options?.signal;
    let lastResult: unknown = undefined;
    let value: T | undefined = undefined;
    const unregistered: string[] = [];
    for (;;) {
      const act = d.next(v, now);
      if (d.events) rt.drain();

      if (act === ACT_ATTEMPT) {
        const ctx = new Attempt(d.attempts, d.timeoutNs / 1e6, signal, clock);
        const started = now;
        let outcome: Outcome | undefined;
        try {
          const r = fn(ctx);
          const result = d.timeoutNs > 0 || signal !== undefined ? await ctx.race(r) : isThenable(r) ? await r : r;
          now = this.#now();
          ctx.dispose();
          outcome = options?.outcomeOf?.(result);
          if (outcome === undefined || outcome.kind === 'success') {
            if (rt.generation === gen) rt.hold(call, now, now - started);
            return result;
          }
          value = result;
          lastResult = result;
          lastError = undefined;
        } catch (err) {
          now = this.#now();
          ctx.dispose();
          if (signal?.aborted && !ctx.timedOut) {
            rt.cancel(call, now, gen);
            throw new LeveeError('cancelled', { policy: p.name, attempts: d.attempts, lastError: signal.reason });
          }
          outcome = ctx.timedOut ? { kind: 'timeout' } : (options?.errorOutcome?.(err) ?? outcomeOfError(err));
          lastError = err;
          lastResult = undefined;
          value = undefined;
        }
        v = this.#reportAttempt(d, call, now, now - started, outcome, gen, lastError, lastResult);
        continue;
      }

      if (act === ACT_SLEEP) {
        try {
          await clockWait(clock, d.sleepNs / 1e6, signal);
        } catch (reason) {
          now = this.#now();
          rt.cancel(call, now, gen);
          throw new LeveeError('cancelled', { policy: p.name, attempts: d.attempts, lastError: reason });
        }
        now = this.#now();
        if (value !== undefined && options?.discard !== undefined) {
          options.discard(value);
          value = undefined;
        }
        const next = rt.generation === gen ? rt.acquire(p, call, now, d.attempts) : undefined;
        if (next === undefined) return this.#single(d, fn, options, now, lastError);
        v = next;
        continue;
      }

      if (act === ACT_DONE) {
        return value as T;
      }

      if (act === ACT_FALLBACK) {
        const name = d.fallbackName;
        const fb = name === undefined ? undefined : (options?.fallbacks?.[name] ?? this.#fallbacks.get(name));
        let ok = false;
        if (fb === undefined) {
          // Counted as failed; the error that ends the call names it (the attempt's error stands).
          const missing = name ?? `#${d.fallbackIndex}`;
          if (!unregistered.includes(missing)) unregistered.push(missing);
        } else {
          try {
            const r = fb({ name: name ?? '', policy: p.name, reason: d.reason, lastError, lastResult, signal });
            const fallbackValue = isThenable(r) ? await r : r;
            if (options?.acceptFallback !== undefined && !options.acceptFallback(fallbackValue)) {
              lastError = new TypeError(`levee: fallback "${name ?? ''}" returned a value of the wrong type`);
            } else {
              value = fallbackValue as T;
              ok = true;
            }
          } catch (err) {
            lastError = err;
          }
        }
        now = this.#now();
        const next = rt.generation === gen ? rt.reportFallback(p, call, now, ok, d.attempts) : undefined;
        if (next === undefined) {
          if (ok) return value as T;
          throw new LeveeError('engine-fault', { policy: p.name, attempts: d.attempts, lastError, lastResult });
        }
        v = next;
        continue;
      }

      // ACT_FAIL
      if (d.cancel) rt.cancel(call, now, gen);
      else rt.failed(now, gen);
      throw new LeveeError(d.reason, {
        policy: p.name,
        attempts: d.attempts,
        lastError,
        lastResult,
        retryAfterMs: d.hintNs > 0 ? d.hintNs / 1e6 : undefined,
        detail: d.detail,
        unregistered,
      });
    }
  }

  /**
   * After a fault: the call proceeds as one attempt without retries, under the policy's attempt
   * timeout (clamped to the call's deadline), and no fallback.
   */
  async #single<T>(
    d: CallDriver,
    fn: (ctx: AttemptContext) => T | PromiseLike<T>,
    options: RunOptions<T> | undefined,
    now: bigint,
    previousError: unknown,
  ): Promise<T> {
    const p = d.policy;
    const timeoutNs = d.degraded(now);
    const attempts = d.attempts;
    const signal = options?.signal;
    const ctx = new Attempt(attempts, timeoutNs / 1e6, signal, this.#clock);
    let result: T;
    try {
      const r = fn(ctx);
      result = timeoutNs > 0 || signal !== undefined ? await ctx.race(r) : await r;
    } catch (err) {
      ctx.dispose();
      const reason: FailureReason = signal?.aborted && !ctx.timedOut ? 'cancelled' : 'engine-fault';
      throw new LeveeError(reason, { policy: p.name, attempts, lastError: err ?? previousError });
    }
    ctx.dispose();
    const outcome = options?.outcomeOf?.(result);
    if (outcome !== undefined && outcome.kind !== 'success') {
      throw new LeveeError('engine-fault', { policy: p.name, attempts, lastResult: result });
    }
    return result;
  }
}

/** Read the OpenTelemetry meter if `@opentelemetry/api` can be imported. */
export async function defaultMeter(): Promise<MeterLike | undefined> {
  try {
    const api = (await import('@opentelemetry/api')) as {
      metrics: { getMeter(name: string, version?: string): MeterLike };
    };
    return api.metrics.getMeter('levee', '0.1.0');
  } catch {
    return undefined;
  }
}

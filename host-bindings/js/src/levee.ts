// The Levee host: drives the policy component step by step (see DESIGN.md, "The step protocol").
// Every decision (what is retried, how long to wait, whether a breaker admits) comes from the core;
// this file does the I/O, clamps what comes out of the guest, and recovers from traps.

import { instantiate } from '../wasm/levee_policy.js';
type ComponentExports = ReturnType<typeof instantiate>;
import type { Engine } from '../wasm/interfaces/levee-policy-engine-api.js';
import type {
  Analysis,
  BreakerState,
  CallInfo,
  Event,
  LoadError,
  OutcomeKind,
} from '../wasm/interfaces/levee-policy-types.js';
import { LeveeError, PolicyLoadError, UnknownPolicyError, outcomeOfError } from './errors.js';
import type { FailureReason, Outcome } from './errors.js';
import { Emitter, Metrics } from './events.js';
import type { EngineFaultEvent, LeveeEvent, LeveeEventName, Listener, MeterLike } from './events.js';
import { decodeVerdict } from './verdict.js';
import type { Verdict } from './verdict.js';
import {
  KIND_ATTEMPT,
  KIND_DONE,
  KIND_FAIL,
  KIND_FALLBACK,
  KIND_RETRY,
  KIND_WAIT,
  INVALID_CODES,
  REASONS,
} from './verdict.js';

/** What differs between runtimes (Node, Worker-style runtimes). */
export interface Platform {
  /** The compiled core module for a file name of the transpiled component. */
  getCoreModule(path: string): WebAssembly.Module;
  /** Monotonic time in integer nanoseconds. */
  now(): bigint;
  /** A seed from the OS random source. */
  randomSeed(): bigint;
  /** Whether timers can be unref'd (Node) so a pending flush never keeps a process alive. */
  unrefTimers: boolean;
}

/** Instantiates core modules: the jco hook (for instrumentation and fault-injection tests). */
export type InstantiateCore = (module: WebAssembly.Module, imports: Record<string, unknown>) => WebAssembly.Instance;

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

/** What an attempt receives. */
export interface AttemptContext {
  /** Aborted when the per-attempt timeout fires or the caller's signal aborts. */
  readonly signal: AbortSignal;
  /** The attempt number, 1 for the first. */
  readonly attempt: number;
  /** The per-attempt timeout in milliseconds, 0 when none. */
  readonly timeoutMs: number;
}

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

/** One step of a call, as `LoadOptions.trace` sees it. */
export interface TraceStep {
  op: 'start' | 'acquire' | 'report' | 'report-fallback';
  call: bigint;
  /** The policy's name ("" for a held-back success sent by `flush`). */
  policy: string;
  /** Attempts started so far. */
  attempts: number;
  /** What was reported (for `report`). */
  outcome?: Outcome;
  /** Whether the fallback succeeded (for `report-fallback`). */
  fallbackOk?: boolean;
  /** The fallback's name (for a `fallback` verdict). */
  fallback?: string;
  verdict: Verdict;
}

/** What the host keeps of a policy after `load` (facts the core gave, never re-decided). */
export interface PolicyEntry {
  readonly index: number;
  readonly name: string;
  readonly maxAttempts: number;
  /** ns, 0 when none */
  readonly attemptTimeoutNs: number;
  /** ns, 0 when none */
  readonly deadlineNs: number;
  readonly deadlineBig: bigint;
  readonly fallbacks: readonly string[];
}

const METHOD_CODES: Readonly<Record<string, number>> = {
  GET: 1,
  HEAD: 2,
  POST: 3,
  PUT: 4,
  DELETE: 5,
  PATCH: 6,
  OPTIONS: 7,
  TRACE: 8,
  CONNECT: 9,
};

/** The `flags` argument of `start`. */
export function startFlags(
  options: { idempotent?: boolean; idempotencyKey?: boolean; method?: string } | undefined,
): number {
  if (options === undefined) return 0;
  let flags = 0;
  if (options.idempotent === false) flags |= 1;
  if (options.idempotencyKey === true) flags |= 2;
  if (options.method !== undefined && options.method !== '') {
    flags |= (METHOD_CODES[options.method.toUpperCase()] ?? 15) << 8;
  }
  return flags;
}

/**
 * `start` as the core module exports it: the canonical ABI of the WIT's `start` (the engine by
 * its rep, the key as pointer and length, u64 as i64, the verdict as a signed i64).
 */
type CoreStart = (
  rep: number,
  call: bigint,
  policy: number,
  keyPtr: number,
  keyLen: number,
  flags: number,
  now: bigint,
  settleCall: bigint,
  settleAt: bigint,
  settleElapsed: bigint,
) => bigint;
type CoreRealloc = (ptr: number, oldSize: number, align: number, size: number) => number;
// Names the component model gives the core module's exports and the resource constructor it imports.
const CORE_START = 'levee:policy/engine-api@0.1.0#[method]engine.start';
const CORE_REALLOC = 'cabi_realloc';
const RESOURCE_IMPORTS = '[export]levee:policy/engine-api@0.1.0';
const RESOURCE_NEW = '[resource-new]engine';

/** The bound on the component's linear memory (512 MiB): the rule of every host. */
export const DEFAULT_MAX_MEMORY_BYTES = 512 * 1024 * 1024;

const NO_SIGNAL: AbortSignal = new AbortController().signal;
const MAX_TIMER_MS = 2147483647;

class Attempt implements AttemptContext {
  readonly attempt: number;
  readonly timeoutMs: number;
  readonly #outer: AbortSignal | undefined;
  #controller: AbortController | undefined;
  #timer: ReturnType<typeof setTimeout> | undefined;
  #onOuterAbort: (() => void) | undefined;
  #aborted = false;
  #abortReason: unknown = undefined;
  timedOut = false;

  constructor(attempt: number, timeoutMs: number, outer: AbortSignal | undefined) {
    this.attempt = attempt;
    this.timeoutMs = timeoutMs;
    this.#outer = outer;
  }

  get signal(): AbortSignal {
    if (this.#controller !== undefined) return this.#controller.signal;
    // Without a timeout the caller's signal is the attempt's. Otherwise the controller is made on
    // first use, so an attempt that never looks at its signal costs no AbortController.
    if (this.timeoutMs === 0) return this.#outer ?? NO_SIGNAL;
    const controller = new AbortController();
    this.#controller = controller;
    if (this.#aborted) controller.abort(this.#abortReason);
    return controller.signal;
  }

  #abort(reason: unknown): void {
    if (this.#aborted) return;
    this.#aborted = true;
    this.#abortReason = reason;
    this.#controller?.abort(reason);
  }

  /**
   * Run the attempt under its timeout and the caller's signal. The promise settles when the attempt
   * does, or when the timeout fires or the caller aborts, whichever is first, even if the attempt
   * ignores its signal.
   */
  race<T>(promise: T | PromiseLike<T>): Promise<T> {
    return new Promise<T>((resolve, reject) => {
      const outer = this.#outer;
      if (this.timeoutMs > 0) {
        this.#timer = setTimeout(
          () => {
            this.timedOut = true;
            const reason = new DOMException(
              `attempt ${this.attempt} timed out after ${this.timeoutMs} ms`,
              'TimeoutError',
            );
            this.#abort(reason);
            reject(reason);
          },
          Math.min(Math.max(this.timeoutMs, 0), MAX_TIMER_MS),
        );
      }
      if (outer !== undefined) {
        const onAbort = (): void => {
          this.#abort(outer.reason);
          reject(outer.reason);
        };
        this.#onOuterAbort = onAbort;
        outer.addEventListener('abort', onAbort, { once: true });
      }
      Promise.resolve(promise).then(resolve, reject);
    });
  }

  dispose(): void {
    if (this.#timer !== undefined) clearTimeout(this.#timer);
    if (this.#onOuterAbort !== undefined) this.#outer?.removeEventListener('abort', this.#onOuterAbort);
  }
}

/** The context of a first attempt without timeout or caller signal: it holds no state, so it is shared. */
const FIRST_ATTEMPT: AttemptContext = Object.freeze({ signal: NO_SIGNAL, attempt: 1, timeoutMs: 0 });

/** Sleep `ms`, rejecting with the signal's reason if it aborts first. */
export function sleep(ms: number, signal?: AbortSignal): Promise<void> {
  if (signal?.aborted) return Promise.reject(signal.reason);
  if (!(ms > 0)) return Promise.resolve();
  return new Promise<void>((resolve, reject) => {
    const onAbort = (): void => {
      clearTimeout(timer);
      reject(signal?.reason);
    };
    const timer = setTimeout(
      () => {
        signal?.removeEventListener('abort', onAbort);
        resolve();
      },
      Math.min(ms, MAX_TIMER_MS),
    );
    signal?.addEventListener('abort', onAbort, { once: true });
  });
}

function isThenable<T>(value: T | PromiseLike<T>): value is PromiseLike<T> {
  return typeof (value as { then?: unknown } | null)?.then === 'function';
}

/**
 * When a refused document is one line with no `:` and no `{` (no policy document is), it is most
 * likely a file name given as text: say so (`load` takes the text, `loadFile` reads a file).
 */
function pathHint(document: string): LoadError[] {
  const text = document.trim();
  if (text === '' || text.includes('\n') || text.includes(':') || text.includes('{') || text.length > 4096) return [];
  return [
    {
      path: '',
      message: `the document is the text '${text}', which looks like a file name: load() takes the document's text, loadFile(path) reads a file`,
    },
  ];
}

function loadErrors(err: unknown): LoadError[] | undefined {
  const payload = (err as { payload?: unknown } | null)?.payload;
  if (Array.isArray(payload)) return payload as LoadError[];
  if (payload !== null && typeof payload === 'object' && 'path' in payload && 'message' in payload) {
    return [payload as LoadError];
  }
  return undefined;
}

/**
 * A loaded policy document and its engine (breaker, budget and bucket state).
 * One instance serves any number of concurrent calls.
 */
export class Levee {
  readonly #platform: Platform;
  readonly #now: () => bigint;
  readonly #instantiateCore: InstantiateCore | undefined;
  #document: string;
  readonly #seed: bigint;
  #exports!: ComponentExports;
  #engine!: Engine;
  // The hot path calls the core module's `start` directly: the same canonical-ABI call jco's glue
  // makes, without its per-argument coercions (about 250 instructions a call) and with a key of
  // ASCII characters written straight into guest memory (the glue's TextEncoder costs 1-2 us a call).
  // `#rep` is the engine's representation, captured when the guest creates it.
  #coreStart: CoreStart | undefined;
  #coreRealloc: CoreRealloc | undefined;
  #coreMemory: WebAssembly.Memory | undefined;
  #coreBytes = new Uint8Array(0);
  #rep = 0;
  #healthy = true;
  #closed = false;
  #generation = 0;
  #policies: PolicyEntry[] = [];
  #byName = new Map<string, PolicyEntry>();
  readonly #fallbacks = new Map<string, FallbackFn>();
  readonly #emitter = new Emitter();
  readonly #metrics: Metrics | undefined;
  #nextCall = 1;
  // The success held back to ride on the next `start` (DESIGN.md, "batching").
  // `#holding` says whether there is one (a boolean: comparing BigInts costs a builtin call).
  #holding = false;
  #heldCall = 0n;
  #heldAt = 0n;
  #heldElapsed = 0n;
  #flushTimer: ReturnType<typeof setTimeout> | undefined;
  readonly #flushTick = (): void => {
    this.#flushTimer = undefined;
    this.flush();
  };
  // Trap recovery: the last exported state.
  #lastState: Uint8Array | undefined;
  #nextCheckpoint: bigint;
  #lastCheckpointAt = 0n;
  readonly #checkpointNs: bigint;
  #memories: WebAssembly.Memory[] = [];
  readonly #maxMemoryBytes: number;
  readonly #trace: ((step: TraceStep) => void) | undefined;

  /** @internal Use `load` from `levee` (Node) or `levee/worker`. */
  constructor(platform: Platform, document: string, options: LoadOptions, meter: MeterLike | undefined) {
    this.#platform = platform;
    this.#now = platform.now;
    this.#document = document;
    this.#instantiateCore = options.instantiateCore;
    this.#trace = options.trace;
    this.#seed = options.seed !== undefined ? BigInt.asUintN(64, BigInt(options.seed)) : platform.randomSeed();
    this.#checkpointNs = BigInt(Math.round((options.checkpointIntervalMs ?? 1000) * 1e6));
    this.#maxMemoryBytes = options.maxMemoryBytes ?? DEFAULT_MAX_MEMORY_BYTES;
    this.#instantiateFresh();
    this.#readPolicies();
    for (const [name, fn] of Object.entries(options.fallbacks ?? {})) this.#fallbacks.set(name, fn);
    this.#metrics = meter ? new Metrics(meter) : undefined;
    this.#nextCheckpoint = platform.now() + this.#checkpointNs;
    this.#lastState = this.#engine.exportState();
  }

  #instantiateFresh(): void {
    const base = this.#instantiateCore ?? ((m, i) => new WebAssembly.Instance(m, i as WebAssembly.Imports));
    const memories: WebAssembly.Memory[] = [];
    let coreStart: CoreStart | undefined;
    let coreRealloc: CoreRealloc | undefined;
    let coreMemory: WebAssembly.Memory | undefined;
    let reps: number[] = [];
    const exports = instantiate(this.#platform.getCoreModule, {}, (module, imports) => {
      const resources = (imports as Record<string, Record<string, unknown>> | undefined)?.[RESOURCE_IMPORTS];
      const create = resources?.[RESOURCE_NEW];
      if (resources !== undefined && typeof create === 'function') {
        resources[RESOURCE_NEW] = (rep: number): unknown => {
          reps.push(rep);
          return (create as (rep: number) => unknown)(rep);
        };
      }
      const instance = base(module, imports);
      const core = instance.exports;
      for (const value of Object.values(core)) {
        if (value instanceof WebAssembly.Memory) memories.push(value);
      }
      const start = core[CORE_START];
      if (typeof start === 'function') {
        // The module that exports `start` owns the memory and allocator its arguments go into.
        coreStart = start as CoreStart;
        const realloc = core[CORE_REALLOC];
        coreRealloc = typeof realloc === 'function' ? (realloc as CoreRealloc) : undefined;
        coreMemory = core.memory instanceof WebAssembly.Memory ? core.memory : undefined;
      }
      return instance;
    });
    let engine: Engine;
    reps = [];
    try {
      engine = exports.engineApi.Engine.load(this.#document, this.#seed);
    } catch (err) {
      const errors = loadErrors(err);
      if (errors) throw new PolicyLoadError([...errors, ...pathHint(this.#document)]);
      throw err;
    }
    this.#memories = memories;
    this.#exports = exports;
    this.#engine = engine;
    // Exactly one engine made by this load, with an i32 rep: otherwise always go through the glue.
    const rep = reps.length === 1 ? reps[0] : undefined;
    if (
      coreStart !== undefined &&
      coreRealloc !== undefined &&
      coreMemory !== undefined &&
      typeof rep === 'number' &&
      rep === (rep | 0)
    ) {
      this.#coreStart = coreStart;
      this.#coreRealloc = coreRealloc;
      this.#coreMemory = coreMemory;
      this.#rep = rep;
    } else {
      this.#coreStart = undefined;
      this.#coreRealloc = undefined;
      this.#coreMemory = undefined;
      this.#rep = 0;
    }
  }

  #readPolicies(): void {
    const engine = this.#engine;
    const count = engine.policyCount();
    const policies: PolicyEntry[] = [];
    const byName = new Map<string, PolicyEntry>();
    for (let index = 0; index < count; index++) {
      const info = engine.policyInfo(index);
      if (info === undefined) continue;
      const entry: PolicyEntry = {
        index,
        name: info.name,
        maxAttempts: info.maxAttempts,
        attemptTimeoutNs: Number(info.attemptTimeout),
        deadlineNs: Number(info.deadline),
        deadlineBig: info.deadline,
        fallbacks: info.fallbacks,
      };
      policies.push(entry);
      byName.set(entry.name, entry);
    }
    this.#policies = policies;
    this.#byName = byName;
  }

  // ---------------------------------------------------------------- policies and state

  /** The policies of the document, in order. */
  get policies(): readonly PolicyEntry[] {
    return this.#policies;
  }

  /** A policy by name (throws on an unknown name). */
  policy(name: string): PolicyEntry {
    const entry = this.#byName.get(name);
    if (entry === undefined) throw this.#unknown(name);
    return entry;
  }

  #unknown(name: string): UnknownPolicyError {
    return new UnknownPolicyError(
      name,
      this.#policies.map((p) => p.name),
    );
  }

  /** The policy with every default filled in, as the core renders it (JSON). */
  policyJson(name: string): string {
    const index = this.policy(name).index;
    return this.#use('policy-json', (e) => e.policyJson(index)) ?? '';
  }

  /** Worst cases of a policy when `layers` layers run it. */
  analyze(name: string, layers = 1): Analysis | undefined {
    const index = this.policy(name).index;
    return this.#use('analyze', (e) => e.analyze(index, layers));
  }

  /** Replace the policies, keeping the state that still applies; on error nothing changes. */
  reload(document: string): void {
    this.flush();
    try {
      this.#engine.reload(document);
    } catch (err) {
      const errors = loadErrors(err);
      if (errors) throw new PolicyLoadError(errors);
      throw err;
    }
    this.#document = document;
    this.#readPolicies();
    this.#checkpoint(this.#platform.now());
  }

  /** Register (or replace) a fallback function under the name a policy's chain uses. */
  fallback(name: string, fn: FallbackFn): this {
    this.#fallbacks.set(name, fn);
    return this;
  }

  /** The breaker state of a policy and key (an open breaker whose wait has passed reads half-open). */
  breakerState(policy: string, key = ''): BreakerState | undefined {
    const index = this.policy(policy).index;
    return this.#use('breaker-state', (e) => e.breakerState(index, key, this.#platform.now()));
  }

  /** Force a breaker state (forced-open, forced-closed, disabled); `closed` returns to normal. */
  setBreakerState(policy: string, state: BreakerState, key = ''): void {
    const index = this.policy(policy).index;
    this.#use('set-breaker-state', (e) => e.setBreakerState(index, key, state, this.#platform.now()));
    // A breaker changed state: a trap from here on must restore it as it now is.
    this.#checkpoint(this.#platform.now());
  }

  /** What the engine knows of a live call (debugging). */
  callInfo(call: bigint): CallInfo | undefined {
    return this.#use('call-info', (e) => e.callInfo(call));
  }

  /** The whole engine state as versioned bytes (to persist, share, or restore after a restart). */
  exportState(): Uint8Array {
    const state = this.#use('export-state', (e) => e.exportState());
    this.#lastState = state;
    return state;
  }

  /** Restore exported state; what no longer applies is dropped. On error nothing changes. */
  importState(state: Uint8Array): void {
    this.flush();
    try {
      this.#engine.importState(state);
    } catch (err) {
      const errors = loadErrors(err);
      if (errors) throw new PolicyLoadError(errors);
      throw err;
    }
    this.#lastState = state;
  }

  /** The low-level engine of the component (the conformance runner drives it directly). */
  get engine(): Engine {
    this.flush();
    return this.#engine;
  }

  /** The instantiated component this host drives (its `Engine` class loads fresh engines). */
  get component(): ComponentExports {
    return this.#exports;
  }

  /**
   * Send any held-back success, stop the flush timer and release the component instance. The
   * Levee must not be used afterwards.
   */
  close(): void {
    this.flush();
    if (this.#flushTimer !== undefined) clearTimeout(this.#flushTimer);
    this.#flushTimer = undefined;
    const dispose = (this.#engine as { [Symbol.dispose]?: () => void })[Symbol.dispose];
    if (typeof dispose === 'function') dispose.call(this.#engine);
    this.#healthy = false;
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
    if (!this.#holding) return;
    const call = this.#heldCall;
    this.#holding = false;
    let v: bigint;
    try {
      v = this.#engine.report(call, this.#heldAt, this.#heldElapsed, 'success', 0, '', 0n, 0);
    } catch (err) {
      this.#recover(err, 'flush', '');
      return;
    }
    if (this.#trace !== undefined) {
      this.#trace({
        op: 'report',
        call,
        policy: '',
        attempts: 0,
        outcome: { kind: 'success' },
        verdict: decodeVerdict(v),
      });
    }
    if ((Number(v & 0x1fn) & 0x10) !== 0) this.#drain();
  }

  #drain(): void {
    let events: Event[];
    try {
      events = this.#engine.drainEvents();
    } catch (err) {
      this.#recover(err, 'drain-events', '');
      return;
    }
    let transitions = false;
    const emitter = this.#emitter;
    const metrics = this.#metrics;
    const listening = emitter.listening;
    for (const raw of events) {
      if (raw.kind === 'breaker-transition') transitions = true;
      if (!listening && metrics === undefined) continue;
      const event = raw as LeveeEvent;
      event.policyName = this.#policies[raw.policy]?.name ?? '';
      metrics?.record(event);
      if (listening) {
        emitter.emit('event', event);
        emitter.emit(event.kind, event);
      }
    }
    // A breaker that changed state is what a restarted instance most needs back.
    if (transitions) this.#checkpoint(this.#platform.now());
  }

  #checkpoint(now: bigint): void {
    this.#nextCheckpoint = now + this.#checkpointNs;
    this.#lastCheckpointAt = now;
    // JavaScript cannot cap a Wasm memory it did not create: check its size here, and treat a
    // component whose memory outgrew the bound like one that trapped (the last state comes back).
    let bytes = 0;
    for (const memory of this.#memories) bytes += memory.buffer.byteLength;
    if (bytes > this.#maxMemoryBytes) {
      this.#recover(
        new RangeError(`levee: the policy component's memory grew to ${bytes} bytes (bound ${this.#maxMemoryBytes})`),
        'memory-limit',
        '',
      );
      return;
    }
    try {
      this.#lastState = this.#engine.exportState();
    } catch (err) {
      this.#recover(err, 'export-state', '');
    }
  }

  #use<R>(phase: string, fn: (engine: Engine) => R): R {
    this.flush();
    if (!this.#healthy) this.#reinstantiate();
    try {
      return fn(this.#engine);
    } catch (err) {
      // A `result` error of the WIT is an answer, not a fault: jco throws it as ComponentError.
      if ((err as { name?: unknown } | null)?.name === 'ComponentError') throw err;
      this.#recover(err, phase, '');
      throw err;
    }
  }

  // ---------------------------------------------------------------- trap recovery

  /**
   * The component trapped (or returned something the glue could not lift): the instance is
   * poisoned. Re-instantiate, reload the document, restore the last exported state, report the
   * fault. Calls in flight continue as single attempts without retries.
   */
  #recover(error: unknown, phase: string, policyName: string): void {
    this.#generation++;
    this.#holding = false;
    const restored = this.#reinstantiate();
    const event: EngineFaultEvent = { kind: 'engine-fault', phase, error, restored, policyName };
    this.#metrics?.fault(event);
    this.#emitter.emit('engine-fault', event);
  }

  #reinstantiate(): boolean {
    try {
      this.#instantiateFresh();
    } catch {
      this.#healthy = false;
      return false;
    }
    this.#healthy = true;
    if (this.#lastState === undefined) return false;
    try {
      this.#engine.importState(this.#lastState);
      return true;
    } catch {
      return false;
    }
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
    const p = typeof policy === 'string' ? this.#byName.get(policy) : policy;
    if (p === undefined) return Promise.reject(this.#unknown(String(policy)));
    const signal = options?.signal;
    if (signal?.aborted) {
      return Promise.reject(new LeveeError('cancelled', { policy: p.name, attempts: 0, lastError: signal.reason }));
    }
    if (this.#closed) return Promise.reject(new Error('levee: this Levee was closed'));
    const now = this.#now();
    if (now > this.#nextCheckpoint) {
      this.flush();
      this.#checkpoint(now);
    }
    if (!this.#healthy && !this.#reinstantiate()) {
      return this.#single(p, fn, options, 0, now, undefined, undefined);
    }
    const gen = this.#generation;
    const call = BigInt(this.#nextCall++);
    let v: bigint;
    try {
      const flags = options === undefined ? 0 : startFlags(options);
      const key = options?.key ?? '';
      const held = this.#holding;
      this.#holding = false;
      const coreStart = this.#coreStart;
      const keyPtr = coreStart === undefined ? -1 : this.#lowerKey(key);
      if (coreStart !== undefined && keyPtr >= 0) {
        v = held
          ? coreStart(
              this.#rep,
              call,
              p.index,
              keyPtr,
              key.length,
              flags,
              now,
              this.#heldCall,
              this.#heldAt,
              this.#heldElapsed,
            )
          : coreStart(this.#rep, call, p.index, keyPtr, key.length, flags, now, 0n, 0n, 0n);
      } else if (held) {
        v = this.#engine.start(call, p.index, key, flags, now, this.#heldCall, this.#heldAt, this.#heldElapsed);
      } else {
        v = this.#engine.start(call, p.index, key, flags, now, 0n, 0n, 0n);
      }
    } catch (err) {
      this.#recover(err, 'start', p.name);
      return this.#single(p, fn, options, 0, now, undefined, p.deadlineNs > 0 ? now + p.deadlineBig : undefined);
    }
    if (this.#trace !== undefined) this.#traceStep('start', call, p, 0, v, undefined, undefined);
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
    return this.#drive(p, fn, options, call, v, now, gen, 0, undefined);
  }

  /**
   * Lower a key for the core module's `start` as the canonical ABI lowers a string: UTF-8 bytes in
   * memory the guest allocated with `cabi_realloc(0, 0, 1, len)` (the guest takes ownership), or
   * (1, 0) for an empty key. Only ASCII keys are written here (their UTF-8 length is their length);
   * for any other key this answers -1 and the call goes through jco's glue.
   */
  #lowerKey(key: string): number {
    const len = key.length;
    if (len === 0) return 1;
    for (let i = 0; i < len; i++) if (key.charCodeAt(i) > 0x7f) return -1;
    const ptr = this.#coreRealloc!(0, 0, 1, len) >>> 0;
    // After the allocation: it may have grown the memory and replaced its buffer.
    const buffer = this.#coreMemory!.buffer;
    let bytes = this.#coreBytes;
    if (bytes.buffer !== buffer) this.#coreBytes = bytes = new Uint8Array(buffer);
    if (ptr + len > bytes.length) throw new RangeError('levee: cabi_realloc returned memory out of bounds');
    for (let i = 0; i < len; i++) bytes[ptr + i] = key.charCodeAt(i);
    return ptr;
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
    if (this.#generation === gen) this.#hold(call, now, now - started);
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
    let v: bigint;
    try {
      const outcome = options?.errorOutcome?.(err) ?? outcomeOfError(err);
      v = this.#reportAttempt(p, call, now, now - started, outcome, gen, 1, err, undefined);
    } catch (failure) {
      return Promise.reject(failure);
    }
    return this.#drive(p, fn, options, call, v, now, gen, 1, err);
  }

  /** Hold a success back: it rides on the next `start` (or a flush soon after). */
  #hold(call: bigint, now: bigint, elapsed: bigint): void {
    if (this.#holding) this.flush();
    this.#holding = true;
    this.#heldCall = call;
    this.#heldAt = now;
    this.#heldElapsed = elapsed;
    if (this.#flushTimer === undefined) this.#scheduleFlush();
  }

  /** Report an attempt's outcome; on a fault (or if the engine was replaced) the call ends here. */
  #reportAttempt(
    p: PolicyEntry,
    call: bigint,
    now: bigint,
    elapsed: bigint,
    outcome: Outcome,
    gen: number,
    attempts: number,
    lastError: unknown,
    lastResult: unknown,
  ): bigint {
    if (this.#generation !== gen) {
      // The engine was replaced while this attempt ran: that was the single attempt.
      throw new LeveeError('engine-fault', { policy: p.name, attempts, lastError, lastResult });
    }
    let v: bigint;
    try {
      if (this.#holding) this.flush();
      v = this.#report(call, now, elapsed, outcome);
    } catch (err) {
      this.#recover(err, 'report', p.name);
      throw new LeveeError('engine-fault', { policy: p.name, attempts, lastError, lastResult });
    }
    if (this.#trace !== undefined) this.#traceStep('report', call, p, attempts, v, outcome, undefined);
    return v;
  }

  /** The step loop, from verdict `v` on. */
  async #drive<T>(
    p: PolicyEntry,
    fn: (ctx: AttemptContext) => T | PromiseLike<T>,
    options: RunOptions<T> | undefined,
    call: bigint,
    v: bigint,
    now: bigint,
    gen: number,
    attempts: number,
    lastError: unknown,
  ): Promise<T> {
    const platform = this.#platform;
    const signal = options?.signal;
    const deadline = p.deadlineNs > 0 ? now + p.deadlineBig : 0n;
    let lastResult: unknown = undefined;
    let value: T | undefined = undefined;
    const unregistered: string[] = [];
    for (;;) {
      // Decode the verdict (see verdict.ts; exact below 2^53, else BigInt).
      const n = Number(v);
      let low: number;
      let payload: number;
      if (n < 9007199254740992) {
        low = n % 65536;
        payload = (n - low) / 65536;
      } else {
        low = Number(v & 0xffffn);
        payload = Number(v >> 16n);
      }
      if ((low & 0x10) !== 0) this.#drain();
      const kind = low & 0xf;
      const detail = low >>> 8;

      if (kind === KIND_ATTEMPT) {
        attempts++;
        if (attempts > p.maxAttempts) {
          // Never past the policy's maximum, whatever the guest says.
          this.#cancel(call, now, gen);
          throw new LeveeError('retries-exhausted', {
            policy: p.name,
            attempts: attempts - 1,
            lastError,
            lastResult,
            detail: 'the engine asked for an attempt beyond the policy maximum',
          });
        }
        let timeoutNs = payload;
        if (deadline !== 0n) {
          const left = Number(deadline - now);
          if (timeoutNs === 0 || timeoutNs > left) timeoutNs = left > 0 ? left : 1;
        }
        const ctx = new Attempt(attempts, timeoutNs / 1e6, signal);
        const started = now;
        let outcome: Outcome | undefined;
        try {
          const r = fn(ctx);
          const result = timeoutNs > 0 || signal !== undefined ? await ctx.race(r) : isThenable(r) ? await r : r;
          now = platform.now();
          ctx.dispose();
          outcome = options?.outcomeOf?.(result);
          if (outcome === undefined || outcome.kind === 'success') {
            if (this.#generation === gen) this.#hold(call, now, now - started);
            return result;
          }
          value = result;
          lastResult = result;
          lastError = undefined;
        } catch (err) {
          now = platform.now();
          ctx.dispose();
          if (signal?.aborted && !ctx.timedOut) {
            this.#cancel(call, now, gen);
            throw new LeveeError('cancelled', { policy: p.name, attempts, lastError: signal.reason });
          }
          outcome = ctx.timedOut ? { kind: 'timeout' } : (options?.errorOutcome?.(err) ?? outcomeOfError(err));
          lastError = err;
          lastResult = undefined;
          value = undefined;
        }
        v = this.#reportAttempt(p, call, now, now - started, outcome, gen, attempts, lastError, lastResult);
        continue;
      }

      if (kind === KIND_RETRY || kind === KIND_WAIT) {
        let delayNs = payload;
        if (deadline !== 0n) {
          // Never sleep past the deadline, whatever the guest says.
          const left = Number(deadline - now);
          if (delayNs > left) delayNs = left > 0 ? left : 0;
        }
        try {
          await sleep(delayNs / 1e6, signal);
        } catch (reason) {
          now = platform.now();
          this.#cancel(call, now, gen);
          throw new LeveeError('cancelled', { policy: p.name, attempts, lastError: reason });
        }
        now = platform.now();
        if (value !== undefined && options?.discard !== undefined) {
          options.discard(value);
          value = undefined;
        }
        if (this.#generation !== gen) {
          return this.#single(p, fn, options, attempts, now, lastError, deadline);
        }
        try {
          if (this.#holding) this.flush();
          v = this.#engine.acquire(call, now);
        } catch (err) {
          this.#recover(err, 'acquire', p.name);
          return this.#single(p, fn, options, attempts, now, lastError, deadline);
        }
        if (this.#trace !== undefined) this.#traceStep('acquire', call, p, attempts, v, undefined, undefined);
        continue;
      }

      if (kind === KIND_DONE) {
        return value as T;
      }

      if (kind === KIND_FALLBACK) {
        const name = p.fallbacks[payload];
        const reason = REASONS[detail] ?? 'none';
        const fb = name === undefined ? undefined : (options?.fallbacks?.[name] ?? this.#fallbacks.get(name));
        let ok = false;
        if (fb === undefined) {
          // Counted as failed; the error that ends the call names it (the attempt's error stands).
          const missing = name ?? `#${payload}`;
          if (!unregistered.includes(missing)) unregistered.push(missing);
        } else {
          try {
            const r = fb({ name: name ?? '', policy: p.name, reason, lastError, lastResult, signal });
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
        now = platform.now();
        if (this.#generation !== gen) {
          if (ok) return value as T;
          throw new LeveeError('engine-fault', { policy: p.name, attempts, lastError, lastResult });
        }
        try {
          if (this.#holding) this.flush();
          v = this.#engine.reportFallback(call, now, ok);
        } catch (err) {
          this.#recover(err, 'report-fallback', p.name);
          if (ok) return value as T;
          throw new LeveeError('engine-fault', { policy: p.name, attempts, lastError, lastResult });
        }
        if (this.#trace !== undefined) this.#traceStep('report-fallback', call, p, attempts, v, undefined, ok);
        continue;
      }

      if (kind === KIND_FAIL) {
        // A failure changed the breaker and budget state: keep it for trap recovery (at most
        // every 10 ms, so a storm of rejections does not export on every call).
        if (this.#generation === gen && now - this.#lastCheckpointAt > 10_000_000n) {
          if (this.#holding) this.flush();
          this.#checkpoint(now);
        }
        throw new LeveeError(REASONS[detail] ?? 'none', {
          policy: p.name,
          attempts,
          lastError,
          lastResult,
          retryAfterMs: payload > 0 ? payload / 1e6 : undefined,
          unregistered,
        });
      }

      throw new LeveeError('invalid', {
        policy: p.name,
        attempts,
        lastError,
        lastResult,
        detail: `the engine answered invalid (${INVALID_CODES[detail] ?? `code ${detail}`})`,
      });
    }
  }

  #report(call: bigint, now: bigint, elapsed: bigint, outcome: Outcome): bigint {
    const kind: OutcomeKind = outcome.kind;
    let code = 0;
    let text = '';
    let flags = 0;
    switch (outcome.kind) {
      case 'http-status':
        code = outcome.status;
        text = outcome.retryAfter ?? '';
        if (outcome.overloaded === true) flags = 1;
        break;
      case 'grpc-status':
        code = outcome.code;
        text = outcome.pushback ?? '';
        break;
      case 'error-class':
        text = outcome.name;
        break;
    }
    const wallSecs = BigInt(Math.floor(Date.now() / 1000));
    return this.#engine.report(call, now, elapsed, kind, code, text, wallSecs, flags);
  }

  #traceStep(
    op: TraceStep['op'],
    call: bigint,
    p: PolicyEntry,
    attempts: number,
    v: bigint,
    outcome: Outcome | undefined,
    fallbackOk: boolean | undefined,
  ): void {
    const verdict = decodeVerdict(v);
    const step: TraceStep = { op, call, policy: p.name, attempts, verdict };
    if (outcome !== undefined) step.outcome = outcome;
    if (fallbackOk !== undefined) step.fallbackOk = fallbackOk;
    if (verdict.kind === 'fallback') step.fallback = p.fallbacks[verdict.payload] ?? '';
    this.#trace?.(step);
  }

  #cancel(call: bigint, now: bigint, gen: number): void {
    if (this.#generation !== gen) return;
    try {
      this.flush();
      this.#engine.cancel(call, now);
    } catch (err) {
      this.#recover(err, 'cancel', '');
    }
  }

  #scheduleFlush(): void {
    const timer = setTimeout(this.#flushTick, 0);
    if (this.#platform.unrefTimers) (timer as { unref?: () => void }).unref?.();
    this.#flushTimer = timer;
  }

  /**
   * After a fault: the call proceeds as one attempt without retries, under the policy's attempt
   * timeout (clamped to the call's deadline), and no fallback.
   */
  async #single<T>(
    p: PolicyEntry,
    fn: (ctx: AttemptContext) => T | PromiseLike<T>,
    options: RunOptions<T> | undefined,
    attemptsBefore: number,
    now: bigint,
    previousError: unknown,
    deadline: bigint | undefined,
  ): Promise<T> {
    const attempts = attemptsBefore + 1;
    let timeoutNs = p.attemptTimeoutNs;
    if (deadline !== undefined && deadline !== 0n) {
      const left = Number(deadline - now);
      if (timeoutNs === 0 || timeoutNs > left) timeoutNs = left > 0 ? left : 1;
    }
    const ctx = new Attempt(attempts, timeoutNs / 1e6, options?.signal);
    let result: T;
    try {
      const r = fn(ctx);
      result = timeoutNs > 0 || options?.signal !== undefined ? await ctx.race(r) : await r;
    } catch (err) {
      ctx.dispose();
      const reason: FailureReason = options?.signal?.aborted && !ctx.timedOut ? 'cancelled' : 'engine-fault';
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

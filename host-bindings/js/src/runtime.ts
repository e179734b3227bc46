// The runtime glue: the jco instance of the policy component, the crossings into it (the hot `start`
// straight into the core module, the others through jco's glue), the success held back to ride on
// the next `start`, event draining, state snapshots, and the recovery from a trap. It knows nothing
// of attempts, sleeps or fallbacks: the driver (driver.ts) and the public API (levee.ts) do.

import { instantiate } from '../wasm/levee_policy.js';
export type ComponentExports = ReturnType<typeof instantiate>;
import type { Engine } from '../wasm/interfaces/levee-policy-engine-api.js';
import type {
  Event,
  HedgeAnswer,
  HedgeCommand,
  LoadError,
  OutcomeKind,
} from '../wasm/interfaces/levee-policy-types.js';
import {
  GUARD_GUEST_MEMORY_BYTES,
  GUARD_STATE_PAGE_BYTES,
  KIND_HEDGE,
  METHODS,
  METHOD_OTHER,
  REPORT_OVERLOADED,
  START_IDEMPOTENCY_KEY,
  START_METHOD_SHIFT,
  START_NON_IDEMPOTENT,
  VERDICT_WAKES_BIT,
} from './constants.js';
import { LeveeClosedError, PolicyLoadError, UnknownPolicyError } from './errors.js';
import type { Outcome } from './errors.js';
import { reportHookError } from './events.js';
import type { Emitter, EngineFaultEvent, LeveeEvent, ObserverErrorHandler, Telemetry } from './events.js';
import { decodeVerdict } from './verdict.js';
import type { Verdict } from './verdict.js';

/** What differs between runtimes (Node, Worker-style runtimes). */
export interface Platform {
  /** The compiled core module for a file name of the transpiled component. */
  getCoreModule(path: string): WebAssembly.Module;
  /** Monotonic time in integer nanoseconds. */
  now(): bigint;
  /** A seed from the OS random source. */
  randomSeed(): bigint;
  /**
   * Run `fn` once the current task and its microtasks are done, without waiting for a timer
   * tick (it then keeps the process alive only until that turn of the event loop is over). A held-back success is flushed this way:
   * a next `start` in the same task carries it, and otherwise it is reported in the same turn of
   * the event loop. `setTimeout(fn, 0)` would cost a second wake-up of an idle process per call
   * (Node's timers are at least 1 ms): 90-130 us of CPU per call with one caller on this
   * project's bench machine, more than the call itself.
   */
  soon(fn: () => void): SoonTask;
}

/**
 * A task `Platform.soon` scheduled. A held-back success that a `start` carried leaves its flush
 * with nothing to do: the runtime then lets the event loop wait for other work first (`unref`),
 * rather than turn once more at once, and `ref`s it again when another success is held.
 */
export interface SoonTask {
  /** Run in this turn of the event loop (the default). */
  ref(): unknown;
  /** Run when the loop next turns for other work (and not at all if nothing keeps it alive). */
  unref(): unknown;
}

/** Instantiates core modules: the jco hook (for instrumentation and fault-injection tests). */
export type InstantiateCore = (module: WebAssembly.Module, imports: Record<string, unknown>) => WebAssembly.Instance;

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

/** One step of a call, as `LoadOptions.trace` sees it. */
export interface TraceStep {
  op: 'start' | 'acquire' | 'report' | 'report-fallback' | 'hedge-step' | 'report-attempt';
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
  /** The attempt reported (for `report-attempt`). */
  attempt?: number;
  /** The commands the core answered (for `hedge-step` and `report-attempt`). */
  commands?: readonly HedgeCommand[];
  /**
   * The core's verdict. For `hedge-step` and `report-attempt`: the verdict of the `end` command
   * when the answer ends the call, otherwise a `hedge` verdict whose detail is the attempts
   * started so far (the call goes on hedged).
   */
  verdict: Verdict;
}

/** What the runtime takes from the load options. */
export interface RuntimeOptions {
  seed: bigint;
  instantiateCore: InstantiateCore | undefined;
  checkpointNs: bigint;
  maxMemoryBytes: number;
  trace: ((step: TraceStep) => void) | undefined;
  /** Where an error of the `trace` callback goes (it is ignored). */
  report: ObserverErrorHandler;
  /**
   * Run the delivery of an event of call `call` (telemetry, listeners) in that call's context
   * (its `levee.call` span, when spans are on); `undefined`: in the current context.
   */
  withCall: ((call: bigint, fn: () => void) => void) | undefined;
  /** Wall-clock milliseconds since the epoch (an HTTP-date in Retry-After is read against it). */
  wallMs: () => number;
}

/**
 * The `flags` argument of `start` (docs/hosts.md, section 6): the method exactly as it will be
 * sent (RFC 9110 methods are case-sensitive: `get` is not `GET`, and is code `METHOD_OTHER`).
 */
export function startFlags(
  options:
    | { idempotent?: boolean | undefined; idempotencyKey?: boolean | string | undefined; method?: string | undefined }
    | undefined,
): number {
  if (options === undefined) return 0;
  let flags = 0;
  if (options.idempotent === false) flags |= START_NON_IDEMPOTENT;
  const key = options.idempotencyKey;
  if (key === true || (typeof key === 'string' && key !== '')) flags |= START_IDEMPOTENCY_KEY;
  const method = options.method;
  if (method !== undefined && method !== '') {
    const code = Object.hasOwn(METHODS, method) ? METHODS[method]! : METHOD_OTHER;
    flags |= code << START_METHOD_SHIFT;
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
export const DEFAULT_MAX_MEMORY_BYTES = GUARD_GUEST_MEMORY_BYTES;

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
 * A `result` error of the WIT is an answer, not a fault: jco throws it as a ComponentError, whose
 * `name` is Error's own (only its class is named so), with the error value as `payload`.
 */
export function isComponentError(err: unknown): err is Error & { payload: unknown } {
  if (!(err instanceof Error) || !('payload' in err)) return false;
  return err.name === 'ComponentError' || err.constructor.name === 'ComponentError';
}

/**
 * The policy component, instantiated, and everything that keeps it usable: one per Levee. Every
 * crossing that can trap answers `undefined` after recovering from the trap (re-instantiated,
 * last exported state restored, `engine-fault` emitted); `generation` counts the instances, so a
 * call that began on an earlier one knows the engine forgot it.
 */
export class Runtime {
  readonly #platform: Platform;
  readonly #now: () => bigint;
  readonly #options: RuntimeOptions;
  readonly #emitter: Emitter;
  readonly #telemetry: Telemetry | undefined;
  #document: string;
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
  #generation = 0;
  policies: PolicyEntry[] = [];
  byName = new Map<string, PolicyEntry>();
  // The success held back to ride on the next `start` (DESIGN.md, "batching").
  // `holding` says whether there is one (a boolean: comparing BigInts costs a builtin call).
  holding = false;
  /** `close` was called: the instance is released. */
  closed = false;
  #heldCall = 0n;
  #heldAt = 0n;
  #heldElapsed = 0n;

  // The bulkhead queue (docs/policy.md, "The queue"): calls parked on a `wait` with reason
  // bulkhead-full, by call id, each with the function that wakes it; the core names the calls
  // to wake (`take-wakes`: it granted them a slot), each one lookup. `parked` counts them: while
  // it is 0 a cancel or a hedged attempt's report pays one number check.
  parked = 0;
  readonly #parkers = new Map<bigint, () => void>();
  // Calls the core named before they parked (the verdict that queued a call may name it, when
  // it is granted a slot at once): claimed by `park` in the same turn, forgotten at its end.
  readonly #unclaimed = new Set<bigint>();
  #unclaimedSweep = false;
  // The flush `hold` scheduled, until it runs; `#flushUrgent` while it has a success to send.
  #flushTask: SoonTask | undefined;
  #flushUrgent = false;
  readonly #flushTick = (): void => {
    this.#flushTask = undefined;
    this.#flushUrgent = false;
    this.flush();
  };
  // Trap recovery: the last snapshot (`export-snapshot`), or the last state the user exported or imported.
  #lastState: Uint8Array | undefined;
  nextCheckpoint: bigint;
  #memories: WebAssembly.Memory[] = [];
  readonly #trace: ((step: TraceStep) => void) | undefined;

  constructor(
    platform: Platform,
    now: () => bigint,
    document: string,
    options: RuntimeOptions,
    emitter: Emitter,
    telemetry: Telemetry | undefined,
  ) {
    this.#platform = platform;
    this.#now = now;
    this.#document = document;
    this.#options = options;
    this.#emitter = emitter;
    this.#telemetry = telemetry;
    this.#trace = options.trace;
    this.#instantiateFresh();
    this.#readPolicies();
    this.nextCheckpoint = now() + options.checkpointNs;
    this.#lastState = exportPages(this.#engine, true);
  }

  /** Counts the instances: it changes whenever the component is replaced. */
  get generation(): number {
    return this.#generation;
  }

  get healthy(): boolean {
    return this.#healthy;
  }

  get engine(): Engine {
    return this.#engine;
  }

  get component(): ComponentExports {
    return this.#exports;
  }

  #instantiateFresh(): void {
    const base = this.#options.instantiateCore ?? ((m, i) => new WebAssembly.Instance(m, i as WebAssembly.Imports));
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
      engine = exports.engineApi.Engine.load(this.#document, this.#options.seed);
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
    this.policies = policies;
    this.byName = byName;
  }

  unknown(name: string): UnknownPolicyError {
    return new UnknownPolicyError(
      name,
      this.policies.map((p) => p.name),
    );
  }

  // ---------------------------------------------------------------- state

  /** Replace the policies, keeping the state that still applies; on error nothing changes. */
  reload(document: string): void {
    this.#shut();
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
    this.checkpoint(this.#now());
  }

  exportState(): Uint8Array {
    const state = this.use('export-state', (e) => exportPages(e, false));
    this.#lastState = state;
    return state;
  }

  importState(state: Uint8Array): void {
    this.#shut();
    this.flush();
    try {
      importPages(this.#engine, state);
    } catch (err) {
      const errors = loadErrors(err);
      if (errors) throw new PolicyLoadError(errors);
      throw err;
    }
    this.#lastState = state;
  }

  close(): void {
    if (this.closed) return;
    this.flush(); // a flush still scheduled then finds nothing held
    this.closed = true;
    const dispose = (this.#engine as { [Symbol.dispose]?: () => void })[Symbol.dispose];
    if (typeof dispose === 'function') dispose.call(this.#engine);
    this.#healthy = false;
    // Nothing is parked for good: each parked call wakes, and finds the Levee closed.
    for (const wake of [...this.#parkers.values()]) wake();
  }

  /**
   * After `close`, no crossing reaches the released instance (it would look like a fault and bring
   * a fresh instance back): the call protocol's crossings throw `LeveeClosedError` (the public API
   * checks first, and ends its calls with it), and a held-back success is dropped.
   */
  #shut(): void {
    if (this.closed) throw new LeveeClosedError();
  }

  /** A crossing outside the call protocol (state, analysis): a trap recovers and is rethrown. */
  use<R>(phase: string, fn: (engine: Engine) => R): R {
    this.#shut();
    this.flush();
    if (!this.#healthy) this.reinstantiate();
    try {
      return fn(this.#engine);
    } catch (err) {
      if (isComponentError(err)) throw err;
      this.#recover(err, phase, '');
      throw err;
    }
  }

  // ---------------------------------------------------------------- the held-back success

  /**
   * Send the success held back for batching (if any) and drain its events. Calls do this by
   * themselves; call it before reading state or events right after a success.
   */
  flush(): void {
    if (!this.holding || this.closed) return;
    const call = this.#heldCall;
    this.holding = false;
    this.#settled();
    let v: bigint;
    try {
      v = this.#engine.report(call, this.#heldAt, this.#heldElapsed, 'success', 0, '', 0n, 0);
    } catch (err) {
      this.#recover(err, 'flush', '');
      return;
    }
    if (this.parked !== 0 && (Number(v & 0x3fn) & VERDICT_WAKES_BIT) !== 0) this.#takeWakes();
    const trace = this.#trace;
    if (trace !== undefined) {
      this.#traced(trace, {
        op: 'report',
        call,
        policy: '',
        attempts: 0,
        outcome: { kind: 'success' },
        verdict: decodeVerdict(v),
      });
    }
    if ((Number(v & 0x1fn) & 0x10) !== 0) this.drain(call);
  }

  /** Hold a success back: it rides on the next `start` (or a flush soon after). */
  hold(call: bigint, now: bigint, elapsed: bigint): void {
    if (this.closed) return; // the call has its value; nothing to tell a released instance
    if (this.holding) this.flush();
    this.holding = true;
    this.#heldCall = call;
    this.#heldAt = now;
    this.#heldElapsed = elapsed;
    if (this.#flushTask === undefined) {
      this.#flushTask = this.#platform.soon(this.#flushTick);
    } else if (!this.#flushUrgent) {
      this.#flushTask.ref();
    }
    this.#flushUrgent = true;
  }

  /** The held-back success rode on a crossing: its flush, if still to run, can wait. */
  #settled(): void {
    if (this.#flushUrgent) {
      this.#flushUrgent = false;
      this.#flushTask?.unref();
    }
  }

  // ---------------------------------------------------------------- the call protocol

  /**
   * `start` (with the held-back success riding on it); `undefined` after a fault. The verdict may
   * come back negative: the core module's i64, which the caller reads as the WIT's u64.
   */
  start(p: PolicyEntry, call: bigint, key: string, flags: number, now: bigint): bigint | undefined {
    let v: bigint;
    const held = this.holding;
    try {
      this.holding = false;
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
      this.#recover(err, 'start', p.name, key, call);
      return undefined;
    }
    if (held) this.#settled();
    // A slot freed (by the held-back success that rode on this start, say) went to a waiter.
    if (this.parked !== 0 && (Number(v & 0x3fn) & VERDICT_WAKES_BIT) !== 0) this.#takeWakes();
    if (this.#trace !== undefined) this.#traceStep('start', call, p, 0, v, undefined, undefined);
    return v;
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

  /** Report an attempt's outcome; `undefined` after a fault. */
  report(
    p: PolicyEntry,
    key: string,
    call: bigint,
    now: bigint,
    elapsed: bigint,
    outcome: Outcome,
    attempts: number,
    callerFlags = 0,
  ): bigint | undefined {
    let v: bigint;
    this.#shut();
    try {
      if (this.holding) this.flush();
      // The caller's predicate (REPORT_CALLER_RETRY / REPORT_CALLER_NO_RETRY), as the driver passes it.
      const a = reportArgs(outcome, callerFlags);
      const kind: OutcomeKind = outcome.kind;
      v = this.#engine.report(call, now, elapsed, kind, a.code, a.text, this.#wallSecs(), a.flags);
    } catch (err) {
      this.#recover(err, 'report', p.name, key, call);
      return undefined;
    }
    // The slot the attempt freed went to the oldest waiter: the core names it.
    if (this.parked !== 0 && (Number(v & 0x3fn) & VERDICT_WAKES_BIT) !== 0) this.#takeWakes();
    if (this.#trace !== undefined) this.#traceStep('report', call, p, attempts, v, outcome, undefined);
    return v;
  }

  /** The wall clock in seconds, for `report`'s Retry-After dates. */
  #wallSecs(): bigint {
    return BigInt(Math.floor(this.#options.wallMs() / 1000));
  }

  /** `hedge-step`: advance a hedged call to `now`; `undefined` after a trap. */
  hedgeStep(p: PolicyEntry, key: string, call: bigint, now: bigint, attempts: number): HedgeAnswer | undefined {
    let a: HedgeAnswer;
    this.#shut();
    try {
      if (this.holding) this.flush();
      a = this.#engine.hedgeStep(call, now);
    } catch (err) {
      this.#recover(err, 'hedge-step', p.name, key, call);
      return undefined;
    }
    if (this.#trace !== undefined) this.#traceHedge('hedge-step', call, p, attempts, a, undefined, undefined);
    return a;
  }

  /**
   * `report-attempt`: attempt `attempt` of a hedged call closed with `outcome` (what a cancelled
   * attempt gives is not looked at, only what it held is freed); `undefined` after a trap.
   */
  reportAttempt(
    p: PolicyEntry,
    key: string,
    call: bigint,
    attempt: number,
    now: bigint,
    elapsed: bigint,
    outcome: Outcome,
    callerFlags: number,
    attempts: number,
  ): HedgeAnswer | undefined {
    let a: HedgeAnswer;
    this.#shut();
    try {
      if (this.holding) this.flush();
      const r = reportArgs(outcome, callerFlags);
      a = this.#engine.reportAttempt(
        call,
        attempt,
        now,
        elapsed,
        outcome.kind,
        r.code,
        r.text,
        this.#wallSecs(),
        r.flags,
      );
    } catch (err) {
      this.#recover(err, 'report-attempt', p.name, key, call);
      return undefined;
    }
    // The attempt freed what it held (a bulkhead slot): the answer has no wakes bit, so while
    // calls are parked the host asks whom the core granted it to.
    if (this.parked !== 0) this.#takeWakes();
    if (this.#trace !== undefined) this.#traceHedge('report-attempt', call, p, attempts, a, attempt, outcome);
    return a;
  }

  /** `acquire` before the next attempt; `undefined` after a fault. */
  acquire(p: PolicyEntry, key: string, call: bigint, now: bigint, attempts: number): bigint | undefined {
    let v: bigint;
    this.#shut();
    try {
      if (this.holding) this.flush();
      v = this.#engine.acquire(call, now);
    } catch (err) {
      this.#recover(err, 'acquire', p.name, key, call);
      return undefined;
    }
    if (this.parked !== 0 && (Number(v & 0x3fn) & VERDICT_WAKES_BIT) !== 0) this.#takeWakes();
    if (this.#trace !== undefined) this.#traceStep('acquire', call, p, attempts, v, undefined, undefined);
    return v;
  }

  /** Report a fallback's result; `undefined` after a fault. */
  reportFallback(
    p: PolicyEntry,
    key: string,
    call: bigint,
    now: bigint,
    ok: boolean,
    attempts: number,
  ): bigint | undefined {
    let v: bigint;
    this.#shut();
    try {
      if (this.holding) this.flush();
      v = this.#engine.reportFallback(call, now, ok);
    } catch (err) {
      this.#recover(err, 'report-fallback', p.name, key, call);
      return undefined;
    }
    if (this.parked !== 0 && (Number(v & 0x3fn) & VERDICT_WAKES_BIT) !== 0) this.#takeWakes();
    if (this.#trace !== undefined) this.#traceStep('report-fallback', call, p, attempts, v, undefined, ok);
    return v;
  }

  /** Abandon a call in the engine (the caller was cancelled), unless the engine already forgot it. */
  cancel(call: bigint, now: bigint, gen: number): void {
    if (this.#generation !== gen || this.closed) return;
    try {
      this.flush();
      this.#engine.cancel(call, now);
    } catch (err) {
      this.#recover(err, 'cancel', '');
      return;
    }
    // The slot or the grant the call held went to the oldest waiter; `cancel` has no verdict.
    if (this.parked !== 0) this.#takeWakes();
  }

  // ---------------------------------------------------------------- the bulkhead queue

  /**
   * Park `call`, told to wait in the bulkhead queue, until `wake` is called (the core named it).
   * Registered in the same synchronous turn as the crossing that queued it, so no crossing that
   * grants it a slot can come in between (no lost wake-up); a wake named in that very crossing
   * is claimed here. Answers the function that ends the park.
   */
  park(call: bigint, wake: () => void): () => void {
    if (this.#unclaimed.delete(call)) {
      wake();
      return () => {};
    }
    this.#parkers.set(call, wake);
    // While nothing was parked the verdicts' wakes bit was not looked at (the hot path pays one
    // number check): the first park takes the wakes left, which may name this very call.
    if (this.parked++ === 0) this.#takeWakes();
    return () => {
      if (this.#parkers.get(call) === wake) {
        this.#parkers.delete(call);
        this.parked--;
      }
    };
  }

  /** Wake the calls the core granted a slot (`take-wakes`), and only them. */
  #takeWakes(): void {
    let calls: BigUint64Array;
    try {
      calls = this.#engine.takeWakes();
    } catch (err) {
      this.#recover(err, 'take-wakes', '');
      return;
    }
    for (const call of calls) {
      const wake = this.#parkers.get(call);
      if (wake !== undefined) {
        this.#parkers.delete(call);
        this.parked--;
        wake();
      } else {
        // Not parked yet (its park comes later in this turn), or not at all (it acquired
        // already, or ended): kept to the end of the turn only.
        this.#unclaimed.add(call);
        if (!this.#unclaimedSweep) {
          this.#unclaimedSweep = true;
          queueMicrotask(() => {
            this.#unclaimedSweep = false;
            this.#unclaimed.clear();
          });
        }
      }
    }
  }

  #traceHedge(
    op: 'hedge-step' | 'report-attempt',
    call: bigint,
    p: PolicyEntry,
    attempts: number,
    a: HedgeAnswer,
    attempt: number | undefined,
    outcome: Outcome | undefined,
  ): void {
    const last = a.commands[a.commands.length - 1];
    const v = last?.tag === 'end' ? last.val.verdict : BigInt(KIND_HEDGE | (Math.min(attempts, 255) << 8));
    const verdict = decodeVerdict(v);
    const step: TraceStep = { op, call, policy: p.name, attempts, verdict, commands: a.commands };
    if (attempt !== undefined) step.attempt = attempt;
    if (outcome !== undefined) step.outcome = outcome;
    if (verdict.kind === 'fallback') step.fallback = p.fallbacks[verdict.payload] ?? '';
    if (this.#trace !== undefined) this.#traced(this.#trace, step);
  }

  /** Show `step` to the `trace` callback: observer code, whose error is reported and ignored. */
  #traced(trace: (step: TraceStep) => void, step: TraceStep): void {
    try {
      trace(step);
    } catch (err) {
      reportHookError(err, 'trace callback', this.#options.report);
    }
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
    if (this.#trace !== undefined) this.#traced(this.#trace, step);
  }

  // ---------------------------------------------------------------- events and snapshots

  /**
   * Deliver the events the core queued. `call`: the call whose crossing queued them, which owns
   * those of no call (a breaker transition its report caused) for `withCall`.
   */
  drain(call?: bigint): void {
    if (this.closed) return;
    let events: Event[];
    try {
      events = this.#engine.drainEvents();
    } catch (err) {
      this.#recover(err, 'drain-events', '');
      return;
    }
    let transitions = false;
    const emitter = this.#emitter;
    const telemetry = this.#telemetry;
    const listening = emitter.listening;
    const withCall = this.#options.withCall;
    for (const raw of events) {
      if (raw.kind === 'breaker-transition') transitions = true;
      if (!listening && telemetry === undefined) continue;
      const event = raw as LeveeEvent;
      event.policyName = this.policies[raw.policy]?.name ?? '';
      const deliver = (): void => {
        telemetry?.event(event);
        if (listening) {
          emitter.emit('event', event);
          emitter.emit(event.kind, event);
        }
      };
      const owner = event.call !== 0n ? event.call : call;
      if (withCall !== undefined && owner !== undefined) withCall(owner, deliver);
      else deliver();
    }
    // A breaker that changed state is what a restarted instance most needs back.
    if (transitions) this.checkpoint(this.#now());
  }

  checkpoint(now: bigint): void {
    this.nextCheckpoint = now + this.#options.checkpointNs;
    // JavaScript cannot cap a Wasm memory it did not create: check its size here, and treat a
    // component whose memory outgrew the bound like one that trapped (the last state comes back).
    let bytes = 0;
    for (const memory of this.#memories) bytes += memory.buffer.byteLength;
    const bound = this.#options.maxMemoryBytes;
    if (bytes > bound) {
      this.#recover(
        new RangeError(`levee: the policy component's memory grew to ${bytes} bytes (bound ${bound})`),
        'memory-limit',
        '',
      );
      return;
    }
    // The recovery snapshot (docs/hosts.md, section 7): only the keys holding protection, so its
    // cost follows them, not the size of the key table (the full `export-state` is the user's).
    try {
      this.#lastState = exportPages(this.#engine, true);
    } catch (err) {
      this.#recover(err, 'export-snapshot', '');
    }
  }

  // ---------------------------------------------------------------- trap recovery

  /**
   * The component trapped (or returned something the glue could not lift): the instance is
   * poisoned. Re-instantiate, reload the document, restore the last exported state, report the
   * fault. Calls in flight continue as single attempts without retries.
   */
  #recover(error: unknown, phase: string, policyName: string, key = '', call: bigint | undefined = undefined): void {
    this.#fault('trap', error, phase, policyName, key, call);
  }

  /**
   * A verdict that breaks the contract (`contract`: the instance is replaced, as after a trap) or
   * an `invalid` answer for a call this host started (`invalid`: the instance stays), reported as
   * `engine-fault` (docs/hosts.md, section 3). The call then finishes degraded (driver.ts).
   */
  guestFault(
    fault: 'contract' | 'invalid',
    detail: string,
    phase: string,
    p: PolicyEntry,
    key: string,
    call: bigint,
  ): void {
    this.#fault(fault, new Error(`levee: ${detail}`), phase, p.name, key, call);
  }

  #fault(
    fault: EngineFaultEvent['fault'],
    error: unknown,
    phase: string,
    policyName: string,
    key: string,
    call: bigint | undefined,
  ): void {
    let restored = false;
    if (fault !== 'invalid') {
      this.#generation++;
      this.holding = false; // the success held for the trapped instance is not sent
      this.#settled();
      restored = this.reinstantiate();
    }
    const event: EngineFaultEvent = { kind: 'engine-fault', fault, phase, error, restored, policyName, key, call };
    const deliver = (): void => {
      this.#telemetry?.fault(event);
      this.#emitter.emit('engine-fault', event);
    };
    const withCall = this.#options.withCall;
    if (withCall !== undefined && call !== undefined) withCall(call, deliver);
    else deliver();
  }

  /** A fresh instance with the last exported state; false when that state could not come back. */
  reinstantiate(): boolean {
    try {
      this.#instantiateFresh();
    } catch {
      this.#healthy = false;
      return false;
    }
    this.#healthy = true;
    if (this.#lastState === undefined) return false;
    try {
      importPages(this.#engine, this.#lastState);
      return true;
    } catch {
      return false;
    }
  }
}

/**
 * `export-state-page` from cursor 0 until the document is complete (`snapshot`: of
 * `export-snapshot`): each crossing copies at most `GUARD_STATE_PAGE_BYTES` and the guest never
 * holds the whole document (docs/hosts.md, "State of any size"). Synchronous, so nothing runs on
 * the engine between the pages. A page over its bound, or a cursor that does not move on by the
 * page's bytes, breaks the contract: thrown, and recovered from as a trap.
 */
export function exportPages(engine: Engine, snapshot: boolean): Uint8Array {
  const pages: Uint8Array[] = [];
  let cursor = 0n;
  let total = 0;
  for (;;) {
    const page = engine.exportStatePage(cursor, snapshot);
    const n = page.bytes.length;
    if (n > GUARD_STATE_PAGE_BYTES || (page.next !== 0n && (n === 0 || page.next !== cursor + BigInt(n)))) {
      throw new Error(
        `levee: export-state-page broke the contract: ${n} bytes from cursor ${cursor}, next ${page.next}`,
      );
    }
    pages.push(page.bytes);
    total += n;
    if (page.next === 0n) break;
    cursor = page.next;
  }
  if (pages.length === 1 && pages[0] !== undefined) return pages[0];
  const out = new Uint8Array(total);
  let at = 0;
  for (const p of pages) {
    out.set(p, at);
    at += p.length;
  }
  return out;
}

/**
 * `import-state-begin`, the state in pages of at most `GUARD_STATE_PAGE_BYTES`
 * (`import-state-page`), `import-state-end`: a state of any size; on error (thrown as
 * `import-state` throws it) nothing changes.
 */
export function importPages(engine: Engine, state: Uint8Array): void {
  engine.importStateBegin();
  for (let at = 0; at < state.length; at += GUARD_STATE_PAGE_BYTES) {
    engine.importStatePage(state.subarray(at, at + GUARD_STATE_PAGE_BYTES));
  }
  engine.importStateEnd();
}

/** What `reportArgs` answers; one object, reused, so that a report allocates nothing for it. */
const REPORT_ARGS = { code: 0, text: '', flags: 0 };

/**
 * The `code`, `text` and `flags` arguments of `report` and `report-attempt` for `outcome` and
 * the caller's predicate flags. The answer is only good until the next call.
 */
function reportArgs(outcome: Outcome, callerFlags: number): typeof REPORT_ARGS {
  let code = 0;
  let text = '';
  let flags = callerFlags;
  switch (outcome.kind) {
    case 'http-status':
      code = outcome.status;
      text = outcome.retryAfter ?? '';
      if (outcome.overloaded === true) flags |= REPORT_OVERLOADED;
      break;
    case 'grpc-status':
      code = outcome.code;
      text = outcome.pushback ?? '';
      break;
    case 'error-class':
      text = outcome.name;
      break;
  }
  REPORT_ARGS.code = code;
  REPORT_ARGS.text = text;
  REPORT_ARGS.flags = flags;
  return REPORT_ARGS;
}

// levee-resilience/testing: virtual time for tests of code that runs under Levee.
//
//   import { load } from 'levee-resilience';
//   import { VirtualClock, noWaits } from 'levee-resilience/testing';
//
//   const clock = new VirtualClock();
//   const levee = await load(doc, { clock, seed: 1n });
//   const call = levee.run('api', attempt);
//   await clock.advance(250);          // timers due in the next 250 ms fire, in order
//
//   const clock = new VirtualClock({ auto: true });   // time jumps to the next timer by itself
//
//   using _ = noWaits();               // or: every Levee skips its waits between attempts

import type { Clock } from './clock.js';
import type { InstantiateCore } from './runtime.js';
import type { TelemetrySink } from './events.js';
import type { HedgeCommand } from '../wasm/interfaces/levee-policy-types.js';

export { noWaits } from './clock.js';
export type { Clock } from './clock.js';
export type { HedgeCommand } from './types.js';

export interface VirtualClockOptions {
  /** The clock's time at creation, in nanoseconds. Default 0. */
  start?: bigint | undefined;
  /** Wall-clock time (ms since the Unix epoch) at time 0 of this clock. Default 2026-01-01T00:00:00Z. */
  wallStartMs?: number | undefined;
  /**
   * Advance by itself: whenever the program is idle (its microtasks have run and two turns of the
   * event loop went by) and a timer of this clock is pending, time jumps to the earliest one and
   * fires it. Right for dependencies that are in-process (promises, virtual timers); an attempt
   * that waits on real I/O would see its timeout fire before the I/O completes. Default false.
   */
  auto?: boolean | undefined;
}

interface Timer {
  at: bigint;
  seq: number;
  resolve: () => void;
  reject: (reason: unknown) => void;
  signal: AbortSignal | undefined;
  onAbort: (() => void) | undefined;
}

const DEFAULT_WALL_START_MS = Date.UTC(2026, 0, 1);

// A turn of the real event loop, after every pending microtask has run.
const macrotask: () => Promise<void> =
  typeof setImmediate === 'function'
    ? () => new Promise<void>((resolve) => setImmediate(resolve))
    : () => new Promise<void>((resolve) => setTimeout(resolve, 0));

/** Nanoseconds from milliseconds (fractions of a millisecond count, to the nanosecond). */
function nsOf(ms: number): bigint {
  if (!(ms > 0)) return 0n;
  if (!Number.isFinite(ms)) throw new RangeError(`levee: a sleep of ${ms} ms`);
  return BigInt(Math.round(ms * 1e6));
}

/**
 * A clock whose time moves only when the test says (`advance`, `advanceTo`, `runAll`), or, with
 * `{ auto: true }`, by itself to the next timer whenever the program waits only on it. Its timers
 * (Levee's sleeps between attempts and attempt timeouts) fire in time order; timers due at the
 * same instant fire in the order they were set.
 */
export class VirtualClock implements Clock {
  #now: bigint;
  readonly #wallStartMs: number;
  readonly #auto: boolean;
  #timers: Timer[] = [];
  #seq = 0;
  #ticking = false;

  constructor(options: VirtualClockOptions = {}) {
    this.#now = options.start ?? 0n;
    this.#wallStartMs = options.wallStartMs ?? DEFAULT_WALL_START_MS;
    this.#auto = options.auto ?? false;
  }

  /** The time, in nanoseconds. */
  now(): bigint {
    return this.#now;
  }

  /** The time, in milliseconds. */
  nowMs(): number {
    return Number(this.#now) / 1e6;
  }

  /** Wall-clock time: `wallStartMs` plus the time, in milliseconds. */
  wallMs(): number {
    return this.#wallStartMs + Math.floor(Number(this.#now) / 1e6);
  }

  /** Timers waiting to fire. */
  get pending(): number {
    return this.#timers.length;
  }

  /** When the next timer fires (ns), or `undefined` when none waits. */
  get nextAt(): bigint | undefined {
    return this.#timers[0]?.at;
  }

  sleep(ms: number, signal?: AbortSignal): Promise<void> {
    if (signal?.aborted) return Promise.reject(signal.reason);
    const at = this.#now + nsOf(ms);
    return new Promise<void>((resolve, reject) => {
      const timer: Timer = { at, seq: this.#seq++, resolve, reject, signal, onAbort: undefined };
      if (signal !== undefined) {
        timer.onAbort = (): void => {
          this.#remove(timer);
          reject(signal.reason);
        };
        signal.addEventListener('abort', timer.onAbort, { once: true });
      }
      this.#insert(timer);
      if (this.#auto) this.#tick();
    });
  }

  /** Let the program run until it waits on nothing but timers: its microtasks, two event-loop turns. */
  async settle(): Promise<void> {
    await macrotask();
    await macrotask();
  }

  /**
   * Move time forward by `ms`, firing every timer that falls due on the way, in order; after each
   * instant with timers, the code they woke runs (`settle`) before time moves on, so timers it sets
   * fire in the same advance when they fall due within it.
   */
  async advance(ms: number): Promise<void> {
    await this.advanceTo(this.#now + nsOf(ms));
  }

  /** Move time forward to `at` (ns), as `advance` does. A time in the past changes nothing. */
  async advanceTo(at: bigint): Promise<void> {
    await this.settle();
    for (;;) {
      const next = this.#timers[0];
      if (next === undefined || next.at > at) break;
      this.#fireNext();
      await this.settle();
    }
    if (at > this.#now) this.#now = at;
    await this.settle();
  }

  /**
   * Fire timers, in order, until none is left (the program settles after each instant). Throws
   * after `limit` instants: a loop that sets a timer for every one it fires never ends by itself.
   */
  async runAll(limit = 10_000): Promise<void> {
    await this.settle();
    for (let i = 0; this.#timers.length > 0; i++) {
      if (i >= limit) throw new Error(`levee: VirtualClock.runAll fired ${limit} instants and timers remain`);
      this.#fireNext();
      await this.settle();
    }
  }

  /** Fire the timers of the earliest instant, moving time there. */
  #fireNext(): void {
    const first = this.#timers[0];
    if (first === undefined) return;
    if (first.at > this.#now) this.#now = first.at;
    const at = first.at;
    while (this.#timers.length > 0 && this.#timers[0]!.at === at) {
      const timer = this.#timers.shift()!;
      if (timer.onAbort !== undefined) timer.signal?.removeEventListener('abort', timer.onAbort);
      timer.resolve();
    }
  }

  #insert(timer: Timer): void {
    const timers = this.#timers;
    let lo = 0;
    let hi = timers.length;
    while (lo < hi) {
      const mid = (lo + hi) >>> 1;
      const t = timers[mid]!;
      if (t.at < timer.at || (t.at === timer.at && t.seq < timer.seq)) lo = mid + 1;
      else hi = mid;
    }
    timers.splice(lo, 0, timer);
  }

  #remove(timer: Timer): void {
    const i = this.#timers.indexOf(timer);
    if (i >= 0) this.#timers.splice(i, 1);
  }

  /** Auto mode: once the program is idle, fire the earliest instant; again while timers remain. */
  #tick(): void {
    if (this.#ticking) return;
    this.#ticking = true;
    void (async () => {
      try {
        for (;;) {
          await this.settle();
          if (this.#timers.length === 0) break;
          this.#fireNext();
        }
      } finally {
        this.#ticking = false;
      }
    })();
  }
}

// ------------------------------------------------------------------ guest faults, injected

/** A crossing of the call protocol (`hedge-step` and `report-attempt`: a hedged call's). */
export type FaultOp = 'start' | 'acquire' | 'report' | 'report-fallback' | 'hedge-step' | 'report-attempt';

/**
 * A guest fault on the `nth` crossing named `op` of one call (1 for the first): a trap (the
 * default), the guest's answer replaced by the packed `verdict` (one that breaks the contract), or,
 * for `hedge-step` and `report-attempt`, by `commands` (with no events pending: the real
 * crossing's events are lost, as a trap's are).
 */
export interface Fault {
  op: FaultOp;
  nth?: number | undefined;
  verdict?: bigint | number | string | undefined;
  commands?: readonly HedgeCommand[] | undefined;
}

const FAULT_OPS: readonly FaultOp[] = ['start', 'acquire', 'report', 'report-fallback', 'hedge-step', 'report-attempt'];
const VERDICT_OPS: readonly FaultOp[] = ['start', 'acquire', 'report', 'report-fallback'];
const METHOD_PREFIX = '[method]engine.';

interface Plan {
  faults: { op: FaultOp; nth: number; verdict: bigint | undefined; commands: readonly HedgeCommand[] | undefined }[];
  counts: Record<FaultOp, number>;
}

/**
 * Faults for tests of the recovery path (docs/hosts.md, section 3), at the component's
 * boundary, exactly where a real trap surfaces: pass `instantiateCore` to `load`, then
 * `inject(call, ...faults)` before the call runs. A Levee numbers its calls 1, 2, ... in the order
 * `run` (or a `leveeFetch` request) is called. The plan survives the re-instantiation.
 */
export class FaultInjector {
  readonly #plans = new Map<bigint, Plan>();
  /** The `instantiateCore` load option that arms the faults. */
  readonly instantiateCore: InstantiateCore = (module, imports) => {
    const instance = new WebAssembly.Instance(module, imports as WebAssembly.Imports);
    const exports: Record<string, unknown> = { ...instance.exports };
    for (const [name, value] of Object.entries(instance.exports)) {
      const at = name.lastIndexOf(METHOD_PREFIX);
      const op = at < 0 ? undefined : FAULT_OPS.find((o) => name.slice(at + METHOD_PREFIX.length) === o);
      if (op === undefined || typeof value !== 'function') continue;
      const real = value as (...args: unknown[]) => unknown;
      exports[name] = (...args: unknown[]): unknown => {
        // The canonical ABI of every crossing: the engine's rep, then the call (an i64).
        const plan = typeof args[1] === 'bigint' ? this.#plans.get(BigInt.asUintN(64, args[1])) : undefined;
        if (plan === undefined) return real(...args);
        const n = ++plan.counts[op];
        const fault = plan.faults.find((f) => f.op === op && f.nth === n);
        if (fault === undefined) return real(...args);
        if (fault.commands !== undefined) return answerWith(instance, real(...args) as number, fault.commands);
        if (fault.verdict === undefined) throw new WebAssembly.RuntimeError(`unreachable (injected at ${op} #${n})`);
        real(...args);
        return BigInt.asIntN(64, fault.verdict);
      };
    }
    return { exports } as unknown as WebAssembly.Instance;
  };

  /** Arm `faults` for call `call`. */
  inject(call: bigint | number, ...faults: Fault[]): this {
    const plan: Plan = {
      faults: [],
      counts: { start: 0, acquire: 0, report: 0, 'report-fallback': 0, 'hedge-step': 0, 'report-attempt': 0 },
    };
    for (const f of faults) {
      if (!FAULT_OPS.includes(f.op)) throw new RangeError(`levee: unknown crossing '${String(f.op)}'`);
      if (f.verdict !== undefined && !VERDICT_OPS.includes(f.op)) {
        throw new RangeError(`levee: '${f.op}' answers commands, not a verdict`);
      }
      if (f.commands !== undefined && VERDICT_OPS.includes(f.op)) {
        throw new RangeError(`levee: '${f.op}' answers a verdict, not commands`);
      }
      plan.faults.push({
        op: f.op,
        nth: f.nth ?? 1,
        verdict: f.verdict === undefined ? undefined : BigInt(f.verdict),
        commands: f.commands,
      });
    }
    this.#plans.set(BigInt(call), plan);
    return this;
  }
}

/**
 * Replace the `hedge-answer` a hedged crossing returned (at `ret`, its canonical-ABI return area:
 * the list's pointer and length, then the events flag) with `commands`, written in memory the
 * guest allocates (`cabi_realloc`), which its post-return frees. The real list is not freed: a
 * test seam's leak of a few bytes.
 */
function answerWith(instance: WebAssembly.Instance, ret: number, commands: readonly HedgeCommand[]): number {
  const { memory, cabi_realloc: realloc } = instance.exports as {
    memory?: WebAssembly.Memory;
    cabi_realloc?: (ptr: number, old: number, align: number, size: number) => number;
  };
  if (memory === undefined || realloc === undefined) throw new Error('levee: no memory or cabi_realloc to answer in');
  const SIZE = 24; // a hedge-command: discriminant, then its payload at offset 8 (align 8)
  const ptr = realloc(0, 0, 8, Math.max(commands.length, 1) * SIZE) >>> 0;
  const view = new DataView(memory.buffer);
  commands.forEach((c, i) => {
    const at = ptr + i * SIZE;
    switch (c.tag) {
      case 'start':
        view.setUint8(at, 0);
        view.setUint32(at + 8, c.val.attempt, true);
        view.setBigUint64(at + 16, c.val.timeout, true);
        break;
      case 'cancel':
        view.setUint8(at, 1);
        view.setUint32(at + 8, c.val, true);
        break;
      case 'wait':
        view.setUint8(at, 2);
        view.setBigUint64(at + 8, c.val, true);
        break;
      case 'end':
        view.setUint8(at, 3);
        view.setUint32(at + 8, c.val.attempt, true);
        view.setBigUint64(at + 16, c.val.verdict, true);
        break;
    }
  });
  view.setUint32(ret, ptr, true);
  view.setUint32(ret + 4, commands.length, true);
  view.setUint8(ret + 8, 0);
  return ret;
}

// ------------------------------------------------------------------ telemetry, recorded

/** One thing a `RecordingSink` received. */
export interface Recorded {
  kind: 'event' | 'add' | 'record' | 'gauge';
  name: string;
  value: number;
  attributes: Record<string, string | number | boolean>;
  /** What `label()` said when it was recorded (say, the test's own call index). */
  label: unknown;
}

/** A `TelemetrySink` that keeps everything, in order; `label` tags each entry (e.g. from an AsyncLocalStorage). */
export class RecordingSink implements TelemetrySink {
  readonly entries: Recorded[] = [];
  readonly #label: () => unknown;

  constructor(label: () => unknown = () => undefined) {
    this.#label = label;
  }

  #add(kind: Recorded['kind'], name: string, value: number, attributes: Recorded['attributes']): void {
    this.entries.push({ kind, name, value, attributes: { ...attributes }, label: this.#label() });
  }

  event(name: string, attributes: Recorded['attributes']): void {
    this.#add('event', name, 0, attributes);
  }

  add(counter: string, value: number, attributes: Recorded['attributes']): void {
    this.#add('add', counter, value, attributes);
  }

  record(histogram: string, value: number, attributes: Recorded['attributes']): void {
    this.#add('record', histogram, value, attributes);
  }

  gauge(gauge: string, value: number, attributes: Recorded['attributes']): void {
    this.#add('gauge', gauge, value, attributes);
  }
}

/** `name{a=1,b=x}`, attributes sorted by name (the metric keys of conformance/hosts). */
export function metricKey(name: string, attributes: Record<string, string | number | boolean>): string {
  const parts = Object.keys(attributes)
    .sort()
    .map((k) => `${k}=${String(attributes[k])}`);
  return `${name}{${parts.join(',')}}`;
}

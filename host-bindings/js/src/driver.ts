// The driver: a small sans-I/O state machine from the core's verdicts to the host's actions
// (docs/hosts.md, section 1): run an attempt under a timeout, sleep, run a fallback, finish with
// a value or a typed error, or take the one recovery path. It reads no clock, starts no timer and
// calls nothing: the public API (levee.ts) passes it each verdict with the `now` of the crossing
// that produced it and does what it answers. It decides nothing the core decides: it relays the
// verdict once it has checked it against the contract (docs/hosts.md, section 2).

import {
  KIND_ATTEMPT,
  KIND_DONE,
  KIND_FALLBACK,
  KIND_HEDGE,
  KIND_INVALID,
  KIND_RETRY,
  KIND_WAIT,
  REASONS,
  VERDICT_RESERVED_MASK,
} from './constants.js';
import type { Reason } from './errors.js';
import type { PolicyEntry } from './runtime.js';
import { decodeVerdict } from './verdict.js';

/** Run attempt `attempts` under `timeoutNs` (0: none), then report it. */
export const ACT_ATTEMPT = 0;
/** Sleep `sleepNs` (`retry`: before a retry, so the `onRetry` hooks run first), then acquire. */
export const ACT_SLEEP = 1;
/** Run fallback `fallbackName` for `reason`, then report it. */
export const ACT_FALLBACK = 2;
/** The call is done: it ends with the value of the last attempt or fallback. */
export const ACT_DONE = 3;
/** The call fails with the core's `reason` (`hintNs`: its retry-after hint). */
export const ACT_FAIL = 4;
/** The verdict is a guest fault (`fault`: `contract` or `invalid`, `detail` says why): call `recover`. */
export const ACT_FAULT = 5;
/** Recovery: the call ends with the last attempt's own result (value, error or response). */
export const ACT_END_ATTEMPT = 6;
/** Recovery: the call ends with the last fallback's own result (value or error). */
export const ACT_END_FALLBACK = 7;
/** Recovery: run one degraded attempt (`attempts`, under `timeoutNs`); its own result ends the call. */
export const ACT_DEGRADED = 8;
/**
 * A hedged call (docs/policy.md, "Hedging"): run attempt 1 under `timeoutNs`, then carry out the
 * commands of `hedge-step` and `report-attempt` (hedge.ts checks them) until one ends the call.
 */
export const ACT_HEDGE = 9;

export type Action =
  | typeof ACT_ATTEMPT
  | typeof ACT_SLEEP
  | typeof ACT_FALLBACK
  | typeof ACT_DONE
  | typeof ACT_FAIL
  | typeof ACT_FAULT
  | typeof ACT_END_ATTEMPT
  | typeof ACT_END_FALLBACK
  | typeof ACT_DEGRADED
  | typeof ACT_HEDGE;

/** The crossing a verdict answers. */
export type Crossing = 'start' | 'acquire' | 'report' | 'report-fallback' | 'hedge-step' | 'report-attempt';

export type Fault = 'trap' | 'contract' | 'invalid';

const TWO_53 = 9007199254740992;
const MAX_REASON = REASONS.length - 1;
const BULKHEAD_FULL = REASONS.indexOf('bulkhead-full');

/** The host side of one call, step by step. The fields below `op` describe the last action. */
export class CallDriver {
  readonly policy: PolicyEntry;
  /** The call's deadline on the Levee's clock (ns), 0n when the policy has none. */
  readonly deadline: bigint;
  /** Attempts started so far. */
  attempts: number;
  /** The crossing whose verdict comes next. */
  op: Crossing;
  /** The verdict just passed says the core has events to drain. */
  events = false;
  timeoutNs = 0;
  sleepNs = 0;
  /** The sleep comes before a retry (not a rate-limit wait). */
  retry = false;
  /** The sleep is a park in the bulkhead queue (a `wait` with reason bulkhead-full): the core naming the call (a granted slot) ends it early. */
  park = false;
  fallbackName = '';
  reason: Reason = 'none';
  hintNs = 0;
  fault: Fault = 'trap';
  /** What was wrong with the verdict (ACT_FAULT). */
  detail = '';

  constructor(policy: PolicyEntry, started: bigint, attempts = 0, op: Crossing = 'start') {
    this.policy = policy;
    this.deadline = policy.deadlineNs > 0 ? started + policy.deadlineBig : 0n;
    this.attempts = attempts;
    this.op = op;
  }

  /** The action for verdict `v`, the answer of crossing `op` made at `now`. */
  next(v: bigint, now: bigint): Action {
    // Split the verdict (see verdict.ts): exact in float arithmetic below 2^53, else in BigInt.
    const n = Number(v);
    let low: number;
    let payload: number;
    if (n < TWO_53) {
      low = n % 65536;
      payload = (n - low) / 65536;
    } else {
      low = Number(v & 0xffffn);
      payload = Number(v >> 16n);
    }
    this.events = (low & 0x10) !== 0;
    const kind = low & 0xf;
    const detail = low >>> 8;
    const p = this.policy;
    const op = this.op;

    if (kind === KIND_INVALID) return this.#fault('invalid', v, 'the engine answered invalid');
    if (kind > KIND_HEDGE || (low & VERDICT_RESERVED_MASK) !== 0) {
      return this.#fault('contract', v, `unknown verdict kind ${kind} or reserved bits set`);
    }
    if (kind === KIND_ATTEMPT) {
      const number = this.attempts + 1;
      if (detail !== Math.min(number, 255) || number > p.maxAttempts) {
        return this.#fault(
          'contract',
          v,
          `attempt ${detail} when attempt ${number} of at most ${p.maxAttempts} was due`,
        );
      }
      const limit = p.attemptTimeoutNs;
      if (limit > 0 && payload > limit) {
        return this.#fault('contract', v, `attempt timeout ${payload} ns above the policy's ${limit} ns`);
      }
      if (this.deadline !== 0n) {
        const left = Number(this.deadline - now);
        if (payload > left) return this.#fault('contract', v, `attempt timeout ${payload} ns past the deadline`);
      }
      if (payload === 0 && (limit > 0 || this.deadline !== 0n)) {
        return this.#fault('contract', v, 'no attempt timeout under a policy with an attempt timeout or a deadline');
      }
      this.attempts = number;
      this.timeoutNs = payload;
      this.op = 'report';
      return ACT_ATTEMPT;
    }
    if (kind === KIND_RETRY || kind === KIND_WAIT) {
      if (this.deadline !== 0n && Number(this.deadline - now) < payload) {
        return this.#fault('contract', v, `a delay of ${payload} ns ends past the deadline`);
      }
      if (detail > MAX_REASON) return this.#fault('contract', v, `unknown reason ${detail}`);
      this.sleepNs = payload;
      this.retry = kind === KIND_RETRY;
      this.park = kind === KIND_WAIT && detail === BULKHEAD_FULL;
      this.op = 'acquire';
      return ACT_SLEEP;
    }
    if (kind === KIND_DONE) {
      if (op === 'start' || op === 'acquire') return this.#fault('contract', v, `done answered to ${op}`);
      return ACT_DONE;
    }
    if (kind === KIND_FALLBACK) {
      const name = p.fallbacks[payload];
      if (name === undefined) {
        return this.#fault('contract', v, `fallback index ${payload} of a chain of ${p.fallbacks.length}`);
      }
      if (detail > MAX_REASON) return this.#fault('contract', v, `unknown reason ${detail}`);
      this.fallbackName = name;
      this.reason = REASONS[detail]!;
      this.op = 'report-fallback';
      return ACT_FALLBACK;
    }
    if (kind === KIND_HEDGE) return this.#hedge(v, now, detail, payload);
    // KIND_FAIL
    if (detail === 0 || detail > MAX_REASON) return this.#fault('contract', v, `fail with reason ${detail}`);
    this.reason = REASONS[detail]!;
    this.hintNs = payload;
    return ACT_FAIL;
  }

  /**
   * The one recovery path (docs/hosts.md, section 3), after a guest fault in crossing `op` at
   * `now`: no retry, no fallback. The answer of a report stands; after `start` or `acquire`, one
   * degraded attempt under `min(attempt-timeout, time left)`, or the typed `deadline` error when
   * no time is left.
   */
  recover(now: bigint): Action {
    const op = this.op;
    if (op === 'report' || op === 'hedge-step' || op === 'report-attempt') return ACT_END_ATTEMPT;
    if (op === 'report-fallback') return ACT_END_FALLBACK;
    let timeoutNs = this.policy.attemptTimeoutNs;
    if (this.deadline !== 0n) {
      const left = Number(this.deadline - now);
      if (left <= 0) {
        this.reason = 'deadline';
        this.hintNs = 0;
        return ACT_FAIL;
      }
      if (timeoutNs === 0 || timeoutNs > left) timeoutNs = left;
    }
    this.attempts++;
    this.timeoutNs = timeoutNs;
    return ACT_DEGRADED;
  }

  /**
   * A `hedge` verdict: only `start` and `acquire` answer one, for attempt 1 of a call with none
   * yet; its timeout is bounded by the deadline (not by `attempt-timeout`: under the `envoy` preset
   * that timeout starts the next hedge and does not end the attempt).
   */
  #hedge(v: bigint, now: bigint, detail: number, payload: number): Action {
    const op = this.op;
    if ((op !== 'start' && op !== 'acquire') || this.attempts !== 0 || detail !== 1) {
      return this.#fault('contract', v, `hedge of attempt ${detail} answered to ${op} after ${this.attempts} attempts`);
    }
    if (this.deadline !== 0n) {
      const left = Number(this.deadline - now);
      if (payload > left) return this.#fault('contract', v, `attempt timeout ${payload} ns past the deadline`);
      if (payload === 0) return this.#fault('contract', v, 'no attempt timeout under a deadline');
    }
    this.attempts = 1;
    this.timeoutNs = payload;
    this.op = 'hedge-step';
    return ACT_HEDGE;
  }

  #fault(fault: Fault, v: bigint, words: string): Action {
    const d = decodeVerdict(v);
    this.fault = fault;
    this.detail = `${words} (verdict ${d.kind} detail ${d.detail} payload ${d.payload} answered to ${this.op})`;
    return ACT_FAULT;
  }
}

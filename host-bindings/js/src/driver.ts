// The driver: a small sans-I/O state machine from the core's verdicts to the host's actions (run an
// attempt under a timeout, sleep, run a fallback, finish with a value or an error). It reads no
// clock, starts no timer and calls nothing: the public API (levee.ts) passes it each verdict with
// the time it arrived and does what it answers. It decides nothing the core decides: it relays the
// verdict, and holds a guest to the contract (never an attempt past the policy's maximum, never a
// timeout or a sleep past the call's deadline).

import type { FailureReason } from './errors.js';
import type { PolicyEntry } from './runtime.js';
import {
  INVALID_CODES,
  KIND_ATTEMPT,
  KIND_DONE,
  KIND_FAIL,
  KIND_FALLBACK,
  KIND_RETRY,
  KIND_WAIT,
  REASONS,
} from './verdict.js';

/** Run attempt `attempts` under `timeoutNs` (0: none), then pass the verdict of its report. */
export const ACT_ATTEMPT = 0;
/** Sleep `sleepNs`, then acquire and pass that verdict. */
export const ACT_SLEEP = 1;
/** Run fallback `fallbackName` (`fallbackIndex` in the chain) for `reason`, then pass the verdict of its report. */
export const ACT_FALLBACK = 2;
/** The call is done: it ends with the value of the last attempt or fallback. */
export const ACT_DONE = 3;
/** The call failed with `reason` (`hintNs`: the core's retry-after hint; `cancel`: tell the core first). */
export const ACT_FAIL = 4;
export type Action = typeof ACT_ATTEMPT | typeof ACT_SLEEP | typeof ACT_FALLBACK | typeof ACT_DONE | typeof ACT_FAIL;

const TWO_53 = 9007199254740992;

/** The host side of one call, step by step. The fields below `attempts` describe the last action. */
export class CallDriver {
  readonly policy: PolicyEntry;
  /** The call's deadline on the Levee's clock (ns), 0n when the policy has none. */
  readonly deadline: bigint;
  /** Attempts started so far. */
  attempts: number;
  /** The verdict just passed says the core has events to drain. */
  events = false;
  timeoutNs = 0;
  sleepNs = 0;
  fallbackIndex = 0;
  fallbackName: string | undefined = undefined;
  reason: FailureReason = 'none';
  hintNs = 0;
  /** Words for the error (a verdict that broke the contract). */
  detail: string | undefined = undefined;
  /** The core still holds the call: cancel it there before failing. */
  cancel = false;

  constructor(policy: PolicyEntry, started: bigint, attempts = 0) {
    this.policy = policy;
    this.deadline = policy.deadlineNs > 0 ? started + policy.deadlineBig : 0n;
    this.attempts = attempts;
  }

  /** The action for verdict `v`, which arrived at `now`. */
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

    if (kind === KIND_ATTEMPT) {
      if (this.attempts >= p.maxAttempts) {
        // Never past the policy's maximum, whatever the guest says.
        return this.#fail('retries-exhausted', 0, true, 'the engine asked for an attempt beyond the policy maximum');
      }
      this.attempts++;
      this.timeoutNs = this.#clampTimeout(payload, now);
      return ACT_ATTEMPT;
    }
    if (kind === KIND_RETRY || kind === KIND_WAIT) {
      let delayNs = payload;
      if (this.deadline !== 0n) {
        // Never sleep past the deadline, whatever the guest says.
        const left = Number(this.deadline - now);
        if (delayNs > left) delayNs = left > 0 ? left : 0;
      }
      this.sleepNs = delayNs;
      return ACT_SLEEP;
    }
    if (kind === KIND_DONE) return ACT_DONE;
    if (kind === KIND_FALLBACK) {
      this.fallbackIndex = payload;
      this.fallbackName = p.fallbacks[payload];
      this.reason = REASONS[detail] ?? 'none';
      return ACT_FALLBACK;
    }
    if (kind === KIND_FAIL) return this.#fail(REASONS[detail] ?? 'none', payload, false, undefined);
    return this.#fail(
      'invalid',
      0,
      false,
      `the engine answered invalid (${INVALID_CODES[detail] ?? `code ${detail}`})`,
    );
  }

  /**
   * After an engine fault: the timeout of the single attempt the call proceeds with (the policy's
   * attempt timeout, clamped to the deadline), as attempt `attempts + 1`.
   */
  degraded(now: bigint): number {
    this.attempts++;
    return this.#clampTimeout(this.policy.attemptTimeoutNs, now);
  }

  #clampTimeout(timeoutNs: number, now: bigint): number {
    if (this.deadline === 0n) return timeoutNs;
    const left = Number(this.deadline - now);
    return timeoutNs === 0 || timeoutNs > left ? (left > 0 ? left : 1) : timeoutNs;
  }

  #fail(reason: FailureReason, hintNs: number, cancel: boolean, detail: string | undefined): Action {
    this.reason = reason;
    this.hintNs = hintNs;
    this.cancel = cancel;
    this.detail = detail;
    return ACT_FAIL;
  }
}

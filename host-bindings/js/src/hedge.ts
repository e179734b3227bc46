// The driver of a hedged call (docs/policy.md, "Hedging", "Host contract"): sans-I/O, like
// driver.ts. The core answers `hedge-step` and `report-attempt` with commands (start an attempt,
// cancel one, wait, end the call); this checks each answer against what the host knows of the
// call before the public API (levee.ts) carries any of it out, and keeps the count of attempts
// started, open (started, not yet reported) and cancelled. It decides nothing: no timer of its
// own, no choice of a winner. An answer that breaks the contract (docs/hosts.md, section 2) is a
// guest fault, like a trap: the call takes the one recovery path.

import type { HedgeAnswer } from '../wasm/interfaces/levee-policy-types.js';
import {
  HEDGE_MAX_ATTEMPTS,
  KIND_DONE,
  KIND_FAIL,
  KIND_FALLBACK,
  KIND_INVALID,
  VERDICT_RESERVED_MASK,
} from './constants.js';

/**
 * Answers in a row that move nothing (no attempt started, cancelled or reported, no time passed)
 * before the host calls the core stuck: a `wait 0` the core repeats for ever would otherwise spin.
 */
const MAX_IDLE_STEPS = 1000;

/** One command of an answer, checked. */
export type HedgeStep =
  | { readonly kind: 'start'; readonly attempt: number; readonly timeoutNs: number }
  | { readonly kind: 'cancel'; readonly attempt: number }
  | { readonly kind: 'wait'; readonly delayNs: number }
  | { readonly kind: 'end'; readonly attempt: number; readonly verdict: bigint };

const TWO_53 = 9007199254740992;

/** Low 16 bits of a packed verdict (kind, events bit, reserved bits, detail). */
function low16(v: bigint): number {
  const n = Number(v);
  return n < TWO_53 ? n % 65536 : Number(v & 0xffffn);
}

/** What the host knows of one hedged call's attempts. */
export class HedgeDriver {
  /** The call's deadline on the Levee's clock (ns), 0n when the policy has none. */
  readonly deadline: bigint;
  /** Attempts started so far (attempt 1 comes with the `hedge` verdict). */
  started = 1;
  /** Attempts started and not yet reported (a cancelled attempt stays open until it has closed). */
  readonly open = new Set<number>([1]);
  /** Attempts the core cancelled. */
  readonly cancelled = new Set<number>();
  /** The call has ended (an `end` command was carried out). */
  ended = false;
  #idle = 0;
  #lastNow = -1n;

  constructor(deadline: bigint) {
    this.deadline = deadline;
  }

  /**
   * Check answer `a` of a crossing made at `now`: the commands to carry out, in order, or the words
   * saying how the answer breaks the contract. Nothing is recorded for an answer that breaks it.
   */
  check(a: HedgeAnswer, now: bigint): HedgeStep[] | string {
    const out: HedgeStep[] = [];
    const left = this.deadline === 0n ? Infinity : Number(this.deadline - now);
    let started = this.started;
    let waits = 0;
    let moved = false;
    const commands = a.commands;
    for (let i = 0; i < commands.length; i++) {
      const c = commands[i]!;
      switch (c.tag) {
        case 'start': {
          const n = c.val.attempt;
          const timeoutNs = Number(c.val.timeout);
          if (n !== started + 1 || n > HEDGE_MAX_ATTEMPTS) {
            return `start of attempt ${n} when attempt ${started + 1} (of at most ${HEDGE_MAX_ATTEMPTS}) was next`;
          }
          if (timeoutNs > left) return `attempt ${n} with a timeout of ${timeoutNs} ns past the deadline`;
          if (timeoutNs === 0 && this.deadline !== 0n) return `attempt ${n} without a timeout under a deadline`;
          started = n;
          moved = true;
          out.push({ kind: 'start', attempt: n, timeoutNs });
          break;
        }
        case 'cancel': {
          const n = c.val;
          if (n < 1 || n > started) return `cancel of attempt ${n}, which was never started`;
          if (this.open.has(n) && !this.cancelled.has(n)) moved = true;
          out.push({ kind: 'cancel', attempt: n });
          break;
        }
        case 'wait': {
          const delayNs = Number(c.val);
          if (delayNs > left) return `a wait of ${delayNs} ns ends past the deadline`;
          if (++waits > 1) return 'two waits in one answer';
          if (delayNs > 0) moved = true;
          out.push({ kind: 'wait', delayNs });
          break;
        }
        case 'end': {
          if (i !== commands.length - 1) return 'a command after the end of the call';
          const n = c.val.attempt;
          const v = c.val.verdict;
          const low = low16(v);
          const kind = low & 0xf;
          if ((low & VERDICT_RESERVED_MASK) !== 0) return 'an end verdict with reserved bits set';
          if (kind === KIND_INVALID) {
            out.push({ kind: 'end', attempt: 0, verdict: v });
            break;
          }
          if (kind !== KIND_DONE && kind !== KIND_FAIL && kind !== KIND_FALLBACK) {
            return `an end verdict of kind ${kind}`;
          }
          if (n < 1 || n > started) return `end on attempt ${n}, which was never started`;
          if (this.open.has(n)) return `end on attempt ${n}, which has not been reported`;
          moved = true;
          out.push({ kind: 'end', attempt: n, verdict: v });
          break;
        }
        default:
          return `unknown command ${(c as { tag?: unknown }).tag as string}`;
      }
    }
    const ending = out.length > 0 && out[out.length - 1]!.kind === 'end';
    if (!ending && waits === 0) {
      // Without a wait the host waits for an attempt to close: there must be one that will.
      if (started === this.started && this.open.size === 0) return 'no attempt in flight, no wait and no end';
    }
    if (moved || now !== this.#lastNow) this.#idle = 0;
    else if (++this.#idle >= MAX_IDLE_STEPS) return `${MAX_IDLE_STEPS} answers in a row moved nothing`;
    this.#lastNow = now;
    return out;
  }

  /** Record a checked command as carried out. */
  apply(s: HedgeStep): void {
    switch (s.kind) {
      case 'start':
        this.started = s.attempt;
        this.open.add(s.attempt);
        break;
      case 'cancel':
        if (this.open.has(s.attempt)) this.cancelled.add(s.attempt);
        break;
      case 'end':
        this.ended = true;
        break;
    }
  }

  /** Attempt `n` was reported (it closed). */
  closed(n: number): void {
    this.open.delete(n);
  }
}

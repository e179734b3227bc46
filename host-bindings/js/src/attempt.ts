// One attempt's I/O: its signal (the per-attempt timeout on the Levee's clock, and the caller's
// signal) and the race between the attempt and that signal.

import { clockTimer } from './clock.js';
import type { Clock } from './clock.js';

/** What an attempt receives. */
export interface AttemptContext {
  /** Aborted when the per-attempt timeout fires or the caller's signal aborts. */
  readonly signal: AbortSignal;
  /** The attempt number, 1 for the first. */
  readonly attempt: number;
  /** The per-attempt timeout in milliseconds, 0 when none. */
  readonly timeoutMs: number;
}

export const NO_SIGNAL: AbortSignal = new AbortController().signal;

/** The context of a first attempt without timeout or caller signal: it holds no state, so it is shared. */
export const FIRST_ATTEMPT: AttemptContext = Object.freeze({ signal: NO_SIGNAL, attempt: 1, timeoutMs: 0 });

export class Attempt implements AttemptContext {
  readonly attempt: number;
  readonly timeoutMs: number;
  readonly #outer: AbortSignal | undefined;
  readonly #clock: Clock;
  #controller: AbortController | undefined;
  #cancelTimer: (() => void) | undefined;
  #onOuterAbort: (() => void) | undefined;
  #aborted = false;
  #abortReason: unknown = undefined;
  readonly #own: boolean;
  #ended: Promise<void> = Promise.resolve();
  timedOut = false;
  /** The caller's signal aborted while `race` waited: it rejected with the caller's reason. */
  callerAborted = false;

  /**
   * `own`: the attempt has a signal of its own even without a timeout (a hedged attempt, which
   * the core may cancel while the others go on: see `cancel`).
   */
  constructor(attempt: number, timeoutMs: number, outer: AbortSignal | undefined, clock: Clock, own = false) {
    this.attempt = attempt;
    this.timeoutMs = timeoutMs;
    this.#outer = outer;
    this.#clock = clock;
    this.#own = own;
  }

  get signal(): AbortSignal {
    if (this.#controller !== undefined) return this.#controller.signal;
    // Without a timeout the caller's signal is the attempt's. Otherwise the controller is made on
    // first use, so an attempt that never looks at its signal costs no AbortController.
    if (this.timeoutMs === 0 && !this.#own) return this.#outer ?? NO_SIGNAL;
    const controller = new AbortController();
    this.#controller = controller;
    if (this.#aborted) controller.abort(this.#abortReason);
    return controller.signal;
  }

  /**
   * Abort this attempt's signal with `reason` (the core cancelled a hedged attempt, or the caller
   * cancelled the call). The race goes on: it settles when the attempt does (or its timeout fires),
   * which is when the attempt has closed.
   */
  cancel(reason: unknown): void {
    this.#abort(reason);
  }

  #abort(reason: unknown): void {
    if (this.#aborted) return;
    this.#aborted = true;
    this.#abortReason = reason;
    this.#controller?.abort(reason);
  }

  /**
   * Run the attempt under its timeout and the caller's signal. When the timeout fires, the
   * attempt's signal aborts and the promise rejects with the timeout's reason once the attempt
   * has ended (settled): until then it still runs, and holds what the call gave it (its bulkhead
   * slot). When the caller aborts, the promise rejects with the caller's reason at once, and
   * `ended` tells when the attempt itself has.
   */
  race<T>(promise: T | PromiseLike<T>): Promise<T> {
    return new Promise<T>((resolve, reject) => {
      const outer = this.#outer;
      let timeout: DOMException | undefined;
      const ended = Promise.resolve(promise).then(
        (value) => {
          if (timeout !== undefined) reject(timeout);
          else resolve(value);
        },
        (error: unknown) => reject(timeout ?? error),
      );
      this.#ended = ended;
      if (this.timeoutMs > 0) {
        this.#cancelTimer = clockTimer(this.#clock, this.timeoutMs, () => {
          this.timedOut = true;
          timeout = new DOMException(`attempt ${this.attempt} timed out after ${this.timeoutMs} ms`, 'TimeoutError');
          this.#abort(timeout);
        });
      }
      if (outer !== undefined) {
        const onAbort = (): void => {
          this.callerAborted = true;
          this.#abort(outer.reason);
          reject(outer.reason);
        };
        this.#onOuterAbort = onAbort;
        outer.addEventListener('abort', onAbort, { once: true });
      }
    });
  }

  /** Settles (never rejects) once the attempt `race` runs has ended: its promise settled. */
  get ended(): Promise<void> {
    return this.#ended;
  }

  dispose(): void {
    if (this.#cancelTimer !== undefined) this.#cancelTimer();
    if (this.#onOuterAbort !== undefined) this.#outer?.removeEventListener('abort', this.#onOuterAbort);
  }
}

export function isThenable<T>(value: T | PromiseLike<T>): value is PromiseLike<T> {
  return typeof (value as { then?: unknown } | null)?.then === 'function';
}

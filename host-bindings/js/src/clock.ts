// Time, injected: every reading of the clock and every wait of a Levee (the sleeps between attempts
// and the attempts' timeouts) goes through its `Clock`, so a test can run a call on virtual time
// (`levee-resilience/testing`) and a program can run Levee on a clock of its own.

/** The clock of one Levee: monotonic time, and waits measured on that time. */
export interface Clock {
  /** Monotonic time in integer nanoseconds (the `now` every step of the core takes). */
  now(): bigint;
  /**
   * Resolve after `ms` milliseconds of this clock's time (fractions of a millisecond count);
   * reject with `signal.reason` as soon as `signal` aborts (at once if it already has). Levee
   * aborts the signal it passes once it no longer needs the wait, so a clock can drop the timer.
   */
  sleep(ms: number, signal?: AbortSignal): Promise<void>;
  /**
   * Wall-clock time in milliseconds since the Unix epoch, for an HTTP-date in `Retry-After`.
   * Default: `Date.now()`.
   */
  wallMs?: (() => number) | undefined;
}

const MAX_TIMER_MS = 2147483647;

/** Sleep `ms` on the real clock (the event loop's timers), rejecting with the signal's reason if it aborts first. */
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

/** A real clock whose time is `now` (a platform's monotonic nanoseconds) and whose waits are the event loop's timers. */
export function realClock(now: () => bigint): Clock {
  return { now, sleep };
}

// ------------------------------------------------------------------ the switch that turns waits off

let waitsOff = 0;

/**
 * Whether the sleeps between attempts are skipped (see `noWaits` in `levee-resilience/testing`).
 * @internal
 */
export function waitsDisabled(): boolean {
  return waitsOff > 0;
}

/**
 * Turn off every Levee's waits between attempts (retry delays, rate-limit waits): they end at once,
 * and no time passes for them. Attempt timeouts, the deadline, the breaker and every other decision
 * stay as they are; a call parked in a bulkhead queue still waits for a slot. For tests:
 * `using _ = noWaits();` or `const on = noWaits(); ...; on.restore()`.
 * Nested uses count: waits come back when the last one is restored.
 */
export function noWaits(): Disposable & { restore(): void } {
  waitsOff++;
  let done = false;
  const restore = (): void => {
    if (done) return;
    done = true;
    waitsOff--;
  };
  return { restore, [Symbol.dispose]: restore };
}

// ------------------------------------------------------------------ timers on a clock

/**
 * Call `fn` after `ms` of `clock`'s time; the function returned cancels it. The real clock uses the
 * event loop's timer directly (no AbortController); any other clock gets a `sleep` that is aborted
 * on cancel.
 * @internal
 */
export function clockTimer(clock: Clock, ms: number, fn: () => void): () => void {
  if (clock.sleep === sleep) {
    const timer = setTimeout(fn, Math.min(Math.max(ms, 0), MAX_TIMER_MS));
    return () => clearTimeout(timer);
  }
  const controller = new AbortController();
  clock.sleep(ms, controller.signal).then(
    () => {
      if (!controller.signal.aborted) fn();
    },
    () => undefined,
  );
  return () => controller.abort();
}

/**
 * Wait `ms` on `clock` under the caller's `signal` (the sleep between attempts), or not at all
 * when waits are turned off.
 * @internal
 */
export function clockWait(clock: Clock, ms: number, signal: AbortSignal | undefined): Promise<void> {
  if (signal?.aborted) return Promise.reject(signal.reason);
  if (!(ms > 0) || waitsOff > 0) return Promise.resolve();
  return clock.sleep(ms, signal);
}

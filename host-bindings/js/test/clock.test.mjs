// Virtual time through the public API: a Levee on a VirtualClock runs its sleeps and its attempts'
// timeouts on that clock, and noWaits() turns the waits between attempts off.

import assert from 'node:assert/strict';
import { describe, test } from 'node:test';
import { LeveeError, leveeFetch, loadSync } from '../dist/index.js';
import { VirtualClock, noWaits } from '../dist/testing.js';

const DOC = `
policies:
  slow:
    attempts: 4
    attempt-timeout: 2s
    deadline: 60s
    backoff: { kind: constant, base: 10s, jitter: none }
    retry-on: ["error:*", timeout, "http:429", "http:503"]
  jittered:
    attempts: 3
    backoff: { kind: exponential, base: 1s, cap: 30s, jitter: full }
    retry-on: ["error:*", timeout, "http:429", "http:503"]
  tight:
    attempts: 5
    attempt-timeout: 4s
    deadline: 7s
    backoff: { kind: constant, base: 1s, jitter: none }
    retry-on: ["error:*", timeout, "http:429", "http:503"]
`;

const MS = 1_000_000n;
const hang = ({ signal }) => new Promise((_, reject) => signal.addEventListener('abort', () => reject(signal.reason)));

describe('VirtualClock', () => {
  test('sleeps between attempts run on the clock: attempt starts are exact, no real time passes', async () => {
    const clock = new VirtualClock({ auto: true });
    const levee = loadSync(DOC, { seed: 1n, clock, meter: null });
    const starts = [];
    const t0 = performance.now();
    const value = await levee.run('slow', ({ attempt }) => {
      starts.push(clock.now());
      if (attempt < 3) throw new Error('again');
      return 'ok';
    });
    assert.equal(value, 'ok');
    assert.deepEqual(starts, [0n, 10_000n * MS, 20_000n * MS]);
    assert.ok(performance.now() - t0 < 2_000, 'twenty virtual seconds in well under two real ones');
  });

  test('an attempt timeout fires on the clock, at exactly the timeout', async () => {
    const clock = new VirtualClock({ auto: true });
    const levee = loadSync(DOC, { seed: 1n, clock, meter: null });
    const seen = [];
    await assert.rejects(
      levee.run('slow', (ctx) => {
        const at = clock.now();
        ctx.signal.addEventListener('abort', () => seen.push([ctx.attempt, clock.now() - at, ctx.signal.reason.name]));
        return hang(ctx);
      }),
      (err) => err instanceof LeveeError && err.reason === 'retries-exhausted' && err.attempts === 4,
    );
    assert.deepEqual(seen, [
      [1, 2_000n * MS, 'TimeoutError'],
      [2, 2_000n * MS, 'TimeoutError'],
      [3, 2_000n * MS, 'TimeoutError'],
      [4, 2_000n * MS, 'TimeoutError'],
    ]);
    // four attempts of 2 s and three sleeps of 10 s
    assert.equal(clock.now(), 38_000n * MS);
  });

  test('the deadline clamps the last timeout, on the clock', async () => {
    const clock = new VirtualClock({ auto: true });
    const levee = loadSync(DOC, { seed: 1n, clock, meter: null });
    const timeouts = [];
    const starts = [];
    await assert.rejects(
      levee.run('tight', (ctx) => {
        timeouts.push(ctx.timeoutMs);
        starts.push(clock.now());
        return hang(ctx);
      }),
      (err) => err instanceof LeveeError,
    );
    assert.equal(starts[0], 0n);
    assert.equal(timeouts[0], 4000);
    assert.equal(starts[1], 5_000n * MS);
    assert.equal(timeouts[1], 2000, 'the second attempt gets what is left of the 7 s deadline');
    assert.ok(clock.now() <= 7_000n * MS);
  });

  test('delays match the events the core emitted (jitter from the seed)', async () => {
    const clock = new VirtualClock({ auto: true });
    const levee = loadSync(DOC, { seed: 7n, clock, meter: null });
    const delays = [];
    levee.on('retry-scheduled', (e) => delays.push(e.duration));
    const starts = [];
    await assert.rejects(
      levee.run('jittered', () => {
        starts.push(clock.now());
        throw new Error('down');
      }),
    );
    assert.equal(delays.length, 2);
    assert.deepEqual(starts, [0n, delays[0], delays[0] + delays[1]]);
  });

  test('manual: nothing fires until the test advances the clock', async () => {
    const clock = new VirtualClock();
    const levee = loadSync(DOC, { seed: 1n, clock, meter: null });
    let attempts = 0;
    const done = levee.run('slow', () => {
      if (++attempts < 2) throw new Error('again');
      return 'second';
    });
    await clock.settle();
    assert.equal(attempts, 1);
    assert.equal(clock.pending, 1, 'the retry sleep waits on the clock');
    await clock.advance(9_999);
    assert.equal(attempts, 1);
    await clock.advance(1);
    assert.equal(attempts, 2);
    assert.equal(await done, 'second');
    assert.equal(clock.pending, 0);
  });

  test('a caller abort during a virtual sleep cancels the call', async () => {
    const clock = new VirtualClock();
    const levee = loadSync(DOC, { seed: 1n, clock, meter: null });
    const controller = new AbortController();
    const pending = levee.run(
      'slow',
      () => {
        throw new Error('down');
      },
      { signal: controller.signal },
    );
    await clock.settle();
    assert.equal(clock.pending, 1);
    controller.abort(new Error('shutdown'));
    await assert.rejects(pending, (err) => err.message === 'shutdown');
    assert.equal(clock.pending, 0, 'the sleep left the clock');
  });

  test('an attempt that finishes leaves no timer behind', async () => {
    const clock = new VirtualClock();
    const levee = loadSync(DOC, { seed: 1n, clock, meter: null });
    assert.equal(await levee.run('slow', async () => 'quick'), 'quick');
    assert.equal(clock.pending, 0);
  });

  test('leveeFetch on the clock: Retry-After waits on it, read against its wall time', async () => {
    const wallStartMs = Date.UTC(2026, 0, 1);
    const clock = new VirtualClock({ auto: true, wallStartMs });
    const levee = loadSync(DOC, { seed: 1n, clock, meter: null });
    const at = [];
    const answers = [
      () => new Response('busy', { status: 503, headers: { 'retry-after': '3' } }),
      () =>
        new Response('busy', {
          status: 429,
          headers: { 'retry-after': new Date(clock.wallMs() + 5000).toUTCString() },
        }),
      () => new Response('ok', { status: 200 }),
    ];
    const fetchWithPolicy = leveeFetch(levee, 'slow', {
      fetch: async () => {
        at.push(clock.now());
        return answers[at.length - 1]();
      },
    });
    const res = await fetchWithPolicy('http://api.test/x');
    assert.equal(res.status, 200);
    assert.equal(at[1] - at[0], 3_000n * MS);
    // an HTTP-date has whole seconds: the wait is between 4 and 5 s
    assert.ok(at[2] - at[1] > 4_000n * MS && at[2] - at[1] <= 5_000n * MS, String(at[2] - at[1]));
  });

  test('timers due at the same instant fire in the order they were set', async () => {
    const clock = new VirtualClock();
    const order = [];
    const a = clock.sleep(5).then(() => order.push('a'));
    const b = clock.sleep(5).then(() => order.push('b'));
    const c = clock.sleep(1).then(() => order.push('c'));
    await clock.runAll();
    await Promise.all([a, b, c]);
    assert.deepEqual(order, ['c', 'a', 'b']);
    assert.equal(clock.now(), 5n * MS);
  });
});

describe('noWaits', () => {
  test('the waits between attempts are skipped while it is on, and come back after', async () => {
    const levee = loadSync(DOC, { seed: 1n, meter: null });
    let attempts = 0;
    const t0 = performance.now();
    const off = noWaits();
    try {
      const value = await levee.run('slow', () => {
        if (++attempts < 4) throw new Error('again');
        return 'fourth';
      });
      assert.equal(value, 'fourth');
    } finally {
      off.restore();
    }
    assert.ok(performance.now() - t0 < 2_000, 'thirty seconds of backoff skipped');
    // Waits are back: the retry sleeps (real time) again.
    const started = performance.now();
    const on = noWaits();
    on.restore();
    on.restore(); // a second restore changes nothing
    const quick = loadSync(
      'policies:\n  p:\n    attempts: 2\n    backoff: { kind: constant, base: 50ms, jitter: none }\n    retry-on: ["error:*"]\n',
      { seed: 1n, meter: null },
    );
    let n = 0;
    await quick.run('p', () => {
      if (++n < 2) throw new Error('once');
      return 1;
    });
    assert.ok(performance.now() - started >= 45, 'the 50 ms wait happened');
  });

  test('attempt timeouts still apply while waits are off', async () => {
    const off = noWaits();
    const clock = new VirtualClock({ auto: true });
    const levee = loadSync(DOC, { seed: 1n, clock, meter: null });
    const starts = [];
    try {
      await assert.rejects(
        levee.run('slow', (ctx) => {
          starts.push(clock.now());
          return hang(ctx);
        }),
        (err) => err.reason === 'retries-exhausted',
      );
    } finally {
      off[Symbol.dispose]();
    }
    assert.deepEqual(starts, [0n, 2_000n * MS, 4_000n * MS, 6_000n * MS]);
  });
});

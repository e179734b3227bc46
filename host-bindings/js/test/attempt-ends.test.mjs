// An attempt holds its bulkhead slot until it has really ended (issue 39): a function that
// ignores its AbortSignal keeps running after its timeout or the caller's abort, and the
// bulkhead bounds it all the same. On a timeout the call goes on (reports the timeout) once the
// attempt has settled; on the caller's abort the caller has its answer at once and the slot is
// given back when the attempt settles.

import assert from 'node:assert/strict';
import { test } from 'node:test';
import { LeveeError, loadSync } from '../dist/index.js';
import { VirtualClock } from '../dist/testing.js';

const DOC = `
policies:
  p:
    attempts: 3
    attempt-timeout: 100ms
    backoff: { kind: constant, base: 100ms, jitter: none }
    bulkhead: { max-concurrent: 1 }
`;

function setup() {
  const clock = new VirtualClock({ auto: true });
  const levee = loadSync(DOC, { seed: 1n, clock, telemetry: null });
  const seen = { running: 0, most: 0, runs: 0 };
  /** A dependency that ignores its signal and answers after `ms`. */
  const deaf = (ms, value) => async () => {
    seen.runs++;
    seen.most = Math.max(seen.most, ++seen.running);
    try {
      await clock.sleep(ms);
      return value;
    } finally {
      seen.running--;
    }
  };
  return { clock, levee, seen, deaf };
}

test('an attempt past its timeout that ignores its signal keeps its slot until it settles', async () => {
  const { clock, levee, seen, deaf } = setup();
  const a = levee.run('p', deaf(250, 'late')).then(
    () => assert.fail('a late answer is a timeout'),
    (err) => err,
  );
  // Another call while the first attempt still runs past its timeout: the bulkhead is full.
  await clock.sleep(150);
  const b = await levee.run('p', deaf(10, 'b')).then(
    (v) => v,
    (err) => err,
  );
  assert.ok(b instanceof LeveeError, `the second call got ${b}`);
  assert.equal(b.reason, 'bulkhead-full');
  const err = await a;
  assert.ok(err instanceof LeveeError);
  assert.equal(err.reason, 'retries-exhausted');
  assert.equal(err.attempts, 3);
  assert.equal(err.lastError?.name, 'TimeoutError');
  assert.equal(seen.most, 1, 'never more than max-concurrent executions at once');
  assert.equal(seen.runs, 3);
  // Each attempt ran its 250 ms, then the 100 ms backoff: the call waited for each to end.
  assert.equal(clock.now(), 950_000_000n);
});

test("on the caller's abort the caller has its answer at once; the slot is held until the attempt settles", async () => {
  const { clock, levee, seen, deaf } = setup();
  const controller = new AbortController();
  const reason = new Error('the caller gave up');
  const a = levee.run('p', deaf(80, 'late'), { signal: controller.signal }).then(
    () => assert.fail('cancelled'),
    (err) => [err, clock.now()],
  );
  await clock.sleep(30);
  controller.abort(reason);
  const [err, at] = await a;
  assert.equal(err, reason);
  assert.equal(at, 30_000_000n);
  // The abandoned attempt still runs (until 80 ms): no other attempt may start meanwhile.
  await clock.sleep(10);
  await assert.rejects(levee.run('p', deaf(10, 'b')), (e) => e instanceof LeveeError && e.reason === 'bulkhead-full');
  await clock.sleep(60);
  assert.equal(await levee.run('p', deaf(10, 'c')), 'c');
  assert.equal(seen.most, 1);
});

test('an attempt that honours its signal ends at its timeout, as before', async () => {
  const { clock, levee } = setup();
  let n = 0;
  const value = await levee.run('p', ({ signal }) => {
    n++;
    if (n === 3) return 'third';
    return new Promise((_, reject) => signal.addEventListener('abort', () => reject(signal.reason)));
  });
  assert.equal(value, 'third');
  // Two timeouts of 100 ms and two backoffs of 100 ms.
  assert.equal(clock.now(), 400_000_000n);
});

test("a hedged call: on the caller's abort each attempt keeps its slot until it settles", async () => {
  const clock = new VirtualClock({ auto: true });
  const levee = loadSync(
    `
policies:
  h:
    bulkhead: { max-concurrent: 1 }
    hedge: { attempts: 2, delay: 500ms }
`,
    { seed: 1n, clock, telemetry: null },
  );
  const controller = new AbortController();
  const reason = new Error('the caller gave up');
  const a = levee
    .run(
      'h',
      async () => {
        await clock.sleep(80); // ignores its signal
        return 'late';
      },
      { signal: controller.signal },
    )
    .then(
      () => assert.fail('cancelled'),
      (err) => [err, clock.now()],
    );
  await clock.sleep(30);
  controller.abort(reason);
  const [err, at] = await a;
  assert.equal(err, reason);
  assert.equal(at, 30_000_000n);
  await clock.sleep(10);
  await assert.rejects(
    levee.run('h', () => 'b'),
    (e) => e instanceof LeveeError && e.reason === 'bulkhead-full',
  );
  await clock.sleep(60);
  assert.equal(await levee.run('h', () => 'c'), 'c');
});

test('a hedged attempt past its timeout that ignores its signal keeps its slot until it settles', async () => {
  const clock = new VirtualClock({ auto: true });
  const levee = loadSync(
    `
policies:
  h:
    attempt-timeout: 100ms
    bulkhead: { max-concurrent: 1 }
    hedge: { attempts: 2, delay: 500ms }
`,
    { seed: 1n, clock, telemetry: null },
  );
  // Attempt 1 ignores its signal and settles at 250 ms; the hedge (attempt 2) answers at once.
  const a = levee.run('h', async ({ attempt }) => {
    if (attempt === 2) return 'two';
    await clock.sleep(250);
    return 'late';
  });
  await clock.sleep(150);
  await assert.rejects(
    levee.run('h', () => 'b'),
    (e) => e instanceof LeveeError && e.reason === 'bulkhead-full',
  );
  assert.equal(await a, 'two');
  assert.equal(clock.now(), 250_000_000n, 'attempt 1 was reported when it settled');
  assert.equal(await levee.run('h', () => 'c'), 'c');
});

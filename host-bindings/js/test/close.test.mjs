// `close()` while calls run is a graceful shutdown (issue 39), not an engine fault: a call in
// flight finishes (a running attempt that succeeds is its answer) or ends with the typed
// `LeveeClosedError`; no attempt starts after close; a sleeping or parked call wakes at once;
// no `engine-fault` is emitted or counted.

import assert from 'node:assert/strict';
import { test } from 'node:test';
import { LeveeClosedError, LeveeError, loadSync } from '../dist/index.js';
import { RecordingSink, VirtualClock } from '../dist/testing.js';

const DOC = `
policies:
  p:
    attempts: 3
    backoff: { kind: constant, base: 10s, jitter: none }
    retry-on: ["error:*"]
  queued:
    attempts: 1
    bulkhead: { max-concurrent: 1, queue: 5, queue-timeout: 10s }
  fb:
    attempts: 1
    retry-on: ["error:*"]
    fallbacks: [slow]
`;

function setup() {
  const clock = new VirtualClock({ auto: true });
  const sink = new RecordingSink();
  const levee = loadSync(DOC, { seed: 1n, clock, telemetry: sink });
  const faults = [];
  levee.on('engine-fault', (e) => faults.push(e));
  const faultEntries = () => sink.entries.filter((e) => e.name === 'engine-fault' || e.name === 'levee.engine.faults');
  return { clock, levee, faults, faultEntries };
}

test('an attempt that fails after close ends the call with LeveeClosedError: no fault, no attempt after', async () => {
  const { clock, levee, faults, faultEntries } = setup();
  let attempts = 0;
  const boom = new Error('the dependency failed');
  const call = levee
    .run('p', async () => {
      attempts++;
      await clock.sleep(50);
      throw boom;
    })
    .then(
      () => assert.fail('it failed'),
      (err) => err,
    );
  await clock.sleep(10);
  levee.close();
  const err = await call;
  assert.ok(err instanceof LeveeClosedError, `${err}`);
  assert.ok(!(err instanceof LeveeError));
  assert.equal(err.cause, boom);
  assert.equal(err.lastError, boom);
  assert.equal(err.policy, 'p');
  assert.equal(err.attempts, 1);
  assert.equal(attempts, 1, 'no attempt starts after close');
  assert.deepEqual(faults, []);
  assert.deepEqual(faultEntries(), []);
  // Later calls, and the engine's state, are refused with the same type.
  await assert.rejects(
    levee.run('p', () => 1),
    LeveeClosedError,
  );
  assert.throws(() => levee.policyJson('p'), LeveeClosedError);
  assert.throws(() => levee.policy('p'), LeveeClosedError);
  assert.deepEqual(faults, []);
});

test('an attempt that succeeds after close is the call answer', async () => {
  const { clock, levee, faults, faultEntries } = setup();
  const call = levee.run('p', async () => {
    await clock.sleep(50);
    return 'done';
  });
  await clock.sleep(10);
  levee.close();
  assert.equal(await call, 'done');
  assert.deepEqual(faults, []);
  assert.deepEqual(faultEntries(), []);
});

test('an attempt that returns after close is the call answer, even a value the policy would retry', async () => {
  const { clock, levee, faults } = setup();
  const call = levee.run(
    'p',
    async () => {
      await clock.sleep(50);
      return { status: 503 };
    },
    { outcomeOf: (v) => ({ kind: 'http-status', status: v.status }) },
  );
  await clock.sleep(10);
  levee.close();
  assert.deepEqual(await call, { status: 503 });
  assert.deepEqual(faults, []);
});

test('a call sleeping before a retry wakes at close and ends with LeveeClosedError', async () => {
  const { clock, levee, faults } = setup();
  let attempts = 0;
  const boom = new Error('flaky');
  const call = levee
    .run('p', () => {
      attempts++;
      throw boom;
    })
    .then(
      () => assert.fail('it failed'),
      (err) => [err, clock.now()],
    );
  await clock.sleep(1000); // the call sleeps its 10 s backoff
  levee.close();
  const [err, at] = await call;
  assert.ok(err instanceof LeveeClosedError, `${err}`);
  assert.equal(err.cause, boom);
  assert.equal(at, 1_000_000_000n, 'woken at close, not at the end of its sleep');
  assert.equal(attempts, 1);
  assert.deepEqual(faults, []);
});

test('a call parked in the bulkhead queue wakes at close; the one running finishes', async () => {
  const { clock, levee, faults } = setup();
  const first = levee.run('queued', async () => {
    await clock.sleep(100);
    return 'first';
  });
  let secondRan = false;
  const second = levee
    .run('queued', () => {
      secondRan = true;
      return 'second';
    })
    .then(
      (v) => v,
      (err) => err,
    );
  await clock.sleep(10);
  levee.close();
  const err = await second;
  assert.ok(err instanceof LeveeClosedError, `${err}`);
  assert.equal(secondRan, false);
  assert.equal(await first, 'first');
  assert.deepEqual(faults, []);
});

test('a fallback running at close is the call answer', async () => {
  const { clock, levee, faults } = setup();
  levee.fallback('slow', async () => {
    await clock.sleep(50);
    return 'fallback';
  });
  const call = levee.run('fb', () => {
    throw new Error('down');
  });
  await clock.sleep(10);
  levee.close();
  assert.equal(await call, 'fallback');
  assert.deepEqual(faults, []);
});

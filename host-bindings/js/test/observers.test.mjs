// Observer code (onRetry hooks, `on()` listeners, telemetry sinks, the `trace` callback, retry
// predicates) never changes a call (issue 39): what it throws is reported (to `onObserverError`,
// by default on the console) and ignored. It never becomes an uncaught exception, never reaches
// the caller and never holds a bulkhead slot.

import assert from 'node:assert/strict';
import { test } from 'node:test';
import { LeveeError, leveeFetch, loadSync } from '../dist/index.js';

const DOC = `
policies:
  http:
    attempts: 3
    backoff: { kind: constant, base: 1ms, jitter: none }
    retry-on: ["http:503", "error:*"]
    bulkhead: { max-concurrent: 1 }
`;

/** Macrotasks, so that anything queued as a microtask or an immediate has run. */
async function turns(n = 3) {
  for (let i = 0; i < n; i++) await new Promise((resolve) => setImmediate(resolve));
}

/** Count the uncaught exceptions while `fn` runs (and a few turns after). */
async function uncaughtDuring(fn) {
  const seen = [];
  const onUncaught = (err) => seen.push(err);
  // node:test has its own listener, which fails the test: take its place for the duration.
  const previous = process.listeners('uncaughtException');
  process.removeAllListeners('uncaughtException');
  process.on('uncaughtException', onUncaught);
  try {
    await fn();
    await turns();
  } finally {
    process.removeListener('uncaughtException', onUncaught);
    for (const l of previous) process.on('uncaughtException', l);
  }
  return seen;
}

/** Replace console.error for the duration of `fn`; answers what it was given. */
async function consoleErrors(fn) {
  const lines = [];
  const original = console.error;
  console.error = (...args) => lines.push(args);
  try {
    await fn();
    await turns();
  } finally {
    console.error = original;
  }
  return lines;
}

function fakeFetch(statuses) {
  let i = 0;
  return async () => new Response('x', { status: statuses[Math.min(i++, statuses.length - 1)] });
}

test('the onRetry hook of the issue (error is undefined on a response retry) is reported, not fatal', async () => {
  const levee = loadSync(DOC, { seed: 1n, telemetry: null });
  levee.onRetry('http', (i) => console.log(i.error.message));
  const fetch = leveeFetch(levee, 'http', { fetch: fakeFetch([503, 200]) });
  let logged;
  const uncaught = await uncaughtDuring(async () => {
    logged = await consoleErrors(async () => {
      const response = await fetch('http://127.0.0.1:1/x');
      assert.equal(response.status, 200);
    });
  });
  assert.deepEqual(uncaught, []);
  assert.equal(logged.length, 1);
  assert.match(String(logged[0][0]), /onRetry hook of policy "http" threw/);
  assert.ok(logged[0].some((a) => a instanceof TypeError));
});

test('a throwing hook, listener and sink go to onObserverError, and the call ends as it would', async () => {
  const reported = [];
  const throwingSink = {
    event() {
      throw new Error('sink event');
    },
    add() {
      throw new Error('sink add');
    },
    record() {},
    gauge() {},
  };
  const levee = loadSync(DOC, {
    seed: 1n,
    telemetry: throwingSink,
    onObserverError: (error, observer) => reported.push([observer, error.message]),
  });
  levee.onRetry('http', () => {
    throw new Error('hook');
  });
  levee.on('retry-scheduled', () => {
    throw new Error('listener');
  });
  let n = 0;
  const uncaught = await uncaughtDuring(async () => {
    const value = await levee.run('http', () => {
      if (++n === 1) throw new Error('first attempt fails');
      return 'ok';
    });
    assert.equal(value, 'ok');
  });
  assert.deepEqual(uncaught, []);
  const what = reported.map(([observer, message]) => `${observer}: ${message}`);
  assert.ok(what.includes('onRetry hook of policy "http": hook'), what.join('\n'));
  assert.ok(what.includes('listener of "retry-scheduled": listener'), what.join('\n'));
  assert.ok(what.includes('telemetry sink: sink event'), what.join('\n'));
  assert.ok(what.includes('telemetry sink: sink add'), what.join('\n'));
});

test('onObserverError that throws itself is ignored too', async () => {
  const levee = loadSync(DOC, {
    seed: 1n,
    telemetry: null,
    onObserverError: () => {
      throw new Error('the reporter broke');
    },
  });
  levee.onRetry('http', () => {
    throw new Error('hook');
  });
  let n = 0;
  const uncaught = await uncaughtDuring(async () => {
    assert.equal(await levee.run('http', () => (++n === 1 ? Promise.reject(new Error('once')) : 'ok')), 'ok');
  });
  assert.deepEqual(uncaught, []);
});

test('a trace callback that throws neither reaches the caller nor holds the bulkhead slot', async () => {
  const reported = [];
  const levee = loadSync(DOC, {
    seed: 1n,
    telemetry: null,
    trace: () => {
      throw new Error('trace broke');
    },
    onObserverError: (error, observer) => reported.push(`${observer}: ${error.message}`),
  });
  for (let i = 0; i < 5; i++) {
    // The dependency answers later: the slot of each call is free once it is over.
    const value = await levee.run('http', async () => {
      await turns(1);
      return i;
    });
    assert.equal(value, i);
  }
  // A failing call too: the core's own error, not the trace's.
  await assert.rejects(
    levee.run('http', () => Promise.reject(new Error('down'))),
    (err) => err instanceof LeveeError && err.reason === 'retries-exhausted',
  );
  assert.equal(await levee.run('http', () => 'after'), 'after');
  assert.ok(reported.length > 0);
  assert.ok(reported.every((r) => r === 'trace callback: trace broke'));
});

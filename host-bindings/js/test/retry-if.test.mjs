// Retry predicates in code (docs/hosts.md, section 9): the answer goes to the core as a report
// flag, and the core decides (the attempts, the idempotency and the deadline still apply).

import assert from 'node:assert/strict';
import { test } from 'node:test';
import { LeveeError, leveeFetch, loadSync } from '../dist/index.js';
import { VirtualClock } from '../dist/testing.js';

const DOC = `
policies:
  p:
    attempts: 3
    backoff: { kind: constant, base: 100ms, jitter: none }
    retry-on: ["error:Flaky"]
  once:
    attempts: 1
`;
class Flaky extends Error {}
class Fatal extends Error {}

function levee() {
  return loadSync(DOC, { seed: 1n, clock: new VirtualClock({ auto: true }), meter: null });
}

test('a result the predicate retries is retried; the value that satisfies it ends the call', async () => {
  const l = levee();
  const seen = [];
  const states = ['pending', 'pending', 'ready'];
  const value = await l.run('p', () => states.shift(), {
    retryIf: (r) => {
      seen.push([r.attempt, r.threw, r.value]);
      return r.value === 'pending' ? true : undefined;
    },
  });
  assert.equal(value, 'ready');
  assert.deepEqual(seen, [
    [1, false, 'pending'],
    [2, false, 'pending'],
    [3, false, 'ready'],
  ]);
});

test('an error the policy would retry is not when the predicate says false; one it would not, is', async () => {
  const l = levee();
  let n = 0;
  await assert.rejects(
    l.run(
      'p',
      () => {
        n++;
        throw new Flaky('x');
      },
      { retryIf: () => false },
    ),
    (err) => err instanceof LeveeError && err.reason === 'non-retryable',
  );
  assert.equal(n, 1);
  l.retryIf('p', (r) => (r.error instanceof Fatal ? true : undefined));
  let m = 0;
  await assert.rejects(
    l.run('p', () => {
      m++;
      throw new Fatal('y');
    }),
    (err) => err.reason === 'retries-exhausted' && err.attempts === 3,
  );
  assert.equal(m, 3, 'the policy-level predicate retried what retry-on does not list');
});

test('the core still decides: no attempt past the maximum, and a non-idempotent call is not retried', async () => {
  const l = levee();
  let n = 0;
  await assert.rejects(
    l.run('once', () => ++n, { retryIf: () => true }),
    (err) => err.reason === 'retries-exhausted' && err.attempts === 1,
  );
  let k = 0;
  await assert.rejects(
    l.run('p', () => ++k, { retryIf: () => true, idempotent: false }),
    (err) => err.reason === 'non-idempotent',
  );
  assert.equal(k, 1);
});

test('a predicate that throws counts as nothing, and its error is reported (onObserverError), not raised', async () => {
  const reported = [];
  const l = loadSync(DOC, {
    seed: 1n,
    clock: new VirtualClock({ auto: true }),
    meter: null,
    onObserverError: (error, observer) => reported.push([observer, error]),
  });
  let n = 0;
  const value = await l.run(
    'p',
    () => {
      if (++n < 2) throw new Flaky('once');
      return 'ok';
    },
    {
      retryIf: () => {
        throw new Error('predicate bug');
      },
    },
  );
  assert.equal(value, 'ok');
  assert.equal(n, 2, 'the policy decided: Flaky is retried');
  assert.equal(reported.length, 2);
  assert.equal(reported[0][0], 'retryIf predicate of a call of policy "p"');
  assert.match(reported[0][1].message, /predicate bug/);
});

test('leveeFetch: a predicate on the response retries a 200 that says not yet', async () => {
  const l = levee();
  let calls = 0;
  const states = ['pending', 'pending', 'done'];
  const poll = leveeFetch(l, 'p', {
    fetch: async () => {
      calls++;
      const state = states.shift();
      return new Response(state, { status: 200, headers: { 'x-state': state } });
    },
    retryIf: (r) => (r.value?.headers.get('x-state') === 'pending' ? true : undefined),
  });
  const res = await poll('http://svc.test/job');
  assert.equal(await res.text(), 'done');
  assert.equal(calls, 3);
});

// When the fallbacks fail, the final error says why (issue 39): its `cause` is the last
// fallback's own error (`fallbackError`, named in the message), and `lastError` stays the last
// attempt's error.

import assert from 'node:assert/strict';
import { test } from 'node:test';
import { LeveeError, leveeFetch, loadSync } from '../dist/index.js';

const DOC = `
policies:
  chain:
    attempts: 1
    retry-on: ["error:*"]
    fallbacks: [first, second]
  http:
    attempts: 1
    fallbacks: [stale]
`;

test("a fallback that throws is the final error's cause", async () => {
  const levee = loadSync(DOC, { seed: 1n, telemetry: null });
  const primary = new Error('primary');
  const f2 = new RangeError('the cache is empty');
  await assert.rejects(
    levee.run(
      'chain',
      () => {
        throw primary;
      },
      {
        fallbacks: {
          first: () => {
            throw new Error('f1');
          },
          second: () => {
            throw f2;
          },
        },
      },
    ),
    (err) => {
      assert.ok(err instanceof LeveeError);
      assert.equal(err.reason, 'fallbacks-failed');
      assert.equal(err.cause, f2);
      assert.equal(err.fallbackError, f2);
      assert.equal(err.lastError, primary);
      assert.match(err.message, /fallback "second" failed: RangeError: the cache is empty/);
      return true;
    },
  );
});

test("a fallback's value of the wrong type is the final error's cause", async () => {
  const levee = loadSync(DOC, { seed: 1n, telemetry: null });
  const fetch = leveeFetch(levee, 'http', {
    fetch: async () => {
      throw Object.assign(new TypeError('fetch failed'), { cause: { code: 'ECONNREFUSED' } });
    },
    fallbacks: { stale: () => 'not a Response' },
  });
  await assert.rejects(fetch('http://127.0.0.1:1/'), (err) => {
    assert.ok(err instanceof LeveeError);
    assert.equal(err.reason, 'fallbacks-failed');
    assert.ok(err.cause instanceof TypeError);
    assert.match(err.cause.message, /fallback "stale" returned a value of the wrong type/);
    assert.match(err.message, /fallback "stale" failed/);
    return true;
  });
});

test('without a failed fallback the cause is the last attempt error, as before', async () => {
  const levee = loadSync(DOC, { seed: 1n, telemetry: null });
  const primary = new Error('primary');
  await assert.rejects(
    levee.run('chain', () => {
      throw primary;
    }),
    (err) => {
      // Neither fallback is registered: they count as failed, and say so, but threw nothing.
      assert.equal(err.reason, 'fallbacks-failed');
      assert.equal(err.cause, primary);
      assert.equal(err.fallbackError, undefined);
      assert.match(err.message, /fallbacks 'first', 'second' are named by the policy but not registered/);
      return true;
    },
  );
});

// The bulkhead queue's host contract on the real clock (docs/policy.md, "The queue"): a call parked
// on a `wait` with reason bulkhead-full is woken by the report or cancel of the call holding the
// slot, long before its queue timeout; a caller's abort ends a park at once. (The virtual-clock
// traces are the bulkhead-queue-* host scenarios.)

import assert from 'node:assert/strict';
import { test } from 'node:test';
import { loadSync, sleep } from '../dist/index.js';

const DOC = `
policies:
  q:
    attempts: 1
    bulkhead: { max-concurrent: 1, queue: 2, queue-timeout: 10s }
`;

test('a parked call is woken by the report of the call holding the slot', async () => {
  const levee = loadSync(DOC);
  const t0 = performance.now();
  const first = levee.run('q', async () => {
    await sleep(30);
    return 'first';
  });
  const second = levee.run('q', () => 'second');
  assert.deepEqual(await Promise.all([first, second]), ['first', 'second']);
  // Woken at the report (about 30 ms), not at the end of its 10 s queue timeout.
  assert.ok(performance.now() - t0 < 2000, `took ${performance.now() - t0} ms`);
  levee.close();
});

test('a parked call is woken by the cancel of the call holding the slot', async () => {
  const levee = loadSync(DOC);
  const controller = new AbortController();
  const first = levee.run(
    'q',
    (ctx) => new Promise((_, reject) => ctx.signal.addEventListener('abort', () => reject(ctx.signal.reason))),
    {
      signal: controller.signal,
    },
  );
  const t0 = performance.now();
  const second = levee.run('q', () => 'second');
  setTimeout(() => controller.abort(new Error('gone')), 30);
  await assert.rejects(first, /gone/);
  assert.equal(await second, 'second');
  assert.ok(performance.now() - t0 < 2000, `took ${performance.now() - t0} ms`);
  levee.close();
});

test("a caller's abort ends its park at once with the caller's reason", async () => {
  const levee = loadSync(DOC);
  let release;
  const first = levee.run('q', () => new Promise((resolve) => (release = resolve)));
  const controller = new AbortController();
  const second = levee.run('q', () => 'second', { signal: controller.signal });
  const t0 = performance.now();
  setTimeout(() => controller.abort(new Error('no longer needed')), 20);
  await assert.rejects(second, /no longer needed/);
  assert.ok(performance.now() - t0 < 2000);
  // The slot holder is unaffected, and the queue is usable again afterwards.
  release('first');
  assert.equal(await first, 'first');
  assert.equal(await levee.run('q', () => 'third'), 'third');
  levee.close();
});

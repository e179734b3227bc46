// A lease renewal that the store fails (issue 40): tried again while the lease lasts, so the
// attempt's outcome is kept; abandoned once the lease, counted on the monotonic clock, would
// have run out. better-sqlite3 is an optional peer: durable/tests/run.sh installs it and runs
// this file; without it these tests are skipped, saying so.

import assert from 'node:assert/strict';
import { mkdtempSync } from 'node:fs';
import { createRequire } from 'node:module';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { test } from 'node:test';

import { loadSync } from '../dist/index.js';

let driver = true;
try {
  createRequire(import.meta.url)('better-sqlite3');
} catch {
  driver = false;
}
const skip = driver ? false : 'better-sqlite3 is not installed (durable/tests/run.sh installs it)';
const { DurableExecutor, SQLiteStore } = await import('../dist/durable.js');

const DOC = `
policies:
  long:
    attempts: 1
    attempt-timeout: 10s
    durable: { lease: 1s }
`;

/** An executor whose store fails the renewals (writes of a running call after its first) in `fail`. */
function setup(fail) {
  const store = new SQLiteStore(join(mkdtempSync(join(tmpdir(), 'levee-renew-')), 'calls.db'));
  const write = store.write.bind(store);
  const seen = { running: 0 };
  store.write = async (id, owner, w) => {
    if (w.status === 'running') {
      seen.running += 1;
      if (fail(seen.running - 1)) throw Object.assign(new Error('database is locked'), { code: 'SQLITE_BUSY' });
    }
    return write(id, owner, w);
  };
  const x = new DurableExecutor(loadSync(DOC, { meter: null }), store, { owner: 't1', pollIntervalMs: 20 });
  return { x, seen };
}

test('a renewal the store fails is tried again and the outcome kept', { skip }, async () => {
  const { x, seen } = setup((n) => n === 1); // the first renewal fails, the next ones succeed
  x.register(
    'job',
    async () => {
      await new Promise((r) => setTimeout(r, 1200)); // renewed every third of the 1 s lease
      return 'ok';
    },
    { policy: 'long' },
  );
  const id = await x.submit('job', '');
  await x.run({ untilIdle: true });
  const st = await x.status(id);
  assert.equal(st.status, 'done');
  assert.equal(Buffer.from(st.result).toString(), 'ok');
  assert.ok(seen.running >= 3, `${seen.running} writes of the running call`);
});

test('a store down past the lease abandons the attempt', { skip }, async () => {
  const { x, seen } = setup((n) => n >= 1); // every renewal fails
  let aborted;
  const gotAbort = new Promise((resolve) => (aborted = resolve));
  x.register(
    'job',
    (payload, ctx) =>
      new Promise((resolve) => {
        const t = setTimeout(() => resolve('too late'), 10_000);
        ctx.signal.addEventListener('abort', () => (clearTimeout(t), aborted(), resolve('too late')), { once: true });
      }),
    { policy: 'long' },
  );
  const id = await x.submit('job', '');
  const stop = new AbortController();
  const running = x.run({ signal: stop.signal });
  const t0 = Date.now();
  await gotAbort;
  assert.ok(Date.now() - t0 < 4000, 'the lease (1 s) ran out long before the handler would end');
  assert.ok(seen.running >= 3, `${seen.running} writes of the running call`);
  stop.abort();
  await running;
  const st = await x.status(id);
  // No outcome recorded for the abandoned attempt: the call stays running until its lapsed
  // lease is found (by this executor's next claim, as a crash: attempts 1, so dead).
  assert.equal(st.result, null);
  assert.ok(['running', 'dead'].includes(st.status), st.status);
  if (st.status === 'dead') assert.match(st.error, /stopped before its outcome was recorded/);
});

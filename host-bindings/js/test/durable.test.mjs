// The durable executor (src/durable.ts) on an SQLite file. Its driver, better-sqlite3, is an
// optional peer dependency: durable/tests/run.sh installs it and runs this file (and the crash
// tests across languages); without it these tests are skipped, saying so.

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
const { DurableExecutor, SQLiteStore, statements } = await import('../dist/durable.js');

const DOC = `
policies:
  quick:
    attempts: 3
    attempt-timeout: 5s
    backoff: { kind: constant, base: 50ms, cap: 50ms, jitter: none }
    durable: { lease: 2s, max-crashes: 2 }
`;

function setup() {
  const path = join(mkdtempSync(join(tmpdir(), 'levee-durable-')), 'calls.db');
  const store = new SQLiteStore(path);
  const x = new DurableExecutor(loadSync(DOC, { meter: null }), store, {
    owner: 'test',
    pollIntervalMs: 20,
    claimHoldMs: 1000,
  });
  return { x, store, path };
}
const reset = () => Object.assign(new Error('reset'), { code: 'ECONNRESET' });

test('the shared statements are read by name', () => {
  for (const d of ['sqlite', 'postgres']) {
    const st = statements(d);
    for (const name of [
      'schema',
      'insert',
      'find_by_key',
      'claim',
      'write',
      'quarantine',
      'get',
      'replace',
      'list',
      'list_dead',
      'next_due',
      'counts',
    ]) {
      assert.ok(st[name], `${d}: ${name}`);
    }
  }
});

test('a failure is retried after its backoff, then the call is done', { skip }, async () => {
  const { x, store } = setup();
  const attempts = [];
  x.register(
    'send',
    async (payload, ctx) => {
      attempts.push(ctx.attempt);
      if (ctx.attempt === 1) throw reset();
      assert.equal(ctx.idempotencyKey, 'k-1');
      assert.equal(Buffer.from(payload).toString(), 'hello');
      return 'sent';
    },
    { policy: 'quick' },
  );
  const id = await x.submit('send', 'hello', { idempotencyKey: 'k-1' });
  assert.equal(await x.submit('send', 'hello', { idempotencyKey: 'k-1' }), id, 'one call per idempotency key');
  const t0 = performance.now();
  await x.run({ untilIdle: true });
  const st = await x.status(id);
  assert.equal(st.status, 'done');
  assert.equal(st.attempts, 2);
  assert.equal(Buffer.from(st.result).toString(), 'sent');
  assert.equal(st.record.failures, 1);
  assert.deepEqual(attempts, [1, 2]);
  assert.ok(performance.now() - t0 >= 50, 'the backoff was waited');
  await store.close();
});

test('calls given up are listed with their last error; bad records are quarantined naming them', { skip }, async () => {
  const { x, store, path } = setup();
  class Refused extends Error {
    name = 'Refused';
  }
  x.register('refuse', () => Promise.reject(new Refused('no such order')), { policy: 'quick' });
  x.register('bare', () => Promise.reject(reset()), { policy: 'quick', idempotent: false });
  const a = await x.submit('refuse', '');
  const b = await x.submit('bare', '');
  const orphan = await x.submit('refuse', '', { idempotencyKey: 'o' });
  const corrupt = await x.submit('refuse', '', { idempotencyKey: 'c' });
  // a record of a handler this process does not have, and a corrupt one
  const Database = createRequire(import.meta.url)('better-sqlite3');
  const db = new Database(path);
  db.prepare("UPDATE levee_durable_calls SET handler = 'gone' WHERE id = ?").run(orphan);
  db.prepare("UPDATE levee_durable_calls SET record = X'4c56445201ff' WHERE id = ?").run(corrupt);
  db.close();
  await x.run({ untilIdle: true });
  const dead = await x.dead();
  assert.equal(dead.length, 4);
  assert.equal(dead[0].id, a);
  assert.match(dead[0].error, /^non-retryable: attempt 1 failed with `Refused`: no such order$/);
  assert.equal(dead[1].id, b);
  assert.match(dead[1].error, /^non-idempotent: attempt 1 failed with `connection-error`/);
  assert.equal(dead[2].status, 'quarantined');
  assert.equal(dead[2].error, 'handler: no durable handler named `gone` is registered');
  assert.equal(dead[3].status, 'quarantined');
  assert.match(dead[3].error, /^record/);
  assert.equal(dead[3].record, null);
  assert.equal(await x.status(999), undefined);
  await store.close();
});

test('cancel, then retry', { skip }, async () => {
  const { x, store } = setup();
  let runs = 0;
  x.register('ok', () => ((runs += 1), 'y'), { policy: 'quick' });
  const id = await x.submit('ok', '');
  assert.equal(await x.cancel(id), true);
  const st = await x.status(id);
  assert.equal(st.status, 'cancelled');
  assert.equal(st.error, 'cancelled by an operator');
  await x.run({ untilIdle: true });
  assert.equal(runs, 0);
  assert.equal(await x.cancel(id), false, 'a finished call is not cancelled again');
  assert.equal(await x.retry(id), true);
  await x.run({ untilIdle: true });
  assert.equal((await x.status(id)).status, 'done');
  assert.equal(runs, 1);
  await store.close();
});

test('register refuses an unknown policy; submit an unknown handler', { skip }, async () => {
  const { x, store } = setup();
  assert.throws(() => x.register('nope', () => undefined), /nope/);
  await assert.rejects(x.submit('nope', ''), /no durable handler named `nope`/);
  await store.close();
});

// The machine lives in the component instance: replaced after a trap in its own `feed`, or in any
// other crossing of the Levee, the executor makes a new one and abandons the call the old one held.
for (const where of ['feed', 'another crossing']) {
  test(
    `a trap (${where}) makes a new machine; the call it held is resumed once its lease lapses`,
    { skip },
    async () => {
      // Traps injected at the core-module boundary (as in trap.test.mjs).
      const plan = { needle: '', times: 0 };
      const instantiateCore = (module, imports) => {
        const instance = new WebAssembly.Instance(module, imports);
        const exports = {};
        for (const [name, value] of Object.entries(instance.exports)) {
          exports[name] =
            typeof value === 'function'
              ? (...args) => {
                  if (plan.times > 0 && plan.needle !== '' && name.endsWith(plan.needle)) {
                    plan.times--;
                    throw new WebAssembly.RuntimeError('unreachable (injected)');
                  }
                  return value(...args);
                }
              : value;
        }
        return { exports };
      };
      const doc = `
policies:
  held:
    attempts: 2
    backoff: { kind: constant, base: 10ms, cap: 10ms, jitter: none }
    durable: { lease: 300ms, max-crashes: 2 }
`;
      const levee = loadSync(doc, { meter: null, instantiateCore });
      const faults = [];
      levee.on('engine-fault', (e) => faults.push(e.phase));
      const store = new SQLiteStore(join(mkdtempSync(join(tmpdir(), 'levee-durable-')), 'calls.db'));
      const x = new DurableExecutor(levee, store, { owner: 'trap', pollIntervalMs: 20, claimHoldMs: 1000 });
      const seen = [];
      x.register(
        'hold',
        (payload, ctx) =>
          new Promise((resolve, reject) => {
            seen.push(ctx.attempt);
            if (ctx.attempt > 1) return resolve('second');
            ctx.signal.addEventListener('abort', () => reject(ctx.signal.reason), { once: true });
            if (where === 'feed') {
              plan.needle = '[method]executor.feed'; // the machine's next feed (a renewal, a poll) traps
              plan.times = 1;
            } else {
              plan.needle = 'export-state-page';
              plan.times = 1;
              assert.throws(() => levee.exportState(), /injected/);
            }
          }),
        { policy: 'held' },
      );
      const id = await x.submit('hold', '');
      const errors = [];
      const error = console.error;
      console.error = (...a) => errors.push(a.map(String).join(' '));
      try {
        await x.run({ untilIdle: true });
      } finally {
        console.error = error;
      }
      const st = await x.status(id);
      assert.deepEqual(seen, [1, 2], 'abandoned at the trap, then resumed as after a crash');
      assert.equal(st.status, 'done');
      assert.equal(Buffer.from(st.result).toString(), 'second');
      assert.deepEqual(faults, [where === 'feed' ? 'durable-executor' : 'export-state']);
      if (where === 'feed')
        assert.ok(
          errors.some((e) => e.includes("the executor's machine failed")),
          errors.join('\n'),
        );
      await store.close();
    },
  );
}

// submit inside the caller's own transaction (the outbox): the call commits or rolls back with
// the caller's rows, on SQLite (the caller's better-sqlite3 handle on the store's file) and on
// PostgreSQL (the caller's pg client after BEGIN; the private cluster of ./pg-fixture.mjs). The
// drivers are optional peer dependencies: durable/tests/run.sh installs them; without them these
// tests are skipped, saying so.

import assert from 'node:assert/strict';
import { mkdtempSync } from 'node:fs';
import { createRequire } from 'node:module';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, before, describe, test } from 'node:test';

import { loadSync } from '../dist/index.js';
import { startPostgres } from './pg-fixture.mjs';

const require = createRequire(import.meta.url);
const load = (name) => {
  try {
    return require(name);
  } catch {
    return undefined;
  }
};
const Database = load('better-sqlite3');
const pg = load('pg');
const { DurableExecutor, PostgresStore, SQLiteStore } = await import('../dist/durable.js');

const DOC = `
policies:
  quick:
    attempts: 3
    attempt-timeout: 5s
    backoff: { kind: constant, base: 50ms, cap: 50ms, jitter: none }
    durable: { lease: 2s, max-crashes: 2 }
`;

function executor(store) {
  const runs = [];
  const x = new DurableExecutor(loadSync(DOC, { meter: null }), store, {
    owner: 'test',
    pollIntervalMs: 20,
    claimHoldMs: 1000,
  });
  x.register('send', (payload) => (runs.push(Buffer.from(payload).toString()), 'sent'), { policy: 'quick' });
  return { x, runs };
}

/** The executor running as a worker would (`stop()` ends it), and a wait for a call to be done. */
function worker(x) {
  const ac = new AbortController();
  const running = x.run({ signal: ac.signal });
  return {
    async done(id) {
      for (let i = 0; i < 500; i++) {
        const st = await x.status(id);
        if (st?.status === 'done') return st;
        await new Promise((r) => setTimeout(r, 20));
      }
      assert.fail(`call ${id} was not done within 10 s: ${JSON.stringify((await x.status(id))?.status)}`);
    },
    async stop() {
      ac.abort();
      await running;
    },
  };
}

/** The parts of a record the core's durable begin makes that do not depend on the time or the seed. */
const begun = (r) => ({
  state: r.state,
  policy: r.policy,
  key: r.key,
  'idempotency-key': r['idempotency-key'],
  'non-idempotent': r['non-idempotent'],
  attempts: r.attempts,
});

// A backend: the store, and the caller's own connection to the same database with its table `orders`.
const backends = {
  sqlite: {
    skip: Database ? false : 'better-sqlite3 is not installed (durable/tests/run.sh installs it)',
    async open() {
      const path = join(mkdtempSync(join(tmpdir(), 'levee-durable-tx-')), 'calls.db');
      const store = new SQLiteStore(path);
      const db = new Database(path, { timeout: 30_000 });
      db.exec('CREATE TABLE orders (id INTEGER PRIMARY KEY, note TEXT NOT NULL)');
      return {
        store,
        tx: db,
        begin: async () => db.exec('BEGIN IMMEDIATE'),
        commit: async () => db.exec('COMMIT'),
        rollback: async () => db.exec('ROLLBACK'),
        order: async (note) => db.prepare('INSERT INTO orders (note) VALUES (?)').run(note),
        count: async (table) => Number(db.prepare(`SELECT count(*) AS n FROM ${table}`).get().n),
        close: async () => {
          db.close();
          await store.close();
        },
      };
    },
  },
  postgres: {
    skip: pg ? false : 'pg is not installed (durable/tests/run.sh installs it)',
    server: undefined,
    n: 0,
    async open() {
      const schema = `levee_js_tx_${process.pid}_${(this.n += 1)}`;
      const admin = new pg.Client(this.server.config);
      await admin.connect();
      await admin.query(`DROP SCHEMA IF EXISTS ${schema} CASCADE; CREATE SCHEMA ${schema}`);
      await admin.end();
      const config = { ...this.server.config, options: `-c search_path=${schema}` };
      const store = await PostgresStore.connect(config);
      const client = new pg.Client(config);
      await client.connect();
      await client.query('CREATE TABLE orders (id BIGSERIAL PRIMARY KEY, note TEXT NOT NULL)');
      return {
        store,
        tx: client,
        config,
        begin: async () => client.query('BEGIN'),
        commit: async () => client.query('COMMIT'),
        rollback: async () => client.query('ROLLBACK'),
        order: async (note) => client.query('INSERT INTO orders (note) VALUES ($1)', [note]),
        count: async (table) => Number((await client.query(`SELECT count(*) AS n FROM ${table}`)).rows[0].n),
        close: async () => {
          await client.end();
          await store.close();
        },
      };
    },
  },
};

for (const [name, b] of Object.entries(backends)) {
  describe(`submit in the caller's transaction (${name})`, { skip: b.skip }, () => {
    if (name === 'postgres') {
      before(async () => {
        b.server = await startPostgres();
      });
      after(async () => {
        await b.server?.stop?.();
      });
    }

    test('rolled back: no call, and the handler never runs', async (t) => {
      if (b.server?.skip) return t.skip(b.server.skip);
      const c = await b.open();
      t.after(c.close);
      const { x, runs } = executor(c.store);
      await c.begin();
      const id = await x.submit('send', 'invoice-1', { tx: c.tx });
      assert.equal(await c.count('levee_durable_calls'), 1, 'the call is written in the transaction');
      await c.rollback();
      await x.run({ untilIdle: true });
      assert.deepEqual(runs, []);
      assert.equal(await x.status(id), undefined);
      assert.deepEqual(await x.calls(), []);
    });

    test('committed: the executor, already running, runs it at its next poll and the call is done', async (t) => {
      if (b.server?.skip) return t.skip(b.server.skip);
      const c = await b.open();
      t.after(c.close);
      const { x, runs } = executor(c.store);
      const w = worker(x);
      t.after(w.stop);
      await new Promise((r) => setTimeout(r, 50)); // the executor is asleep in its poll
      await c.begin();
      await c.order('order 1');
      const id = await x.submit('send', 'invoice-1', { tx: c.tx, idempotencyKey: 'invoice-1', key: 'mail' });
      // PostgreSQL: polls pass and the call is not visible yet. (Not on SQLite: in one process the
      // executor's claim would wait synchronously for the write lock this transaction holds.)
      if (name === 'postgres') await new Promise((r) => setTimeout(r, 50));
      assert.deepEqual(runs, []);
      await c.commit();
      const st = await w.done(id);
      await w.stop();
      assert.equal(st.attempts, 1);
      assert.equal(st.idempotencyKey, 'invoice-1');
      assert.equal(Buffer.from(st.result).toString(), 'sent');
      assert.equal(st.record.key, 'mail');
      assert.deepEqual(runs, ['invoice-1']);
      assert.equal(await c.count('orders'), 1);
    });

    test('an idempotency key reused inside the transaction returns the first id and adds nothing', async (t) => {
      if (b.server?.skip) return t.skip(b.server.skip);
      const c = await b.open();
      t.after(c.close);
      const { x, runs } = executor(c.store);
      await c.begin();
      const first = await x.submit('send', 'invoice-2', { tx: c.tx, idempotencyKey: 'invoice-2' });
      assert.equal(await x.submit('send', 'other', { tx: c.tx, idempotencyKey: 'invoice-2' }), first);
      assert.equal(await c.count('levee_durable_calls'), 1);
      await c.commit();
      // the record is the one a plain submit makes (the core's durable begin)
      const plain = await x.submit('send', 'plain', { idempotencyKey: 'plain' });
      assert.deepEqual(begun((await x.status(first)).record), {
        ...begun((await x.status(plain)).record),
        'idempotency-key': 'invoice-2',
      });
      assert.equal((await x.status(first)).record.state, 'scheduled');
      assert.equal(await x.submit('send', 'again', { idempotencyKey: 'invoice-2' }), first, 'and after the commit');
      await c.begin();
      assert.equal(await x.submit('send', 'again', { tx: c.tx, idempotencyKey: 'invoice-2' }), first);
      await c.commit();
      await x.run({ untilIdle: true });
      assert.deepEqual(runs.sort(), ['invoice-2', 'plain'], 'one call per key, with the first payload');
      assert.equal((await x.calls()).length, 2);
    });

    test('a business row and the call are atomic', async (t) => {
      if (b.server?.skip) return t.skip(b.server.skip);
      const c = await b.open();
      t.after(c.close);
      const { x, runs } = executor(c.store);
      await c.begin();
      await c.order('order 3');
      await x.submit('send', 'invoice-3', { tx: c.tx, idempotencyKey: 'invoice-3' });
      await c.rollback();
      assert.equal(await c.count('orders'), 0);
      assert.equal(await c.count('levee_durable_calls'), 0);
      await x.run({ untilIdle: true });
      assert.deepEqual(runs, []);
      // the key is free again: the rolled-back call did not take it
      await c.begin();
      await c.order('order 3');
      const id = await x.submit('send', 'invoice-3', { tx: c.tx, idempotencyKey: 'invoice-3' });
      await c.commit();
      assert.equal(await c.count('orders'), 1);
      await x.run({ untilIdle: true });
      assert.equal((await x.status(id)).status, 'done');
      assert.deepEqual(runs, ['invoice-3']);
    });

    test("submit's own errors, and a tx of the wrong kind, are errors naming tx; nothing is written", async (t) => {
      if (b.server?.skip) return t.skip(b.server.skip);
      const c = await b.open();
      t.after(c.close);
      const { x } = executor(c.store);
      await c.begin();
      await assert.rejects(x.submit('nope', '', { tx: c.tx }), /no durable handler named `nope`/);
      const wrong =
        name === 'sqlite'
          ? /^TypeError: tx: an SQLiteStore takes the caller's better-sqlite3 Database/
          : /^TypeError: tx: a PostgresStore takes the caller's `pg` client/;
      // the other driver's connection (not connected: it is never used)
      const otherDriver =
        name === 'sqlite'
          ? pg
            ? new pg.Client()
            : { query() {} }
          : Database
            ? new Database(':memory:')
            : { prepare() {} };
      for (const bad of [null, {}, 'client', otherDriver])
        await assert.rejects(x.submit('send', '', { tx: bad }), (err) => (assert.match(String(err), wrong), true));
      await c.commit();
      // a connection that is not inside a transaction
      await assert.rejects(x.submit('send', '', { tx: c.tx }), /^Error: tx: .* is not inside a transaction/);
      if (name === 'sqlite') {
        const other = new Database(join(mkdtempSync(join(tmpdir(), 'levee-durable-tx-')), 'other.db'));
        other.exec('BEGIN');
        await assert.rejects(x.submit('send', '', { tx: other }), /^Error: tx: .*must be written to the store's file$/);
        other.close();
      } else {
        const pool = new pg.Pool(c.config);
        await assert.rejects(x.submit('send', '', { tx: pool }), /^TypeError: tx: a pg Pool runs each query/);
        await pool.end();
      }
      assert.deepEqual(await x.calls(), []);
    });
  });
}

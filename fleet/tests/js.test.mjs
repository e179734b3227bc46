// The JavaScript fleet option (levee-resilience/fleet) on its own, against the private Redis that
// fleet/tests/run.sh starts (FLEET_REDIS=host:port): what one process must do before the
// multi-process scenarios (check.py) put it among Python and Go ones.
//
//   FLEET_REDIS=127.0.0.1:PORT node --test fleet/tests/js.test.mjs

import assert from 'node:assert/strict';
import { execFile, spawn } from 'node:child_process';
import { createServer } from 'node:net';
import { test } from 'node:test';
import { setTimeout as sleep } from 'node:timers/promises';
import { promisify } from 'node:util';

const pkg = process.env.LEVEE_JS_DIR ?? new URL('../../host-bindings/js/', import.meta.url).pathname;
const { loadSync, LeveeError } = await import(`${pkg}/dist/index.js`);
const { Fleet } = await import(`${pkg}/dist/fleet.js`);

const ADDR = process.env.FLEET_REDIS;
assert.ok(ADDR, 'FLEET_REDIS=host:port (fleet/tests/run.sh starts the Redis)');
const URL_ = `redis://${ADDR}/0`;
const [HOST, PORT] = ADDR.split(':');
const cli = (...args) =>
  promisify(execFile)('redis-cli', ['-h', HOST, '-p', PORT, ...args]).then((r) => r.stdout.trim());

const DOC = `
policies:
  plain: { attempts: 1 }
  strict:
    attempts: 1
    fleet: { publish: strict, timeout: 200ms, rate-limit: { rate: 10, burst: 3 } }
  waits:
    attempts: 1
    fleet: { publish: strict, timeout: 200ms, rate-limit: { rate: 10, burst: 1, max-wait: 1s } }
  leased:
    attempts: 1
    fleet: { timeout: 200ms, lease: 10, rate-limit: { rate: 1000, burst: 100 } }
  dep:
    attempts: 1
    breaker: { window: { kind: count, size: 10 }, minimum-calls: 4, failure-rate: 50, open-duration: 30s }
    fleet: { quorum: 2, within: 30s, ttl: 30s, publish-every: 10s, timeout: 200ms }
  slow:
    attempts: 1
    breaker: { window: { kind: count, size: 10 } }
    fleet: { publish: strict, timeout: 20ms, retry-every: 100ms, rate-limit: { rate: 1000, burst: 100 } }
`;

async function fleetOf(node, options = {}) {
  const levee = loadSync(DOC);
  const events = [];
  const fleet = await Fleet.connect(levee, options.url ?? URL_, { node, listener: (e) => events.push(e), ...options });
  return { levee, fleet, events };
}

async function done(...fs) {
  for (const { fleet, levee } of fs) {
    await fleet.close();
    levee.close();
  }
}

const fail = () => {
  throw new Error('the dependency is down');
};

test('the plans are the core’s; a policy without a fleet section runs as levee.run', async () => {
  await cli('FLUSHALL');
  const f = await fleetOf('js-plans');
  assert.deepEqual([...f.fleet.plans.keys()], ['strict', 'waits', 'leased', 'dep', 'slow']);
  const s = f.fleet.plans.get('strict');
  assert.equal(s.keyPrefix, 'levee:{strict/');
  assert.equal(s.rateInterval, 100_000_000);
  assert.equal(s.strict, true);
  assert.equal(f.fleet.plans.get('leased').lease, 10);
  assert.equal(await f.fleet.run('plain', () => 7), 7);
  await assert.rejects(
    f.fleet.run('nope', () => 1),
    /nope/,
  );
  assert.equal(await f.fleet.sync('plain'), false);
  assert.deepEqual(f.events, []);
  await done(f);
});

test('Redis down at connect: local-only at once, one degraded event, nothing fails', async () => {
  // A port that was free a moment ago: nothing listens on it.
  const port = await new Promise((resolve) => {
    const s = createServer().listen(0, '127.0.0.1', () => {
      const p = s.address().port;
      s.close(() => resolve(p));
    });
  });
  const t0 = performance.now();
  const f = await fleetOf('js-down', { url: `redis://127.0.0.1:${port}/0` });
  assert.ok(performance.now() - t0 < 1500, 'connect resolved within its second');
  assert.equal(f.fleet.up, false);
  assert.deepEqual(
    f.events.map((e) => e.kind),
    ['degraded'],
  );
  for (let i = 0; i < 5; i++) assert.equal(await f.fleet.run('strict', () => i), i);
  await assert.rejects(
    f.fleet.run('dep', fail),
    (e) => e instanceof LeveeError && e.lastError?.message === 'the dependency is down',
  );
  assert.equal(await f.fleet.sync('dep'), false);
  await done(f);
});

test('strict rate limit: the burst is admitted, then rate-limited with the retry-after hint', async () => {
  await cli('FLUSHALL');
  const f = await fleetOf('js-strict');
  for (let i = 0; i < 3; i++) assert.equal(await f.fleet.run('strict', () => i, { key: 'a' }), i);
  const err = await f.fleet.run('strict', () => 1, { key: 'a' }).catch((e) => e);
  assert.ok(err instanceof LeveeError, String(err));
  assert.equal(err.reason, 'rate-limited');
  assert.equal(err.policy, 'strict');
  assert.ok(err.retryAfterMs > 0 && err.retryAfterMs <= 100, `hint ${err.retryAfterMs} ms`);
  // Another key has its own bucket; a cost takes that many tokens at once.
  assert.equal(await f.fleet.run('strict', () => 'b', { key: 'b', cost: 3 }), 'b');
  assert.equal((await f.fleet.run('strict', () => 'b', { key: 'b' }).catch((e) => e)).reason, 'rate-limited');
  await assert.rejects(
    f.fleet.run('strict', () => 1, { cost: 0 }),
    RangeError,
  );
  await assert.rejects(
    f.fleet.run('strict', () => 1, { cost: 1.5 }),
    RangeError,
  );
  assert.ok(f.fleet.up);
  await done(f);
});

test('max-wait: a call waits for its token; the caller’s signal cuts the wait short', async () => {
  await cli('FLUSHALL');
  const f = await fleetOf('js-waits');
  await f.fleet.run('waits', () => 1);
  let t0 = performance.now();
  await f.fleet.run('waits', () => 2);
  const waited = performance.now() - t0;
  assert.ok(waited >= 80 && waited < 400, `waited ${waited} ms for a 100 ms interval`);
  t0 = performance.now();
  let ran = false;
  const err = await f.fleet
    .run(
      'waits',
      () => {
        ran = true;
      },
      { signal: AbortSignal.timeout(20) },
    )
    .catch((e) => e);
  assert.equal(err?.name, 'TimeoutError', String(err));
  assert.ok(performance.now() - t0 < 80, 'the abort ended the wait');
  assert.equal(ran, false);
  await done(f);
});

test('leases: concurrent calls wait for the one lease request in flight', async () => {
  await cli('FLUSHALL');
  const f = await fleetOf('js-lease');
  await cli('CONFIG', 'RESETSTAT');
  const out = await Promise.all(Array.from({ length: 10 }, (_, i) => f.fleet.run('leased', () => i, { key: 'x' })));
  assert.deepEqual(
    out,
    Array.from({ length: 10 }, (_, i) => i),
  );
  const stats = await cli('INFO', 'commandstats');
  const calls = (name) => Number(new RegExp(`cmdstat_${name}:calls=(\\d+)`).exec(stats)?.[1] ?? 0);
  assert.equal(calls('evalsha') + calls('eval'), 1, `one round trip for 10 calls:\n${stats}`);
  await done(f);
});

test('publication: two open processes are a quorum that opens a third, healthy one', async () => {
  await cli('FLUSHALL');
  const [a, b, c] = [await fleetOf('js-a'), await fleetOf('js-b'), await fleetOf('js-c')];
  for (const f of [a, b]) {
    for (let i = 0; i < 4; i++) await f.fleet.run('dep', fail, { key: 'k' }).catch(() => {});
    assert.equal(f.levee.breakerState('dep', 'k'), 'open');
    assert.equal(await f.fleet.sync('dep', 'k'), true);
  }
  const opened = [];
  c.levee.on('breaker-transition', (e) => opened.push(e.name));
  assert.equal(await c.fleet.run('dep', () => 'ok', { key: 'k' }), 'ok');
  assert.equal(await c.fleet.sync('dep', 'k'), true);
  assert.equal(c.levee.breakerState('dep', 'k'), 'open');
  assert.deepEqual(opened, ['fleet-quorum'], 'emitted when the fleet state is applied');
  const err = await c.fleet.run('dep', () => 'ok', { key: 'k' }).catch((e) => e);
  assert.equal(err?.reason, 'breaker-open');
  // Its next publication says the quorum opened it (so it never counts toward the quorum itself).
  assert.equal(await c.fleet.sync('dep', 'k'), true);
  const state = await c.fleet.inspect('dep', 'k');
  const rec = Object.fromEntries(state.records.map((r) => [r.node, r]));
  assert.equal(rec['js-a'].trips, 1);
  assert.equal(rec['js-b'].state, 'open');
  assert.equal(rec['js-c']['fleet-opened'], true);
  assert.equal(await c.fleet.inspect('dep', 'other'), undefined);
  await done(a, b, c);
});

test('bytes the core refuses: a bad-state event, and calls go on', async () => {
  await cli('FLUSHALL');
  await cli('HSET', 'levee:{dep/k}:s', 'v', '3', 'd', 'garbage');
  const f = await fleetOf('js-bad');
  assert.equal(await f.fleet.run('dep', () => 1, { key: 'k' }), 1);
  await f.fleet.sync('dep', 'k');
  const bad = f.events.filter((e) => e.kind === 'bad-state');
  assert.equal(bad.length, 1, JSON.stringify(f.events));
  assert.equal(bad[0].policy, 'dep');
  assert.equal(bad[0].key, 'k');
  assert.match(bad[0].detail, /\S/);
  assert.equal(await f.fleet.run('dep', () => 2, { key: 'k' }), 2);
  assert.ok(f.fleet.up, 'a refused state is not the store being down');
  await assert.rejects(f.fleet.inspect('dep', 'k'), /levee fleet: the store's bytes: .*magic/);
  await done(f);
});

test('a slow store: past the policy’s timeout the fleet is local-only at once, then comes back', async () => {
  await cli('FLUSHALL');
  const f = await fleetOf('js-slow');
  assert.equal(await f.fleet.run('slow', () => 0), 0);
  const sleeper = spawn('redis-cli', ['-h', HOST, '-p', PORT, 'DEBUG', 'SLEEP', '0.5'], { stdio: 'ignore' });
  await sleep(100);
  const t0 = performance.now();
  assert.equal(await f.fleet.run('slow', () => 1), 1);
  const took = performance.now() - t0;
  assert.ok(took < 150, `a call waited ${took} ms for a store whose timeout is 20 ms`);
  assert.equal(f.fleet.up, false);
  for (let i = 0; i < 100; i++) assert.equal(await f.fleet.run('slow', () => i), i);
  await new Promise((resolve) => sleeper.on('exit', resolve));
  for (let i = 0; i < 40 && !f.fleet.up; i++) await sleep(50);
  assert.deepEqual(
    f.events.map((e) => e.kind),
    ['degraded', 'restored'],
  );
  assert.equal(await f.fleet.run('slow', () => 2), 2);
  assert.ok(f.fleet.up);
  await done(f);
});

// The JavaScript fleet option on a real Redis Cluster (docs/fleet.md, "Redis Cluster"): three
// masters (redis-server --cluster-enabled) on free ports of 127.0.0.1, joined by
// `redis-cli --cluster create`, and one Fleet whose client is an ioredis Cluster: its keys spread
// over the shards, and a master killed with SIGKILL and restarted under load costs no error on
// the data path, one `degraded` and one `restored` once the master serves again. Every server is
// stopped at the end. About 15 s.
//
//   node --test fleet/tests/js_cluster.test.mjs        (fleet/tests/run.sh runs it)

import assert from 'node:assert/strict';
import { execFileSync } from 'node:child_process';
import { mkdtempSync, readFileSync, rmSync } from 'node:fs';
import { createServer } from 'node:net';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, test } from 'node:test';
import { setTimeout as sleep } from 'node:timers/promises';

const pkg = process.env.LEVEE_JS_DIR ?? new URL('../../host-bindings/js/', import.meta.url).pathname;
const { loadSync } = await import(`${pkg}/dist/index.js`);
const { Fleet } = await import(`${pkg}/dist/fleet.js`);
const { Cluster } = await import(`${pkg}/node_modules/ioredis/built/index.js`);

const work = mkdtempSync(join(tmpdir(), 'levee-js-cluster-'));
const cli = (port, ...args) => execFileSync('redis-cli', ['-h', '127.0.0.1', '-p', String(port), ...args]).toString();

function free(port) {
  return new Promise((resolve) => {
    const s = createServer()
      .once('error', () => resolve(false))
      .listen(port, '127.0.0.1', () => s.close(() => resolve(true)));
  });
}

/** Three free ports whose cluster bus ports (port + 10000) are free too. */
async function ports() {
  const out = [];
  for (let tries = 0; out.length < 3 && tries < 200; tries++) {
    const p = 20000 + Math.floor(Math.random() * 30000);
    if (!out.includes(p) && (await free(p)) && (await free(p + 10000))) out.push(p);
  }
  assert.equal(out.length, 3, 'three free ports');
  return out;
}

function start(port) {
  const dir = join(work, String(port));
  execFileSync('mkdir', ['-p', dir]);
  execFileSync('redis-server', [
    ...['--port', String(port), '--bind', '127.0.0.1', '--cluster-enabled', 'yes'],
    ...['--cluster-config-file', 'nodes.conf', '--cluster-node-timeout', '2000', '--save', '', '--appendonly', 'no'],
    ...['--daemonize', 'yes', '--pidfile', join(dir, 'pid'), '--logfile', join(dir, 'log'), '--dir', dir],
  ]);
}

function pid(port) {
  return Number(readFileSync(join(work, String(port), 'pid'), 'utf8'));
}

async function clusterOk(list, seconds) {
  for (let i = 0; i < seconds * 10; i++) {
    if (list.every((p) => /cluster_state:ok/.test(cli(p, 'CLUSTER', 'INFO')))) return;
    await sleep(100);
  }
  assert.fail(`the cluster on ${list} is not ok after ${seconds} s`);
}

const PORTS = await ports();
after(async () => {
  const alive = (p) => {
    try {
      process.kill(p, 0);
      return true;
    } catch {
      return false;
    }
  };
  const pids = [];
  for (const p of PORTS) {
    try {
      pids.push(pid(p));
      process.kill(pids.at(-1));
    } catch {
      // never started, or already stopped
    }
  }
  for (let i = 0; i < 50 && pids.some(alive); i++) await sleep(100);
  rmSync(work, { recursive: true, force: true, maxRetries: 5, retryDelay: 100 });
});

test('a Fleet on an ioredis Cluster: keys over 3 shards, a master killed and restarted, no error', async () => {
  for (const p of PORTS) start(p);
  for (const p of PORTS) for (let i = 0; i < 50 && !/PONG/.test(cli(p, 'PING')); i++) await sleep(50);
  execFileSync('redis-cli', [
    '--cluster',
    'create',
    ...PORTS.map((p) => `127.0.0.1:${p}`),
    ...['--cluster-replicas', '0', '--cluster-yes'],
  ]);
  await clusterOk(PORTS, 10);

  const levee = loadSync(`
policies:
  dep:
    attempts: 1
    breaker: { window: { kind: count, size: 10 } }
    fleet: { publish: strict, timeout: 200ms, retry-every: 200ms, rate-limit: { rate: 100000, burst: 1000 } }
`);
  const client = new Cluster([{ host: '127.0.0.1', port: PORTS[0] }], {
    enableOfflineQueue: false,
    clusterRetryStrategy: () => 200,
    redisOptions: { commandTimeout: 200, connectTimeout: 500, enableOfflineQueue: false, maxRetriesPerRequest: 0 },
  });
  client.on('error', () => {});
  const events = [];
  const fleet = await Fleet.connect(levee, undefined, { client, node: 'js-cluster', listener: (e) => events.push(e) });
  assert.ok(fleet.up, JSON.stringify(events));

  const keys = Array.from({ length: 12 }, (_, i) => `key-${i}`);
  for (const k of keys) assert.equal(await fleet.run('dep', () => k, { key: k }), k);
  const held = PORTS.map((p) => cli(p, '--scan', '--pattern', 'levee:*}:s').trim().split('\n').filter(Boolean).length);
  assert.equal(
    held.reduce((a, b) => a + b, 0),
    keys.length,
    `every key's state is on the cluster: ${held}`,
  );
  assert.ok(
    held.every((n) => n > 0),
    `the keys spread over the 3 masters: ${held}`,
  );

  // Under load: a master killed with SIGKILL at 0.5 s, restarted at 2 s (it rejoins empty).
  let ok = 0;
  let errors = 0;
  const samples = [];
  const t0 = performance.now();
  let killed = false;
  let restarted = false;
  while (performance.now() - t0 < 7000 && !(restarted && fleet.up && performance.now() - t0 > 4000)) {
    const t = performance.now() - t0;
    if (!killed && t > 500) {
      process.kill(pid(PORTS[1]), 'SIGKILL');
      killed = true;
    }
    if (killed && !restarted && t > 2000) {
      start(PORTS[1]);
      restarted = true;
    }
    for (const k of keys) {
      try {
        await fleet.run('dep', () => 1, { key: k });
        ok++;
      } catch (err) {
        errors++;
        if (samples.length < 3) samples.push(String(err));
      }
    }
    await sleep(5);
  }
  assert.equal(errors, 0, `no error on the data path (${ok} calls ok): ${samples}`);
  assert.deepEqual(
    events.map((e) => e.kind),
    ['degraded', 'restored'],
    'local-only once, restored once every master serves',
  );
  assert.ok(fleet.up);
  await clusterOk(PORTS, 5);
  // The restarted master holds its keys' state again after the next publications.
  for (const k of keys) await fleet.run('dep', () => 1, { key: k });
  const again = cli(PORTS[1], '--scan', '--pattern', 'levee:*}:s').trim().split('\n').filter(Boolean).length;
  assert.equal(again, held[1], 'the restarted master holds its keys again');
  await fleet.close();
  client.disconnect();
  levee.close();
});

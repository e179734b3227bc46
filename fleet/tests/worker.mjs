// One JavaScript process of the fleet test (fleet/tests/run.sh): runs a scenario against the shared
// Redis from a common wall-clock start and prints one JSON line of counts, as worker.py and the Go
// fleet-worker do. `bench` measures the cost of one call per policy of bench.yaml instead.
//
//   node worker.mjs MODE --addr HOST:PORT --node NAME --start UNIX_SECONDS [--seconds S] [--bad FROM:TO]
//                        [--failures N] [--policies FILE]

import { readFileSync } from 'node:fs';
import { parseArgs } from 'node:util';
import { setTimeout as sleep } from 'node:timers/promises';

const pkg = process.env.LEVEE_JS_DIR ?? new URL('../../host-bindings/js/', import.meta.url).pathname;
const { loadSync, LeveeError } = await import(`${pkg}/dist/index.js`);
const { Fleet } = await import(`${pkg}/dist/fleet.js`);

const { values: a, positionals } = parseArgs({
  allowPositionals: true,
  options: {
    addr: { type: 'string' },
    node: { type: 'string' },
    start: { type: 'string', default: '0' },
    seconds: { type: 'string', default: '10' },
    bad: { type: 'string', default: '' },
    failures: { type: 'string', default: '0' },
    policies: { type: 'string', default: new URL('policies.yaml', import.meta.url).pathname },
  },
});
const mode = positionals[0];
const MODES = ['rate', 'rate-strict', 'breaker', 'steady', 'records', 'bench'];
if (!MODES.includes(mode)) throw new Error(`worker.mjs: mode must be one of ${MODES.join(', ')}`);

class DependencyDown extends Error {
  name = 'DependencyDown';
}

const levee = loadSync(readFileSync(a.policies, 'utf8'));
let quorum = 0;
levee.on('breaker-transition', (ev) => {
  if (ev.name === 'fleet-quorum') quorum++;
});
const events = [];
const fleet = await Fleet.connect(levee, `redis://${a.addr}/0`, {
  node: a.node,
  listener: (ev) => events.push(ev.kind),
});
const out = { node: a.node, lang: 'js', mode };
const start = Number(a.start) * 1000;
const untilStart = () => sleep(Math.max(0, start - Date.now()));

if (mode === 'bench') {
  out.ns_per_call = await bench();
} else if (mode === 'records') {
  for (let i = 0; i < Number(a.failures); i++) {
    await fleet
      .run(
        'count',
        () => {
          throw new DependencyDown('recorded failure');
        },
        { key: 'k' },
      )
      .catch(() => {});
  }
  await untilStart();
  // What is checked is that concurrent records are all counted, not availability: a process
  // that went local-only on a loaded machine (an operation slower than the policy's timeout)
  // waits, bounded, until its fleet is back before it publishes.
  for (let i = 0; i < 100 && !fleet.up; i++) await sleep(50);
  for (let i = 0; i < 50; i++) await fleet.sync('count', 'k');
  Object.assign(out, { conflicts: fleet.conflicts, publications: fleet.publications, fleet_events: events });
} else {
  await scenario();
}
console.log(JSON.stringify(out));
await fleet.close();
levee.close();

async function scenario() {
  const [from, to] = a.bad ? a.bad.split(':').map(Number) : [-1, -1];
  const counts = { ok: 0, limited: 0, open: 0, failed: 0, errors: 0, invoked: 0 };
  const phases = {};
  const samples = [];
  const policy = mode === 'rate' || mode === 'rate-strict' ? mode : 'dep';
  const paced = mode === 'breaker' || mode === 'steady';
  await untilStart();
  const end = start + Number(a.seconds) * 1000;
  for (let now = Date.now(); now < end; now = Date.now()) {
    const t = (now - start) / 1000;
    const phase = (phases[String(Math.floor(t))] ??= { ok: 0, open: 0, failed: 0, invoked: 0 });
    const failing = from <= t && t < to;
    try {
      await fleet.run(
        policy,
        () => {
          counts.invoked++;
          phase.invoked++;
          if (failing) throw new DependencyDown('the dependency is down');
          return 1;
        },
        { key: 'k' },
      );
      counts.ok++;
      phase.ok++;
    } catch (err) {
      if (err instanceof LeveeError && err.reason === 'rate-limited') {
        counts.limited++;
        await sleep(Math.min(Math.max(err.retryAfterMs ?? 1, 1), 5));
      } else if (err instanceof LeveeError && err.reason === 'breaker-open') {
        counts.open++;
        phase.open++;
      } else if (err instanceof DependencyDown || err instanceof LeveeError) {
        counts.failed++;
        phase.failed++;
      } else {
        counts.errors++; // anything else is an error on the data path
        if (samples.length < 5) samples.push(String(err?.stack ?? err));
      }
    }
    if (paced) await sleep(5);
  }
  Object.assign(out, counts, {
    phases,
    quorum_events: quorum,
    fleet_events: events,
    conflicts: fleet.conflicts,
    publications: fleet.publications,
    error_samples: samples,
  });
}

/** The cost of one call per policy of bench.yaml: the best of 3 rounds of 0.5 s (the machine is shared). */
async function bench() {
  const res = {};
  const noop = () => 1;
  for (const name of ['local', 'async', 'lease', 'strict-rate', 'strict']) {
    const run =
      name === 'local' ? () => levee.run(name, noop, { key: 'k' }) : () => fleet.run(name, noop, { key: 'k' });
    for (let i = 0; i < 200; i++) await run();
    let best = Infinity;
    for (let round = 0; round < 3; round++) {
      let n = 0;
      const t0 = process.hrtime.bigint();
      while (process.hrtime.bigint() - t0 < 500_000_000n) {
        await run();
        // A real program yields to the event loop: so does this one, every 1,000 calls, so that
        // the background publication runs (and is counted) as it would.
        if (++n % 1000 === 0) await new Promise((r) => setImmediate(r));
      }
      best = Math.min(best, Number(process.hrtime.bigint() - t0) / n);
    }
    res[name] = best;
  }
  return res;
}

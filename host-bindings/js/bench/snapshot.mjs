// Snapshots at many keys (issue 41, docs/performance.md): what the host's recovery snapshot costs the
// call path when the key table is large. N keys k0..k{N-1} are filled with successful calls, the
// breaker of key "open" is opened (so snapshots are due), then one caller cycles over k0..k999 for
// T seconds of the real clock (the periodic snapshot is once per second of the engine's clock),
// counting calls and timing the slowest. Not a timed test: figures go in docs/performance.md.
//
//   node bench/snapshot.mjs [--sizes 1,100000,1000000] [--seconds 3] [--snapshot both|export-snapshot|export-state] [--json]
//
// `--snapshot export-state` measures the host as it was before issue 41 (the recovery snapshot was
// the whole `export-state`): the bench asks for the whole state's pages where the host asks for
// the snapshot's. A first, unmeasured round (N = 1, the same T) warms the JIT, so that the N = 1
// row is not the only one that pays for it.

import { performance } from 'node:perf_hooks';
import { loadSync } from '../dist/index.js';

const DOC = `
policies:
  p:
    attempts: 1
    breaker: { window: { kind: count, size: 4 }, minimum-calls: 2, open-duration: 1h }
    keys: { max: 1000000 }
`;

function arg(name, fallback) {
  const i = process.argv.indexOf(name);
  return i >= 0 && i + 1 < process.argv.length ? process.argv[i + 1] : fallback;
}
const sizes = arg('--sizes', '1,100000,1000000')
  .split(',')
  .map((s) => Number(s));
const seconds = Number(arg('--seconds', '3'));
const which = arg('--snapshot', 'both');
const modes = which === 'both' ? ['export-snapshot', 'export-state'] : [which];
if (
  sizes.some((n) => !Number.isSafeInteger(n) || n < 1) ||
  !(seconds > 0) ||
  modes.some((m) => !m.startsWith('export-'))
) {
  console.error(
    'usage: node bench/snapshot.mjs [--sizes 1,100000] [--seconds 3] [--snapshot both|export-snapshot|export-state]',
  );
  process.exit(2);
}

const ok = () => 1;
const down = () => {
  throw new Error('down');
};

/** One size under one snapshot: fill, open a breaker, then T seconds of calls over k0..k999. */
async function measure(n, mode, secs = seconds) {
  const levee = loadSync(DOC, { seed: 1n, telemetry: null });
  const engine = levee.engine;
  const proto = Object.getPrototypeOf(engine);
  const real = proto.exportStatePage;
  // The host takes its recovery snapshot page by page (`export-state-page` with `snapshot`
  // true). Before issue 41 the recovery snapshot was the whole state: `export-state` asks for
  // those pages instead. Each snapshot is timed on its own (its pages summed): a slow call on a
  // busy machine may be the scheduler's or the garbage collector's.
  const snapshots = { count: 0, maxMs: 0, currentMs: 0 };
  proto.exportStatePage = function exportStatePage(cursor, snapshot) {
    if (!snapshot) return real.call(this, cursor, snapshot); // the user's export-state
    const t = performance.now();
    try {
      return real.call(this, cursor, mode !== 'export-state');
    } finally {
      const ms = performance.now() - t;
      if (cursor === 0n) {
        snapshots.count++;
        snapshots.currentMs = 0;
      }
      snapshots.currentMs += ms;
      if (snapshots.currentMs > snapshots.maxMs) snapshots.maxMs = snapshots.currentMs;
    }
  };
  const faults = [];
  levee.on('engine-fault', (e) => faults.push(`${e.phase}: ${e.error}`));
  try {
    const names = Array.from({ length: n }, (_, i) => `k${i}`);
    const t0 = performance.now();
    for (const key of names) await levee.run('p', ok, { key });
    const fillS = (performance.now() - t0) / 1e3;
    for (let i = 0; i < 2; i++) await levee.run('p', down, { key: 'open' }).catch(() => undefined);
    if (levee.breakerState('p', 'open') !== 'open') throw new Error('the breaker of "open" did not open');
    // k0..k999 whatever N (a table smaller than 1000 grows to 1000 keys): the same work per call.
    const cycle = Array.from({ length: 1000 }, (_, i) => `k${i}`);
    let calls = 0;
    let slowest = 0;
    let over10 = 0;
    // the slowest call during which a snapshot was taken: what a snapshot costs a call
    let slowestSnap = 0;
    snapshots.count = 0;
    snapshots.maxMs = 0;
    const end = performance.now() + secs * 1e3;
    for (let now = performance.now(); now < end;) {
      const key = cycle[calls % cycle.length];
      const before = snapshots.count;
      await levee.run('p', ok, { key });
      const after = performance.now();
      if (after - now > slowest) slowest = after - now;
      if (snapshots.count !== before && after - now > slowestSnap) slowestSnap = after - now;
      if (after - now > 10) over10++;
      now = after;
      calls++;
    }
    const snapshotsDuring = snapshots.count;
    const state = levee.exportState().length;
    return {
      n,
      mode,
      fillS,
      calls,
      slowestMs: slowest,
      slowestSnapshotCallMs: slowestSnap,
      over10,
      snapshots: snapshotsDuring,
      snapshotMaxMs: snapshots.maxMs,
      stateBytes: state,
      faults,
    };
  } finally {
    proto.exportStatePage = real;
    levee.close();
  }
}

const json = process.argv.includes('--json');
if (!json) {
  console.log(`node ${process.version}, T = ${seconds} s, one caller over k0..k999`);
  console.log(
    `| snapshot | N | fill (s) | calls | vs N=${Math.min(...sizes)} | slowest call (ms) | slowest call taking a snapshot (ms) | calls > 10 ms | snapshots | slowest snapshot (ms) | export-state bytes | faults |`,
  );
  console.log('|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|');
}
// Each row as soon as it is measured (the whole state at 10^6 keys takes minutes).
await measure(1, modes[0]); // the warm-up round, not reported
globalThis.gc?.();
const rows = [];
for (const mode of modes) {
  for (const n of sizes) {
    const r = await measure(n, mode);
    rows.push(r);
    globalThis.gc?.();
    if (json) continue;
    const base = rows.find((b) => b.mode === r.mode && b.n === Math.min(...sizes));
    const ratio = base === undefined ? '' : (r.calls / base.calls).toFixed(2);
    console.log(
      `| ${r.mode} | ${r.n} | ${r.fillS.toFixed(1)} | ${r.calls} | ${ratio} | ${r.slowestMs.toFixed(2)} | ${r.slowestSnapshotCallMs.toFixed(2)} | ${r.over10} | ${r.snapshots} | ${r.snapshotMaxMs.toFixed(2)} | ${r.stateBytes} | ${r.faults.join('; ')} |`,
    );
  }
}
if (json) console.log(JSON.stringify(rows, null, 2));
// An engine fault (a trap, the memory bound) fails the run: the smoke run in ci.sh relies on it.
if (rows.some((r) => r.faults.length > 0)) process.exitCode = 1;

// CPU time per call at production load: N async callers share one Levee (and one cockatiel policy) and
// each makes ROUNDS calls of a function that waits 5 ms, so about N calls are in flight at any time.
// CPU time is process.cpuUsage() (user + system) over the whole level divided by the calls made; both
// contenders run at every level in this one process, so the ratios of one run are comparable.
//
//   node bench/load.mjs                                    # 1, 1,000, 10,000, 40,000 in flight
//   node bench/load.mjs --levels 1,100 --rounds 5 --single 20   # the CI smoke run

import { ConsecutiveBreaker, ExponentialBackoff, circuitBreaker, handleAll, retry, wrap } from 'cockatiel';
import { loadSync } from '../dist/index.js';
import { BENCH_POLICY } from './policy.mjs';

const args = process.argv.slice(2);
const arg = (name, dflt) => {
  const i = args.indexOf(name);
  return i >= 0 ? args[i + 1] : dflt;
};
const LEVELS = String(arg('--levels', '1,1000,10000,40000')).split(',').map(Number);
const ROUNDS = Number(arg('--rounds', 20));
const SINGLE = Number(arg('--single', 400));
const WAIT_MS = Number(arg('--wait-ms', 5));

const levee = loadSync(BENCH_POLICY, { seed: 1n, meter: null });
const policy = levee.policy('bench');
const cockatiel = wrap(
  retry(handleAll, { maxAttempts: 2, backoff: new ExponentialBackoff({ initialDelay: 100, maxDelay: 10_000 }) }),
  circuitBreaker(handleAll, { halfOpenAfter: 10_000, breaker: new ConsecutiveBreaker(5) }),
);
const work = () => new Promise((resolve) => setTimeout(resolve, WAIT_MS, 1));
/** Each contender making one call of `w`. */
const calling = (w) => ({
  levee: () => levee.run(policy, w),
  cockatiel: () => cockatiel.execute(w),
});
const contenders = calling(work);

async function level(call, n, rounds) {
  const caller = async () => {
    let s = 0;
    for (let r = 0; r < rounds; r++) s += await call();
    return s;
  };
  if (globalThis.gc) globalThis.gc();
  const c0 = process.cpuUsage();
  const t0 = performance.now();
  const sums = await Promise.all(Array.from({ length: n }, caller));
  const wall = performance.now() - t0;
  const c = process.cpuUsage(c0);
  if (sums.some((s) => s !== rounds)) throw new Error('a call failed');
  return { cpuUs: (c.user + c.system) / (n * rounds), wallMs: wall };
}

// Warm up: V8 compiles the hot JavaScript and WebAssembly again in optimizing tiers on background
// threads, and that CPU time lands in whatever level runs next: give every contender enough calls
// (flat out, then waiting) that its tier-up is over before the first measured level.
for (const call of Object.values(calling(() => Promise.resolve(1)))) await level(call, 100, 200);
for (const call of Object.values(contenders)) await level(call, 100, 10);
console.log(`# node ${process.version}, ${WAIT_MS} ms wait, CPU time (user+system) per call`);
console.log(
  `${'in flight'.padEnd(10)} ${'contender'.padEnd(10)} ${'calls'.padStart(8)} ${'wall ms'.padStart(9)} ${'CPU us/call'.padStart(12)} ${'levee/this'.padStart(10)}`,
);
// One caller is mostly an idle process: its CPU per call is the event loop's wake-ups, which move
// with whatever else the machine runs. So level 1 runs in BLOCKS blocks, the contenders taking turns
// (levee, cockatiel, cockatiel, levee, ...), and each contender's figure covers all of its blocks.
const BLOCKS = 4;
const NAMES = Object.keys(contenders);

async function measure(n) {
  const out = Object.fromEntries(NAMES.map((name) => [name, { cpuUs: 0, wallMs: 0, calls: 0 }]));
  const blocks = n === 1 ? BLOCKS : 1;
  const rounds = n === 1 ? Math.max(1, Math.round(SINGLE / BLOCKS)) : ROUNDS;
  for (let b = 0; b < blocks; b++) {
    for (const name of b % 2 === 0 ? NAMES : [...NAMES].reverse()) {
      const r = await level(contenders[name], n, rounds);
      const o = out[name];
      o.cpuUs += r.cpuUs * n * rounds; // the total, divided by the calls below
      o.wallMs += r.wallMs;
      o.calls += n * rounds;
    }
  }
  for (const o of Object.values(out)) o.cpuUs /= o.calls;
  return out;
}

for (const n of LEVELS) {
  const results = await measure(n);
  const first = results[NAMES[0]].cpuUs;
  for (const name of NAMES) {
    const { cpuUs, wallMs, calls } = results[name];
    console.log(
      `${String(n).padEnd(10)} ${name.padEnd(10)} ${String(calls).padStart(8)} ${wallMs.toFixed(0).padStart(9)} ${cpuUs.toFixed(2).padStart(12)} ${(first / cpuUs).toFixed(2).padStart(10)}`,
    );
  }
}

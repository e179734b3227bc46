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
const contenders = {
  levee: () => levee.run(policy, work),
  cockatiel: () => cockatiel.execute(work),
};

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

for (const call of Object.values(contenders)) await level(call, 10, 10); // warm up
console.log(`# node ${process.version}, ${WAIT_MS} ms wait, CPU time (user+system) per call`);
console.log(
  `${'in flight'.padEnd(10)} ${'contender'.padEnd(10)} ${'calls'.padStart(8)} ${'wall ms'.padStart(9)} ${'CPU us/call'.padStart(12)} ${'levee/this'.padStart(10)}`,
);
for (const n of LEVELS) {
  const rounds = n === 1 ? SINGLE : ROUNDS;
  let first;
  for (const [name, call] of Object.entries(contenders)) {
    const { cpuUs, wallMs } = await level(call, n, rounds);
    first ??= cpuUs;
    console.log(
      `${String(n).padEnd(10)} ${name.padEnd(10)} ${String(n * rounds).padStart(8)} ${wallMs.toFixed(0).padStart(9)} ${cpuUs.toFixed(2).padStart(12)} ${(first / cpuUs).toFixed(2).padStart(10)}`,
    );
  }
}

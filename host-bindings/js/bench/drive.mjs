// One case of bench/overhead.mjs, run alone for bench/instructions.sh: 30000 warm-up calls, then N.
//
//   node bench/drive.mjs <levee|stubbed|cockatiel|bare> <N>

import { ConsecutiveBreaker, ExponentialBackoff, circuitBreaker, handleAll, retry, wrap } from 'cockatiel';
import { loadSync } from '../dist/index.js';
import { BENCH_POLICY } from './policy.mjs';

const [mode, count] = process.argv.slice(2);
const N = Number(count);
const work = async () => 1;
let run;
if (mode === 'levee' || mode === 'stubbed') {
  const stub = (module, imports) => {
    const exports = { ...new WebAssembly.Instance(module, imports).exports };
    for (const name of Object.keys(exports)) if (name.endsWith('[method]engine.start')) exports[name] = () => 0x100n;
    return { exports };
  };
  const levee = loadSync(BENCH_POLICY, {
    seed: 1n,
    meter: null,
    instantiateCore: mode === 'stubbed' ? stub : undefined,
  });
  const policy = levee.policy('bench');
  run = () => levee.run(policy, work);
} else if (mode === 'cockatiel') {
  const policy = wrap(
    retry(handleAll, { maxAttempts: 2, backoff: new ExponentialBackoff({ initialDelay: 100, maxDelay: 10_000 }) }),
    circuitBreaker(handleAll, { halfOpenAfter: 10_000, breaker: new ConsecutiveBreaker(5) }),
  );
  run = () => policy.execute(work);
} else if (mode === 'bare') {
  run = work;
} else {
  throw new Error(`unknown case ${mode}`);
}
let s = 0;
for (let i = 0; i < 30_000; i++) s += await run();
for (let i = 0; i < N; i++) s += await run();
if (s !== N + 30_000) throw new Error('wrong sum');

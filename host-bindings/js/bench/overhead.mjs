// Per-call overhead of a function that succeeds first time, under retry + circuit breaker:
// levee (this package: start crossing + held-back success), cockatiel (the equivalent policy), and a
// bare await, measured in one run, in alternating rounds, reporting the median round.
//
//   node bench/overhead.mjs [--calls N] [--rounds R] [--json]

import { performance } from 'node:perf_hooks';
import { ConsecutiveBreaker, ExponentialBackoff, circuitBreaker, handleAll, retry, wrap } from 'cockatiel';
import { loadSync } from '../dist/index.js';
import { BENCH_POLICY } from './policy.mjs';

const args = process.argv.slice(2);
const arg = (name, dflt) => {
  const i = args.indexOf(name);
  return i >= 0 ? Number(args[i + 1]) : dflt;
};
const CALLS = arg('--calls', 200_000);
const ROUNDS = arg('--rounds', 7);

const levee = loadSync(BENCH_POLICY, { seed: 1n, meter: null });
const policy = levee.policy('bench');

// The host alone: the same Levee, whose core module's `start` answers "attempt 1" at once (the
// first-attempt verdict, 0x100) without entering the guest. It separates this package's cost from
// the core's.
const stubbed = loadSync(BENCH_POLICY, {
  seed: 1n,
  meter: null,
  instantiateCore: (module, imports) => {
    const instance = new WebAssembly.Instance(module, imports);
    const exports = { ...instance.exports };
    for (const name of Object.keys(exports)) {
      if (name.endsWith('[method]engine.start')) exports[name] = () => 0x100n;
    }
    return { exports };
  },
});
const stubbedPolicy = stubbed.policy('bench');
const cockatiel = wrap(
  retry(handleAll, { maxAttempts: 2, backoff: new ExponentialBackoff({ initialDelay: 100, maxDelay: 10_000 }) }),
  circuitBreaker(handleAll, { halfOpenAfter: 10_000, breaker: new ConsecutiveBreaker(5) }),
);

const work = async () => 1;

// The floor this core sets: the same crossings (start with the previous success settled, two clock
// reads) around the same awaited call, with no host logic at all.
const engine = levee.component.engineApi.Engine.load(BENCH_POLICY, 1n);
let floorCall = 1n;
const hrtime = process.hrtime; // as the host reads it (the global `process` is an accessor)

const cases = {
  bare: async (n) => {
    let s = 0;
    for (let i = 0; i < n; i++) s += await work();
    return s;
  },
  levee: async (n) => {
    let s = 0;
    for (let i = 0; i < n; i++) s += await levee.run(policy, work);
    return s;
  },
  'levee, core stubbed': async (n) => {
    let s = 0;
    for (let i = 0; i < n; i++) s += await stubbed.run(stubbedPolicy, work);
    return s;
  },
  'core floor': async (n) => {
    let s = 0;
    let prev = 0n;
    let prevAt = 0n;
    let prevElapsed = 0n;
    for (let i = 0; i < n; i++) {
      const t0 = hrtime.bigint();
      const call = floorCall++;
      engine.start(call, 0, '', 0, t0, prev, prevAt, prevElapsed);
      s += await work();
      const t1 = hrtime.bigint();
      prev = call;
      prevAt = t1;
      prevElapsed = t1 - t0;
    }
    if (prev !== 0n) engine.report(prev, prevAt, prevElapsed, 'success', 0, '', 0n, 0);
    engine.drainEvents();
    return s;
  },
  cockatiel: async (n) => {
    let s = 0;
    for (let i = 0; i < n; i++) s += await cockatiel.execute(work);
    return s;
  },
};

const results = Object.fromEntries(Object.keys(cases).map((k) => [k, []]));
for (const fn of Object.values(cases)) await fn(20_000); // warm up
for (let r = 0; r < ROUNDS; r++) {
  for (const [name, fn] of Object.entries(cases)) {
    const t0 = performance.now();
    const s = await fn(CALLS);
    const dt = performance.now() - t0;
    if (s !== CALLS) throw new Error(`${name}: wrong sum ${s}`);
    results[name].push((dt * 1e6) / CALLS);
  }
}
const median = (xs) => [...xs].sort((a, b) => a - b)[Math.floor(xs.length / 2)];
const summary = Object.fromEntries(Object.entries(results).map(([k, v]) => [k, median(v)]));
if (args.includes('--json')) {
  console.log(JSON.stringify({ node: process.version, calls: CALLS, rounds: ROUNDS, ns_per_call: summary }));
} else {
  console.log(`node ${process.version}, ${CALLS} calls x ${ROUNDS} rounds, median ns per call`);
  for (const [k, v] of Object.entries(summary)) {
    const over = k === 'bare' ? '' : `  (overhead over bare: ${(v - summary.bare).toFixed(0)} ns)`;
    console.log(`  ${k.padEnd(20)} ${v.toFixed(0).padStart(6)} ns${over}`);
  }
  const ok = summary.levee < summary.cockatiel;
  console.log(ok ? 'levee is below cockatiel' : 'REGRESSION: levee is not below cockatiel');
  if (args.includes('--check') && !ok) process.exit(1);
}

// Cost of one crossing into the component through jco's glue: a regression in jco (an async task per
// call, as from 1.13.1 on) shows here first.
//
//   node bench/crossing.mjs [glue-dir] [--json] [--check]
//
// glue-dir defaults to ../wasm (the pinned jco's output); bench/jco-versions.sh passes others.

import { readFileSync } from 'node:fs';
import { resolve } from 'node:path';
import { pathToFileURL } from 'node:url';
import { performance } from 'node:perf_hooks';

const args = process.argv.slice(2);
const dir = resolve(args.find((a) => !a.startsWith('--')) ?? new URL('../wasm', import.meta.url).pathname);
const { instantiate } = await import(pathToFileURL(resolve(dir, 'levee_policy.js')).href);
const component = instantiate((p) => new WebAssembly.Module(readFileSync(resolve(dir, p))), {});
const { Engine } = component.engineApi;
const engine = Engine.load('policies:\n  p:\n    attempts: 3\n', 1n);

const N = 300_000;
const ROUNDS = 5;
const cases = {
  // A method with primitives and a u64 result (an `invalid` verdict: unknown call).
  'acquire (u64 verdict)': () => {
    let x = 0n;
    for (let i = 0; i < N; i++) x ^= engine.acquire(999_999_999n, 1n);
    return x;
  },
  // The hot path of a call that succeeds first time: start, then the success settled by the next start.
  'start + settled success': () => {
    let x = 0n;
    let prev = 0n;
    let call = 1n;
    const t = 1_000n;
    for (let i = 0; i < N; i++) {
      x ^= engine.start(call, 0, '', 0, t, prev, t, 0n);
      prev = call;
      call++;
    }
    engine.report(prev, t, 0n, 'success', 0, '', 0n, 0);
    engine.drainEvents();
    return x;
  },
  'policy-count (u32)': () => {
    let x = 0;
    for (let i = 0; i < N; i++) x += engine.policyCount();
    return x;
  },
};
const out = {};
for (const [name, fn] of Object.entries(cases)) {
  fn();
  const times = [];
  for (let r = 0; r < ROUNDS; r++) {
    const t0 = performance.now();
    fn();
    times.push(((performance.now() - t0) * 1e6) / N);
  }
  times.sort((a, b) => a - b);
  out[name] = times[Math.floor(ROUNDS / 2)];
}
if (args.includes('--json')) console.log(JSON.stringify({ dir, ns_per_call: out }));
else {
  console.log(`jco glue in ${dir}: median ns per call`);
  for (const [k, v] of Object.entries(out)) console.log(`  ${k.padEnd(26)} ${v.toFixed(0).padStart(6)} ns`);
}
// A crossing above 1 us means the glue makes a task per call again (jco >= 1.13.1): flag it.
const worst = Math.max(...Object.values(out));
if (worst > 1000) {
  console.log(`REGRESSION: a crossing costs ${worst.toFixed(0)} ns (expected well under 1000 ns)`);
  if (args.includes('--check')) process.exit(1);
}

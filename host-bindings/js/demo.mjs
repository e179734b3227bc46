// Run one policy against a URL and print each decision, one line per step.
//   node demo.mjs URL [policy-file] [policy-name]
// Default policy: $LEVEE_DEMO_POLICY, else the repository's examples/demo/policy.yaml (or
// examples/demo.yaml) if present, else a built-in one; default name: `demo`, else the first policy.

import { existsSync, readFileSync } from 'node:fs';
import { LeveeError, REASONS, leveeFetch, load } from './dist/index.js';

const url = process.argv[2];
if (!url) {
  console.error('usage: demo.sh URL [policy.yaml] [policy-name]');
  process.exit(2);
}
const DEFAULT_POLICY = `
policies:
  demo:
    attempts: 4
    attempt-timeout: 2s
    deadline: 15s
    backoff: { kind: exponential, base: 100ms, cap: 2s, jitter: full }
    breaker:
      window: { kind: count, size: 10 }
      minimum-calls: 5
      open-duration: 5s
`;
const shared = ['../../examples/demo/policy.yaml', '../../examples/demo.yaml']
  .map((p) => new URL(p, import.meta.url))
  .find((u) => existsSync(u));
const source = process.argv[3] || process.env.LEVEE_DEMO_POLICY || shared;
const document = source ? readFileSync(source, 'utf8') : DEFAULT_POLICY;
const ms = (ns) => `${(ns / 1e6).toFixed(1)}ms`;
const t0 = performance.now();
const stamp = () => `+${(performance.now() - t0).toFixed(0).padStart(5)}ms`;

function describe(step) {
  const v = step.verdict;
  const reason = (code) => REASONS[code] ?? `reason ${code}`;
  switch (v.kind) {
    case 'attempt':
      return `attempt ${v.detail}${v.payload > 0 ? ` (timeout ${ms(v.payload)})` : ''}`;
    case 'wait':
      return `wait ${ms(v.payload)} (${reason(v.detail)})`;
    case 'retry':
      return `retry after ${ms(v.payload)}`;
    case 'done':
      return 'done';
    case 'fallback':
      return `fallback ${step.fallback} (${reason(v.detail)})`;
    case 'fail':
      return `fail: ${reason(v.detail)}`;
    default:
      return `invalid (code ${v.detail})`;
  }
}

function outcome(o) {
  if (o === undefined) return '';
  switch (o.kind) {
    case 'http-status':
      return `HTTP ${o.status}${o.retryAfter ? ` Retry-After: ${o.retryAfter}` : ''}`;
    case 'error-class':
      return `error ${o.name}`;
    default:
      return o.kind;
  }
}

const levee = await load(document, {
  // One seed for every host (examples/demo/run.sh passes LEVEE_DEMO_SEED): the same jitter.
  seed: BigInt(process.env.LEVEE_DEMO_SEED || '1'),
  meter: null,
  trace: (s) => {
    const what = s.op === 'report' ? `attempt ${s.attempts}: ${outcome(s.outcome)}` : s.op;
    console.log(`${stamp()} js ${what.padEnd(34)} -> ${describe(s)}`);
  },
});
const policyName = process.argv[4] || (levee.policies.some((p) => p.name === 'demo') ? 'demo' : levee.policies[0].name);
console.log(`policy '${policyName}' -> ${url}`);
levee.on('event', (e) => {
  if (e.kind === 'breaker-transition') console.log(`${stamp()} js event breaker ${e.stateFrom} -> ${e.stateTo}`);
});
try {
  const res = await leveeFetch(levee, policyName)(url);
  console.log(`${stamp()} js result HTTP ${res.status}`);
} catch (err) {
  if (err instanceof LeveeError)
    console.log(`${stamp()} js result gave up: ${err.reason} after ${err.attempts} attempts`);
  else console.log(`${stamp()} js result error: ${err}`);
  process.exitCode = 1;
}

// Trap recovery (DESIGN.md, "Failure of the engine itself"): a trap in the component makes the host
// re-instantiate it, restore the last exported state, let the current call run as a single attempt
// without retries, and report the fault as an event. Traps are injected at the core-module boundary
// through jco's instantiateCore hook, exactly where a real trap surfaces.

import assert from 'node:assert/strict';
import { test } from 'node:test';
import { LeveeError, PolicyLoadError, loadSync } from '../dist/index.js';
import { FaultInjector, VirtualClock } from '../dist/testing.js';

const DOC = `
policies:
  guarded:
    attempts: 3
    backoff: { kind: constant, base: 1ms, jitter: none }
    retry-on: ["error:*"]
    breaker:
      window: { kind: count, size: 2 }
      minimum-calls: 2
      failure-rate: 50
      open-duration: 60s
      failure-on: ["error:*"]
  plain:
    attempts: 3
    backoff: { kind: constant, base: 1ms, jitter: none }
    retry-on: ["error:*"]
  tripwire:
    attempts: 1
    breaker:
      window: { kind: count, size: 2 }
      minimum-calls: 2
      failure-rate: 100
      open-duration: 60s
      failure-on: ["error:*"]
`;

/** A jco instantiateCore hook that traps the next `times` calls of core exports whose name has `needle`. */
function injector() {
  const plan = { needle: '', times: 0, instances: 0 };
  const hook = (module, imports) => {
    const instance = new WebAssembly.Instance(module, imports);
    plan.instances++;
    const exports = {};
    for (const [name, value] of Object.entries(instance.exports)) {
      exports[name] =
        typeof value === 'function'
          ? (...args) => {
              if (plan.times > 0 && plan.needle !== '' && name.includes(plan.needle)) {
                plan.times--;
                throw new WebAssembly.RuntimeError('unreachable (injected)');
              }
              return value(...args);
            }
          : value;
    }
    return { exports };
  };
  return { plan, hook };
}

test('a trap at start: fault event, the call runs once without retries, then all is normal', async () => {
  const { plan, hook } = injector();
  const levee = loadSync(DOC, { seed: 3n, instantiateCore: hook });
  const faults = [];
  levee.on('engine-fault', (e) => faults.push(e));
  const before = plan.instances;
  plan.needle = 'engine.start';
  plan.times = 1;
  let calls = 0;
  await assert.rejects(
    levee.run('plain', () => {
      calls++;
      throw new Error('boom');
    }),
    (err) => {
      // The degraded attempt's own error, as the user's code threw it (docs/hosts.md, section 3).
      assert.ok(!(err instanceof LeveeError));
      assert.equal(err.message, 'boom');
      return true;
    },
  );
  assert.equal(calls, 1, 'a single attempt, no retries');
  assert.equal(faults.length, 1);
  assert.equal(faults[0].phase, 'start');
  assert.equal(faults[0].fault, 'trap');
  assert.ok(faults[0].error instanceof WebAssembly.RuntimeError);
  assert.ok(plan.instances > before, 're-instantiated');
  // The next call is driven by the new instance, with retries again.
  let n = 0;
  const value = await levee.run('plain', () => {
    if (++n < 3) throw new Error('again');
    return 'ok';
  });
  assert.equal(value, 'ok');
  assert.equal(n, 3);
});

test('a trap at start when the attempt succeeds: the caller gets the value', async () => {
  const { plan, hook } = injector();
  const levee = loadSync(DOC, { seed: 3n, instantiateCore: hook });
  plan.needle = 'engine.start';
  plan.times = 1;
  assert.equal(await levee.run('plain', () => 42), 42);
});

test('a trap at report: the attempt already made was the single attempt', async () => {
  const { plan, hook } = injector();
  const levee = loadSync(DOC, { seed: 3n, instantiateCore: hook });
  const faults = [];
  levee.on('engine-fault', (e) => faults.push(e));
  plan.needle = 'engine.report';
  plan.times = 1;
  let calls = 0;
  await assert.rejects(
    levee.run('plain', () => {
      calls++;
      throw new Error('first');
    }),
    (err) => !(err instanceof LeveeError) && err.message === 'first',
  );
  assert.equal(calls, 1);
  assert.equal(faults[0].phase, 'report');
});

test('the state exported before the trap comes back: an open breaker stays open', async () => {
  const { plan, hook } = injector();
  const levee = loadSync(DOC, { seed: 3n, instantiateCore: hook });
  const faults = [];
  levee.on('engine-fault', (e) => faults.push(e));
  for (let i = 0; i < 2; i++) {
    await assert.rejects(
      levee.run('guarded', () => {
        throw new Error('down');
      }),
    );
  }
  assert.equal(levee.breakerState('guarded'), 'open');
  plan.needle = 'engine.start';
  plan.times = 1;
  // The faulted call runs as one attempt (the core could not be asked).
  assert.equal(await levee.run('guarded', () => 'probe'), 'probe');
  assert.equal(faults.length, 1);
  assert.equal(faults[0].restored, true);
  assert.equal(levee.breakerState('guarded'), 'open', 'the breaker state survived the trap');
  await assert.rejects(
    levee.run('guarded', () => 'x'),
    (err) => err.reason === 'breaker-open',
  );
});

test('snapshots follow the one rule (docs/hosts.md, section 7): failures since the last one are forgotten, a trip is not', async () => {
  const { plan, hook } = injector();
  const levee = loadSync(DOC, { seed: 3n, instantiateCore: hook, checkpointIntervalMs: 60_000 });
  await assert.rejects(levee.run('tripwire', () => Promise.reject(new Error('down'))));
  assert.equal(levee.breakerState('tripwire'), 'closed');
  plan.needle = 'engine.start';
  plan.times = 1;
  assert.equal(await levee.run('plain', () => 'during the fault'), 'during the fault');
  // No snapshot since load: the restored engine has no failure of 'tripwire'; one more failure
  // does not trip it, two do (and the trip is snapshotted at once).
  await assert.rejects(levee.run('tripwire', () => Promise.reject(new Error('down'))));
  assert.equal(levee.breakerState('tripwire'), 'closed');
  await assert.rejects(levee.run('tripwire', () => Promise.reject(new Error('down'))));
  assert.equal(levee.breakerState('tripwire'), 'open');
  plan.times = 1;
  await levee.run('plain', () => 'another fault');
  assert.equal(levee.breakerState('tripwire'), 'open');
});

test('a component whose memory outgrows the bound is replaced, its state restored', async () => {
  const levee = loadSync(DOC, { seed: 3n, checkpointIntervalMs: 0, maxMemoryBytes: 8 * 1024 * 1024 });
  const faults = [];
  levee.on('engine-fault', (e) => faults.push(e));
  for (let i = 0; i < 2; i++) {
    await assert.rejects(
      levee.run('guarded', () => {
        throw new Error('down');
      }),
    );
  }
  assert.equal(levee.breakerState('guarded'), 'open');
  assert.equal(faults.length, 0);
  // A state whose first value never ends (12 MiB of one string, refused at the end: the document
  // ends early) makes the guest grow its memory past the bound, as the paged import keeps the
  // value's bytes until it is complete; the next checkpoint sees it. (A key that long is refused
  // by the host.)
  const text = '{"format":"' + 'x'.repeat(12 * 1024 * 1024);
  assert.throws(() => levee.importState(new TextEncoder().encode(text)), PolicyLoadError);
  assert.equal(faults.length, 0);
  assert.equal(await levee.run('plain', () => 1), 1);
  assert.equal(faults.length, 1);
  assert.equal(faults[0].phase, 'memory-limit');
  assert.equal(faults[0].restored, true);
  assert.equal(levee.breakerState('guarded'), 'open', 'state came back');
  assert.equal(await levee.run('plain', () => 2), 2);
  assert.equal(faults.length, 1, 'the new instance is within the bound');
});

test('a trap never forgets a trip: keyed and forced breakers stay open with no periodic checkpoint', async () => {
  const { plan, hook } = injector();
  // No periodic checkpoint in this test: only the exports on breaker changes can keep the trips.
  const levee = loadSync(DOC, { seed: 3n, instantiateCore: hook, checkpointIntervalMs: 3_600_000 });
  for (let i = 0; i < 2; i++) {
    await assert.rejects(levee.run('tripwire', () => Promise.reject(new Error('down')), { key: 'db-1' }));
  }
  assert.equal(levee.breakerState('tripwire', 'db-1'), 'open');
  levee.setBreakerState('tripwire', 'forced-open', 'db-2');
  plan.needle = 'engine.start';
  plan.times = 1;
  assert.equal(await levee.run('plain', () => 'during the fault'), 'during the fault');
  for (const key of ['db-1', 'db-2']) {
    let ran = 0;
    await assert.rejects(
      levee.run(
        'tripwire',
        () => {
          ran++;
          return 1;
        },
        { key },
      ),
      (err) => err instanceof LeveeError && err.reason === 'breaker-open',
      `the breaker of ${key} came back closed`,
    );
    assert.equal(ran, 0);
  }
});

test('the bounds fit the largest valid work: 4,096 policies, a 4,000-policy reload, 10,000 keys', async () => {
  const body =
    '    attempts: 1\n    breaker: { window: { kind: count, size: 2 }, minimum-calls: 2, failure-rate: 50, open-duration: 60s }\n';
  const many = (n) => 'policies:\n' + Array.from({ length: n }, (_, i) => `  p${i}:\n${body}`).join('');
  const levee = loadSync(many(4096), { seed: 1n });
  const faults = [];
  levee.on('engine-fault', (e) => faults.push(e));
  assert.equal(levee.policies.length, 4096);
  levee.reload(many(4000));
  assert.equal(levee.policies.length, 4000);
  levee.reload(`policies:\n  p:\n${body}    keys: { max: 1000000 }\n`);
  for (let i = 0; i < 10_000; i++) await levee.run('p', () => 1, { key: `host-${i}` });
  const state = levee.exportState();
  assert.ok(state.length > 1 << 20, `${state.length} bytes`);
  levee.importState(state);
  assert.equal(faults.length, 0);
});

test('a call in flight when another call trapped: the new instance answers invalid, its attempt stands', async () => {
  const faults = new FaultInjector();
  const clock = new VirtualClock();
  const levee = loadSync(DOC, { seed: 3n, clock, instantiateCore: faults.instantiateCore, meter: null });
  const seen = [];
  levee.on('engine-fault', (e) => seen.push([e.fault, e.phase, e.call]));
  // Call 1 is in its first attempt on the first instance when call 2 traps at start.
  faults.inject(2, { op: 'start', nth: 1 });
  const first = levee.run(
    'plain',
    async () => {
      await clock.sleep(50);
      throw new Error('first failed');
    },
    { signal: new AbortController().signal },
  );
  await clock.settle();
  assert.equal(await levee.run('plain', () => 'second, degraded'), 'second, degraded');
  // No retry for call 1: the engine it started on is gone; its own error ends it.
  const ended = assert.rejects(first, (err) => !(err instanceof LeveeError) && err.message === 'first failed');
  await clock.advance(50);
  await ended;
  assert.deepEqual(seen, [
    ['trap', 'start', 2n],
    ['invalid', 'report', 1n],
  ]);
});

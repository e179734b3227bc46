// Keys (issue 41, docs/policy.md "Keys"): the recovery snapshot is `export-snapshot` (only the keys
// holding protection), a key longer than the bound is refused before the core, the new
// `key-overflow` event and the key metrics, and a state of any size comes back after a trap.

import assert from 'node:assert/strict';
import { test } from 'node:test';
import { LeveeError, constants, loadSync } from '../dist/index.js';
import { DurableExecutor } from '../dist/durable.js';
import { RecordingSink } from '../dist/testing.js';

const DOC = `
policies:
  tripwire:
    attempts: 1
    breaker:
      window: { kind: count, size: 2 }
      minimum-calls: 2
      failure-rate: 50
      open-duration: 1h
      failure-on: ["error:*"]
  one:
    attempts: 1
    keys: { max: 1 }
    breaker:
      window: { kind: count, size: 2 }
      minimum-calls: 2
      failure-rate: 50
      open-duration: 1h
      failure-on: ["error:*"]
  many:
    attempts: 1
    keys: { max: 1000000 }
    breaker:
      window: { kind: count, size: 4 }
      minimum-calls: 2
      failure-rate: 50
      open-duration: 1h
      failure-on: ["error:*"]
`;

/**
 * A jco instantiateCore hook that counts the crossings of each engine method (by the core export
 * named after it), and traps the next `trap.times` crossings whose name holds `trap.needle`.
 */
function instrument() {
  const counts = new Map();
  const trap = { needle: '', times: 0 };
  const hook = (module, imports) => {
    const instance = new WebAssembly.Instance(module, imports);
    const exports = {};
    for (const [name, value] of Object.entries(instance.exports)) {
      // Not the post-return functions: identical ones are one function, shared (export-state's is export-snapshot's).
      const at = name.startsWith('cabi_post') ? -1 : name.indexOf('engine.');
      exports[name] =
        typeof value === 'function' && at >= 0
          ? (...args) => {
              const method = name.slice(at + 'engine.'.length);
              counts.set(method, (counts.get(method) ?? 0) + 1);
              if (trap.times > 0 && name.includes(trap.needle)) {
                trap.times--;
                throw new WebAssembly.RuntimeError('unreachable (injected)');
              }
              return value(...args);
            }
          : value;
    }
    return { exports };
  };
  return { counts, trap, hook };
}

const fail = () => {
  throw new Error('down');
};

async function openBreaker(levee, policy, key) {
  for (let i = 0; i < 2; i++) await assert.rejects(levee.run(policy, fail, { key }));
  assert.equal(levee.breakerState(policy, key), 'open');
}

test('the recovery snapshot is export-snapshot; export-state is only what the user asks for', async () => {
  const { counts, trap, hook } = instrument();
  const levee = loadSync(DOC, { seed: 1n, instantiateCore: hook, telemetry: null });
  counts.clear();
  await openBreaker(levee, 'tripwire', 'a'); // a transition: the host snapshots
  // export-snapshot, page by page (export-state-page with its snapshot flag)
  assert.ok((counts.get('export-state-page') ?? 0) >= 1, `crossings: ${[...counts]}`);
  assert.equal(counts.get('export-state') ?? 0, 0, 'no whole export-state on the recovery path');
  // The snapshot brings the open breaker back after a trap.
  trap.needle = 'engine.start';
  trap.times = 1;
  const faults = [];
  levee.on('engine-fault', (e) => faults.push(e));
  assert.equal(await levee.run('tripwire', () => 1, { key: 'b' }), 1);
  assert.equal(faults.length, 1);
  assert.equal(faults[0].restored, true);
  assert.equal(levee.breakerState('tripwire', 'a'), 'open');
  // The user's own export is the whole state, by pages too.
  const before = counts.get('export-state-page') ?? 0;
  const state = levee.exportState();
  assert.ok(state.length > 0);
  assert.ok(counts.get('export-state-page') > before);
  assert.equal(counts.get('export-state') ?? 0, 0);
});

test('a key longer than the bound is refused at every entry, naming its length and the bound', async () => {
  const levee = loadSync(DOC, { seed: 1n, telemetry: null });
  const bound = constants.GUARD_MAX_KEY_BYTES;
  const expect = (bytes) => (err) => {
    assert.ok(err instanceof RangeError, String(err));
    assert.ok(!(err instanceof LeveeError));
    assert.equal(
      err.message,
      `levee: key: ${bytes} bytes, longer than the ${bound} a key may be (docs/policy.md, Keys)`,
    );
    return true;
  };
  let ran = 0;
  const fn = () => ++ran;
  // At the bound: accepted (ASCII, and 2-byte characters counted as UTF-8 bytes).
  assert.equal(await levee.run('tripwire', fn, { key: 'k'.repeat(bound) }), 1);
  assert.equal(await levee.run('tripwire', fn, { key: 'é'.repeat(bound / 2) }), 2);
  assert.equal(levee.breakerState('tripwire', 'k'.repeat(bound)), 'closed');
  // One byte more: refused before the core, the function never runs.
  await assert.rejects(levee.run('tripwire', fn, { key: 'k'.repeat(bound + 6) }), expect(bound + 6));
  // 513 UTF-16 units, 1026 UTF-8 bytes; 257 astral characters, 1028 bytes.
  await assert.rejects(levee.run('tripwire', fn, { key: 'é'.repeat(bound / 2 + 1) }), expect(bound + 2));
  await assert.rejects(levee.run('tripwire', fn, { key: '😀'.repeat(bound / 4 + 1) }), expect(bound + 4));
  assert.equal(ran, 2);
  assert.throws(() => levee.breakerState('tripwire', 'k'.repeat(bound + 1)), expect(bound + 1));
  assert.throws(() => levee.setBreakerState('tripwire', 'forced-open', 'k'.repeat(bound + 1)), expect(bound + 1));
  // The durable executor: refused before the store is touched (this one has none).
  const x = new DurableExecutor(levee, {});
  x.register('job', () => undefined, { policy: 'tripwire' });
  await assert.rejects(x.submit('job', 'payload', { key: 'k'.repeat(bound + 1) }), expect(bound + 1));
});

test('key-evicted and key-overflow: events to listeners and sink, and the key counters', async () => {
  const sink = new RecordingSink();
  const levee = loadSync(DOC, { seed: 1n, telemetry: sink });
  const seen = [];
  levee.on('key-evicted', (e) => seen.push(['key-evicted', e.key, e.name]));
  levee.on('key-overflow', (e) => seen.push(['key-overflow', e.key, e.name]));
  // keys.max 1: "a" at rest is evicted for "b".
  await levee.run('one', () => 1, { key: 'a' });
  await levee.run('one', () => 1, { key: 'b' });
  levee.flush();
  assert.deepEqual(seen, [['key-evicted', 'a', 'a']]);
  // "b" holds protection (its breaker is open): "c" is decided against the overflow entry.
  await openBreaker(levee, 'one', 'b');
  await levee.run('one', () => 1, { key: 'c' });
  levee.flush();
  assert.deepEqual(seen.at(-1), ['key-overflow', 'levee:overflow', 'c']);
  const adds = (name) => sink.entries.filter((e) => e.kind === 'add' && e.name === name);
  assert.deepEqual(
    adds('levee.keys.evicted').map((e) => [e.value, e.attributes]),
    seen.filter((s) => s[0] === 'key-evicted').map(() => [1, { 'levee.policy': 'one' }]),
  );
  assert.deepEqual(
    adds('levee.keys.overflow').map((e) => [e.value, e.attributes]),
    seen.filter((s) => s[0] === 'key-overflow').map(() => [1, { 'levee.policy': 'one' }]),
  );
  // In telemetry, levee.key is the caller's key, as for key-evicted the key evicted (docs/telemetry.md).
  const overflow = sink.entries.filter((e) => e.kind === 'event' && e.name === 'key-overflow');
  assert.ok(overflow.length > 0);
  assert.equal(overflow.at(-1).attributes['levee.key'], 'c');
});

test('a state of any size comes back: 20,000 keys of 1,000 bytes, a trap, the breaker still open', async () => {
  const { trap, hook } = instrument();
  const levee = loadSync(DOC, { seed: 1n, instantiateCore: hook, telemetry: null });
  const N = 20_000;
  for (let i = 0; i < N; i++) await levee.run('many', () => 1, { key: `${i}:`.padEnd(1000, 'x') });
  await openBreaker(levee, 'many', 'open');
  const state = levee.exportState();
  assert.ok(state.length > N * 1000, `${state.length} bytes`);
  // The user's export is the recovery state too; then a trap: a fresh instance takes it back.
  const faults = [];
  levee.on('engine-fault', (e) => faults.push(e));
  trap.needle = 'engine.start';
  trap.times = 1;
  assert.equal(await levee.run('many', () => 2, { key: 'other' }), 2);
  assert.equal(faults.length, 1);
  assert.equal(faults[0].restored, true);
  assert.equal(levee.breakerState('many', 'open'), 'open');
  await assert.rejects(
    levee.run('many', () => 3, { key: 'open' }),
    (err) => err instanceof LeveeError && err.reason === 'breaker-open',
  );
  // And from the periodic snapshot alone (no user export after the breaker opened).
  const fresh = loadSync(DOC, { seed: 1n, instantiateCore: hook, telemetry: null, checkpointIntervalMs: 0 });
  fresh.importState(state);
  await fresh.run('many', () => 1, { key: 'last' }); // a checkpoint on the call path
  trap.times = 1;
  assert.equal(await fresh.run('many', () => 2, { key: 'other' }), 2);
  assert.equal(fresh.breakerState('many', 'open'), 'open');
  assert.equal(fresh.breakerState('many', `7:`.padEnd(1000, 'x')), 'closed');
});

test('state above what import-state takes in one crossing goes out and back in by pages', async () => {
  const { counts, hook } = instrument();
  const levee = loadSync(DOC, { seed: 1n, instantiateCore: hook, telemetry: null });
  const N = 70_000; // about 70 MB, above import-state's 64 MiB
  for (let i = 0; i < N; i++) await levee.run('many', () => 1, { key: `${i}:`.padEnd(1000, 'x') });
  await openBreaker(levee, 'many', 'open');
  counts.clear();
  const state = levee.exportState();
  assert.ok(state.length > 64 * 1024 * 1024, `${state.length} bytes`);
  const pages = counts.get('export-state-page') ?? 0;
  assert.ok(pages >= Math.ceil(state.length / constants.GUARD_STATE_PAGE_BYTES), `${pages} pages`);
  assert.equal(counts.get('export-state') ?? 0, 0);
  const other = loadSync(DOC, { seed: 2n, instantiateCore: hook, telemetry: null });
  other.importState(state);
  assert.equal(other.breakerState('many', 'open'), 'open');
  // An import that stops early is refused and changes nothing.
  assert.throws(() => other.importState(state.subarray(0, 3 * 1024 * 1024)), /ends early/);
  assert.equal(other.breakerState('many', 'open'), 'open');
});

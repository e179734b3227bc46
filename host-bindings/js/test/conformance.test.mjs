// Replays every conformance vector (conformance/vectors/*.json) through the component as this host
// loads it (same jco glue, same core module loading), and compares every verdict and event exactly.

import assert from 'node:assert/strict';
import { readFileSync, readdirSync } from 'node:fs';
import { test } from 'node:test';
import { encodeVerdict, instantiateComponent } from '../dist/index.js';

const VECTORS = new URL('../../../conformance/vectors/', import.meta.url);

/** Vectors this host skips, by name, with the reason. None today. */
const SKIP = {};

const KIND_CODES = { attempt: 0, wait: 1, done: 2, retry: 3, fallback: 4, fail: 5, invalid: 6 };
const UNKNOWN_POLICY = 4294967295;

function expectedVerdict(e) {
  assert.ok(e && typeof e === 'object' && 'kind' in e, `expected verdict object, got ${JSON.stringify(e)}`);
  const v = encodeVerdict(KIND_CODES[e.kind], e.detail, BigInt(e.payload), e.events_pending);
  // The packed integer is exact in JSON only below 2^53: check it there too.
  if (Number.isSafeInteger(e.verdict)) assert.equal(v, BigInt(e.verdict), 'vector decoding disagrees with its verdict');
  return v;
}

function u64(n) {
  return BigInt(n ?? 0);
}

const eventOut = (e) => ({
  at: e.at,
  kind: e.kind,
  policy: e.policy,
  key: e.key,
  call: e.call,
  attempt: e.attempt,
  reason: e.reason,
  duration: e.duration,
  state_from: e.stateFrom,
  state_to: e.stateTo,
  name: e.name,
  value: e.value,
});

const eventExpected = (e) => ({ ...e, at: u64(e.at), call: u64(e.call), duration: u64(e.duration), value: BigInt(e.value) });

function componentError(fn) {
  try {
    fn();
    return { ok: null };
  } catch (err) {
    if (err?.name !== 'ComponentError' && !('payload' in (err ?? {}))) throw err;
    return { err: err.payload };
  }
}

function hex(s) {
  const out = new Uint8Array(s.length / 2);
  for (let i = 0; i < out.length; i++) out[i] = parseInt(s.slice(2 * i, 2 * i + 2), 16);
  return out;
}

function replay(component, vector) {
  const { Engine } = component.engineApi;
  const seed = BigInt(vector.seed);
  if (vector.load_errors !== null && vector.load_errors !== undefined) {
    const r = componentError(() => Engine.load(vector.document, seed));
    assert.deepEqual(r, { err: vector.load_errors }, 'load errors');
    return;
  }
  let engine = Engine.load(vector.document, seed);
  const policy = (name) => (typeof name === 'number' ? name : (engine.policyIndex(name) ?? UNKNOWN_POLICY));
  vector.steps.forEach((s, i) => {
    const where = `step ${i} (${s.op}) of ${vector.name}`;
    let actual;
    let expected = s.expect;
    switch (s.op) {
      case 'start':
        actual = engine.start(
          u64(s.call),
          policy(s.policy),
          s.key ?? '',
          s.flags ?? 0,
          u64(s.now),
          u64(s.settle_call),
          u64(s.settle_at),
          u64(s.settle_elapsed),
        );
        expected = expectedVerdict(s.expect);
        break;
      case 'acquire':
        actual = engine.acquire(u64(s.call), u64(s.now));
        expected = expectedVerdict(s.expect);
        break;
      case 'report':
        actual = engine.report(
          u64(s.call),
          u64(s.now),
          u64(s.elapsed),
          s.kind,
          s.code ?? 0,
          s.text ?? '',
          u64(s.wall_secs),
          s.flags ?? 0,
        );
        expected = expectedVerdict(s.expect);
        break;
      case 'report_fallback':
        actual = engine.reportFallback(u64(s.call), u64(s.now), s.ok);
        expected = expectedVerdict(s.expect);
        break;
      case 'cancel':
        engine.cancel(u64(s.call), u64(s.now));
        return;
      case 'drain_events':
        actual = engine.drainEvents().map(eventOut);
        expected = s.expect.map(eventExpected);
        break;
      case 'breaker_state':
        actual = engine.breakerState(policy(s.policy), s.key ?? '', u64(s.now)) ?? null;
        break;
      case 'set_breaker_state':
        actual = componentError(() => engine.setBreakerState(policy(s.policy), s.key ?? '', s.state, u64(s.now)));
        break;
      case 'call_info': {
        const c = engine.callInfo(u64(s.call));
        actual =
          c === undefined
            ? null
            : {
                policy: c.policy,
                key: c.key,
                attempts: c.attempts,
                deadline: c.deadline,
                last_reason: c.lastReason,
                in_flight: c.inFlight,
              };
        if (expected !== null) expected = { ...expected, deadline: u64(expected.deadline) };
        break;
      }
      case 'policy_info': {
        const p = engine.policyInfo(policy(s.policy));
        actual =
          p === undefined
            ? null
            : {
                name: p.name,
                max_attempts: p.maxAttempts,
                attempt_timeout: p.attemptTimeout,
                deadline: p.deadline,
                fallbacks: p.fallbacks,
              };
        if (expected !== null) {
          expected = { ...expected, attempt_timeout: u64(expected.attempt_timeout), deadline: u64(expected.deadline) };
        }
        break;
      }
      case 'analyze': {
        const a = engine.analyze(policy(s.policy), s.layers);
        actual =
          a === undefined
            ? null
            : {
                worst_attempts: a.worstAttempts,
                worst_latency: a.worstLatency ?? null,
                amplification: a.amplification,
                amplification_with_budget: a.amplificationWithBudget,
              };
        if (expected !== null && expected.worst_latency !== null) {
          expected = { ...expected, worst_latency: u64(expected.worst_latency) };
        }
        break;
      }
      case 'export_import': {
        const state = engine.exportState();
        const fresh = Engine.load(vector.document, seed);
        fresh.importState(state);
        engine = fresh;
        return;
      }
      case 'reload':
        actual = componentError(() => engine.reload(s.document));
        break;
      case 'import_state':
        actual = componentError(() => engine.importState(hex(s.bytes_hex)));
        break;
      default:
        assert.fail(`${where}: unknown op`);
    }
    assert.deepEqual(actual, expected, where);
  });
}

const files = readdirSync(VECTORS)
  .filter((f) => f.endsWith('.json'))
  .sort();

test('the conformance vectors are there', () => {
  assert.ok(files.length > 0, `no vectors in ${VECTORS.pathname}`);
});

const component = instantiateComponent();
for (const file of files) {
  const vector = JSON.parse(readFileSync(new URL(file, VECTORS), 'utf8'));
  const skip = SKIP[vector.name];
  test(`vector ${vector.name}`, skip ? { skip } : {}, () => {
    assert.equal(`${vector.name}.json`, file, 'a vector is named after its file');
    replay(component, vector);
  });
}

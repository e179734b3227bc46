// Replays every conformance vector (conformance/vectors/*.json) through the component as this host
// loads it (same jco glue, same core module loading), and compares every verdict and event exactly.

import assert from 'node:assert/strict';
import { readFileSync, readdirSync } from 'node:fs';
import { test } from 'node:test';
import { REASONS, decodeVerdict, instantiateComponent } from '../dist/index.js';

const VECTORS = new URL('../../../conformance/vectors/', import.meta.url);

/** Vectors this host skips, by name, with the reason. None today. */
const SKIP = {};

const UNKNOWN_POLICY = 4294967295;

/** The JSON form of a verdict, as the Rust runner writes it (`verdict_json`). */
function verdictJson(raw) {
  const d = decodeVerdict(raw);
  const out = { verdict: raw, kind: d.kind, detail: d.detail };
  if (d.kind === 'wait' || d.kind === 'retry' || d.kind === 'fallback' || d.kind === 'fail') {
    out.reason = REASONS[d.detail] ?? '?';
  }
  out.payload = d.payload;
  out.events_pending = d.eventsPending;
  return out;
}

/** The JSON form of a hedged call's answer, as the Rust runner writes it (`hedge_json`). */
function hedgeJson(answer) {
  const commands = answer.commands.map((c) => {
    switch (c.tag) {
      case 'start':
        return { start: { attempt: c.val.attempt, timeout: c.val.timeout } };
      case 'cancel':
        return { cancel: c.val };
      case 'wait':
        return { wait: c.val };
      default:
        return { end: { attempt: c.val.attempt, verdict: verdictJson(c.val.verdict) } };
    }
  });
  return { commands, events_pending: answer.eventsPending };
}

/** The JSON form of an event (`event_json`). */
const eventJson = (e) => ({
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

/**
 * Whether `actual` satisfies `expected`, as the Rust runner decides (`matches_expectation`):
 * objects compare the fields `expected` names, arrays element by element with equal lengths,
 * scalars exactly. u64 values come out of jco as BigInt: compared exactly when the JSON number is
 * exact (below 2^53); a larger JSON number is compared as a double and the verdict's decoded
 * fields, also in the vector, pin it exactly.
 */
function matches(expected, actual) {
  if (typeof actual === 'bigint') {
    if (typeof expected !== 'number') return false;
    return Number.isSafeInteger(expected) ? BigInt(expected) === actual : Number(actual) === expected;
  }
  if (Array.isArray(expected)) {
    return (
      Array.isArray(actual) && expected.length === actual.length && expected.every((e, i) => matches(e, actual[i]))
    );
  }
  if (expected !== null && typeof expected === 'object') {
    if (actual === null || typeof actual !== 'object' || Array.isArray(actual)) return false;
    return Object.entries(expected).every(([k, v]) => k in actual && matches(v, actual[k]));
  }
  return Object.is(expected, actual) || expected === actual;
}

const show = (v) => JSON.stringify(v, (_, x) => (typeof x === 'bigint' ? `${x}n` : x));

/**
 * An s64 or u64 argument as jco takes it (BigInt). A JSON number beyond 2^53 is read as a double:
 * the vectors' large values (wall times near 1.8e18 ns) are multiples of 100 ms, which doubles
 * hold exactly, so `BigInt` of the number is the value the vector means.
 */
function u64(n) {
  return BigInt(n ?? 0);
}

function componentError(fn) {
  try {
    fn();
    return { ok: null };
  } catch (err) {
    if (err?.name !== 'ComponentError' && !('payload' in (err ?? {}))) throw err;
    return { err: err.payload };
  }
}

/** The JSON form of a row to write (`row_json`): `error` null when none. */
const rowJson = (r) => ({
  id: r.id,
  status: r.status,
  next_at: r.nextAt,
  attempts: r.attempts,
  record_hex: Buffer.from(r.bytes).toString('hex'),
  lease: r.lease,
  keep_result: r.keepResult,
  error: r.error ?? null,
});

/** The JSON form of an executor's command (`exec_command_json`). */
function commandJson(c) {
  switch (c.tag) {
    case 'claim':
      return { claim: { limit: c.val.limit, hold: c.val.hold } };
    case 'write':
      return { write: rowJson(c.val) };
    case 'run':
      return { run: { id: c.val.id, attempt: c.val.attempt, timeout: c.val.timeout, renew_every: c.val.renewEvery } };
    case 'abandon':
      return { abandon: c.val };
    case 'quarantine':
      return { quarantine: { id: c.val.id, error: c.val.error } };
    case 'sleep':
      return { sleep: c.val };
    case 'log':
      return { log: { level: c.val.level, id: c.val.id, text: c.val.text } };
    default:
      return c.tag === 'next-due' ? 'next_due' : c.tag;
  }
}

/** The write result of an `exec_written` step: "applied", "lost" or {"failed": error}. */
function writeResult(r) {
  if (r === 'applied' || r === 'lost') return { tag: r };
  return { tag: 'failed', val: String(r?.failed ?? '') };
}

function hex(s) {
  const out = new Uint8Array(s.length / 2);
  for (let i = 0; i < out.length; i++) out[i] = parseInt(s.slice(2 * i, 2 * i + 2), 16);
  return out;
}

function replay(component, vector) {
  const { Engine, Executor } = component.engineApi;
  const seed = BigInt(vector.seed);
  if (vector.load_errors !== null && vector.load_errors !== undefined) {
    const r = componentError(() => Engine.load(vector.document, seed));
    assert.ok('err' in r, 'the document loaded but errors were expected');
    assert.deepEqual(r.err, vector.load_errors, 'load errors');
    return;
  }
  let engine;
  try {
    engine = Engine.load(vector.document, seed);
  } catch (err) {
    assert.fail(`the document did not load: ${show(err.payload ?? err)}`);
  }
  // As the Rust runner: a policy is named by a string (anything else reads as ""), and a name the
  // engine does not know resolves to 4294967295.
  const policy = (name) => engine.policyIndex(typeof name === 'string' ? name : '') ?? UNKNOWN_POLICY;
  // The record of the last durable step that succeeded (steps without `record_hex` use it).
  let record = new Uint8Array(0);
  // The shared bytes of the last fleet_merge that succeeded (steps without `shared_hex` use them).
  let shared = new Uint8Array(0);
  // The trace's executor (an `executor` step makes it).
  let executor;
  const feed = (now, event) => {
    assert.ok(executor !== undefined, 'an exec_* step before any executor step');
    const out = executor.feed(engine, u64(now), event);
    // The record flows: that of the last write an executor step answered.
    for (const c of out) if (c.tag === 'write') record = c.val.bytes;
    return out.map(commandJson);
  };
  vector.steps.forEach((s, i) => {
    let actual = null;
    switch (s.op) {
      case 'start':
        actual = verdictJson(
          engine.start(
            u64(s.call),
            policy(s.policy),
            s.key ?? '',
            s.flags ?? 0,
            u64(s.now),
            u64(s.settle_call),
            u64(s.settle_at),
            u64(s.settle_elapsed),
          ),
        );
        break;
      case 'acquire':
        actual = verdictJson(engine.acquire(u64(s.call), u64(s.now)));
        break;
      case 'report':
        actual = verdictJson(
          engine.report(
            u64(s.call),
            u64(s.now),
            u64(s.elapsed),
            s.kind,
            s.code ?? 0,
            s.text ?? '',
            u64(s.wall_secs),
            s.flags ?? 0,
          ),
        );
        break;
      case 'report_fallback':
        actual = verdictJson(engine.reportFallback(u64(s.call), u64(s.now), s.ok));
        break;
      case 'hedge_step':
        actual = hedgeJson(engine.hedgeStep(u64(s.call), u64(s.now)));
        break;
      case 'report_attempt':
        actual = hedgeJson(
          engine.reportAttempt(
            u64(s.call),
            s.attempt ?? 0,
            u64(s.now),
            u64(s.elapsed),
            s.kind,
            s.code ?? 0,
            s.text ?? '',
            u64(s.wall_secs),
            s.flags ?? 0,
          ),
        );
        break;
      case 'cancel':
        engine.cancel(u64(s.call), u64(s.now));
        break;
      case 'drain_events':
        actual = engine.drainEvents().map(eventJson);
        break;
      case 'take_wakes':
        actual = Array.from(engine.takeWakes(), (c) => Number(c));
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
        break;
      }
      case 'export_import':
      case 'snapshot_import': {
        // snapshot_import: the bytes of export-snapshot (only the keys holding protection).
        const state = s.op === 'snapshot_import' ? engine.exportSnapshot() : engine.exportState();
        const fresh = Engine.load(vector.document, seed);
        fresh.importState(state);
        engine = fresh;
        break;
      }
      case 'reload':
        actual = componentError(() => engine.reload(s.document));
        break;
      case 'import_state':
        actual = componentError(() => engine.importState(hex(s.bytes_hex)));
        break;
      case 'durable_begin':
      case 'durable_step':
      case 'durable_renew':
      case 'durable_outcome':
      case 'durable_cancel':
      case 'durable_revive':
      case 'durable_inspect': {
        const rec = typeof s.record_hex === 'string' ? hex(s.record_hex) : record;
        const call = () => {
          switch (s.op) {
            case 'durable_begin':
              return engine.durableBegin(
                policy(s.policy),
                s.key ?? '',
                s.idempotency_key ?? '',
                s.flags ?? 0,
                u64(s.wall_now),
              );
            case 'durable_step':
              return engine.durableStep(rec, s.owner ?? '', u64(s.wall_now), u64(s.elapsed));
            case 'durable_renew':
              return engine.durableRenew(rec, s.owner ?? '', u64(s.wall_now), u64(s.elapsed));
            case 'durable_outcome':
              return engine.durableOutcome(
                rec,
                s.owner ?? '',
                u64(s.wall_now),
                u64(s.elapsed),
                s.kind,
                s.code ?? 0,
                s.text ?? '',
                s.message ?? '',
                s.flags ?? 0,
              );
            case 'durable_cancel':
              return engine.durableCancel(rec, u64(s.wall_now));
            case 'durable_revive':
              return engine.durableRevive(rec, u64(s.wall_now));
            default:
              return engine.durableInspect(rec);
          }
        };
        let out;
        try {
          out = call();
        } catch (err) {
          if (err?.name !== 'ComponentError' && !('payload' in (err ?? {}))) throw err;
          actual = { err: err.payload };
          break;
        }
        if (typeof out === 'string') {
          actual = { ok: out };
          break;
        }
        record = out.bytes;
        actual = {
          ok: {
            action: out.action,
            attempt: out.attempt,
            wait: out.wait,
            timeout: out.timeout,
            next_at: out.nextAt,
            lease_until: out.leaseUntil,
            reason: out.reason,
            policy_changed: out.policyChanged,
            record_hex: Buffer.from(out.bytes).toString('hex'),
          },
        };
        break;
      }
      case 'fleet_plan':
        actual = engine.fleetPlan(policy(s.policy)) ?? null;
        break;
      case 'fleet_merge':
      case 'fleet_apply':
      case 'fleet_inspect': {
        // The shared bytes flow as the Rust runner's do (levee-resilience/fleet carries them).
        const bytes = typeof s.shared_hex === 'string' ? hex(s.shared_hex) : shared;
        const args = [policy(s.policy), s.key ?? '', s.node ?? '', u64(s.now), u64(s.wall_ms), bytes];
        let out;
        try {
          out =
            s.op === 'fleet_inspect'
              ? engine.fleetInspect(bytes)
              : s.op === 'fleet_apply'
                ? engine.fleetApply(...args)
                : engine.fleetMerge(...args);
        } catch (err) {
          if (err?.name !== 'ComponentError' && !('payload' in (err ?? {}))) throw err;
          actual = { err: err.payload };
          break;
        }
        if (s.op === 'fleet_inspect') actual = { ok: out };
        else if (s.op === 'fleet_apply') actual = { ok: null };
        else {
          shared = out;
          actual = { ok: { hex: Buffer.from(out).toString('hex'), state: JSON.parse(engine.fleetInspect(out)) } };
        }
        break;
      }
      case 'executor': {
        const c = s.config ?? {};
        executor = new Executor({
          owner: c.owner ?? '',
          concurrency: c.concurrency ?? 0,
          poll: u64(c.poll),
          claimHold: u64(c.claim_hold),
          untilIdle: c.until_idle === true,
        });
        for (const name of s.register ?? []) executor.register(name);
        break;
      }
      case 'exec_poll':
        actual = feed(s.now, { tag: 'poll' });
        break;
      case 'exec_claim_failed':
        actual = feed(s.now, { tag: 'claim-failed', val: s.error ?? '' });
        break;
      case 'exec_claimed':
        actual = feed(s.now, {
          tag: 'claimed',
          val: (s.rows ?? []).map((r) => ({
            id: u64(r.id),
            handler: r.handler ?? '',
            bytes: typeof r.record_hex === 'string' ? hex(r.record_hex) : record,
            dbNow: u64(r.db_now),
          })),
        });
        break;
      case 'exec_next_due':
        actual = feed(s.now, {
          tag: 'next-due',
          val: s.due_in === null || s.due_in === undefined ? undefined : u64(s.due_in),
        });
        break;
      case 'exec_written':
        actual = feed(s.now, { tag: 'written', val: { id: u64(s.id), result: writeResult(s.result) } });
        break;
      case 'exec_renew':
        actual = feed(s.now, { tag: 'renew', val: u64(s.id) });
        break;
      case 'exec_finished':
        actual = feed(s.now, {
          tag: 'finished',
          val: {
            id: u64(s.id),
            kind: s.kind,
            code: s.code ?? 0,
            text: s.text ?? '',
            message: s.message ?? '',
            flags: s.flags ?? 0,
          },
        });
        break;
      case 'exec_forget':
        assert.ok(executor !== undefined, 'an exec_* step before any executor step');
        executor.forget(u64(s.id));
        break;
      case 'exec_running':
        assert.ok(executor !== undefined, 'an exec_* step before any executor step');
        actual = executor.running();
        break;
      case 'exec_operator': {
        const rec = typeof s.record_hex === 'string' ? hex(s.record_hex) : record;
        try {
          const row = Executor.operator(engine, u64(s.id), rec, s.revive === true, u64(s.wall_now));
          record = row.bytes;
          actual = { ok: rowJson(row) };
        } catch (err) {
          if (err?.name !== 'ComponentError' && !('payload' in (err ?? {}))) throw err;
          actual = { err: err.payload };
        }
        break;
      }
      default:
        assert.fail(`step ${i}: unknown op ${s.op}`);
    }
    if ('expect' in s) {
      assert.ok(
        matches(s.expect, actual),
        `${vector.name} step ${i} (${s.op}): expected ${show(s.expect)}, got ${show(actual)}`,
      );
    }
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

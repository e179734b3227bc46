// Hedged calls (docs/policy.md, "Hedging"): through `run` and `leveeFetch` on virtual time, the
// hedge driver's checks alone, the recovery path, and a hedged request to a real server on
// 127.0.0.1 whose losing request is aborted.

import assert from 'node:assert/strict';
import { describe, test } from 'node:test';
import { HedgeDriver } from '../dist/hedge.js';
import { GrpcStatusError, LeveeError, encodeVerdict, leveeFetch, loadSync } from '../dist/index.js';
import { FaultInjector, RecordingSink, VirtualClock, metricKey } from '../dist/testing.js';
import { scriptedServer } from './helpers.mjs';

const MS = 1_000_000;

/** A Levee on a VirtualClock (auto) with a RecordingSink. */
function setup(document, options = {}) {
  const clock = new VirtualClock({ auto: true });
  const sink = new RecordingSink();
  const levee = loadSync(document, { clock, telemetry: sink, seed: 7n, ...options });
  return { clock, sink, levee };
}

const ms = (clock) => Number(clock.now()) / MS;

/**
 * A dependency whose attempt `n` answers as `script[n]` says: `{ after, value }`, `{ after, error }`
 * or `{ hang: true }`; it honours its signal (rejects with its reason when aborted) unless
 * `deaf: true`, which finishes `after` whatever happens. `log` records what each attempt saw.
 */
function dependency(clock, script) {
  const log = [];
  const fn = async (ctx) => {
    const step = script[ctx.attempt] ?? script.default;
    const rec = { attempt: ctx.attempt, start: ms(clock) };
    log.push(rec);
    ctx.signal.addEventListener('abort', () => (rec.aborted = ms(clock)), { once: true });
    try {
      if (step.hang) {
        await new Promise((_, reject) => {
          if (ctx.signal.aborted) reject(ctx.signal.reason);
          ctx.signal.addEventListener('abort', () => reject(ctx.signal.reason), { once: true });
        });
      } else {
        await clock.sleep(step.after ?? 0, step.deaf ? undefined : ctx.signal);
      }
    } finally {
      rec.end = ms(clock);
    }
    if (step.error !== undefined) throw step.error();
    return step.value;
  };
  return { fn, log };
}

function metrics(sink) {
  const out = {};
  for (const e of sink.entries) {
    if (e.kind === 'add') {
      const k = metricKey(e.name, e.attributes);
      out[k] = (out[k] ?? 0) + e.value;
    }
  }
  return out;
}
const events = (sink, name) => sink.entries.filter((e) => e.kind === 'event' && e.name === name);

const A6 = `
policies:
  p:
    hedge: { attempts: 4, delay: 500ms, non-fatal: ["grpc:unavailable"] }
`;

describe('hedged calls through run', () => {
  test('the A6 example: #2 at 500 ms, #3 at 700 ms after #1 fails, #2 wins at 900 ms, #3 is aborted, #4 never starts', async () => {
    const { clock, sink, levee } = setup(A6);
    const { fn, log } = dependency(clock, {
      1: { after: 700, error: () => new GrpcStatusError(14) },
      2: { after: 400, value: 'two' },
      3: { after: 1000, value: 'three' },
      4: { value: 'four' },
    });
    const value = await levee.run('p', fn);
    assert.equal(value, 'two');
    assert.equal(ms(clock), 900);
    assert.deepEqual(log, [
      { attempt: 1, start: 0, end: 700 },
      { attempt: 2, start: 500, end: 900 },
      { attempt: 3, start: 700, aborted: 900, end: 900 },
    ]);
    await clock.settle();
    // #3 was reported as it closed: the call left the engine's table.
    assert.equal(levee.callInfo(1n), undefined);
    assert.deepEqual(
      events(sink, 'hedge-started').map((e) => e.attributes['levee.attempt']),
      [2, 3],
    );
    const m = metrics(sink);
    assert.equal(m['levee.hedges{levee.policy=p}'], 2);
    assert.equal(m['levee.calls{levee.policy=p,levee.result=success,levee.retried=true}'], 1);
    assert.equal(m['levee.attempts{levee.outcome=grpc-status,levee.policy=p}'], 1);
    assert.equal(m['levee.attempts{levee.outcome=success,levee.policy=p}'], 1);
  });

  test('trace sees every hedged crossing and the commands it answered', async () => {
    const steps = [];
    const { clock, levee } = setup(A6, { trace: (s) => steps.push(s) });
    const { fn } = dependency(clock, {
      1: { after: 700, error: () => new GrpcStatusError(14) },
      2: { after: 400, value: 'two' },
      3: { hang: true },
    });
    await levee.run('p', fn);
    await clock.settle();
    const tags = (s) => (s.commands ?? []).map((c) => c.tag).join(',');
    assert.deepEqual(
      steps.map((s) => [s.op, s.attempt, tags(s), s.verdict.kind]),
      [
        ['start', undefined, '', 'hedge'],
        ['hedge-step', undefined, 'wait', 'hedge'],
        ['hedge-step', undefined, 'start,wait', 'hedge'],
        ['report-attempt', 1, 'start,wait', 'hedge'],
        ['report-attempt', 2, 'cancel,end', 'done'],
        ['report-attempt', 3, '', 'hedge'],
      ],
    );
  });

  test('a success of the original before the delay sends no hedge', async () => {
    const { clock, sink, levee } = setup(A6);
    const { fn, log } = dependency(clock, { 1: { after: 100, value: 'one' } });
    assert.equal(await levee.run('p', fn), 'one');
    assert.equal(log.length, 1);
    assert.equal(events(sink, 'hedge-started').length, 0);
    await clock.settle();
    assert.equal(clock.pending, 0, 'no timer of the call is left behind');
  });

  test('when every attempt fails the call fails with the last failure (grpc) and is never retried', async () => {
    const { clock, levee } = setup(`policies:\n  p:\n    hedge: { attempts: 3, delay: 100ms }\n`);
    const errors = [];
    const { fn, log } = dependency(clock, {
      default: {
        after: 50,
        error: () => {
          const e = Object.assign(new Error(`refused ${errors.length + 1}`), { code: 'ECONNREFUSED' });
          errors.push(e);
          return e;
        },
      },
    });
    const err = await levee.run('p', fn).catch((e) => e);
    assert.ok(err instanceof LeveeError);
    assert.equal(err.reason, 'retries-exhausted');
    assert.equal(err.attempts, 3);
    assert.equal(err.lastError, errors[2]);
    assert.deepEqual(
      log.map((r) => r.start),
      [0, 50, 100],
    );
  });

  test('the polly preset fails with the primary failure', async () => {
    const { clock, levee } = setup(`policies:\n  p:\n    hedge: { attempts: 3, delay: 50ms, preset: polly }\n`);
    const errors = [];
    const { fn } = dependency(clock, {
      default: {
        after: 10,
        error: () => {
          const e = Object.assign(new Error(`refused ${errors.length + 1}`), { code: 'ECONNREFUSED' });
          errors.push(e);
          return e;
        },
      },
    });
    const err = await levee.run('p', fn).catch((e) => e);
    assert.ok(err instanceof LeveeError);
    assert.equal(err.reason, 'retries-exhausted');
    assert.equal(err.lastError, errors[0], "the primary's failure");
  });

  test('a fatal failure ends the call at once and cancels the hedge in flight', async () => {
    const { clock, levee } = setup(`policies:\n  p:\n    hedge: { attempts: 2, delay: 10ms }\n`);
    class Invalid extends Error {}
    const { fn, log } = dependency(clock, {
      1: { hang: true },
      2: { after: 5, error: () => new Invalid('bad input') },
    });
    const err = await levee.run('p', fn).catch((e) => e);
    assert.ok(err instanceof LeveeError);
    assert.equal(err.reason, 'non-retryable');
    assert.ok(err.lastError instanceof Invalid);
    assert.deepEqual(log[0], { attempt: 1, start: 0, aborted: 15, end: 15 });
  });

  test('a fallback runs after every hedge failed, with the last failure', async () => {
    const { clock, sink, levee } = setup(
      `policies:\n  p:\n    hedge: { attempts: 2, delay: 20ms }\n    fallbacks: [cache]\n`,
    );
    const seen = [];
    const { fn } = dependency(clock, {
      default: { after: 30, error: () => Object.assign(new Error('reset'), { code: 'ECONNRESET' }) },
    });
    const value = await levee.run('p', fn, {
      fallbacks: {
        cache: (ctx) => {
          seen.push({ reason: ctx.reason, attempts: ctx.attempts, error: ctx.lastError?.code });
          return 'cached';
        },
      },
    });
    assert.equal(value, 'cached');
    assert.deepEqual(seen, [{ reason: 'retries-exhausted', attempts: 2, error: 'ECONNRESET' }]);
    assert.equal(metrics(sink)['levee.calls{levee.policy=p,levee.result=fallback,levee.retried=true}'], 1);
  });

  test('the throttled case: once the token budget is at half, a call sends no hedge and fails with reason budget', async () => {
    const { clock, sink, levee } = setup(`
policies:
  p:
    hedge: { attempts: 5, delay: 0 }
    budget: { kind: token, max-tokens: 10, token-ratio: 0.1 }
`);
    const fail = { after: 10, error: () => Object.assign(new Error('refused'), { code: 'ECONNREFUSED' }) };
    const first = dependency(clock, { default: fail });
    const e1 = await levee.run('p', first.fn).catch((e) => e);
    assert.equal(e1.reason, 'retries-exhausted');
    assert.equal(first.log.length, 5, 'delay 0 sends every attempt at once');
    assert.ok(first.log.every((r) => r.start === 0));
    const second = dependency(clock, { default: fail });
    const e2 = await levee.run('p', second.fn).catch((e) => e);
    assert.equal(e2.reason, 'budget');
    assert.equal(second.log.length, 1, 'the budget refused every hedge');
    assert.equal(events(sink, 'budget-refused').length, 1);
  });

  test('a cancelled attempt keeps its bulkhead slot until it has closed', async () => {
    const { clock, levee } = setup(`
policies:
  p:
    bulkhead: { max-concurrent: 2 }
    hedge: { attempts: 2, delay: 0 }
`);
    // Attempt 2 ignores its signal: cancelled at 10 ms, it closes at 50 ms.
    const one = dependency(clock, { 1: { after: 10, value: 'one' }, 2: { after: 50, deaf: true, value: 'late' } });
    const discarded = [];
    assert.equal(await levee.run('p', one.fn, { discard: (v) => discarded.push(v) }), 'one');
    assert.equal(one.log[1].aborted, 10);
    // At 20 ms the cancelled attempt still holds its slot: one attempt of the next call fits, its hedge does not.
    await clock.sleep(10);
    const two = dependency(clock, { default: { after: 5, value: 'two' } });
    assert.equal(await levee.run('p', two.fn), 'two');
    assert.equal(two.log.length, 1);
    // Once it has closed (50 ms) and been reported, both attempts fit again.
    await clock.sleep(40);
    assert.deepEqual(discarded, ['late'], "the late attempt's value is freed, not returned");
    assert.equal(levee.callInfo(1n), undefined);
    const three = dependency(clock, { 1: { after: 5, value: 'three' }, 2: { hang: true } });
    assert.equal(await levee.run('p', three.fn), 'three');
    assert.equal(three.log.length, 2);
  });

  test('the caller cancelling a hedged call aborts every attempt and reports none', async () => {
    const { clock, sink, levee } = setup(A6);
    const { fn, log } = dependency(clock, { default: { hang: true } });
    const controller = new AbortController();
    const reason = new Error('caller gave up');
    void clock.sleep(600).then(() => controller.abort(reason));
    const err = await levee.run('p', fn, { signal: controller.signal }).catch((e) => e);
    assert.equal(err, reason);
    assert.deepEqual(log, [
      { attempt: 1, start: 0, aborted: 600, end: 600 },
      { attempt: 2, start: 500, aborted: 600, end: 600 },
    ]);
    await clock.settle();
    assert.equal(levee.callInfo(1n), undefined);
    const m = metrics(sink);
    assert.equal(m['levee.calls{levee.policy=p,levee.result=cancelled,levee.retried=true}'], 1);
    assert.ok(!Object.keys(m).some((k) => k.startsWith('levee.attempts')), 'no attempt is counted');
    assert.equal(clock.pending, 0);
  });

  test('each attempt runs under the timeout its start gives', async () => {
    const { clock, levee } = setup(`
policies:
  p:
    attempt-timeout: 300ms
    hedge: { attempts: 2, delay: 100ms }
`);
    const { fn, log } = dependency(clock, { 1: { hang: true }, 2: { hang: true } });
    const err = await levee.run('p', fn).catch((e) => e);
    assert.ok(err instanceof LeveeError);
    assert.equal(err.reason, 'retries-exhausted');
    assert.equal(err.lastError.name, 'TimeoutError');
    assert.deepEqual(
      log.map((r) => [r.start, r.end]),
      [
        [0, 300],
        [100, 400],
      ],
    );
  });

  test('a hedge that answers at once ends the call at once, while the original still runs', async () => {
    const { clock, levee } = setup(`policies:\n  p:\n    deadline: 300ms\n    hedge: { attempts: 3, delay: 100ms }\n`);
    const starts = [];
    const value = await levee.run('p', (ctx) => {
      starts.push([ctx.attempt, ms(clock), ctx.timeoutMs]);
      return ctx.attempt === 2 ? 'two' : new Promise(() => undefined);
    });
    assert.equal(value, 'two');
    assert.equal(ms(clock), 100);
    assert.deepEqual(starts, [
      [1, 0, 300],
      [2, 100, 200],
    ]);
  });

  test('under a deadline no attempt runs past it', async () => {
    const { clock, levee } = setup(`policies:\n  p:\n    deadline: 300ms\n    hedge: { attempts: 3, delay: 100ms }\n`);
    const { fn, log } = dependency(clock, { default: { hang: true } });
    const err = await levee.run('p', fn).catch((e) => e);
    assert.ok(err instanceof LeveeError);
    assert.equal(err.attempts, 3);
    assert.equal(err.lastError.name, 'TimeoutError');
    assert.deepEqual(
      log.map((r) => [r.start, r.end]),
      [
        [0, 300],
        [100, 300],
        [200, 300],
      ],
    );
  });

  test("the caller's predicate sees every live attempt; its answer goes to the core", async () => {
    const { clock, levee } = setup(`policies:\n  p:\n    hedge: { attempts: 2, delay: 100ms }\n`);
    const seen = [];
    const { fn } = dependency(clock, { 1: { after: 50, value: 'bad' }, 2: { after: 50, value: 'good' } });
    const value = await levee.run('p', fn, {
      retryIf: (r) => {
        seen.push([r.attempt, r.value, ms(clock)]);
        return r.value === 'bad' ? true : undefined;
      },
    });
    assert.equal(value, 'good');
    // 'bad' counts as a (non-fatal) failure: the hedge goes at once, at 50 ms, not at 100 ms.
    assert.deepEqual(seen, [
      [1, 'bad', 50],
      [2, 'good', 100],
    ]);
  });

  test('an operation that is not idempotent is never hedged', async () => {
    const { clock, sink, levee } = setup(`policies:\n  p:\n    hedge: { attempts: 2, delay: 10ms }\n`);
    const { fn, log } = dependency(clock, { 1: { after: 50, value: 'once' } });
    assert.equal(await levee.run('p', fn, { idempotent: false }), 'once');
    assert.equal(log.length, 1);
    assert.equal(events(sink, 'hedge-started').length, 0);
  });
});

describe('hedged HTTP calls', () => {
  const DOC = `policies:\n  http:\n    hedge: { attempts: 2, delay: 100ms }\n`;

  test('each hedged attempt is its own request; the loser is aborted', async () => {
    const { clock, sink, levee } = setup(DOC);
    const requests = [];
    const fetch = async (request) => {
      const rec = { attempt: request.headers.get('x-levee-attempt'), start: ms(clock) };
      requests.push(rec);
      request.signal.addEventListener('abort', () => (rec.aborted = ms(clock)), { once: true });
      if (rec.attempt === '1') {
        await new Promise((_, reject) =>
          request.signal.addEventListener('abort', () => reject(request.signal.reason), { once: true }),
        );
      }
      await clock.sleep(50, request.signal);
      return new Response('from 2', { status: 200 });
    };
    const response = await leveeFetch(levee, 'http', { fetch })('http://api.test/x');
    assert.equal(response.status, 200);
    assert.equal(await response.text(), 'from 2');
    assert.deepEqual(requests, [
      { attempt: '1', start: 0, aborted: 150 },
      { attempt: '2', start: 100 },
    ]);
    assert.equal(metrics(sink)['levee.hedges{levee.policy=http}'], 1);
  });

  test('a 503 of the original sends the hedge at once; the last response is returned when both fail', async () => {
    const { clock, levee } = setup(DOC);
    const starts = [];
    const fetch = async (request) => {
      starts.push(ms(clock));
      await clock.sleep(30, request.signal);
      return new Response(`503 #${request.headers.get('x-levee-attempt')}`, { status: 503 });
    };
    const response = await leveeFetch(levee, 'http', { fetch })('http://api.test/x');
    assert.equal(response.status, 503);
    assert.equal(await response.text(), '503 #2');
    assert.deepEqual(starts, [0, 30]);
  });

  test("the caller's abort aborts every hedged request and rejects with its reason", async () => {
    const { clock, sink, levee } = setup(DOC);
    const aborted = [];
    const fetch = (request) =>
      new Promise((_, reject) =>
        request.signal.addEventListener(
          'abort',
          () => {
            aborted.push([request.headers.get('x-levee-attempt'), ms(clock)]);
            reject(request.signal.reason);
          },
          { once: true },
        ),
      );
    const controller = new AbortController();
    const reason = new Error('user navigated away');
    void clock.sleep(150).then(() => controller.abort(reason));
    const err = await leveeFetch(levee, 'http', { fetch })('http://api.test/x', { signal: controller.signal }).catch(
      (e) => e,
    );
    assert.equal(err, reason);
    assert.deepEqual(aborted, [
      ['1', 150],
      ['2', 150],
    ]);
    await clock.settle();
    assert.equal(levee.callInfo(1n), undefined);
    assert.equal(metrics(sink)['levee.calls{levee.policy=http,levee.result=cancelled,levee.retried=true}'], 1);
  });

  test('a request whose body is a stream is never hedged', async () => {
    const { clock, sink, levee } = setup(DOC);
    let requests = 0;
    const fetch = async (request) => {
      requests++;
      await request.arrayBuffer();
      await clock.sleep(300, request.signal);
      return new Response(null, { status: 201 });
    };
    const body = new ReadableStream({
      start(s) {
        s.enqueue(new TextEncoder().encode('part'));
        s.close();
      },
    });
    const response = await leveeFetch(levee, 'http', { fetch })('http://api.test/upload', {
      method: 'PUT',
      body,
      duplex: 'half',
    });
    assert.equal(response.status, 201);
    assert.equal(requests, 1);
    assert.equal(events(sink, 'hedge-started').length, 0);
  });

  test('against a real server on 127.0.0.1: the slow request is aborted when the hedge answers', async () => {
    const server = await scriptedServer();
    try {
      server.script('/slow', [
        { status: 200, body: 'slow', delay: 2000 },
        { status: 200, body: 'fast', delay: 0 },
      ]);
      const levee = loadSync(`policies:\n  http:\n    hedge: { attempts: 2, delay: 100ms }\n`, { seed: 1n });
      const t0 = performance.now();
      const response = await leveeFetch(levee, 'http')(server.url('/slow'));
      const took = performance.now() - t0;
      assert.equal(response.status, 200);
      assert.equal(await response.text(), 'fast');
      assert.ok(took < 1500, `the hedge answered first (${took.toFixed(0)} ms)`);
      assert.deepEqual(
        server.requests('/slow').map((r) => r.headers['x-levee-attempt']),
        ['1', '2'],
      );
      // The first request's connection is closed by the abort.
      const [first] = server.requests('/slow');
      for (let i = 0; i < 100 && !first.aborted; i++) await new Promise((r) => setTimeout(r, 10));
      assert.equal(first.aborted, true);
      levee.close();
    } finally {
      await server.close();
    }
  });
});

describe('the recovery path of a hedged call', () => {
  test('a trap at hedge-step: attempt 1 goes on alone, its own result ends the call', async () => {
    const faults = new FaultInjector();
    const { clock, sink, levee } = setup(A6, { instantiateCore: faults.instantiateCore });
    faults.inject(1, { op: 'hedge-step', nth: 1 });
    const { fn, log } = dependency(clock, { 1: { after: 800, value: 'alone' } });
    assert.equal(await levee.run('p', fn), 'alone');
    assert.equal(log.length, 1, 'no hedge without the core');
    const faultsSeen = events(sink, 'engine-fault').map((e) => e.attributes['levee.fault']);
    assert.deepEqual(faultsSeen, ['trap']);
  });

  test("a trap at report-attempt: that attempt's own result ends the call, the others are aborted", async () => {
    const faults = new FaultInjector();
    const { clock, levee } = setup(A6, { instantiateCore: faults.instantiateCore });
    faults.inject(1, { op: 'report-attempt', nth: 1 });
    const boom = new GrpcStatusError(14);
    const { fn, log } = dependency(clock, { 1: { after: 600, error: () => boom }, 2: { hang: true } });
    const err = await levee.run('p', fn).catch((e) => e);
    assert.equal(err, boom, "the attempt's own error, as is");
    assert.equal(log[1].aborted, 600);
  });

  test('commands that break the contract are a contract fault: one attempt goes on alone', async () => {
    const bad = [
      [{ tag: 'start', val: { attempt: 3, timeout: 0n } }],
      [{ tag: 'start', val: { attempt: 12, timeout: 0n } }],
      [{ tag: 'cancel', val: 4 }],
      [{ tag: 'end', val: { attempt: 2, verdict: 2n } }],
      [{ tag: 'end', val: { attempt: 1, verdict: encodeVerdict(0, 1, 0, false) } }],
    ];
    for (const commands of bad) {
      const { clock, sink, levee } = setup(A6);
      const engine = levee.engine;
      engine.hedgeStep = () => ({ commands, eventsPending: false });
      const { fn, log } = dependency(clock, { 1: { after: 50, value: 'one' } });
      assert.equal(
        await levee.run('p', fn),
        'one',
        JSON.stringify(commands, (_, v) => (typeof v === 'bigint' ? String(v) : v)),
      );
      assert.equal(log.length, 1);
      assert.deepEqual(
        events(sink, 'engine-fault').map((e) => e.attributes['levee.fault']),
        ['contract'],
      );
    }
  });

  test('a fault with no attempt in flight that the core let run: one degraded attempt', async () => {
    const { clock, sink, levee } = setup(A6);
    const engine = levee.engine;
    // The core cancels attempt 1 at once, then answers its report with a start out of turn.
    engine.hedgeStep = () => ({
      commands: [
        { tag: 'cancel', val: 1 },
        { tag: 'wait', val: 1000n * BigInt(MS) },
      ],
      eventsPending: false,
    });
    engine.reportAttempt = () => ({
      commands: [{ tag: 'start', val: { attempt: 9, timeout: 0n } }],
      eventsPending: false,
    });
    const { fn, log } = dependency(clock, { 1: { hang: true }, 2: { after: 20, value: 'degraded' } });
    assert.equal(await levee.run('p', fn), 'degraded');
    assert.deepEqual(log, [
      { attempt: 1, start: 0, aborted: 0, end: 0 },
      { attempt: 2, start: 0, end: 20 },
    ]);
    assert.deepEqual(
      events(sink, 'engine-fault').map((e) => e.attributes['levee.fault']),
      ['contract'],
    );
  });

  test('an end with an invalid verdict is the invalid fault; the instance stays', async () => {
    const { clock, sink, levee } = setup(A6);
    const engine = levee.engine;
    engine.hedgeStep = () => ({
      commands: [{ tag: 'end', val: { attempt: 0, verdict: encodeVerdict(6, 1, 0, false) } }],
      eventsPending: false,
    });
    const { fn } = dependency(clock, { 1: { after: 50, value: 'one' } });
    assert.equal(await levee.run('p', fn), 'one');
    assert.deepEqual(
      events(sink, 'engine-fault').map((e) => e.attributes['levee.fault']),
      ['invalid'],
    );
    assert.equal(levee.engine, engine, 'not re-instantiated');
  });
});

describe('the hedge driver alone', () => {
  const answer = (...commands) => ({ commands, eventsPending: false });
  const start = (attempt, timeout = 0n) => ({ tag: 'start', val: { attempt, timeout } });
  const end = (attempt, verdict) => ({ tag: 'end', val: { attempt, verdict } });

  test('a well-formed answer is carried out in order', () => {
    const d = new HedgeDriver(0n);
    const steps = d.check(answer(start(2), { tag: 'wait', val: 500n * BigInt(MS) }), 0n);
    assert.deepEqual(steps, [
      { kind: 'start', attempt: 2, timeoutNs: 0 },
      { kind: 'wait', delayNs: 500 * MS },
    ]);
    for (const s of steps) d.apply(s);
    assert.equal(d.started, 2);
    d.closed(1);
    const next = d.check(answer({ tag: 'cancel', val: 2 }, end(1, 2n)), 0n);
    assert.equal(typeof next, 'object');
  });

  test('every breach of the contract is named', () => {
    const d = new HedgeDriver(1000n * BigInt(MS));
    const cases = [
      [answer(start(1, 1n)), /start of attempt 1/],
      [answer(start(3, 1n)), /start of attempt 3/],
      [answer(start(2, 0n)), /without a timeout under a deadline/],
      [answer(start(2, 2000n * BigInt(MS))), /past the deadline/],
      [answer({ tag: 'cancel', val: 2 }), /never started/],
      [answer({ tag: 'wait', val: 1001n * BigInt(MS) }), /past the deadline/],
      [answer(end(2, 2n)), /never started/],
      [answer(end(1, 2n)), /not been reported/],
      [answer(end(1, encodeVerdict(3, 2, 10, false))), /end verdict of kind 3/],
      [answer(end(1, 2n | 0x40n)), /reserved bits/],
      [answer(end(1, 2n), { tag: 'wait', val: 1n }), /after the end/],
    ];
    for (const [a, re] of cases) {
      const r = d.check(a, 0n);
      assert.equal(
        typeof r,
        'string',
        JSON.stringify(a, (_, v) => (typeof v === 'bigint' ? String(v) : v)),
      );
      assert.match(r, re);
    }
    const past = new HedgeDriver(0n);
    for (let n = 2; n <= 11; n++) past.apply({ kind: 'start', attempt: n, timeoutNs: 0 });
    assert.match(past.check(answer(start(12)), 0n), /of at most 11/);
  });

  test('an answer with nothing to wait for, and one repeated for ever, are faults', () => {
    const d = new HedgeDriver(0n);
    d.closed(1);
    assert.match(d.check(answer(), 0n), /no attempt in flight/);
    const e = new HedgeDriver(0n);
    let r;
    for (let i = 0; i <= 1000 && typeof r !== 'string'; i++) r = e.check(answer({ tag: 'wait', val: 0n }), 5n);
    assert.match(r, /moved nothing/);
  });
});

describe('spans of a hedged call', () => {
  test('one levee.attempt span per hedged attempt, the cancelled one marked, each attempt in its span', async () => {
    const spans = [];
    let active;
    const api = {
      trace: {
        getTracer: () => ({
          startSpan(name, options = {}, context) {
            const span = {
              name,
              parent: context?.span,
              attributes: { ...(options.attributes ?? {}) },
              ended: false,
              setAttribute(k, v) {
                this.attributes[k] = v;
              },
              setStatus() {},
              end() {
                this.ended = true;
              },
            };
            spans.push(span);
            return span;
          },
        }),
        setSpan: (context, span) => ({ parent: context, span }),
      },
      context: {
        active: () => active,
        with(context, fn) {
          const before = active;
          active = context;
          try {
            return fn();
          } finally {
            active = before;
          }
        },
      },
    };
    const { clock, levee } = setup(A6, { spans: api });
    const seen = [];
    const { fn } = dependency(clock, {
      1: { after: 700, error: () => new GrpcStatusError(14) },
      2: { after: 400, value: 'two' },
      3: { hang: true },
    });
    const value = await levee.run('p', (ctx) => {
      seen.push(active?.span?.attributes['levee.attempt']);
      return fn(ctx);
    });
    assert.equal(value, 'two');
    await clock.settle();
    const [call, ...attempts] = spans;
    assert.equal(call.name, 'levee.call');
    assert.equal(call.attributes['levee.result'], 'success');
    assert.deepEqual(
      attempts.map((s) => [s.name, s.parent, s.attributes['levee.attempt'], s.attributes['levee.outcome'], s.ended]),
      [
        ['levee.attempt', call, 1, 'grpc-status', true],
        ['levee.attempt', call, 2, 'success', true],
        ['levee.attempt', call, 3, 'cancelled', true],
      ],
    );
    assert.deepEqual(seen, [1, 2, 3], 'each attempt runs in its own span');
  });
});

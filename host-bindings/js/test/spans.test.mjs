// Spans (docs/telemetry.md): levee.call per call, a levee.attempt child per attempt, with
// http.request.resend_count on the HTTP integration's resends and levee.degraded on the degraded
// attempt; each attempt runs in its span's context.

import assert from 'node:assert/strict';
import { test } from 'node:test';
import * as otel from '@opentelemetry/api';
import { OpenTelemetrySink, leveeFetch, load, loadSync } from '../dist/index.js';
import { FaultInjector, VirtualClock } from '../dist/testing.js';

const DOC = `
policies:
  p:
    attempts: 3
    backoff: { kind: constant, base: 10ms, jitter: none }
    retry-on: ["error:Boom", "http:503"]
`;

/** An OpenTelemetry API stand-in that records spans and the context each runs in. */
function recordingApi() {
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
            status: undefined,
            ended: false,
            setAttribute(k, v) {
              this.attributes[k] = v;
            },
            setStatus(s) {
              this.status = s;
            },
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
  return { api, spans, active: () => active };
}

test('a fetch retried once: one call span, two attempt spans, the resend counted', async () => {
  const { api, spans, active } = recordingApi();
  const clock = new VirtualClock({ auto: true });
  const levee = loadSync(DOC, { seed: 1n, clock, spans: api, meter: null });
  const statuses = [503, 200];
  const seen = [];
  const fetchWithPolicy = leveeFetch(levee, 'p', {
    fetch: async () => {
      seen.push(active()?.span?.name);
      return new Response(null, { status: statuses.shift() });
    },
  });
  assert.equal((await fetchWithPolicy('http://svc.test/x')).status, 200);
  const [call, a1, a2] = spans;
  assert.equal(spans.length, 3);
  assert.equal(call.name, 'levee.call');
  assert.deepEqual(call.attributes, {
    'levee.policy': 'p',
    'levee.key': 'svc.test:80',
    'levee.result': 'success',
  });
  assert.ok(call.ended);
  assert.equal(a1.name, 'levee.attempt');
  assert.equal(a1.parent, call);
  assert.deepEqual(a1.attributes, { 'levee.attempt': 1, 'levee.outcome': 'http-status' });
  assert.deepEqual(a2.attributes, {
    'levee.attempt': 2,
    'http.request.resend_count': 1,
    'levee.outcome': 'http-status',
  });
  assert.ok(a1.ended && a2.ended);
  assert.deepEqual(seen, ['levee.attempt', 'levee.attempt'], 'the attempt runs in its span');
});

test('a failed call has an error status and its reason; the degraded attempt is marked', async () => {
  const { api, spans } = recordingApi();
  const faults = new FaultInjector();
  const levee = loadSync(DOC, { seed: 1n, spans: api, meter: null, instantiateCore: faults.instantiateCore });
  class Fatal extends Error {}
  await assert.rejects(levee.run('p', () => Promise.reject(new Fatal('no'))));
  const call = spans[0];
  assert.equal(call.attributes['levee.result'], 'failure');
  assert.equal(call.attributes['levee.reason'], 'non-retryable');
  assert.equal(call.status.code, 2);
  assert.equal(spans[1].attributes['levee.outcome'], 'error-class');

  faults.inject(2, { op: 'start', nth: 1 });
  assert.equal(await levee.run('p', () => 'degraded but fine'), 'degraded but fine');
  const degraded = spans.filter((s) => s.name === 'levee.attempt').at(-1);
  assert.equal(degraded.attributes['levee.degraded'], true);
  assert.equal(spans.at(-2).attributes['levee.result'], 'success');
});

test('spans: true makes load() use @opentelemetry/api (no-op spans without an SDK)', async () => {
  const levee = await load(DOC, { seed: 1n, spans: true, meter: null });
  assert.equal(await levee.run('p', async () => 7), 7);
  assert.throws(() => loadSync(DOC, { spans: true }), /spans: true needs load/);
  assert.ok(typeof otel.trace.getTracer === 'function');
});

/** The recording API's spans with `addEvent`, and a sink that puts events on the active span. */
function recordingApiWithEvents() {
  const rec = recordingApi();
  const startSpan = rec.api.trace.getTracer().startSpan;
  rec.api.trace.getTracer = () => ({
    startSpan(...args) {
      const span = startSpan(...args);
      span.events = [];
      span.addEvent = (name, attributes) => span.events.push({ name, attributes });
      span.isRecording = () => !span.ended;
      return span;
    },
  });
  return rec;
}

const noMeter = {
  createCounter: () => ({ add() {} }),
  createHistogram: () => ({ record() {} }),
};

test("events land on the call's span, not the caller's (issue 39)", async () => {
  const { api, spans, active } = recordingApiWithEvents();
  const clock = new VirtualClock({ auto: true });
  const sink = new OpenTelemetrySink(noMeter, () => active()?.span);
  const levee = loadSync(DOC, { seed: 1n, clock, spans: api, telemetry: sink });
  // The caller's own span is active around the call.
  const caller = api.trace.getTracer().startSpan('caller');
  let n = 0;
  const value = await api.context.with(api.trace.setSpan(undefined, caller), () =>
    levee.run('p', () => {
      if (++n < 2) throw Object.assign(new Error('once'), { name: 'Boom' });
      return 'ok';
    }),
  );
  assert.equal(value, 'ok');
  const call = spans.find((s) => s.name === 'levee.call');
  assert.deepEqual(
    call.events.map((e) => e.name),
    ['retry-scheduled'],
  );
  assert.equal(call.events[0].attributes['levee.attempt'], 1);
  assert.deepEqual(caller.events, [], "nothing lands on the caller's span");
});

test('a call span ended by a fallback has its reason', async () => {
  const { api, spans } = recordingApi();
  const doc = `
policies:
  f:
    attempts: 1
    retry-on: ["error:*"]
    fallbacks: [cached]
`;
  const levee = loadSync(doc, { seed: 1n, spans: api, meter: null, fallbacks: { cached: () => 'cached' } });
  assert.equal(
    await levee.run('f', () => {
      throw new Error('down');
    }),
    'cached',
  );
  const call = spans.find((s) => s.name === 'levee.call');
  assert.equal(call.attributes['levee.result'], 'fallback');
  assert.equal(call.attributes['levee.reason'], 'retries-exhausted');
});

test("a breaker transition a call's report caused lands on that call's span", async () => {
  const { api, spans, active } = recordingApiWithEvents();
  const clock = new VirtualClock({ auto: true });
  const sink = new OpenTelemetrySink(noMeter, () => active()?.span);
  const doc = `
policies:
  b:
    attempts: 1
    retry-on: ["error:*"]
    breaker: { minimum-calls: 1, failure-rate: 50, open-duration: 10s }
`;
  const levee = loadSync(doc, { seed: 1n, clock, spans: api, telemetry: sink });
  await assert.rejects(levee.run('b', () => Promise.reject(new Error('down'))));
  const call = spans.find((s) => s.name === 'levee.call');
  assert.ok(
    call.events.some((e) => e.name === 'breaker-transition' && e.attributes['levee.breaker.to'] === 'open'),
    JSON.stringify(call.events.map((e) => e.name)),
  );
});

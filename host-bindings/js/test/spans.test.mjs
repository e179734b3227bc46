// Spans (docs/telemetry.md): levee.call per call, a levee.attempt child per attempt, with
// http.request.resend_count on the HTTP integration's resends and levee.degraded on the degraded
// attempt; each attempt runs in its span's context.

import assert from 'node:assert/strict';
import { test } from 'node:test';
import * as otel from '@opentelemetry/api';
import { leveeFetch, load, loadSync } from '../dist/index.js';
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

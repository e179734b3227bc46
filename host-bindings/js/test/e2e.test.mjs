// End to end: the fetch wrapper against a real HTTP server on 127.0.0.1.

import assert from 'node:assert/strict';
import { after, before, describe, test } from 'node:test';
import { HEADER_ATTEMPT, LeveeError, leveeFetch, load } from '../dist/index.js';
import { recordEvents, scriptedServer } from './helpers.mjs';

const POLICIES = `
policies:
  http:
    attempts: 3
    attempt-timeout: 150ms
    deadline: 20s
    backoff: { kind: exponential, base: 10ms, cap: 40ms, jitter: full }
  breaker:
    attempts: 1
    breaker:
      window: { kind: count, size: 2 }
      minimum-calls: 2
      failure-rate: 50
      open-duration: 600ms
      half-open-permits: 1
  with-fallback:
    attempts: 2
    backoff: { kind: constant, base: 5ms, jitter: none }
    fallbacks: [cached]
`;

describe('fetch against a real server', () => {
  let server;
  let levee;
  let events;
  let steps;
  before(async () => {
    server = await scriptedServer();
    steps = [];
    levee = await load(POLICIES, { seed: 7n, meter: null, trace: (s) => steps.push(s) });
    events = recordEvents(levee);
  });
  after(() => server.close());

  const eventsOf = (kind) => events.filter((e) => e.kind === kind);
  const fresh = () => {
    events.length = 0;
    steps.length = 0;
  };

  test('503 then 200: retried, the 200 is returned', async () => {
    fresh();
    server.script('/flaky', [{ status: 503 }, { status: 200, body: 'ok' }]);
    const fetch = leveeFetch(levee, 'http');
    const res = await fetch(server.url('/flaky'));
    assert.equal(res.status, 200);
    assert.equal(await res.text(), 'ok');
    assert.equal(server.requests('/flaky').length, 2);
    const retries = eventsOf('retry-scheduled');
    assert.equal(retries.length, 1);
    assert.equal(retries[0].attempt, 1);
    assert.equal(retries[0].policyName, 'http');
    assert.deepEqual(
      steps.map((s) => `${s.op}:${s.verdict.kind}`),
      ['start:attempt', 'report:retry', 'acquire:attempt', 'report:done'],
    );
  });

  test('every attempt carries x-levee-attempt (the cross-layer rule, docs/envoy.md)', async () => {
    fresh();
    server.script('/marked', [{ status: 503 }, { status: 503 }, { status: 200 }]);
    const fetch = leveeFetch(levee, 'http');
    const headers = new Headers({ accept: 'text/plain' });
    const res = await fetch(server.url('/marked'), { headers });
    assert.equal(res.status, 200);
    assert.deepEqual(
      server.requests('/marked').map((r) => r.headers['x-levee-attempt']),
      ['1', '2', '3'],
    );
    assert.equal(HEADER_ATTEMPT, 'x-levee-attempt');
    assert.equal(headers.has('x-levee-attempt'), false, "the caller's headers are not changed");
  });

  test('429 with Retry-After in seconds: the wait follows the header', async () => {
    fresh();
    server.script('/throttled', [{ status: 429, headers: { 'retry-after': '1' } }, { status: 200 }]);
    const res = await leveeFetch(levee, 'http')(server.url('/throttled'));
    assert.equal(res.status, 200);
    const [first, second] = server.requests('/throttled');
    assert.ok(second.at - first.at >= 950, `second request after ${second.at - first.at} ms`);
    const [retry] = eventsOf('retry-scheduled');
    assert.ok(retry.duration >= 1_000_000_000n, `delay ${retry.duration} ns`);
  });

  test('429 with Retry-After as an HTTP-date', async () => {
    fresh();
    const when = new Date((Math.floor(Date.now() / 1000) + 2) * 1000);
    server.script('/dated', [{ status: 429, headers: { 'retry-after': when.toUTCString() } }, { status: 200 }]);
    const res = await leveeFetch(levee, 'http')(server.url('/dated'));
    assert.equal(res.status, 200);
    const [first, second] = server.requests('/dated');
    assert.ok(second.at - first.at >= 950, `second request after ${second.at - first.at} ms`);
    const [retry] = eventsOf('retry-scheduled');
    assert.ok(retry.duration >= 1_000_000_000n && retry.duration <= 3_000_000_000n, `delay ${retry.duration} ns`);
  });

  test('400 is not retried: returned as is', async () => {
    fresh();
    server.script('/bad', [{ status: 400, body: 'bad request' }]);
    const res = await leveeFetch(levee, 'http')(server.url('/bad'));
    assert.equal(res.status, 400);
    assert.equal(await res.text(), 'bad request');
    assert.equal(server.requests('/bad').length, 1);
    assert.equal(eventsOf('retry-scheduled').length, 0);
    const last = steps.at(-1);
    assert.equal(last.verdict.kind, 'fail');
  });

  test('a 503 marked x-envoy-overloaded is not retried', async () => {
    fresh();
    server.script('/overloaded', [{ status: 503, headers: { 'x-envoy-overloaded': 'true' } }, { status: 200 }]);
    const res = await leveeFetch(levee, 'http')(server.url('/overloaded'));
    assert.equal(res.status, 503);
    assert.equal(server.requests('/overloaded').length, 1);
  });

  test('a POST is not retried without an idempotency key, and is with one', async () => {
    fresh();
    server.script('/post', [{ status: 503 }]);
    const fetch = leveeFetch(levee, 'http');
    const res = await fetch(server.url('/post'), { method: 'POST', body: 'payload' });
    assert.equal(res.status, 503);
    assert.equal(server.requests('/post').length, 1);
    server.script('/post-key', [{ status: 503 }, { status: 201 }]);
    const res2 = await fetch(server.url('/post-key'), {
      method: 'POST',
      body: 'payload',
      headers: { 'idempotency-key': 'abc' },
    });
    assert.equal(res2.status, 201);
    assert.equal(server.requests('/post-key').length, 2);
  });

  test('per-attempt timeout: the slow attempt is aborted through its signal, the next one answers', async () => {
    fresh();
    server.script('/slow', [
      { status: 200, delay: 2000, body: 'late' },
      { status: 200, body: 'fast' },
    ]);
    const res = await leveeFetch(levee, 'http')(server.url('/slow'));
    assert.equal(await res.text(), 'fast');
    const [first, second] = server.requests('/slow');
    assert.ok(second, 'a second request was made');
    assert.ok(second.at - first.at < 1500, 'the first attempt did not run to its end');
    assert.deepEqual(steps[1].outcome, { kind: 'timeout' });
    await new Promise((r) => setTimeout(r, 50));
    assert.equal(first.aborted, true, 'the server saw the first request aborted');
  });

  test('connection refused: retried as connection errors, then a typed error with the last error', async () => {
    fresh();
    const closed = await scriptedServer();
    const url = closed.url('/gone');
    await closed.close();
    await assert.rejects(leveeFetch(levee, 'http')(url), (err) => {
      assert.ok(err instanceof LeveeError);
      assert.equal(err.reason, 'retries-exhausted');
      assert.equal(err.attempts, 3);
      assert.ok(err.lastError instanceof TypeError);
      return true;
    });
    assert.deepEqual(
      steps.filter((s) => s.op === 'report').map((s) => s.outcome.kind),
      ['connection-error', 'connection-error', 'connection-error'],
    );
  });

  test('breaker: trips open, rejects without calling, recovers through half-open', async () => {
    fresh();
    server.script('/down', [{ status: 500 }, { status: 500 }, { status: 200, body: 'back' }]);
    const fetch = leveeFetch(levee, 'breaker');
    assert.equal((await fetch(server.url('/down'))).status, 500);
    assert.equal((await fetch(server.url('/down'))).status, 500);
    assert.equal(levee.breakerState('breaker', server.host), 'open');
    await assert.rejects(fetch(server.url('/down')), (err) => {
      assert.ok(err instanceof LeveeError);
      assert.equal(err.reason, 'breaker-open');
      assert.ok(err.retryAfterMs === undefined || err.retryAfterMs <= 600);
      return true;
    });
    assert.equal(server.requests('/down').length, 2, 'the open breaker kept the call away');
    await new Promise((r) => setTimeout(r, 650));
    assert.equal(levee.breakerState('breaker', server.host), 'half-open');
    const res = await fetch(server.url('/down'));
    assert.equal(await res.text(), 'back');
    assert.equal(levee.breakerState('breaker', server.host), 'closed');
    const transitions = eventsOf('breaker-transition').map((e) => `${e.stateFrom}->${e.stateTo}`);
    assert.deepEqual(transitions, ['closed->open', 'open->half-open', 'half-open->closed']);
    assert.ok(eventsOf('breaker-transition').every((e) => e.key === server.host));
  });

  test('fallback: used when retries run out, and reported', async () => {
    fresh();
    server.script('/unavailable', [{ status: 503 }]);
    let seen;
    const fetch = leveeFetch(levee, 'with-fallback', {
      fallbacks: {
        cached: (ctx) => {
          seen = ctx;
          return new Response('cached copy', { status: 200 });
        },
      },
    });
    const res = await fetch(server.url('/unavailable'));
    assert.equal(await res.text(), 'cached copy');
    assert.equal(server.requests('/unavailable').length, 2);
    assert.equal(seen.name, 'cached');
    assert.equal(seen.reason, 'retries-exhausted');
    assert.equal(seen.lastResult.status, 503);
    const [chosen] = eventsOf('fallback-chosen');
    assert.equal(chosen.name, 'cached');
    assert.equal(chosen.reason, 'retries-exhausted');
    assert.equal(chosen.policyName, 'with-fallback');
  });

  test('a fallback that returns no Response counts as failed', async () => {
    fresh();
    server.script('/unavailable2', [{ status: 503 }]);
    const fetch = leveeFetch(levee, 'with-fallback', { fallbacks: { cached: () => 'not a response' } });
    const res = await fetch(server.url('/unavailable2'));
    assert.equal(res.status, 503, 'the last response is returned when the fallback fails');
    assert.equal(steps.at(-1).op, 'report-fallback');
    assert.equal(steps.at(-1).fallbackOk, false);
    assert.equal(steps.at(-1).verdict.kind, 'fail');
  });

  test('the caller aborts: fetch rejects with the signal reason and the call is cancelled', async () => {
    fresh();
    server.script('/hang', [{ status: 200, delay: 5000 }]);
    const controller = new AbortController();
    const pending = leveeFetch(levee, 'http')(server.url('/hang'), { signal: controller.signal });
    setTimeout(() => controller.abort(new Error('user went away')), 30);
    await assert.rejects(pending, /user went away/);
    assert.equal(server.requests('/hang').length, 1);
  });
});

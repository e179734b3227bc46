// What an HTTP attempt covers (docs/http.md, issue 14): the deadline bounds the body, a
// connection closed mid-body is a connection error of that attempt, a streamed request body is
// replayed (a Request can be cloned).

import assert from 'node:assert/strict';
import { after, before, test } from 'node:test';
import { LeveeError, leveeFetch, loadSync } from '../dist/index.js';
import { scriptedServer } from './helpers.mjs';

const DOC = `
policies:
  deadline:
    attempts: 3
    deadline: 2s
    backoff: { kind: constant, base: 10ms, jitter: none }
  retry:
    attempts: 3
    backoff: { kind: constant, base: 10ms, jitter: none }
`;

let server;
before(async () => {
  server = await scriptedServer();
});
after(() => server.close());

test('the deadline covers the body: a trickling body fails at the deadline, not after it', async () => {
  const levee = loadSync(DOC, { seed: 1n });
  server.script('/trickle', [{ status: 200, body: 'x'.repeat(50), trickle: 200 }]); // 10 s of body
  const f = leveeFetch(levee, 'deadline');
  const t0 = performance.now();
  await assert.rejects(f(server.url('/trickle')), LeveeError);
  const took = performance.now() - t0;
  assert.ok(took < 3000, `failed after ${took} ms under a 2 s deadline`);
});

test('a connection closed mid-body is a connection error of that attempt: retried', async () => {
  const levee = loadSync(DOC, { seed: 1n });
  server.script('/cut', [
    { status: 200, body: 'y'.repeat(1000), cut: true },
    { status: 200, body: 'whole' },
  ]);
  const r = await leveeFetch(levee, 'retry')(server.url('/cut'));
  assert.equal(r.status, 200);
  assert.equal(await r.text(), 'whole');
  assert.equal(server.requests('/cut').length, 2);
});

test('a streamed request body cannot be sent twice: the request is not retried (docs/hosts.md, section 6)', async () => {
  const levee = loadSync(DOC, { seed: 1n });
  server.script('/put', [{ status: 503 }, { status: 200, body: 'done' }]);
  const stream = () =>
    new ReadableStream({
      start(c) {
        c.enqueue(new TextEncoder().encode('part one, '));
        c.enqueue(new TextEncoder().encode('part two'));
        c.close();
      },
    });
  // Even with an Idempotency-Key: the body itself cannot be replayed.
  const r = await leveeFetch(levee, 'retry')(server.url('/put'), {
    method: 'PUT',
    body: stream(),
    duplex: 'half',
    headers: { 'idempotency-key': 'k1' },
  });
  assert.equal(r.status, 503, 'the last response is returned');
  const seen = server.requests('/put');
  assert.equal(seen.length, 1);
  assert.deepEqual(
    seen.map((e) => e.received),
    ['part one, part two'],
  );
  // The same body as bytes is replayable: retried.
  server.script('/put2', [{ status: 503 }, { status: 200, body: 'done' }]);
  const r2 = await leveeFetch(levee, 'retry')(server.url('/put2'), { method: 'PUT', body: 'part one, part two' });
  assert.equal(r2.status, 200);
  assert.deepEqual(
    server.requests('/put2').map((e) => e.received),
    ['part one, part two', 'part one, part two'],
  );
});

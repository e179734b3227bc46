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

test('a streamed request body is replayed on the retry', async () => {
  const levee = loadSync(DOC, { seed: 1n });
  server.script('/put', [{ status: 503 }, { status: 200, body: 'done' }]);
  const body = new ReadableStream({
    start(c) {
      c.enqueue(new TextEncoder().encode('part one, '));
      c.enqueue(new TextEncoder().encode('part two'));
      c.close();
    },
  });
  const r = await leveeFetch(levee, 'retry')(server.url('/put'), { method: 'PUT', body, duplex: 'half' });
  assert.equal(r.status, 200);
  const seen = server.requests('/put');
  assert.equal(seen.length, 2);
  assert.deepEqual(
    seen.map((e) => e.received),
    ['part one, part two', 'part one, part two'],
  );
});

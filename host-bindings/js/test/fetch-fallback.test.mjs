// leveeFetch's fallbacks see the request (issue 39), as Python's see it as `ctx.args[0]`: one
// fetch with a per-URL cache serves every URL.

import assert from 'node:assert/strict';
import { test } from 'node:test';
import { leveeFetch, loadSync } from '../dist/index.js';

const DOC = `
policies:
  http:
    attempts: 1
    fallbacks: [cache]
`;

const down = async () => new Response('down', { status: 503 });

test("a fallback given to leveeFetch gets the call's request", async () => {
  const levee = loadSync(DOC, { seed: 1n, telemetry: null });
  const cache = new Map([
    ['http://127.0.0.1:1/a', 'cached a'],
    ['http://127.0.0.1:1/b', 'cached b'],
  ]);
  const seen = [];
  const fetch = leveeFetch(levee, 'http', {
    fetch: down,
    fallbacks: {
      cache: ({ request }) => {
        seen.push([request.method, request.url, request.headers.get('x-trace')]);
        return new Response(cache.get(request.url));
      },
    },
  });
  assert.equal(await (await fetch('http://127.0.0.1:1/a', { headers: { 'x-trace': '1' } })).text(), 'cached a');
  assert.equal(
    await (await fetch(new Request('http://127.0.0.1:1/b', { method: 'PUT', body: 'x' }))).text(),
    'cached b',
  );
  assert.deepEqual(seen, [
    ['GET', 'http://127.0.0.1:1/a', '1'],
    ['PUT', 'http://127.0.0.1:1/b', null],
  ]);
});

test('a fallback registered on the Levee gets it too; run() passes the request it is given', async () => {
  const levee = loadSync(DOC, { seed: 1n, telemetry: null });
  levee.fallback('cache', ({ request }) => new Response(`cached ${new URL(request.url).pathname}`));
  const fetch = leveeFetch(levee, 'http', { fetch: down });
  assert.equal(await (await fetch('http://127.0.0.1:1/c')).text(), 'cached /c');
  // Outside leveeFetch there is no request unless the caller passes one.
  const seen = [];
  levee.fallback('cache', ({ request }) => seen.push(request) && 'v');
  await levee.run('http', () => Promise.reject(new Error('x')));
  const request = new Request('http://127.0.0.1:1/d');
  await levee.run('http', () => Promise.reject(new Error('x')), { request });
  assert.deepEqual(seen, [undefined, request]);
});

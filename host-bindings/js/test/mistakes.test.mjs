// Mistakes a newcomer makes (issue 14): a file name given as the document, an unknown policy
// name, a fallback named by the policy but never registered.

import assert from 'node:assert/strict';
import { test } from 'node:test';
import {
  LeveeError,
  PolicyLoadError,
  UnknownPolicyError,
  leveeFetch,
  load,
  loadFile,
  loadSync,
} from '../dist/index.js';

const DOC = `
policies:
  upstream:
    attempts: 2
    backoff: { kind: constant, base: 1ms, jitter: none }
    retry-on: ["error:*"]
    fallbacks: [cached, stale]
  db:
    attempts: 1
`;

test('a file name given as the document says so; loadFile reads a file and names a missing one', async () => {
  await assert.rejects(load('polcy.yaml', { meter: null }), (err) => {
    assert.ok(err instanceof PolicyLoadError);
    assert.match(err.message, /the document is the text 'polcy.yaml', which looks like a file name/);
    assert.match(err.message, /loadFile\(path\)/);
    return true;
  });
  await assert.rejects(loadFile('polcy.yaml'), (err) => err.code === 'ENOENT' && /polcy\.yaml/.test(err.message));
});

test('an unknown policy fails when it is named, listing the known ones', async () => {
  const levee = loadSync(DOC, { seed: 1n });
  assert.throws(
    () => levee.policy('upstrem'),
    (err) => {
      assert.ok(err instanceof UnknownPolicyError);
      assert.ok(err instanceof RangeError);
      assert.match(
        err.message,
        /no policy named 'upstrem' \(did you mean 'upstream'\?\); the document's policies: 'upstream', 'db'/,
      );
      assert.deepEqual(err.known, ['upstream', 'db']);
      return true;
    },
  );
  assert.throws(() => leveeFetch(levee, 'upstrem'), UnknownPolicyError);
  await assert.rejects(
    levee.run('upstrem', () => 1),
    UnknownPolicyError,
  );
});

test('a fallback named by the policy but never registered is named in the error; the attempt error stands', async () => {
  const levee = loadSync(DOC, { seed: 1n });
  const down = new Error('connect ECONNREFUSED');
  await assert.rejects(
    levee.run('upstream', () => {
      throw down;
    }),
    (err) => {
      assert.ok(err instanceof LeveeError);
      assert.equal(err.reason, 'fallbacks-failed');
      assert.deepEqual(err.unregistered, ['cached', 'stale']);
      assert.match(err.message, /fallbacks 'cached', 'stale' are named by the policy but not registered/);
      assert.equal(err.lastError, down);
      return true;
    },
  );
  levee.fallback('cached', () => 'from cache');
  assert.equal(
    await levee.run('upstream', () => {
      throw down;
    }),
    'from cache',
  );
});

test('a request that cannot be built (credentials in the URL) is refused as itself, before any call starts', async () => {
  const levee = loadSync(DOC, { seed: 1n, meter: null });
  let attempts = 0;
  const events = [];
  levee.on('event', (e) => events.push(e));
  const fetchWithPolicy = leveeFetch(levee, 'upstream', {
    fetch: async () => {
      attempts++;
      return new Response('never');
    },
  });
  await assert.rejects(fetchWithPolicy('http://user:pw@svc.test/a'), (err) => err instanceof TypeError);
  assert.equal(attempts, 0);
  assert.deepEqual(events, []);
});

test('loadFile refuses a file that is not UTF-8, naming it (issue 39)', async () => {
  const { mkdtempSync, writeFileSync } = await import('node:fs');
  const { tmpdir } = await import('node:os');
  const { join } = await import('node:path');
  const dir = mkdtempSync(join(tmpdir(), 'levee-'));
  const file = join(dir, 'latin1.yaml');
  // A comment written in Latin-1: its \xe9 is no UTF-8 (decoded loosely, it loaded silently).
  writeFileSync(file, Buffer.concat([Buffer.from('policies:\n  p: {} # caf'), Buffer.from([0xe9]), Buffer.from('\n')]));
  await assert.rejects(loadFile(file), (err) => {
    assert.ok(err instanceof PolicyLoadError, `${err}`);
    assert.ok(err.message.includes(file), err.message);
    assert.match(err.message, /not valid UTF-8/);
    assert.match(err.message, /line 2/);
    return true;
  });
  // A UTF-8 file loads, its name or not.
  const good = join(dir, 'utf8.yaml');
  writeFileSync(good, 'policies:\n  p: {} # café\n');
  const levee = await loadFile(good, { meter: null });
  assert.deepEqual(
    levee.policies.map((p) => p.name),
    ['p'],
  );
});

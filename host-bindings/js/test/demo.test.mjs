// demo.sh's program prints one line per step against a real server.

import assert from 'node:assert/strict';
import { execFile } from 'node:child_process';
import { fileURLToPath } from 'node:url';
import { promisify } from 'node:util';
import { test } from 'node:test';
import { scriptedServer } from './helpers.mjs';

const demo = fileURLToPath(new URL('../demo.mjs', import.meta.url));

test('the demo prints each decision: 503, retry, 200, done', async () => {
  const server = await scriptedServer();
  try {
    server.script('/flaky', [{ status: 503 }, { status: 200 }]);
    const { stdout } = await promisify(execFile)(process.execPath, [demo, server.url('/flaky')], { timeout: 30_000 });
    const lines = stdout.trim().split('\n');
    const steps = lines.filter((l) => l.includes(' -> ') && !l.startsWith('policy'));
    assert.match(steps[0], /start .*-> attempt 1/);
    assert.match(steps[1], /attempt 1: HTTP 503 .*-> retry after/);
    assert.match(steps[2], /acquire .*-> attempt 2/);
    assert.match(steps[3], /attempt 2: HTTP 200 .*-> done/);
    assert.match(lines.at(-1), /result HTTP 200/);
    assert.equal(server.requests('/flaky').length, 2);
  } finally {
    await server.close();
  }
});

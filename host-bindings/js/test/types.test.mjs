// The package's types in a user's project with `exactOptionalPropertyTypes` (issue 39):
// test/types/exact-optional.ts, compiled against dist/ with that flag, passes `undefined` to
// every option field of the public API.

import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import { createRequire } from 'node:module';
import { test } from 'node:test';
import { fileURLToPath } from 'node:url';

test('every option field accepts undefined under exactOptionalPropertyTypes', () => {
  const tsc = createRequire(import.meta.url).resolve('typescript/bin/tsc');
  const project = fileURLToPath(new URL('./types/tsconfig.json', import.meta.url));
  const r = spawnSync(process.execPath, [tsc, '-p', project], { encoding: 'utf8' });
  assert.equal(r.status, 0, r.stdout + r.stderr);
});

// The package in a Worker-style runtime: a small worker runs in workerd (the npm `workerd` package)
// on 127.0.0.1, imports the transpiled core module statically, and fetches through the policy from
// a real server (503 then 200). workerd is stopped at the end.

import assert from 'node:assert/strict';
import { spawn } from 'node:child_process';
import { copyFileSync, mkdirSync, mkdtempSync, readdirSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { after, before, test } from 'node:test';
import { freePort, scriptedServer } from './helpers.mjs';

// The package under test: this checkout's, or (release/install-test.sh) one installed from the
// npm tarball into a fresh project, with that project's workerd.
const pkg = process.env.LEVEE_JS_PACKAGE_DIR || fileURLToPath(new URL('..', import.meta.url));
const WORKERD = process.env.LEVEE_WORKERD || join(pkg, 'node_modules/.bin/workerd');

const MAIN = (wasmFiles) => `
${wasmFiles.map((f, i) => `import core${i} from './wasm/${f}';`).join('\n')}
import { load, leveeFetch } from './dist/worker.js';

const modules = { ${wasmFiles.map((f, i) => `'${f}': core${i}`).join(', ')} };
const POLICY = \`
policies:
  http:
    attempts: 3
    attempt-timeout: 2s
    backoff: { kind: constant, base: 10ms, jitter: none }
  hedged:
    hedge: { attempts: 2, delay: 100ms }
\`;
let levee;
const events = [];

export default {
  async fetch(request) {
    const url = new URL(request.url);
    if (url.pathname === '/health') return new Response('ok');
    if (levee === undefined) {
      levee = load(POLICY, { modules });
      levee.on('event', (e) => events.push(e.kind + ':' + e.attempt));
    }
    const upstream = url.searchParams.get('upstream');
    // A caller's signal, as a worker passes its request's: hedged waits follow it.
    const res = await leveeFetch(levee, url.searchParams.get('policy') ?? 'http')(upstream, {
      signal: new AbortController().signal,
    });
    return Response.json({ status: res.status, body: await res.text(), events });
  },
};
`;

let dir;
let child;
let port;
let server;
let output = '';

before(async () => {
  server = await scriptedServer();
  dir = mkdtempSync(join(tmpdir(), 'levee-workerd-'));
  mkdirSync(join(dir, 'dist'));
  mkdirSync(join(dir, 'wasm'));
  const distFiles = readdirSync(join(pkg, 'dist')).filter((f) => f.endsWith('.js'));
  const glueFiles = readdirSync(join(pkg, 'wasm')).filter((f) => f.endsWith('.js'));
  const wasmFiles = readdirSync(join(pkg, 'wasm')).filter((f) => f.endsWith('.wasm'));
  for (const f of distFiles) copyFileSync(join(pkg, 'dist', f), join(dir, 'dist', f));
  for (const f of [...glueFiles, ...wasmFiles]) copyFileSync(join(pkg, 'wasm', f), join(dir, 'wasm', f));
  writeFileSync(join(dir, 'main.js'), MAIN(wasmFiles));
  port = await freePort();
  const modules = [
    `(name = "main.js", esModule = embed "main.js")`,
    // Node-only entry points are left out: the worker entry must not need them.
    ...distFiles
      .filter((f) => f !== 'index.js' && f !== 'platform-node.js')
      .map((f) => `(name = "dist/${f}", esModule = embed "dist/${f}")`),
    ...glueFiles.map((f) => `(name = "wasm/${f}", esModule = embed "wasm/${f}")`),
    ...wasmFiles.map((f) => `(name = "wasm/${f}", wasm = embed "wasm/${f}")`),
  ];
  writeFileSync(
    join(dir, 'config.capnp'),
    `using Workerd = import "/workerd/workerd.capnp";
const config :Workerd.Config = (
  services = [
    (name = "main", worker = .worker),
    (name = "internet", network = (allow = ["public", "private", "local"])),
  ],
  sockets = [ (name = "http", address = "127.0.0.1:${port}", http = (), service = "main") ],
);
const worker :Workerd.Worker = (
  modules = [
    ${modules.join(',\n    ')}
  ],
  compatibilityDate = "2025-01-01",
  compatibilityFlags = ["enable_weak_ref"],
);
`,
  );
  child = spawn(WORKERD, ['serve', join(dir, 'config.capnp')], { stdio: ['ignore', 'pipe', 'pipe'] });
  child.stdout.on('data', (d) => (output += d));
  child.stderr.on('data', (d) => (output += d));
  const deadline = Date.now() + 30_000;
  for (;;) {
    if (child.exitCode !== null) throw new Error(`workerd exited (${child.exitCode}):\n${output}`);
    try {
      const r = await fetch(`http://127.0.0.1:${port}/health`);
      if (r.ok) break;
    } catch {
      // not up yet
    }
    if (Date.now() > deadline) throw new Error(`workerd did not come up:\n${output}`);
    await new Promise((r) => setTimeout(r, 100));
  }
});

after(async () => {
  if (child && child.exitCode === null) {
    const exited = new Promise((r) => child.once('exit', r));
    child.kill('SIGTERM');
    const timer = setTimeout(() => child.kill('SIGKILL'), 3000);
    await exited;
    clearTimeout(timer);
  }
  await server?.close();
  if (dir) rmSync(dir, { recursive: true, force: true });
});

test('a worker in workerd retries a 503 through the policy core', async () => {
  server.script('/flaky', [{ status: 503 }, { status: 200, body: 'from upstream' }]);
  const r = await fetch(`http://127.0.0.1:${port}/?upstream=${encodeURIComponent(server.url('/flaky'))}`);
  const text = await r.text();
  assert.equal(r.status, 200, `${text}\n${output}`);
  const body = JSON.parse(text);
  assert.equal(body.status, 200);
  assert.equal(body.body, 'from upstream');
  assert.deepEqual(body.events, ['retry-scheduled:1']);
  assert.equal(server.requests('/flaky').length, 2);
});

test('a worker in workerd hedges a slow request: the hedge answers, the slow one is aborted', async () => {
  server.script('/slow', [
    { status: 200, body: 'slow', delay: 3000 },
    { status: 200, body: 'fast', delay: 0 },
  ]);
  const t0 = performance.now();
  const r = await fetch(`http://127.0.0.1:${port}/?policy=hedged&upstream=${encodeURIComponent(server.url('/slow'))}`);
  const text = await r.text();
  assert.equal(r.status, 200, `${text}\n${output}`);
  const body = JSON.parse(text);
  assert.equal(body.body, 'fast');
  assert.ok(body.events.includes('hedge-started:2'), text);
  assert.ok(performance.now() - t0 < 2500, 'the hedge answered before the slow request');
  const [slow, fast] = server.requests('/slow');
  assert.equal(slow.headers['x-levee-attempt'], '1');
  assert.equal(fast.headers['x-levee-attempt'], '2');
  for (let i = 0; i < 100 && !slow.aborted; i++) await new Promise((res) => setTimeout(res, 10));
  assert.equal(slow.aborted, true, 'the slow request was aborted');
});

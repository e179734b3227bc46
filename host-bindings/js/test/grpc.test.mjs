// The gRPC interceptor (levee-resilience/grpc) against a real @grpc/grpc-js server of
// grpc/flaky.proto on 127.0.0.1 (test/grpc-server.mjs). Small real times; the assertions are on
// counts and order, and on lower bounds that hold however slow the machine is.

import assert from 'node:assert/strict';
import { execFile } from 'node:child_process';
import { mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { promisify } from 'node:util';
import { after, before, test } from 'node:test';
import grpc from '@grpc/grpc-js';
import { GrpcStatusError, LeveeError, load } from '../dist/index.js';
import { PREVIOUS_ATTEMPTS_HEADER, grpcAuthority, leveeInterceptor } from '../dist/grpc.js';
import { flakyPackage, flakyServer } from './grpc-server.mjs';

const Flaky = flakyPackage().Flaky;
const UNAVAILABLE = grpc.status.UNAVAILABLE;

const DOC = `
policies:
  retry:
    attempts: 3
    backoff: { kind: constant, base: 5ms, jitter: none }
  timeout:
    attempts: 3
    attempt-timeout: 150ms
    backoff: { kind: constant, base: 5ms, jitter: none }
  limited:
    attempts: 1
    rate-limit: { rate: 1, per: 1h }
  breaker:
    attempts: 1
    breaker: { window: { kind: count, size: 2 }, minimum-calls: 2, failure-rate: 50, open-duration: 1h }
  hedged:
    hedge: { attempts: 2, delay: 30ms }
  patient:
    attempts: 20
    backoff: { kind: constant, base: 30ms, jitter: none }
`;

let server;
let other;
let levee;
let plain;
const clients = [];
let scriptSeq = 0;
const script = (name) => `${name}-${++scriptSeq}`;

before(async () => {
  server = await flakyServer();
  other = await flakyServer();
  levee = await load(DOC, { seed: 7, telemetry: null });
  plain = new Flaky(server.address, grpc.credentials.createInsecure());
});

after(async () => {
  for (const c of clients) c.close();
  plain.close();
  levee.close();
  await server.stop();
  await other.stop();
});

/** A client of `address` with Levee's interceptor and grpc-js's own retries off. */
function client(policy, address = server.address, options = {}) {
  const c = new Flaky(address, grpc.credentials.createInsecure(), {
    'grpc.enable_retries': 0,
    interceptors: [leveeInterceptor(levee, policy, { target: address, ...options })],
  });
  clients.push(c);
  return c;
}

const unary = (c, request, options = {}) =>
  new Promise((resolve, reject) => c.Unary(request, options, (err, reply) => (err ? reject(err) : resolve(reply))));

const stats = (name) =>
  new Promise((resolve, reject) => plain.Stats({ script: name }, (err, r) => (err ? reject(err) : resolve(r))));

/** Poll the server's Stats until `check` holds (each poll is a real RPC; bounded). */
async function statsUntil(name, check) {
  let s;
  for (let i = 0; i < 200; i++) {
    s = await stats(name);
    if (check(s)) return s;
    await new Promise((r) => setTimeout(r, 10));
  }
  return s;
}

test('an UNAVAILABLE status is retried, with grpc-previous-rpc-attempts on later attempts', async () => {
  const name = script('unavailable');
  const reply = await unary(client('retry'), {
    script: name,
    steps: [{ code: UNAVAILABLE }, { code: UNAVAILABLE }, { code: 0 }],
  });
  assert.equal(reply.attempt, 3);
  assert.equal(reply.previousAttempts, '2');
  assert.deepEqual(
    server.seen(name).attempts.map((a) => a.previous),
    ['', '1', '2'],
  );
  assert.equal(PREVIOUS_ATTEMPTS_HEADER, 'grpc-previous-rpc-attempts');
  assert.equal((await stats(name)).started, 3);
});

test('INVALID_ARGUMENT is not retried and reaches the caller as it is', async () => {
  const name = script('invalid');
  const err = await unary(client('retry'), {
    script: name,
    steps: [{ code: grpc.status.INVALID_ARGUMENT, message: 'bad' }],
  }).catch((e) => e);
  assert.equal(err.code, grpc.status.INVALID_ARGUMENT);
  assert.equal(err.details, 'bad');
  assert.equal((await stats(name)).started, 1);
});

test('retries run out: the last attempt status, the LeveeError as its cause', async () => {
  const name = script('exhausted');
  const err = await unary(client('retry'), { script: name, steps: [{ code: UNAVAILABLE, message: 'down' }] }).catch(
    (e) => e,
  );
  assert.equal(err.code, UNAVAILABLE);
  assert.equal(err.details, 'down');
  assert.ok(err.cause instanceof LeveeError);
  assert.equal(err.cause.reason, 'retries-exhausted');
  assert.ok(err.cause.lastError instanceof GrpcStatusError);
  assert.equal((await stats(name)).started, 3);
});

test('a pushback delays the next attempt at least that long; a negative one stops retries', async () => {
  const name = script('pushback');
  const reply = await unary(client('retry'), {
    script: name,
    steps: [{ code: UNAVAILABLE, pushback: '120' }, { code: 0 }],
  });
  assert.equal(reply.attempt, 2);
  const [a1, a2] = server.seen(name).attempts;
  assert.ok(a2.at - a1.at >= 119, `second attempt ${a2.at - a1.at} ms after the first`);

  const stop = script('pushback-stop');
  const err = await unary(client('retry'), {
    script: stop,
    steps: [{ code: UNAVAILABLE, pushback: '-1' }, { code: 0 }],
  }).catch((e) => e);
  assert.equal(err.code, UNAVAILABLE);
  assert.equal(err.cause?.reason, 'pushback');
  assert.equal((await stats(stop)).started, 1);
});

test("the policy's rate limit rejects locally with RESOURCE_EXHAUSTED", async () => {
  const c = client('limited');
  const first = script('limited');
  assert.equal((await unary(c, { script: first })).attempt, 1);
  const second = script('limited');
  const err = await unary(c, { script: second }).catch((e) => e);
  assert.equal(err.code, grpc.status.RESOURCE_EXHAUSTED);
  assert.ok(err.cause instanceof LeveeError);
  assert.equal(err.cause.reason, 'rate-limited');
  assert.equal((await stats(second)).started, 0);
});

test('the breaker opens per target: the failing one is refused, the other passes', async () => {
  const failing = client('breaker', server.address);
  const healthy = client('breaker', other.address);
  for (let i = 0; i < 2; i++) {
    const err = await unary(failing, { script: script('breaker'), steps: [{ code: UNAVAILABLE }] }).catch((e) => e);
    assert.equal(err.code, UNAVAILABLE);
    assert.equal((await unary(healthy, { script: script('breaker-ok') })).attempt, 1);
  }
  assert.equal(levee.breakerState('breaker', grpcAuthority(server.address)), 'open');
  assert.equal(levee.breakerState('breaker', other.address), 'closed');
  const refused = script('breaker');
  const err = await unary(failing, { script: refused }).catch((e) => e);
  assert.equal(err.code, UNAVAILABLE);
  assert.equal(err.cause?.reason, 'breaker-open');
  assert.equal((await stats(refused)).started, 0);
  const reply = await unary(healthy, { script: script('breaker-ok') });
  assert.equal(reply.authority, other.address);
});

test('a hedge answers a slow call and the loser is cancelled at the server', async () => {
  const name = script('hedge');
  const reply = await unary(client('hedged'), { script: name, steps: [{ code: 0, delayMs: 2000 }, { code: 0 }] });
  assert.equal(reply.attempt, 2);
  assert.equal(reply.previousAttempts, '1');
  const s = await statsUntil(name, (x) => x.cancelled === 1);
  assert.deepEqual(
    { started: s.started, finished: s.finished, cancelled: s.cancelled },
    { started: 2, finished: 1, cancelled: 1 },
  );
});

test('deadline: each attempt carries the attempt timeout, never more than the caller deadline', async () => {
  const c = client('timeout');
  const reply = await unary(c, { script: script('deadline') });
  assert.ok(reply.deadlineMs > 0 && reply.deadlineMs <= 150, `server saw ${reply.deadlineMs} ms`);
  const short = await unary(c, { script: script('deadline') }, { deadline: Date.now() + 80 });
  assert.ok(short.deadlineMs > 0 && short.deadlineMs <= 80, `server saw ${short.deadlineMs} ms`);
  const none = await unary(client('retry'), { script: script('deadline') });
  assert.equal(none.deadlineMs, -1);
});

test('an attempt past its timeout is a timeout: retried, the server saw it cancelled', async () => {
  const name = script('attempt-timeout');
  const reply = await unary(client('timeout'), { script: name, steps: [{ code: 0, delayMs: 2000 }, { code: 0 }] });
  assert.equal(reply.attempt, 2);
  const s = await statsUntil(name, (x) => x.cancelled === 1);
  assert.equal(s.cancelled, 1);
});

test("the caller's deadline bounds the whole call", async () => {
  const name = script('caller-deadline');
  const err = await unary(
    client('patient'),
    { script: name, steps: [{ code: UNAVAILABLE }] },
    { deadline: Date.now() + 100 },
  ).catch((e) => e);
  assert.equal(err.code, grpc.status.DEADLINE_EXCEEDED);
  const s = await stats(name);
  assert.ok(s.started >= 1 && s.started < 20, `${s.started} attempts`);
});

/** Read a server stream to its end: `{ messages, error }`. */
function readStream(c, request) {
  return new Promise((resolve) => {
    const messages = [];
    const call = c.ServerStream(request);
    call.on('data', (m) => messages.push(m));
    call.on('error', (error) => resolve({ messages, error }));
    call.on('end', () => resolve({ messages, error: undefined }));
  });
}

test('a server stream is retried before its first message and never after it', async () => {
  const name = script('stream');
  const { messages, error } = await readStream(client('retry'), {
    script: name,
    steps: [{ code: UNAVAILABLE }, { code: UNAVAILABLE, messages: 2 }, { code: 0, messages: 5 }],
  });
  assert.deepEqual(
    messages.map((m) => [m.attempt, m.received]),
    [
      [2, 1],
      [2, 2],
    ],
  );
  assert.equal(error?.code, UNAVAILABLE);
  assert.equal((await stats(name)).started, 2);

  const ok = script('stream-ok');
  const whole = await readStream(client('retry'), {
    script: ok,
    steps: [{ code: UNAVAILABLE }, { code: 0, messages: 3 }],
  });
  assert.equal(whole.error, undefined);
  assert.deepEqual(
    whole.messages.map((m) => m.received),
    [1, 2, 3],
  );
  assert.equal(whole.messages[0].previousAttempts, '1');
});

test('a hedged server stream: the first message wins, the other attempt is cancelled', async () => {
  const name = script('stream-hedge');
  const { messages, error } = await readStream(client('hedged'), {
    script: name,
    steps: [
      { code: 0, messages: 2, delayMs: 2000 },
      { code: 0, messages: 3, delayMs: 5 },
    ],
  });
  assert.equal(error, undefined);
  assert.deepEqual(
    messages.map((m) => [m.attempt, m.received]),
    [
      [2, 1],
      [2, 2],
      [2, 3],
    ],
  );
  const s = await statsUntil(name, (x) => x.cancelled === 1);
  assert.equal(s.cancelled, 1);
});

test('a client stream is buffered and sent again by each attempt', async () => {
  const name = script('client-stream');
  const reply = await new Promise((resolve, reject) => {
    const call = client('retry').ClientStream((err, r) => (err ? reject(err) : resolve(r)));
    for (let i = 0; i < 3; i++) call.write({ script: name, steps: [{ code: UNAVAILABLE }, { code: 0 }] });
    call.end();
  });
  assert.equal(reply.attempt, 2);
  assert.equal(reply.received, 3);
});

test('cancellation by the caller ends the call at once, no retry, and the server sees it', async () => {
  const name = script('cancel');
  const c = client('retry');
  const done = new Promise((resolve) => {
    const call = c.Unary({ script: name, steps: [{ code: 0, delayMs: 5000 }] }, (err) => resolve(err));
    statsUntil(name, (s) => s.started === 1).then(() => call.cancel());
  });
  const err = await done;
  assert.equal(err.code, grpc.status.CANCELLED);
  const s = await statsUntil(name, (x) => x.cancelled === 1);
  assert.deepEqual({ started: s.started, cancelled: s.cancelled }, { started: 1, cancelled: 1 });
});

test('a transport failure is the status grpc-js reports, classified by the core', async () => {
  const gone = await flakyServer();
  const address = gone.address;
  await gone.stop();
  const err = await unary(client('retry', address), { script: script('down') }).catch((e) => e);
  assert.equal(err.code, UNAVAILABLE);
  assert.equal(err.cause?.reason, 'retries-exhausted');
  assert.equal(err.cause?.attempts, 3);
});

test('the key: the target authority, a call host, or a function of the call', async () => {
  assert.equal(grpcAuthority('dns:///api.example:443'), 'api.example:443');
  assert.equal(grpcAuthority('ipv4:127.0.0.1:50051'), '127.0.0.1:50051');
  assert.equal(grpcAuthority('127.0.0.1:50051'), '127.0.0.1:50051');
  const keys = [];
  const c = client('breaker', server.address, {
    key: (call) => {
      keys.push(call.method);
      return 'fixed';
    },
  });
  await unary(c, { script: script('key') });
  assert.deepEqual(keys, ['/levee.flaky.v1.Flaky/Unary']);
  assert.equal(levee.breakerState('breaker', 'fixed'), 'closed');
});

test("the README's gRPC example runs as written", async () => {
  const readme = readFileSync(new URL('../README.md', import.meta.url), 'utf8');
  const marker = readme.indexOf('<!-- readme-test: grpc-example.mjs -->');
  assert.ok(marker >= 0, 'the marker of the example');
  const block = /```js\n([\s\S]*?)```/.exec(readme.slice(marker));
  assert.ok(block !== null, 'the fenced block after the marker');
  // Inside the package, so that `levee-resilience` resolves to this package (self-reference).
  const dir = mkdtempSync(fileURLToPath(new URL('../.readme-', import.meta.url)));
  try {
    const file = join(dir, 'grpc-example.mjs');
    writeFileSync(file, block[1]);
    const proto = fileURLToPath(new URL('../../../grpc/flaky.proto', import.meta.url));
    const { stdout } = await promisify(execFile)(process.execPath, [file, server.address, proto]);
    assert.equal(stdout.trim(), 'answered by attempt 3 (previous attempts: 2)');
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
});

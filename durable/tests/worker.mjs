// The JS durable worker of the crash tests (durable/tests/run.sh): worker.py's arguments and log
// lines, on host-bindings/js (built: dist/), so that the harness kills and resumes Python, Go and
// JS workers alike.
//
//   node worker.mjs STORE --owner NAME --log FILE [--submit HANDLER[:KEY[:PAYLOAD]]]... [--die-after-outcome]
//                   [--until-idle] [--scale N] [--concurrency N] [--submit-only]

import { openSync, writeSync } from 'node:fs';
import { fileURLToPath } from 'node:url';
import { dirname, join } from 'node:path';
import { parseArgs } from 'node:util';

const js = join(dirname(fileURLToPath(import.meta.url)), '../../host-bindings/js/dist');
const { loadSync } = await import(join(js, 'index.js'));
const { DurableExecutor, PostgresStore, SQLiteStore } = await import(join(js, 'durable.js'));

// worker.py's DOC: the same policies, so that a record either wrote runs in both.
const DOC = `
policies:
  flaky:
    attempts: 5
    attempt-timeout: 60s
    retry-on: [timeout, connection-error]
    backoff: { kind: constant, base: 3s, cap: 3s, jitter: none }
    durable: { lease: 2s, max-crashes: 3 }
  work:
    attempts: 10
    attempt-timeout: 10s
    backoff: { kind: exponential, base: 100ms, cap: 1s, jitter: full }
    durable: { lease: 2s, max-crashes: 5 }
`;

const [spec, ...rest] = process.argv.slice(2);
const { values: args } = parseArgs({
  args: rest,
  options: {
    owner: { type: 'string' },
    log: { type: 'string' },
    submit: { type: 'string', multiple: true, default: [] },
    'die-after-outcome': { type: 'boolean', default: false },
    'until-idle': { type: 'boolean', default: false },
    scale: { type: 'string', default: '0' },
    concurrency: { type: 'string', default: '16' },
    'submit-only': { type: 'boolean', default: false },
  },
});
const fd = openSync(args.log, 'a');
const log = (...parts) => writeSync(fd, parts.join(' ') + '\n'); // one write per line (O_APPEND)
const now = () => BigInt(Date.now()) * 1_000_000n;
const pid = process.pid;

const [kind, ...tail] = spec.split(':');
const where = tail.join(':');
const store = kind === 'sqlite' ? new SQLiteStore(where) : await PostgresStore.connect(libpq(where));

// `host=... port=... user=... dbname=...` (the harness's libpq string) as pg's config.
function libpq(s) {
  const c = Object.fromEntries(s.trim().split(/\s+/).map((kv) => kv.split('=')));
  return { host: c.host, port: Number(c.port ?? 5432), user: c.user, database: c.dbname, password: c.password };
}

const executor = new DurableExecutor(loadSync(DOC, { meter: null }), store, {
  owner: args.owner,
  pollIntervalMs: 50,
  claimHoldMs: 1000,
  concurrency: Number(args.concurrency),
  onAttemptDone: args['die-after-outcome']
    ? (id, attempt, outcome) => {
        log('outcome', id, attempt, pid, now(), outcome.kind);
        process.kill(pid, 'SIGKILL'); // between the outcome and its write
      }
    : undefined,
});

const coded = (message, code) => Object.assign(new Error(message), { code });
class ValueError extends Error {
  name = 'ValueError';
}
const sleep = (ms, signal) =>
  new Promise((resolve, reject) => {
    const t = setTimeout(resolve, ms);
    signal.addEventListener('abort', () => (clearTimeout(t), reject(signal.reason)), { once: true });
  });

executor.register(
  'flaky',
  async (_payload, ctx) => {
    log('start', ctx.callId, ctx.attempt, pid, now());
    if (ctx.attempt === 1) {
      log('end', ctx.callId, ctx.attempt, pid, now(), 'timeout');
      throw coded('the first attempt always times out', 'UND_ERR_HEADERS_TIMEOUT');
    }
    log('end', ctx.callId, ctx.attempt, pid, now(), 'ok');
    return 'ok';
  },
  { policy: 'flaky' },
);
const slow = async (payload, ctx) => {
  log('start', ctx.callId, ctx.attempt, pid, now());
  await sleep(ctx.attempt === 1 ? Number(Buffer.from(payload).toString() || '0') * 1000 : 50, ctx.signal);
  log('end', ctx.callId, ctx.attempt, pid, now(), 'ok');
  return 'ok';
};
executor.register('slow', slow, { policy: 'flaky' });
executor.register('slow-bare', slow, { policy: 'flaky', idempotent: false });
executor.register(
  'work',
  async (payload, ctx) => {
    log('start', ctx.callId, ctx.attempt, pid, now());
    const n = Number(Buffer.from(payload).toString());
    await sleep(1, ctx.signal);
    if ((n * 7 + ctx.attempt) % 10 === 0) {
      log('end', ctx.callId, ctx.attempt, pid, now(), 'fail');
      throw coded('transient', 'ECONNRESET');
    }
    if (n % 1000 === 999) {
      log('end', ctx.callId, ctx.attempt, pid, now(), 'fatal');
      throw new ValueError(`call ${n} is refused`);
    }
    log('end', ctx.callId, ctx.attempt, pid, now(), 'ok');
    return 'ok';
  },
  { policy: 'work' },
);

for (const s of args.submit) {
  const [handler, key = '', ...payload] = s.split(':');
  const id = await executor.submit(handler, payload.join(':'), key ? { idempotencyKey: key } : {});
  log('submitted', id, handler, key || '-', pid, now());
}
const scale = Number(args.scale);
for (let i = 0; i < scale; i++) await executor.submit('work', String(i), { idempotencyKey: `work-${i}` });
if (scale > 0) log('submitted-scale', scale, pid, now());
log('ready', args.owner, pid, now());
if (!args['submit-only']) {
  const stop = new AbortController();
  process.on('SIGTERM', () => stop.abort());
  await executor.run({ signal: stop.signal, untilIdle: args['until-idle'] });
}
await store.close();

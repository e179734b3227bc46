// The scripted gRPC server of grpc/flaky.proto (docs/grpc.md) in Node: on 127.0.0.1, on a port the
// OS chooses, started and stopped by the tests. Each request carries its script; attempts with the
// same script id share a counter, and `Stats` (or `seen(script)`) tells what the server saw.

import { fileURLToPath } from 'node:url';
import grpc from '@grpc/grpc-js';
import protoLoader from '@grpc/proto-loader';

const PROTO = fileURLToPath(new URL('../../../grpc/flaky.proto', import.meta.url));

/** The `levee.flaky.v1` package: `Flaky` (a client constructor with `.service`). */
export function flakyPackage() {
  const def = protoLoader.loadSync(PROTO, { longs: Number, defaults: true });
  return grpc.loadPackageDefinition(def).levee.flaky.v1;
}

const sleep = (ms, call) =>
  new Promise((resolve) => {
    if (ms <= 0) return resolve(true);
    const timer = setTimeout(() => resolve(true), ms);
    call.once('cancelled', () => {
      clearTimeout(timer);
      resolve(false);
    });
  });

/** Start a server: `{ address, port, seen(script), stop() }`. */
export async function flakyServer() {
  const scripts = new Map();
  const state = (script) => {
    let s = scripts.get(script);
    if (s === undefined) {
      s = { count: 0, started: 0, finished: 0, cancelled: 0, attempts: [] };
      scripts.set(script, s);
    }
    return s;
  };
  // One attempt of `request` arriving on `call`: its step and the reply fields of what it saw.
  const begin = (request, call) => {
    const s = state(request.script);
    const n = ++s.count;
    s.started++;
    const at = performance.now();
    const steps = request.steps.length > 0 ? request.steps : [{ code: 0, delayMs: 0, messages: 0, message: '' }];
    const step = steps[Math.min(n, steps.length) - 1];
    const deadline = call.getDeadline();
    const until = deadline instanceof Date ? deadline.getTime() : deadline;
    const previous = call.metadata.get('grpc-previous-rpc-attempts')[0];
    const reply = {
      attempt: n,
      previousAttempts: previous === undefined ? '' : String(previous),
      deadlineMs: Number.isFinite(until) ? Math.max(0, until - Date.now()) : -1,
      payload: request.payload,
      authority: call.getHost(),
    };
    s.attempts.push({ n, at, previous: reply.previousAttempts, deadlineMs: reply.deadlineMs });
    // Cancelled while the server waited (grpc-js may also say 'cancelled' of a call it answered).
    let done = false;
    call.once('cancelled', () => {
      if (!done) s.cancelled++;
      done = true;
    });
    const status = () => {
      const metadata = new grpc.Metadata();
      if (step.pushback !== undefined && step.pushback !== null) metadata.set('grpc-retry-pushback-ms', step.pushback);
      return { code: step.code, details: step.message || `scripted status ${step.code}`, metadata };
    };
    const finish = () => {
      done = true;
      s.finished++;
    };
    return { step, reply, status, finish };
  };

  const server = new grpc.Server();
  server.addService(flakyPackage().Flaky.service, {
    async Unary(call, callback) {
      const a = begin(call.request, call);
      if (!(await sleep(a.step.delayMs, call))) return;
      a.finish();
      if (a.step.code === 0) callback(null, a.reply);
      else callback(a.status());
    },
    async ServerStream(call) {
      const a = begin(call.request, call);
      for (let i = 0; i < a.step.messages; i++) {
        if (!(await sleep(a.step.delayMs, call))) return;
        call.write({ ...a.reply, received: i + 1 });
      }
      if (a.step.messages === 0 && !(await sleep(a.step.delayMs, call))) return;
      a.finish();
      if (a.step.code === 0) call.end();
      else call.emit('error', a.status());
    },
    ClientStream(call, callback) {
      const requests = [];
      call.on('data', (r) => requests.push(r));
      call.on('end', async () => {
        const a = begin(requests[0] ?? { script: '', steps: [], payload: Buffer.alloc(0) }, call);
        if (!(await sleep(a.step.delayMs, call))) return;
        a.finish();
        if (a.step.code === 0) callback(null, { ...a.reply, received: requests.length });
        else callback(a.status());
      });
    },
    Stats(call, callback) {
      const s = state(call.request.script);
      callback(null, { started: s.started, finished: s.finished, cancelled: s.cancelled });
    },
  });
  const port = await new Promise((resolve, reject) =>
    server.bindAsync('127.0.0.1:0', grpc.ServerCredentials.createInsecure(), (err, p) =>
      err ? reject(err) : resolve(p),
    ),
  );
  return {
    address: `127.0.0.1:${port}`,
    port,
    /** What the server saw of `script`: counts and, per attempt, its arrival time (ms). */
    seen: (script) => state(script),
    stop: () => new Promise((resolve) => server.tryShutdown(() => resolve())),
    kill: () => server.forceShutdown(),
  };
}

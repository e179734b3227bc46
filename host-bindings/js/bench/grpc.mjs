// CPU per unary gRPC call over a local connection (issue 43): no interceptor, Levee's interceptor
// (levee-resilience/grpc, retry; retry + breaker) and grpc-js's built-in retry configured by the
// service config (`grpc.service_config` with a `retryPolicy`). The server (test/grpc-server.mjs,
// grpc/flaky.proto) runs in a child process, so the CPU measured (process.cpuUsage of this
// process / calls) is the client's alone. Every call succeeds first time. One run, the cases in
// alternating rounds, the median round reported.
//
//   node bench/grpc.mjs [--calls N] [--rounds R] [--concurrency C] [--json]

import { fork } from 'node:child_process';
import { fileURLToPath } from 'node:url';
import grpc from '@grpc/grpc-js';
import { load } from '../dist/index.js';
import { leveeInterceptor } from '../dist/grpc.js';
import { flakyPackage, flakyServer } from '../test/grpc-server.mjs';

if (process.argv[2] === '--serve') {
  const server = await flakyServer();
  process.send({ address: server.address });
  process.on('message', async () => {
    await server.stop();
    process.exit(0);
  });
} else {
  const args = process.argv.slice(2);
  const arg = (name, dflt) => {
    const i = args.indexOf(name);
    return i >= 0 ? Number(args[i + 1]) : dflt;
  };
  const CALLS = arg('--calls', 4000);
  const ROUNDS = arg('--rounds', 7);
  const CONCURRENCY = arg('--concurrency', 8);

  const child = fork(fileURLToPath(import.meta.url), ['--serve']);
  const { address } = await new Promise((resolve) => child.once('message', resolve));

  const levee = await load(
    `
policies:
  retry:
    attempts: 3
    backoff: { kind: exponential, base: 100ms, cap: 1s, jitter: full }
  breaker:
    attempts: 3
    backoff: { kind: exponential, base: 100ms, cap: 1s, jitter: full }
    breaker: { failure-rate: 50, minimum-calls: 20 }
`,
    { seed: 1n, meter: null },
  );

  const Flaky = flakyPackage().Flaky;
  const insecure = grpc.credentials.createInsecure();
  const serviceConfig = {
    methodConfig: [
      {
        name: [{ service: 'levee.flaky.v1.Flaky' }],
        retryPolicy: {
          maxAttempts: 3,
          initialBackoff: '0.1s',
          maxBackoff: '1s',
          backoffMultiplier: 2,
          retryableStatusCodes: ['UNAVAILABLE'],
        },
      },
    ],
  };
  // Each client on its own channel (no shared subchannel pool), so each case has its connection.
  const own = { 'grpc.use_local_subchannel_pool': 1 };
  const clients = {
    none: new Flaky(address, insecure, { ...own, 'grpc.enable_retries': 0 }),
    levee: new Flaky(address, insecure, {
      ...own,
      'grpc.enable_retries': 0,
      interceptors: [leveeInterceptor(levee, 'retry', { target: address })],
    }),
    // grpc-js's interceptor machinery alone: an interceptor that passes every call through.
    'pass-through interceptor': new Flaky(address, insecure, {
      ...own,
      'grpc.enable_retries': 0,
      interceptors: [(options, nextCall) => new grpc.InterceptingCall(nextCall(options))],
    }),
    'levee+breaker': new Flaky(address, insecure, {
      ...own,
      'grpc.enable_retries': 0,
      interceptors: [leveeInterceptor(levee, 'breaker', { target: address })],
    }),
    'grpc-retry': new Flaky(address, insecure, {
      ...own,
      'grpc.enable_retries': 1,
      'grpc.service_config': JSON.stringify(serviceConfig),
    }),
  };

  const request = { script: 'bench', steps: [{ code: 0 }] };
  const call = (c) =>
    new Promise((resolve, reject) => c.Unary(request, (err, reply) => (err ? reject(err) : resolve(reply))));
  async function round(c, n) {
    let next = 0;
    const worker = async () => {
      while (next < n) {
        next++;
        await call(c);
      }
    };
    const cpu0 = process.cpuUsage();
    const t0 = performance.now();
    await Promise.all(Array.from({ length: CONCURRENCY }, worker));
    const wall = performance.now() - t0;
    const cpu = process.cpuUsage(cpu0);
    return { cpuUs: (cpu.user + cpu.system) / n, wallUs: (wall * 1000) / n };
  }

  // Warm up each case (connection, JIT).
  for (const c of Object.values(clients)) await round(c, Math.min(CALLS, 1000));
  const results = Object.fromEntries(Object.keys(clients).map((k) => [k, []]));
  // Each round starts with the next case, so no case always runs first or after the same one.
  const names = Object.keys(clients);
  for (let r = 0; r < ROUNDS; r++) {
    for (let i = 0; i < names.length; i++) {
      const name = names[(r + i) % names.length];
      results[name].push(await round(clients[name], CALLS));
    }
  }
  const median = (xs) => [...xs].sort((a, b) => a - b)[xs.length >> 1];
  const rows = Object.entries(results).map(([name, rs]) => ({
    name,
    cpuUs: median(rs.map((x) => x.cpuUs)),
    wallUs: median(rs.map((x) => x.wallUs)),
  }));
  const base = rows[0].cpuUs;
  if (args.includes('--json')) {
    console.log(JSON.stringify({ calls: CALLS, rounds: ROUNDS, concurrency: CONCURRENCY, rows }));
  } else {
    console.log(`${CALLS} calls x ${ROUNDS} rounds, ${CONCURRENCY} in flight, median round (node ${process.version})`);
    console.log('| client | CPU per call | vs none | wall per call |');
    console.log('|---|---:|---:|---:|');
    for (const r of rows) {
      console.log(
        `| ${r.name} | ${r.cpuUs.toFixed(1)} us | ${(r.cpuUs / base).toFixed(2)}x | ${r.wallUs.toFixed(1)} us |`,
      );
    }
  }

  // The interceptors' own CPU, without grpc-js's channel or the network: a call below the
  // interceptor that answers OK on the next microtask (what is left is the interceptor's work).
  const def = { path: '/levee.flaky.v1.Flaky/Unary', requestStream: false, responseStream: false };
  const below = () => {
    let listener;
    return {
      start: (_md, l) => (listener = l),
      sendMessageWithContext: () => undefined,
      sendMessage: () => undefined,
      startRead: () => undefined,
      halfClose: () =>
        queueMicrotask(() => {
          listener.onReceiveMetadata(new grpc.Metadata());
          listener.onReceiveMessage({});
          listener.onReceiveStatus({ code: 0, details: '', metadata: new grpc.Metadata() });
        }),
      cancelWithStatus: () => undefined,
      getPeer: () => 'stub',
      getAuthContext: () => null,
    };
  };
  const bare = {
    'pass-through interceptor': (options, nextCall) => new grpc.InterceptingCall(nextCall(options)),
    levee: leveeInterceptor(levee, 'retry', { target: address }),
    'levee+breaker': leveeInterceptor(levee, 'breaker', { target: address }),
  };
  const once = (interceptor) =>
    new Promise((resolve) => {
      const call = interceptor({ method_definition: def }, below);
      call.start(new grpc.Metadata(), { onReceiveStatus: resolve });
      call.sendMessage(request);
      call.halfClose();
    });
  const bareResults = Object.fromEntries(Object.keys(bare).map((k) => [k, []]));
  const bareNames = Object.keys(bare);
  const BARE_CALLS = CALLS * 5;
  for (const i of Object.values(bare)) for (let j = 0; j < BARE_CALLS; j++) await once(i);
  for (let r = 0; r < ROUNDS; r++) {
    for (let k = 0; k < bareNames.length; k++) {
      const name = bareNames[(r + k) % bareNames.length];
      const cpu0 = process.cpuUsage();
      for (let j = 0; j < BARE_CALLS; j++) await once(bare[name]);
      const cpu = process.cpuUsage(cpu0);
      bareResults[name].push((cpu.user + cpu.system) / BARE_CALLS);
    }
  }
  const bareRows = Object.entries(bareResults).map(([name, rs]) => ({ name, cpuUs: median(rs) }));
  if (args.includes('--json')) {
    console.log(JSON.stringify({ interceptorOnly: bareRows }));
  } else {
    console.log(
      `\nthe interceptor alone (no channel, no network), ${BARE_CALLS} calls x ${ROUNDS} rounds, median round`,
    );
    console.log('| interceptor | CPU per call |');
    console.log('|---|---:|');
    for (const r of bareRows) console.log(`| ${r.name} | ${r.cpuUs.toFixed(1)} us |`);
  }

  for (const c of Object.values(clients)) c.close();
  levee.close();
  child.send('stop');
}

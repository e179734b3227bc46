// A user's project with `exactOptionalPropertyTypes` (issue 39): every option field of the
// package's public API accepts `undefined`, so optional values pass through as they are
// (`{ signal: maybeSignal, key: maybeKey }`). Compiled by test/types.test.mjs against dist/.

import {
  GrpcStatusError,
  HttpStatusError,
  LeveeError,
  OpenTelemetrySink,
  leveeFetch,
  loadSync,
  startFlags,
} from '../../dist/index.js';
import type {
  Clock,
  FallbackFn,
  LoadOptions,
  LeveeFetchOptions,
  MeterLike,
  ObserverErrorHandler,
  RetryHook,
  RetryPredicate,
  RunOptions,
  TelemetrySink,
  TraceStep,
} from '../../dist/index.js';
import { FaultInjector, VirtualClock } from '../../dist/testing.js';
import type { Fault, VirtualClockOptions } from '../../dist/testing.js';
import type { WorkerLoadOptions } from '../../dist/worker.js';
import type { FleetOptions, FleetRunOptions } from '../../dist/fleet.js';
import { DurableExecutor } from '../../dist/durable.js';
import type { DurableExecutorOptions, Store, SubmitOptions } from '../../dist/durable.js';
import { leveeInterceptor } from '../../dist/grpc.js';
import type { GrpcCallInfo, LeveeGrpcOptions } from '../../dist/grpc.js';
import type { Interceptor } from '@grpc/grpc-js';

declare function maybe<T>(): T | undefined;

const signal = maybe<AbortSignal>();
const key = maybe<string>();

const run: RunOptions<Response> = {
  key,
  signal,
  idempotent: maybe<boolean>(),
  idempotencyKey: maybe<boolean | string>(),
  method: maybe<string>(),
  outcomeOf: maybe<RunOptions<Response>['outcomeOf'] & {}>(),
  errorOutcome: maybe<RunOptions<Response>['errorOutcome'] & {}>(),
  fallbacks: maybe<Record<string, FallbackFn<Response>>>(),
  discard: maybe<(value: Response) => void>(),
  acceptFallback: maybe<(value: unknown) => boolean>(),
  onRetry: maybe<RetryHook>(),
  retryIf: maybe<RetryPredicate<Response>>(),
  request: maybe<Request>(),
};

const clock: Clock = { now: () => 0n, sleep: async () => undefined, wallMs: maybe<() => number>() };

const loadOptions: LoadOptions = {
  seed: maybe<bigint>(),
  fallbacks: maybe<Record<string, FallbackFn>>(),
  telemetry: maybe<TelemetrySink | null>(),
  meter: maybe<MeterLike | null>(),
  onRetry: maybe<Record<string, RetryHook>>(),
  retryIf: maybe<Record<string, RetryPredicate>>(),
  spans: maybe<boolean>(),
  clock: maybe<Clock>(),
  checkpointIntervalMs: maybe<number>(),
  instantiateCore: maybe<LoadOptions['instantiateCore'] & {}>(),
  maxMemoryBytes: maybe<number>(),
  trace: maybe<(step: TraceStep) => void>(),
  onObserverError: maybe<ObserverErrorHandler>(),
};

const workerOptions: WorkerLoadOptions = { ...loadOptions, modules: {} };

const fetchOptions: LeveeFetchOptions = {
  fetch: maybe<typeof fetch>(),
  key: maybe<(url: URL, request: Request) => string>(),
  fallbacks: maybe<Record<string, FallbackFn<Response>>>(),
  onRetry: maybe<RetryHook>(),
  retryIf: maybe<RetryPredicate<Response>>(),
};

const virtual: VirtualClockOptions = { start: maybe<bigint>(), wallStartMs: maybe<number>(), auto: maybe<boolean>() };
const fault: Fault = {
  op: 'start',
  nth: maybe<number>(),
  verdict: maybe<bigint>(),
  commands: maybe<Fault['commands'] & {}>(),
};

const fleetOptions: FleetOptions = {
  node: maybe<string>(),
  client: maybe<FleetOptions['client'] & {}>(),
  redisOptions: maybe<FleetOptions['redisOptions'] & {}>(),
  listener: maybe<FleetOptions['listener'] & {}>(),
  background: maybe<boolean>(),
};
const fleetRun: FleetRunOptions<number> = { key, signal, cost: maybe<number>() };

const grpcOptions: LeveeGrpcOptions = {
  target: maybe<string>(),
  key: maybe<(call: GrpcCallInfo) => string>(),
  onRetry: maybe<RetryHook>(),
  clientStreams: maybe<'buffer' | 'pass'>(),
};

const durableOptions: DurableExecutorOptions = {
  owner: maybe<string>(),
  concurrency: maybe<number>(),
  pollIntervalMs: maybe<number>(),
  claimHoldMs: maybe<number>(),
  onAttemptDone: maybe<DurableExecutorOptions['onAttemptDone'] & {}>(),
};

export async function use(store: Store): Promise<void> {
  const levee = loadSync('policies: { p: {} }', loadOptions);
  await levee.run('p', () => 1, { signal, key });
  await leveeFetch(levee, 'p', fetchOptions)('http://127.0.0.1:1/', { signal: signal ?? null });
  await levee.run('p', async () => new Response(), run);
  new VirtualClock(virtual);
  new FaultInjector().inject(1, fault);
  startFlags({ idempotent: maybe<boolean>(), idempotencyKey: key, method: maybe<string>() });
  new HttpStatusError(503, { retryAfter: maybe<string>(), overloaded: maybe<boolean>(), message: maybe<string>() });
  new GrpcStatusError(14, { pushback: maybe<string>(), message: maybe<string>() });
  new OpenTelemetrySink(maybe<MeterLike>()!, undefined, { gaugeKey: maybe<boolean>() });
  new LeveeError('deadline', {
    policy: 'p',
    attempts: 1,
    lastError: maybe<Error>(),
    retryAfterMs: maybe<number>(),
    detail: maybe<string>(),
    unregistered: maybe<string[]>(),
  });
  const executor = new DurableExecutor(levee, store, durableOptions);
  executor.register('h', async () => 'done', { policy: maybe<string>(), idempotent: maybe<boolean>() });
  const submitOptions: SubmitOptions = { idempotencyKey: key, key, tx: maybe<object>() };
  await executor.submit('h', 'payload', submitOptions);
  await executor.run({ signal, untilIdle: maybe<boolean>() });
  const interceptors: Interceptor[] = [
    leveeInterceptor(levee, 'p', grpcOptions),
    leveeInterceptor(levee, (call) => (call.method.endsWith('/Stats') ? 'q' : 'p'), { target: key }),
  ];
  void [clock, workerOptions, fleetOptions, fleetRun, interceptors];
}

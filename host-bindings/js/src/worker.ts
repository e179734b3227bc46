// levee for Worker-style runtimes (workerd, Cloudflare Workers, Deno Deploy...): these forbid
// compiling Wasm at run time, so the caller imports the core modules statically and passes them:
//
//   import core from 'levee-resilience/wasm/levee_policy.core.wasm';
//   const levee = load(policyText, { modules: { 'levee_policy.core.wasm': core } });

import { Levee, sinkOf } from './levee.js';
import type { LoadOptions, Platform, SoonTask } from './levee.js';

/** `soon`'s task in a Worker-style runtime: a timer there keeps nothing alive to let go of. */
const STAYS: SoonTask = { ref: () => undefined, unref: () => undefined };

export interface WorkerLoadOptions extends LoadOptions {
  /** The compiled core modules of the component, by file name (as in the package's `wasm/`). */
  modules: Record<string, WebAssembly.Module>;
}

/** Load a policy document with statically imported core modules. */
export function load(document: string, options: WorkerLoadOptions): Levee {
  const { modules } = options;
  const perf = performance; // read the global once, not on every clock reading
  const platform: Platform = {
    getCoreModule(path: string): WebAssembly.Module {
      const module = modules[path];
      if (module === undefined) throw new Error(`levee: core module "${path}" was not passed in options.modules`);
      return module;
    },
    now: () => BigInt(Math.round(perf.now() * 1e6)),
    randomSeed: () => crypto.getRandomValues(new BigUint64Array(1))[0] ?? 0n,
    // No setImmediate in Worker-style runtimes: a macrotask after the current one.
    soon: (fn) => {
      setTimeout(fn, 0);
      return STAYS;
    },
  };
  return new Levee(platform, document, options, sinkOf(options));
}

export { Levee, sleep } from './levee.js';
export type {
  AttemptContext,
  Clock,
  FallbackContext,
  FallbackFn,
  LoadOptions,
  PolicyEntry,
  RunOptions,
  TraceStep,
} from './levee.js';
export {
  GrpcStatusError,
  HttpStatusError,
  LeveeClosedError,
  LeveeError,
  PolicyLoadError,
  UnknownPolicyError,
  outcomeOfError,
} from './errors.js';
export type { FailureReason, Outcome } from './errors.js';
export { OpenTelemetrySink } from './events.js';
export type {
  EngineFaultEvent,
  LeveeEvent,
  LeveeEventMap,
  LeveeEventName,
  MeterLike,
  ObserverErrorHandler,
  RetryHook,
  RetryInfo,
  TelemetrySink,
} from './events.js';
export type { BreakerState, Event, EventKind, LoadError, Reason } from './types.js';
export { leveeFetch } from './fetch.js';

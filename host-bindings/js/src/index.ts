// levee for Node: `load` a policy document, then `run` calls under its policies or wrap `fetch`.

import { readFile } from 'node:fs/promises';
import { instantiate } from '../wasm/levee_policy.js';
type ComponentExports = ReturnType<typeof instantiate>;
import { Levee, loadSink, loadSpans, sinkOf } from './levee.js';
import type { LoadOptions } from './levee.js';
import { nodePlatform } from './platform-node.js';

/**
 * Load a policy document (YAML or JSON). The core validates it and fills defaults; an invalid
 * document rejects with a `PolicyLoadError` that names each field path. When `@opentelemetry/api`
 * is installed, events are also recorded as metrics on its global meter (unless `meter: null`).
 */
export async function load(document: string, options: LoadOptions = {}): Promise<Levee> {
  return new Levee(nodePlatform, document, options, await loadSink(options), await loadSpans(options));
}

/** `load` without looking for OpenTelemetry (metrics only through `options.meter`). */
export function loadSync(document: string, options: LoadOptions = {}): Levee {
  return new Levee(nodePlatform, document, options, sinkOf(options));
}

/** A fresh instance of the policy component itself (low level: the raw `Engine` of the WIT). */
export function instantiateComponent(): ComponentExports {
  return instantiate(nodePlatform.getCoreModule, {});
}

/** Load a policy document from a file. */
export async function loadFile(path: string | URL, options: LoadOptions = {}): Promise<Levee> {
  return load(await readFile(path, 'utf8'), options);
}

export { Levee, sleep, startFlags } from './levee.js';
export type {
  AttemptContext,
  AttemptResult,
  Clock,
  FallbackContext,
  FallbackFn,
  InstantiateCore,
  LoadOptions,
  PolicyEntry,
  RetryPredicate,
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
  errorClassName,
  outcomeOfError,
} from './errors.js';
export type { FailureReason, LeveeErrorDetails, Outcome } from './errors.js';
export { OpenTelemetrySink, eventAttributes } from './events.js';
export type {
  AttributeValue,
  Attributes,
  EngineFaultEvent,
  LeveeEvent,
  LeveeEventMap,
  LeveeEventName,
  Listener,
  MeterLike,
  ObserverErrorHandler,
  RetryHook,
  RetryInfo,
  SpanLike,
  TelemetrySink,
} from './events.js';
export * as constants from './constants.js';
export type { OpenTelemetryApiLike, SpanHandle } from './spans.js';
export type {
  Analysis,
  BreakerState,
  CallInfo,
  Engine,
  Event,
  EventKind,
  HedgeAnswer,
  HedgeCommand,
  LoadError,
  OutcomeKind,
  PolicyInfo,
  Reason,
} from './types.js';
export type { ComponentExports };
export { HEADER_ATTEMPT, httpKey, leveeFetch } from './fetch.js';
export type { LeveeFetchOptions } from './fetch.js';
export { decodeVerdict, encodeVerdict, REASONS } from './verdict.js';
export type { Verdict, VerdictKind } from './verdict.js';

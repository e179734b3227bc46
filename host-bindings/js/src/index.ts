// levee for Node: `load` a policy document, then `run` calls under its policies or wrap `fetch`.

import { readFile } from 'node:fs/promises';
import { instantiate } from '../wasm/levee_policy.js';
type ComponentExports = ReturnType<typeof instantiate>;
import { PolicyLoadError } from './errors.js';
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

/**
 * Load a policy document from a file. A file that is not UTF-8 text is refused with a
 * `PolicyLoadError` naming it and the line of the first bad byte (not loaded with replacement
 * characters in its names).
 */
export async function loadFile(path: string | URL, options: LoadOptions = {}): Promise<Levee> {
  const bytes = await readFile(path);
  let text: string;
  try {
    text = new TextDecoder('utf-8', { fatal: true, ignoreBOM: true }).decode(bytes);
  } catch {
    const at = firstInvalidUtf8(bytes);
    let line = 1;
    for (let i = 0; i < at; i++) if (bytes[i] === 0x0a) line++;
    const name = path instanceof URL ? path.href : path;
    throw new PolicyLoadError([
      {
        path: '',
        message: `the file '${name}' is not valid UTF-8 (byte ${at}, line ${line}): a policy document is UTF-8 text`,
      },
    ]);
  }
  return load(text, options);
}

/** The offset of the first byte of `bytes` that is not part of well-formed UTF-8 (RFC 3629). */
function firstInvalidUtf8(bytes: Uint8Array): number {
  let i = 0;
  while (i < bytes.length) {
    const b = bytes[i]!;
    let n: number;
    let min: number;
    if (b < 0x80) {
      i++;
      continue;
    } else if (b >= 0xc2 && b <= 0xdf) {
      n = 1;
      min = 0x80;
    } else if (b >= 0xe0 && b <= 0xef) {
      n = 2;
      min = 0x800;
    } else if (b >= 0xf0 && b <= 0xf4) {
      n = 3;
      min = 0x10000;
    } else {
      return i;
    }
    let cp = b & (0x3f >> n);
    for (let k = 1; k <= n; k++) {
      const c = bytes[i + k];
      if (c === undefined || (c & 0xc0) !== 0x80) return i;
      cp = (cp << 6) | (c & 0x3f);
    }
    if (cp < min || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) return i;
    i += n + 1;
  }
  return bytes.length;
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

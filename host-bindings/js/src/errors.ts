// Typed errors and the mapping of what an attempt produced to an outcome the core classifies.
// The host states facts (a status, a header, an error's class); it never decides what is retryable.

import type { LoadError, Reason } from '../wasm/interfaces/levee-policy-types.js';
import {
  GUARD_MAX_KEY_BYTES,
  HTTP_TLS_CERTIFICATE_CLASS,
  HTTP_UNNAMED_ERROR_CLASS,
  TEXT_KEY_TOO_LONG,
} from './constants.js';

/** Why a call failed: always one of the core's reasons (docs/hosts.md, section 5). */
export type FailureReason = Reason;

export type { Reason };

/** What an attempt produced, as the core's `report` takes it. */
export type Outcome =
  | { kind: 'success' }
  | { kind: 'timeout' }
  | { kind: 'connection-error' }
  /** An HTTP response; `retryAfter` is the raw `Retry-After` header. */
  | { kind: 'http-status'; status: number; retryAfter?: string | null; overloaded?: boolean }
  /** A gRPC status; `pushback` is the raw `grpc-retry-pushback-ms` metadata. */
  | { kind: 'grpc-status'; code: number; pushback?: string | null }
  /** An error of a named class (the policy lists which classes are retryable). */
  | { kind: 'error-class'; name: string };

export interface LeveeErrorDetails {
  policy: string;
  attempts: number;
  /** The error of the last attempt (or of the last fallback), if it threw. */
  lastError?: unknown;
  /** The value of the last attempt, when it returned one the policy classified as a failure. */
  lastResult?: unknown;
  /** A retry-after hint from the core (an open breaker's remaining wait), in milliseconds. */
  retryAfterMs?: number | undefined;
  /** Extra words for the message. */
  detail?: string | undefined;
  /** Fallbacks the policy's chain named that no function was registered for (they count as failed). */
  unregistered?: readonly string[] | undefined;
  /** The error of the last fallback of the chain, when it ran and failed (the error's `cause`). */
  fallbackError?: unknown;
  /** That fallback's name. */
  fallbackName?: string | undefined;
}

/** The words of a value thrown, for a message: `Name: message` for an Error. */
function describeThrown(err: unknown): string {
  if (err instanceof Error) return `${err.name}: ${err.message}`;
  try {
    return String(err);
  } catch {
    return typeof err;
  }
}

/** The words every host uses for fallbacks named by a policy but never registered. */
export function unregisteredMessage(names: readonly string[]): string {
  const listed = names.map((n) => `'${n}'`).join(', ');
  return names.length === 1
    ? `fallback ${listed} is named by the policy but not registered`
    : `fallbacks ${listed} are named by the policy but not registered`;
}

/** The words every host uses for an unknown policy name: the known names (the first 20) and the closest. */
export function unknownPolicyMessage(name: string, known: readonly string[]): string {
  let msg = `no policy named '${name}'`;
  const close = closest(name, known);
  if (close !== undefined) msg += ` (did you mean '${close}'?)`;
  if (known.length === 0) return `${msg}; the document has no policies`;
  const shown = known
    .slice(0, 20)
    .map((k) => `'${k}'`)
    .join(', ');
  return `${msg}; the document's policies: ${shown}${known.length > 20 ? ` and ${known.length - 20} more` : ''}`;
}

function closest(name: string, known: readonly string[]): string | undefined {
  // The nearest by edit distance, within a third of the name's length (at least 2).
  let best: string | undefined;
  let bestD = Math.max(2, Math.floor(name.length / 3)) + 1;
  for (const k of known) {
    const d = editDistance(name, k);
    if (d < bestD) {
      best = k;
      bestD = d;
    }
  }
  return best;
}

function editDistance(a: string, b: string): number {
  if (Math.abs(a.length - b.length) > 8) return Number.MAX_SAFE_INTEGER;
  let prev = Array.from({ length: b.length + 1 }, (_, j) => j);
  for (let i = 1; i <= a.length; i++) {
    const cur = [i];
    for (let j = 1; j <= b.length; j++) {
      cur[j] = Math.min(prev[j]! + 1, cur[j - 1]! + 1, prev[j - 1]! + (a[i - 1] === b[j - 1] ? 0 : 1));
    }
    prev = cur;
  }
  return prev[b.length]!;
}

/** The UTF-8 length of `s` as the component receives it (a lone surrogate is U+FFFD, 3 bytes). */
function utf8Length(s: string): number {
  let n = 0;
  for (let i = 0; i < s.length; i++) {
    const c = s.charCodeAt(i);
    if (c < 0x80) n += 1;
    else if (c < 0x800) n += 2;
    else if (c >= 0xd800 && c < 0xdc00 && i + 1 < s.length && (s.charCodeAt(i + 1) & 0xfc00) === 0xdc00) {
      n += 4;
      i++;
    } else n += 3;
  }
  return n;
}

/**
 * The error for a key longer than `GUARD_MAX_KEY_BYTES` UTF-8 bytes (docs/policy.md, "Keys"),
 * `undefined` for any other key. The core would decide such a key against the shared overflow
 * entry without a word: the host refuses it first. A key of at most a third of the bound in
 * UTF-16 units (3 UTF-8 bytes at most each) costs one comparison.
 */
export function keyError(key: string): RangeError | undefined {
  if (key.length * 3 <= GUARD_MAX_KEY_BYTES) return undefined;
  const bytes = utf8Length(key);
  if (bytes <= GUARD_MAX_KEY_BYTES) return undefined;
  const text = TEXT_KEY_TOO_LONG.replace('{bytes}', String(bytes)).replace('{max}', String(GUARD_MAX_KEY_BYTES));
  return new RangeError(`levee: ${text}`);
}

/** Throw `keyError(key)`, if any: every public entry that takes a key (run, breaker state, fleet, durable). */
export function checkKey(key: string): void {
  const err = keyError(key);
  if (err !== undefined) throw err;
}

/** A policy name the document does not have: thrown when the name is given (`policy`, `run`, `leveeFetch`). */
export class UnknownPolicyError extends RangeError {
  override readonly name = 'UnknownPolicyError';
  readonly policy: string;
  readonly known: readonly string[];

  constructor(policy: string, known: readonly string[]) {
    super(`levee: ${unknownPolicyMessage(policy, known)}`);
    this.policy = policy;
    this.known = known;
  }
}

/**
 * A call that Levee gave up on (or refused), with the reason and the last error. Its `cause` is
 * the last attempt's error, or, when the call ended after a fallback that failed, that
 * fallback's error (`fallbackError`; `lastError` stays the attempt's).
 */
export class LeveeError extends Error {
  override readonly name = 'LeveeError';
  readonly reason: FailureReason;
  readonly policy: string;
  readonly attempts: number;
  readonly lastError: unknown;
  readonly lastResult: unknown;
  readonly retryAfterMs: number | undefined;
  /** Fallbacks the policy's chain named that no function was registered for. */
  readonly unregistered: readonly string[];
  /** The error of the last fallback, when the call ended after it failed (then the `cause`). */
  readonly fallbackError: unknown;

  constructor(reason: FailureReason, details: LeveeErrorDetails) {
    const unregistered = details.unregistered ?? [];
    const failed = details.fallbackError;
    const words = [
      details.detail,
      failed !== undefined ? `fallback "${details.fallbackName ?? ''}" failed: ${describeThrown(failed)}` : undefined,
      unregistered.length > 0 ? unregisteredMessage(unregistered) : undefined,
    ];
    const said = words.filter((w) => w !== undefined && w !== '').join('; ');
    const tail = said ? `: ${said}` : '';
    const cause = failed ?? details.lastError;
    super(
      `levee: policy "${details.policy}" gave up (${reason}) after ${details.attempts} attempt${details.attempts === 1 ? '' : 's'}${tail}`,
      cause !== undefined ? { cause } : undefined,
    );
    this.fallbackError = failed;
    this.reason = reason;
    this.policy = details.policy;
    this.attempts = details.attempts;
    this.lastError = details.lastError;
    this.lastResult = details.lastResult;
    this.retryAfterMs = details.retryAfterMs;
    this.unregistered = unregistered;
  }
}

/**
 * The Levee was closed (`close()`): a call made after it, or a call in flight that needed the
 * engine again (after an attempt that threw or timed out, to retry, to report a fallback that
 * failed). No attempt starts after close. Its `cause` is the last attempt's (or fallback's) error.
 * Not a `LeveeError`: closing is the program's doing, not a decision of the policy.
 */
export class LeveeClosedError extends Error {
  override readonly name = 'LeveeClosedError';
  /** The policy of the call the close ended, if one was in flight. */
  readonly policy: string | undefined;
  /** The attempts that call made. */
  readonly attempts: number;
  /** The error of its last attempt (or fallback), if it threw: the `cause`. */
  readonly lastError: unknown;
  /** The value of its last attempt, when it returned one. */
  readonly lastResult: unknown;

  constructor(policy?: string, attempts = 0, cause?: unknown, lastResult?: unknown) {
    super(
      policy === undefined
        ? 'levee: this Levee was closed'
        : `levee: this Levee was closed while a call of policy "${policy}" was in flight (after ${attempts} attempt${attempts === 1 ? '' : 's'}); no attempt starts after close`,
      cause !== undefined ? { cause } : undefined,
    );
    this.policy = policy;
    this.attempts = attempts;
    this.lastError = cause;
    this.lastResult = lastResult;
  }
}

/** A policy document (or imported state) the core refused; every error names its field path. */
export class PolicyLoadError extends Error {
  override readonly name = 'PolicyLoadError';
  readonly errors: readonly LoadError[];

  constructor(errors: readonly LoadError[]) {
    super(
      'levee: invalid policy document:\n' +
        errors.map((e) => `  ${e.path === '' ? '(document)' : e.path}: ${e.message}`).join('\n'),
    );
    this.errors = errors;
  }
}

/** Throw this from an attempt to report an HTTP status (the core decides if it is retried). */
export class HttpStatusError extends Error {
  override readonly name = 'HttpStatusError';
  readonly status: number;
  readonly retryAfter: string | null;
  readonly overloaded: boolean;

  constructor(
    status: number,
    options: {
      retryAfter?: string | null | undefined;
      overloaded?: boolean | undefined;
      message?: string | undefined;
    } = {},
  ) {
    super(options.message ?? `HTTP status ${status}`);
    this.status = status;
    this.retryAfter = options.retryAfter ?? null;
    this.overloaded = options.overloaded ?? false;
  }
}

/** Throw this from an attempt to report a gRPC status (with the raw pushback metadata). */
export class GrpcStatusError extends Error {
  override readonly name = 'GrpcStatusError';
  readonly code: number;
  readonly pushback: string | null;

  constructor(code: number, options: { pushback?: string | null | undefined; message?: string | undefined } = {}) {
    super(options.message ?? `gRPC status ${code}`);
    this.code = code;
    this.pushback = options.pushback ?? null;
  }
}

// Error codes of Node (libuv), undici and Node's TLS layer that mean the connection could not be
// made or broke (docs/hosts.md, "Outcomes of errors": refused, reset, DNS failure, connect
// timeout, TLS handshake failure).
const CONNECTION_CODES = new Set([
  'ECONNREFUSED',
  'ECONNRESET',
  'ECONNABORTED',
  'ENOTFOUND',
  'EAI_AGAIN',
  'ETIMEDOUT',
  'EPIPE',
  'ENETUNREACH',
  'ENETDOWN',
  'EHOSTUNREACH',
  'EHOSTDOWN',
  'EADDRNOTAVAIL',
  'EPROTO',
  'UND_ERR_SOCKET',
  'UND_ERR_CONNECT_TIMEOUT',
  'UND_ERR_CLOSED',
  'ERR_SSL_WRONG_VERSION_NUMBER',
  'ERR_SSL_SSLV3_ALERT_HANDSHAKE_FAILURE',
  'ERR_SSL_TLSV1_ALERT_PROTOCOL_VERSION',
  'ERR_TLS_HANDSHAKE_TIMEOUT',
]);

// Codes of a server certificate that failed verification (OpenSSL's X509 verify results as Node
// names them): a certificate does not heal by retrying, so they are the error class
// `tls-certificate`, which no default rule retries.
const TLS_CERTIFICATE_CODES = new Set([
  'ERR_TLS_CERT_ALTNAME_INVALID',
  'ERR_TLS_CERT_ALTNAME_FORMAT',
  'CERT_HAS_EXPIRED',
  'CERT_NOT_YET_VALID',
  'CERT_REVOKED',
  'CERT_UNTRUSTED',
  'CERT_REJECTED',
  'CERT_SIGNATURE_FAILURE',
  'CERT_CHAIN_TOO_LONG',
  'UNABLE_TO_VERIFY_LEAF_SIGNATURE',
  'UNABLE_TO_GET_ISSUER_CERT',
  'UNABLE_TO_GET_ISSUER_CERT_LOCALLY',
  'UNABLE_TO_DECRYPT_CERT_SIGNATURE',
  'UNABLE_TO_DECODE_ISSUER_PUBLIC_KEY',
  'DEPTH_ZERO_SELF_SIGNED_CERT',
  'SELF_SIGNED_CERT_IN_CHAIN',
  'INVALID_CA',
  'INVALID_PURPOSE',
  'HOSTNAME_MISMATCH',
]);

// Errors an HTTP client raises when the server did not answer in time (not the connect timeout).
const TIMEOUT_CODES = new Set(['UND_ERR_HEADERS_TIMEOUT', 'UND_ERR_BODY_TIMEOUT']);

function codeOf(err: unknown): string | undefined {
  if (typeof err !== 'object' || err === null) return undefined;
  const code = (err as { code?: unknown }).code;
  return typeof code === 'string' ? code : undefined;
}

/**
 * The name of an error's class (docs/hosts.md, "The name of an error"): its `name` when it sets
 * one other than the inherited "Error", else its constructor's name; a thrown value that is not
 * an Error, or a name that is empty, is "Error".
 */
export function errorClassName(err: unknown): string {
  if (!(err instanceof Error)) return HTTP_UNNAMED_ERROR_CLASS;
  const name = (err as { name?: unknown }).name;
  if (typeof name === 'string' && name !== '' && name !== 'Error') return name;
  const ctor = (err as { constructor?: { name?: unknown } }).constructor;
  if (ctor && typeof ctor.name === 'string' && ctor.name !== '') return ctor.name;
  return HTTP_UNNAMED_ERROR_CLASS;
}

/**
 * The default description of an error thrown by an attempt: HTTP and gRPC status errors as such,
 * connection failures (Node and undici codes, also on `cause`, as `fetch` reports them) as
 * `connection-error`, client-side response timeouts as `timeout`, a certificate that failed
 * verification as the class `tls-certificate`, anything else by its class name.
 */
export function outcomeOfError(err: unknown): Outcome {
  if (err instanceof HttpStatusError) {
    return { kind: 'http-status', status: err.status, retryAfter: err.retryAfter, overloaded: err.overloaded };
  }
  if (err instanceof GrpcStatusError) {
    return { kind: 'grpc-status', code: err.code, pushback: err.pushback };
  }
  const code = codeOf(err) ?? codeOf((err as { cause?: unknown } | null)?.cause);
  if (code !== undefined) {
    if (TIMEOUT_CODES.has(code)) return { kind: 'timeout' };
    if (CONNECTION_CODES.has(code)) return { kind: 'connection-error' };
    if (TLS_CERTIFICATE_CODES.has(code)) return { kind: 'error-class', name: HTTP_TLS_CERTIFICATE_CLASS };
  }
  return { kind: 'error-class', name: errorClassName(err) };
}

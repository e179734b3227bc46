// A `fetch` that runs every request under a policy: the status and the raw Retry-After header of
// each response, and network errors, are reported to the core, which decides what happens next.

import {
  DEFAULT_PORTS,
  HTTP_ATTEMPT_HEADER,
  HTTP_OVERLOADED_HEADER,
  HTTP_RETRY_AFTER_HEADER,
  IDEMPOTENCY_HEADERS,
} from './constants.js';
import { LeveeError } from './errors.js';
import type { RetryHook } from './events.js';
import type { AttemptContext, FallbackFn, Levee, PolicyEntry, RetryPredicate } from './levee.js';

export interface LeveeFetchOptions {
  /** The fetch to wrap (default: the global one). */
  fetch?: typeof globalThis.fetch | undefined;
  /** The key of per-key state for a request (default: `httpKey(url)`, `host:port`, so each origin has its breaker). */
  key?: ((url: URL, request: Request) => string) | undefined;
  /** Fallbacks for these requests, by name; they return a Response. Each gets the request as `ctx.request`. */
  fallbacks?: Record<string, FallbackFn<Response>> | undefined;
  /** Called before the sleep of each retry of these requests (see `Levee.onRetry`). */
  onRetry?: RetryHook | undefined;
  /** A retry predicate for these requests (its `value` is the Response; see `Levee.retryIf`). */
  retryIf?: RetryPredicate<Response> | undefined;
}

/**
 * The key of an HTTP call (docs/hosts.md, section 6): the origin as `host:port`, the host
 * lower-cased (an IPv6 literal in brackets), no userinfo, and the port always written, the
 * scheme's default when the URL has none. Every Levee host names the same origin the same way.
 */
export function httpKey(url: URL): string {
  const host = url.hostname.toLowerCase();
  const port = url.port !== '' ? url.port : DEFAULT_PORTS[url.protocol.slice(0, -1)];
  return port === undefined ? host : `${host}:${port}`;
}

/** A body that `fetch` reads once (a stream or an async iterable): it cannot be sent twice. */
function isStream(body: unknown): boolean {
  if (body === null || body === undefined || typeof body !== 'object') return false;
  if (typeof ReadableStream !== 'undefined' && body instanceof ReadableStream) return true;
  return typeof (body as { [Symbol.asyncIterator]?: unknown })[Symbol.asyncIterator] === 'function';
}

/** Statuses whose response has no body (a `Response` made with one throws). */
const NULL_BODY = new Set([101, 103, 204, 205, 304]);

/**
 * Read the body inside the attempt (docs/http.md: an attempt is the whole response), under the
 * attempt's signal, and give back a response whose body is in memory. A body that trickles past
 * the attempt's timeout is a timeout; one that breaks off, a connection error of that attempt.
 */
async function buffered(response: Response): Promise<Response> {
  const body = await response.arrayBuffer();
  const copy = new Response(NULL_BODY.has(response.status) ? null : body, {
    status: response.status,
    statusText: response.statusText,
    headers: response.headers,
  });
  Object.defineProperty(copy, 'url', { value: response.url });
  Object.defineProperty(copy, 'redirected', { value: response.redirected });
  return copy;
}

/**
 * The cross-layer rule (docs/envoy.md): every attempt carries its number; the application decides
 * the request's retries, so a Levee filter in an Envoy on the way adds none.
 */
export const HEADER_ATTEMPT = HTTP_ATTEMPT_HEADER;

function discardBody(response: Response): void {
  // Free the connection of a response that will not be returned.
  if (response.body !== null && !response.bodyUsed) response.body.cancel().catch(() => undefined);
}

/**
 * Wrap `fetch` with a policy. Each attempt gets its own signal (the per-attempt timeout and the
 * caller's `signal`) and is the whole response: its body is read inside the attempt, so the
 * deadline bounds the body too and a connection closed mid-body is a connection error of that
 * attempt (docs/http.md); the response returned has its body in memory. Every response is reported as an HTTP status with its Retry-After header; a
 * response the policy does not retry (or the last one, when retries run out) is returned as fetch
 * would return it. Refusals (breaker open, budget, deadline) reject with a `LeveeError`; a caller's
 * abort rejects with the signal's reason, as fetch does.
 */
export function leveeFetch(
  levee: Levee,
  policy: string | PolicyEntry,
  options: LeveeFetchOptions = {},
): (input: RequestInfo | URL, init?: RequestInit) => Promise<Response> {
  const entry = typeof policy === 'string' ? levee.policy(policy) : policy;
  const base = options.fetch ?? globalThis.fetch.bind(globalThis);
  const keyOf = options.key ?? httpKey;
  return async (input, init) => {
    const request = new Request(input, init);
    const outer = init?.signal ?? (input instanceof Request ? input.signal : undefined) ?? undefined;
    const url = new URL(request.url);
    // docs/hosts.md, section 6: a body that cannot be sent twice makes the request non-idempotent
    // whatever its headers say; otherwise a non-empty Idempotency-Key (or X-Idempotency-Key) counts.
    const stream = isStream(init?.body);
    const idempotencyKey = !stream && IDEMPOTENCY_HEADERS.some((h) => (request.headers.get(h) ?? '') !== '');
    try {
      const attemptOf = ({ signal, attempt }: AttemptContext): Promise<Response> => {
        const r = new Request(request.clone(), { signal });
        r.headers.set(HTTP_ATTEMPT_HEADER, String(attempt));
        return base(r).then(buffered);
      };
      return await levee.run<Response>(entry, attemptOf, {
        key: keyOf(url, request),
        signal: outer,
        // The method as fetch sends it: `Request` upper-cases the standard ones (not `patch`).
        method: request.method,
        idempotent: stream ? false : undefined,
        idempotencyKey,
        outcomeOf: (response) => ({
          kind: 'http-status',
          status: response.status,
          retryAfter: response.headers.get(HTTP_RETRY_AFTER_HEADER),
          overloaded: response.headers.has(HTTP_OVERLOADED_HEADER),
        }),
        discard: discardBody,
        acceptFallback: (value) => value instanceof Response,
        fallbacks: options.fallbacks,
        request,
        onRetry: options.onRetry,
        retryIf: options.retryIf,
      });
    } catch (err) {
      // A response the call ended after is returned as fetch would return it (docs/hosts.md, section 5).
      if (err instanceof LeveeError && err.lastResult instanceof Response) return err.lastResult;
      throw err;
    }
  };
}

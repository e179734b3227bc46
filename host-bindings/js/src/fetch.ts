// A `fetch` that runs every request under a policy: the status and the raw Retry-After header of
// each response, and network errors, are reported to the core, which decides what happens next.

import { LeveeError } from './errors.js';
import type { AttemptContext, FallbackFn, Levee, PolicyEntry } from './levee.js';

export interface LeveeFetchOptions {
  /** The fetch to wrap (default: the global one). */
  fetch?: typeof globalThis.fetch;
  /** The key of per-key state for a request (default: the URL's host, so each host has its breaker). */
  key?: (url: URL, request: Request) => string;
  /** Fallbacks for these requests, by name; they return a Response. */
  fallbacks?: Record<string, FallbackFn<Response>>;
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
export const HEADER_ATTEMPT = 'x-levee-attempt';

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
  const keyOf = options.key ?? ((url: URL) => url.host);
  return async (input, init) => {
    const request = new Request(input, init);
    const outer = init?.signal ?? (input instanceof Request ? input.signal : undefined) ?? undefined;
    const url = new URL(request.url);
    try {
      const attemptOf = ({ signal, attempt }: AttemptContext): Promise<Response> => {
        const r = new Request(request.clone(), { signal });
        r.headers.set(HEADER_ATTEMPT, String(attempt));
        return base(r).then(buffered);
      };
      return await levee.run<Response>(entry, attemptOf, {
        key: keyOf(url, request),
        signal: outer,
        method: request.method,
        idempotencyKey: request.headers.has('idempotency-key'),
        outcomeOf: (response) => ({
          kind: 'http-status',
          status: response.status,
          retryAfter: response.headers.get('retry-after'),
          overloaded: response.headers.has('x-envoy-overloaded'),
        }),
        discard: discardBody,
        acceptFallback: (value) => value instanceof Response,
        fallbacks: options.fallbacks,
      });
    } catch (err) {
      if (err instanceof LeveeError) {
        if (err.reason === 'cancelled' && outer?.aborted) throw outer.reason;
        if (err.lastResult instanceof Response) return err.lastResult;
      }
      throw err;
    }
  };
}

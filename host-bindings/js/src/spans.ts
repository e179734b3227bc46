// Spans (docs/telemetry.md, "Spans"): `levee.call` per call and a `levee.attempt` child per
// attempt, on OpenTelemetry's API, which the caller passes in (`load(doc, { spans: api })`, or
// `spans: true` with `load`, which imports `@opentelemetry/api`) so that the dependency stays
// optional. An attempt runs in its span's context, so the client spans it makes nest under it.

import {
  ATTR_ATTEMPT,
  ATTR_DEGRADED,
  ATTR_KEY,
  ATTR_OUTCOME,
  ATTR_POLICY,
  ATTR_REASON,
  ATTR_RESEND_COUNT,
  ATTR_RESULT,
  SPAN_ATTEMPT,
  SPAN_CALL,
} from './constants.js';
import type { Attributes } from './events.js';

/** The part of an OpenTelemetry `Span` Levee uses. */
export interface SpanHandle {
  setAttribute(key: string, value: string | number | boolean): unknown;
  setStatus(status: { code: number; message?: string }): unknown;
  end(): void;
}

/** The part of the `@opentelemetry/api` module Levee uses (pass the module itself). */
export interface OpenTelemetryApiLike {
  trace: {
    getTracer(
      name: string,
      version?: string,
    ): {
      startSpan(name: string, options?: { attributes?: Attributes }, context?: unknown): SpanHandle;
    };
    setSpan(context: unknown, span: SpanHandle): unknown;
  };
  context: {
    active(): unknown;
    with<A extends unknown[], F extends (...args: A) => ReturnType<F>>(
      context: unknown,
      fn: F,
      thisArg?: ThisParameterType<F>,
      ...args: A
    ): ReturnType<F>;
  };
}

const STATUS_ERROR = 2; // SpanStatusCode.ERROR

/** Makes the spans of a Levee's calls. */
export class Spans {
  readonly #api: OpenTelemetryApiLike;
  readonly #tracer: ReturnType<OpenTelemetryApiLike['trace']['getTracer']>;

  constructor(api: OpenTelemetryApiLike) {
    this.#api = api;
    this.#tracer = api.trace.getTracer('levee', '0.1.0');
  }

  /** The span of a call, a child of the caller's active span. */
  call(policy: string, key: string): CallSpan {
    const span = this.#tracer.startSpan(SPAN_CALL, { attributes: { [ATTR_POLICY]: policy, [ATTR_KEY]: key } });
    return new CallSpan(this.#api, this.#tracer, span);
  }
}

export class CallSpan {
  readonly #api: OpenTelemetryApiLike;
  readonly #tracer: ReturnType<OpenTelemetryApiLike['trace']['getTracer']>;
  readonly #span: SpanHandle;
  readonly #context: unknown;

  constructor(
    api: OpenTelemetryApiLike,
    tracer: ReturnType<OpenTelemetryApiLike['trace']['getTracer']>,
    span: SpanHandle,
  ) {
    this.#api = api;
    this.#tracer = tracer;
    this.#span = span;
    this.#context = api.trace.setSpan(api.context.active(), span);
  }

  /** Start attempt `n`'s span (`http.request.resend_count` = n - 1 from the second attempt of an HTTP call on). */
  startAttempt(n: number, http: boolean, degraded: boolean): SpanHandle {
    const attributes: Attributes = { [ATTR_ATTEMPT]: n };
    if (http && n > 1) attributes[ATTR_RESEND_COUNT] = n - 1;
    if (degraded) attributes[ATTR_DEGRADED] = true;
    return this.#tracer.startSpan(SPAN_ATTEMPT, { attributes }, this.#context);
  }

  /**
   * Run `fn` in the context of the call's span: the telemetry of the call's crossings (events go
   * to the active span) lands on it, not on the caller's.
   */
  run<R>(fn: () => R): R {
    return this.#api.context.with(this.#context, fn);
  }

  /** Run `fn` in the context of an attempt's span. */
  within<R>(span: SpanHandle, fn: () => R): R {
    const api = this.#api;
    return api.context.with(api.trace.setSpan(this.#context, span), fn);
  }

  /** End an attempt's span with its outcome. */
  static endAttempt(span: SpanHandle, outcome: string): void {
    span.setAttribute(ATTR_OUTCOME, outcome);
    span.end();
  }

  /** End the call's span (`reason`: the core's, for a failure or the fallback that ended it). */
  end(result: string, reason: string | undefined): void {
    this.#span.setAttribute(ATTR_RESULT, result);
    if (reason !== undefined) this.#span.setAttribute(ATTR_REASON, reason);
    if (result === 'failure') this.#span.setStatus({ code: STATUS_ERROR, message: reason ?? 'failure' });
    this.#span.end();
  }
}

// gRPC client interceptors for @grpc/grpc-js (docs/grpc.md): the gRPC analogue of fetch.ts. Every
// attempt of a call is a call of the channel below the interceptor, run by `Levee.run` (so the
// driver and the hedged driver carry out what the core decides); its status and the raw
// `grpc-retry-pushback-ms` trailer are reported to the core as a `grpc-status` outcome. This file
// does the I/O only: per-attempt calls with their deadline and metadata, buffering what the caller
// sent so that an attempt can send it again, and handing the caller one call's answer.

import { InterceptingCall, Metadata, status as Status } from '@grpc/grpc-js';
import type { Interceptor, InterceptorOptions, InterceptingListener, NextCall, StatusObject } from '@grpc/grpc-js';
import {
  GRPC_PREVIOUS_ATTEMPTS_HEADER,
  GRPC_REJECTED_STATUS,
  GRPC_REJECTED_STATUS_OTHER,
  HTTP_ATTEMPT_HEADER,
  HTTP_PUSHBACK_TRAILER,
} from './constants.js';
import { GrpcStatusError, LeveeClosedError, LeveeError, outcomeOfError } from './errors.js';
import type { FailureReason, Outcome } from './errors.js';
import type { RetryHook } from './events.js';
import type { AttemptContext, AttemptResult, Levee, PolicyEntry } from './levee.js';

/** The call below an interceptor (grpc-js does not export its interface by name). */
type CallInterface = ConstructorParameters<typeof InterceptingCall>[0];
/** What grpc-js passes with a message it sends (a write callback, write flags). */
type MessageContext = Parameters<CallInterface['sendMessageWithContext']>[0];

/**
 * gRPC A6: the metadata that tells the server how many attempts of this call were sent before
 * this one (on attempts after the first; absent on the first).
 */
export const PREVIOUS_ATTEMPTS_HEADER = GRPC_PREVIOUS_ATTEMPTS_HEADER;

/** Every attempt's number (1 on the first), for a Levee filter on the way (docs/envoy.md). */
export const ATTEMPT_HEADER = HTTP_ATTEMPT_HEADER;

/**
 * The gRPC status a call ends with when the core refused it with no attempt status to show
 * (docs/grpc.md): a local rate limit or a full bulkhead is RESOURCE_EXHAUSTED, an open breaker
 * UNAVAILABLE, the policy's deadline DEADLINE_EXCEEDED. Any other reason without an attempt
 * status is UNKNOWN. The table is the contract's (wit/constants.json `grpc.REJECTED_STATUS`), the
 * same in every host. The `LeveeError` is the `cause` of the `ServiceError` the caller gets.
 */
export const REJECTION_STATUS: Readonly<Partial<Record<FailureReason, Status>>> = Object.freeze(
  GRPC_REJECTED_STATUS as Partial<Record<FailureReason, Status>>,
);

/** What a key function and a policy function see of a call. */
export interface GrpcCallInfo {
  /** The method's full path, `/package.Service/Method`. */
  readonly method: string;
  /** The call's options as the interceptor received them (`host`: a per-call authority). */
  readonly options: InterceptorOptions;
}

export interface LeveeGrpcOptions {
  /**
   * The channel's target as given to the client (`127.0.0.1:50051`, `dns:///api.example:443`): the
   * default key is its authority, so each target has its breaker. A call's `host` option (an
   * authority of its own) takes precedence.
   */
  target?: string | undefined;
  /** The key of per-key state for a call (default: the authority, see `target`). */
  key?: ((call: GrpcCallInfo) => string) | undefined;
  /** Called before the sleep of each retry of these calls (see `Levee.onRetry`). */
  onRetry?: RetryHook | undefined;
  /**
   * Client-streaming calls: `'buffer'` (the default) holds the request messages in memory until
   * the caller half-closes, then sends them with each attempt, so the call can be retried;
   * `'pass'` sends them as they come, without Levee (never retried). Bidirectional streams are
   * always passed through without Levee (their requests depend on the replies: none is retried).
   */
  clientStreams?: 'buffer' | 'pass' | undefined;
}

/**
 * A gRPC status an attempt ended with, as the attempt's error (what `Levee.run` reports and what
 * a `LeveeError` carries as `lastError`): the status object, the response headers, and whether the
 * attempt's own deadline (the per-attempt timeout the core granted) was the one that passed.
 */
export class GrpcAttemptError extends GrpcStatusError {
  readonly status: StatusObject;
  readonly headers: Metadata | undefined;
  /** DEADLINE_EXCEEDED because the attempt's timeout passed (not the caller's deadline): a timeout. */
  readonly timedOut: boolean;
  /** The stream had delivered a message to the caller before it failed (A6's commit): never retried. */
  readonly committed: boolean;

  constructor(status: StatusObject, headers: Metadata | undefined, timedOut: boolean, committed: boolean) {
    const pushback = status.metadata.get(HTTP_PUSHBACK_TRAILER)[0];
    super(status.code, {
      pushback: typeof pushback === 'string' ? pushback : null,
      message: `${status.code} ${Status[status.code] ?? ''}: ${status.details}`,
    });
    this.status = status;
    this.headers = headers;
    this.timedOut = timedOut;
    this.committed = committed;
  }
}

/** How an attempt's error is reported: an attempt whose own deadline passed is a timeout. */
function errorOutcome(err: unknown): Outcome {
  if (err instanceof GrpcAttemptError && err.timedOut) return { kind: 'timeout' };
  return outcomeOfError(err);
}

/** A failure after the commit is final (A6): the retry predicate says never retry it. */
function retryIf(result: AttemptResult<Flight>): boolean | undefined {
  return result.threw && result.error instanceof GrpcAttemptError && result.error.committed ? false : undefined;
}

/** The authority of a channel target: `dns:///host:port` and `ipv4:host:port` name `host:port`. */
export function grpcAuthority(target: string): string {
  const slashes = target.indexOf(':///');
  if (slashes >= 0) return target.slice(slashes + 4);
  const authority = /^[a-z][a-z0-9+.-]*:\/\/([^/]*)\//i.exec(target);
  if (authority !== null) return target.slice(authority[0].length);
  const scheme = /^(dns|ipv4|ipv6|unix|unix-abstract|vsock):/i.exec(target);
  return scheme !== null ? target.slice(scheme[0].length) : target;
}

/** The status the caller sees for an error `Levee.run` rejected with, its cause attached. */
function statusOfError(err: unknown): StatusObject {
  if (isCallerStatus(err)) return { code: err.code, details: err.details, metadata: new Metadata() };
  let cause = err;
  let last = err;
  if (err instanceof LeveeError || err instanceof LeveeClosedError) last = err.lastError;
  if (last instanceof GrpcAttemptError) {
    return last === err ? last.status : withCause({ ...last.status }, cause);
  }
  if (last instanceof DOMException && last.name === 'TimeoutError') {
    return withCause({ code: Status.DEADLINE_EXCEEDED, details: last.message, metadata: new Metadata() }, cause);
  }
  let code: Status = Status.UNKNOWN;
  if (err instanceof LeveeError) code = REJECTION_STATUS[err.reason] ?? (GRPC_REJECTED_STATUS_OTHER as Status);
  else if (err instanceof LeveeClosedError) code = Status.UNAVAILABLE;
  const details = err instanceof Error ? err.message : String(err);
  return withCause({ code, details, metadata: new Metadata() }, cause);
}

function withCause(status: StatusObject, cause: unknown): StatusObject {
  return Object.assign(status, { cause });
}

/** The reason a call's signal is aborted with when the caller cancels it or its deadline passes. */
interface CallerStatus {
  readonly callerStatus: true;
  readonly code: Status;
  readonly details: string;
}

function isCallerStatus(v: unknown): v is CallerStatus {
  return typeof v === 'object' && v !== null && (v as { callerStatus?: unknown }).callerStatus === true;
}

/** One attempt: its call below the interceptor and what it has received. */
class Flight {
  readonly call: CallInterface;
  headers: Metadata | undefined = undefined;
  readonly messages: unknown[] = [];
  status: StatusObject | undefined = undefined;
  constructor(call: CallInterface) {
    this.call = call;
  }
}

/** Whether a policy hedges (read from the policy as the core renders it, once per policy entry). */
const hedged = new WeakMap<PolicyEntry, boolean>();

function hedges(levee: Levee, entry: PolicyEntry): boolean {
  let h = hedged.get(entry);
  if (h === undefined) {
    let json: { hedge?: unknown } | null;
    try {
      json = JSON.parse(levee.policyJson(entry.name)) as { hedge?: unknown } | null;
    } catch {
      // No answer from the engine (it is being recovered): asked again on the next call.
      return false;
    }
    h = json !== null && typeof json === 'object' && json.hedge !== undefined && json.hedge !== null;
    hedged.set(entry, h);
  }
  return h;
}

function deadlineMs(options: InterceptorOptions): number {
  const d = options.deadline;
  if (d === undefined) return Infinity;
  return d instanceof Date ? d.getTime() : d;
}

/**
 * One call the caller made, run under the policy: what the caller sends is kept until it
 * half-closes, then `Levee.run` makes the attempts. A unary or client-streaming call's answer is
 * handed to the caller once the call has ended; a server stream's messages go to the caller from
 * the attempt that received the first one (A6's commit), and that attempt is never retried.
 */
class LeveeCall implements CallInterface {
  readonly #levee: Levee;
  readonly #entry: PolicyEntry;
  readonly #key: string;
  readonly #options: InterceptorOptions;
  readonly #nextCall: NextCall;
  readonly #onRetry: RetryHook | undefined;
  readonly #streaming: boolean;
  readonly #deadline: number;
  readonly #abort = new AbortController();
  #listener: Partial<InterceptingListener> | undefined = undefined;
  #metadata: Metadata = new Metadata();
  readonly #sent: [MessageContext, unknown][] = [];
  #halfClosed = false;
  #ended = false;
  #deadlineTimer: ReturnType<typeof setTimeout> | undefined = undefined;
  /** The latest attempt (for `getPeer`, `getAuthContext`). */
  #current: Flight | undefined = undefined;
  /** Server stream: the attempt whose messages go to the caller. */
  #committed: Flight | undefined = undefined;
  /** Server stream: the committed attempt answers the caller directly (a hedged call ended on it). */
  #handedOver = false;
  /** Server stream: messages the caller asked for (`startRead`) and has not had yet. */
  #reads = 0;
  /** Server stream: the committed attempt's messages not yet asked for. */
  readonly #pending: unknown[] = [];

  constructor(
    levee: Levee,
    entry: PolicyEntry,
    key: string,
    options: InterceptorOptions,
    nextCall: NextCall,
    onRetry: RetryHook | undefined,
  ) {
    this.#levee = levee;
    this.#entry = entry;
    this.#key = key;
    this.#options = options;
    this.#nextCall = nextCall;
    this.#onRetry = onRetry;
    this.#streaming = options.method_definition.responseStream;
    this.#deadline = deadlineMs(options);
  }

  start(metadata: Metadata, listener?: Partial<InterceptingListener>): void {
    this.#metadata = metadata;
    this.#listener = listener;
    if (this.#deadline !== Infinity) {
      // The caller's deadline bounds the whole call (each attempt's deadline is at most it).
      const ms = Math.max(0, this.#deadline - Date.now());
      this.#deadlineTimer = setTimeout(() => this.#cancel(Status.DEADLINE_EXCEEDED, 'Deadline exceeded'), ms);
    }
  }

  sendMessageWithContext(context: MessageContext, message: unknown): void {
    // Kept for every attempt; the write is done as far as the caller is concerned.
    this.#sent.push([context.flags === undefined ? {} : { flags: context.flags }, message]);
    context.callback?.();
  }

  sendMessage(message: unknown): void {
    this.sendMessageWithContext({}, message);
  }

  halfClose(): void {
    if (this.#halfClosed || this.#ended) return;
    this.#halfClosed = true;
    this.#run();
  }

  cancelWithStatus(code: Status, details: string): void {
    this.#cancel(code, details);
  }

  getPeer(): string {
    return this.#current?.call.getPeer() ?? 'unknown';
  }

  getAuthContext(): ReturnType<CallInterface['getAuthContext']> {
    return this.#current?.call.getAuthContext() ?? null;
  }

  startRead(): void {
    if (!this.#streaming || this.#ended) return;
    if (this.#committed === undefined) {
      this.#reads++;
      return;
    }
    const next = this.#pending.shift();
    if (next !== undefined) {
      this.#listener?.onReceiveMessage?.(next);
      return;
    }
    this.#reads++;
    this.#committed.call.startRead();
  }

  #cancel(code: Status, details: string): void {
    if (this.#ended) return;
    if (this.#committed !== undefined && this.#handedOver) {
      // The call's answer comes from the committed attempt: cancelling it ends the call.
      this.#committed.call.cancelWithStatus(code, details);
      return;
    }
    // Levee.run rejects at once with this reason; each attempt's signal aborts its call.
    this.#abort.abort({ callerStatus: true, code, details } satisfies CallerStatus);
    if (!this.#halfClosed) this.#end({ code, details, metadata: new Metadata() });
  }

  #end(status: StatusObject, headers?: Metadata, messages?: readonly unknown[]): void {
    if (this.#ended) return;
    this.#ended = true;
    if (this.#deadlineTimer !== undefined) clearTimeout(this.#deadlineTimer);
    const l = this.#listener;
    if (headers !== undefined) l?.onReceiveMetadata?.(headers);
    if (messages !== undefined) for (const m of messages) l?.onReceiveMessage?.(m);
    // A stream's messages the caller has not asked for yet go before its status.
    for (const m of this.#pending.splice(0)) l?.onReceiveMessage?.(m);
    l?.onReceiveStatus?.(status);
  }

  #run(): void {
    const hedging = this.#streaming && hedges(this.#levee, this.#entry);
    this.#levee
      .run<Flight>(this.#entry, (ctx) => this.#attempt(ctx, hedging), {
        key: this.#key,
        signal: this.#abort.signal,
        errorOutcome,
        retryIf: this.#streaming ? retryIf : undefined,
        onRetry: this.#onRetry,
        // A cancelled loser that still answered: free its call.
        discard: (f) => f.call.cancelWithStatus(Status.CANCELLED, 'levee: attempt superseded'),
        acceptFallback: (v) => v !== undefined,
      })
      .then(
        (answer) => this.#answer(answer),
        (err: unknown) => this.#fail(err),
      );
  }

  #answer(answer: Flight | unknown): void {
    if (!(answer instanceof Flight)) {
      // A fallback's value is the response message.
      this.#end({ code: Status.OK, details: '', metadata: new Metadata() }, new Metadata(), [answer]);
      return;
    }
    if (this.#streaming && answer.status === undefined) {
      // A hedged stream ended on its first message: the committed attempt answers from now on.
      this.#handedOver = true;
      return;
    }
    const status = answer.status ?? { code: Status.OK, details: '', metadata: new Metadata() };
    // A committed stream has had its headers and messages; any other answer is handed over whole.
    if (this.#committed === answer) this.#end(status);
    else this.#end(status, answer.headers ?? new Metadata(), answer.messages);
  }

  #fail(err: unknown): void {
    const last = err instanceof LeveeError ? err.lastError : err;
    if (last instanceof GrpcAttemptError && last.committed) {
      // The stream's messages went to the caller: only its status is left.
      this.#end(statusOfError(err));
      return;
    }
    this.#end(statusOfError(err), last instanceof GrpcAttemptError ? last.headers : undefined);
  }

  /** One attempt: a call below the interceptor, with its deadline and A6's metadata. */
  #attempt(ctx: AttemptContext, hedging: boolean): Promise<Flight> {
    return new Promise<Flight>((resolve, reject) => {
      const now = Date.now();
      const own = ctx.timeoutMs > 0 ? now + ctx.timeoutMs : Infinity;
      const deadline = Math.min(own, this.#deadline);
      const ownDeadline = own < this.#deadline;
      const metadata = this.#metadata.clone();
      metadata.set(ATTEMPT_HEADER, String(ctx.attempt));
      if (ctx.attempt > 1) metadata.set(PREVIOUS_ATTEMPTS_HEADER, String(ctx.attempt - 1));
      const call = this.#nextCall({ ...this.#options, deadline });
      const flight = new Flight(call);
      this.#current = flight;
      const fail = (status: StatusObject): void => {
        // The attempt's deadline was the earlier one and the caller's has not passed: its timeout.
        const timedOut = ownDeadline && status.code === Status.DEADLINE_EXCEEDED && Date.now() < this.#deadline;
        reject(new GrpcAttemptError(status, flight.headers, timedOut, this.#committed === flight));
      };
      const onAbort = (): void => call.cancelWithStatus(Status.CANCELLED, 'levee: attempt cancelled');
      ctx.signal.addEventListener('abort', onAbort, { once: true });
      call.start(metadata, {
        onReceiveMetadata: (headers) => {
          flight.headers = headers;
        },
        onReceiveMessage: (message: unknown) => {
          if (!this.#streaming) {
            flight.messages.push(message);
            return;
          }
          if (this.#committed === undefined) {
            // A6's commit: the first message of the call; from now on this attempt is the call.
            this.#committed = flight;
            this.#listener?.onReceiveMetadata?.(flight.headers ?? new Metadata());
            if (hedging) resolve(flight);
          } else if (this.#committed !== flight) {
            // A hedge that answered after another one committed: the core cancels it.
            resolve(flight);
            return;
          }
          if (this.#reads > 0) {
            this.#reads--;
            this.#listener?.onReceiveMessage?.(message);
            if (this.#reads > 0) call.startRead();
          } else {
            this.#pending.push(message);
          }
        },
        onReceiveStatus: (status) => {
          ctx.signal.removeEventListener('abort', onAbort);
          flight.status = status;
          if (this.#handedOver && this.#committed === flight) {
            this.#end(status);
            return;
          }
          if (status.code === Status.OK) resolve(flight);
          else fail(status);
        },
      });
      // One message at a time: grpc-js's call takes the next write once the last one is done.
      // The last one is followed by the half-close at once, as grpc-js's own unary call does (one
      // write with the end of the stream).
      const sent = this.#sent;
      const send = (i: number): void => {
        if (i >= sent.length - 1) {
          const last = sent[i];
          if (last !== undefined) call.sendMessageWithContext(last[0], last[1]);
          call.halfClose();
          return;
        }
        const [context, message] = sent[i]!;
        call.sendMessageWithContext({ ...context, callback: () => send(i + 1) }, message);
      };
      send(0);
      if (this.#streaming) call.startRead();
      if (ctx.signal.aborted) onAbort();
    });
  }
}

/**
 * A client interceptor that runs every call of a client under a policy. `policy` is a policy name,
 * a policy entry, or a function of the call that names one. Pass it in the client's options
 * (`interceptors: [leveeInterceptor(levee, 'grpc', { target })]`) or a call's options, and turn
 * grpc-js's own retries off on that channel (`'grpc.enable_retries': 0`): retries in one layer only.
 *
 * - Unary and client-streaming calls (their requests buffered, see `clientStreams`): each attempt
 *   is a new call of the channel, under the deadline `min(the attempt's timeout, the caller's
 *   deadline)`, with `grpc-previous-rpc-attempts` after the first; its status (the trailer, or
 *   the status grpc-js reports for a transport failure) and its raw `grpc-retry-pushback-ms` are
 *   reported to the core; the caller gets the answer of the attempt that ended the call.
 * - Server-streaming calls: retried only until the first response message (A6's commit); from then
 *   on the messages go to the caller as they come and the stream's end is the call's final outcome
 *   (reported, never retried). Under a hedging policy the first message ends the hedged call (the
 *   other attempts are cancelled) and the rest of the stream is not reported.
 * - Bidirectional streams pass through without Levee.
 * - A call the core refuses ends with a status (`REJECTION_STATUS`) whose `ServiceError` has the
 *   `LeveeError` as its `cause`; when the call ended after attempts, the last attempt's status.
 *   The caller's cancellation and deadline end the call at once and are never retried.
 */
export function leveeInterceptor(
  levee: Levee,
  policy: string | PolicyEntry | ((call: GrpcCallInfo) => string | PolicyEntry),
  options: LeveeGrpcOptions = {},
): Interceptor {
  const fixed = typeof policy === 'function' ? undefined : typeof policy === 'string' ? levee.policy(policy) : policy;
  const authority = options.target === undefined ? '' : grpcAuthority(options.target);
  const keyOf = options.key;
  const onRetry = options.onRetry;
  const passClientStreams = options.clientStreams === 'pass';
  return (callOptions: InterceptorOptions, nextCall: NextCall): InterceptingCall => {
    const def = callOptions.method_definition;
    if (def.requestStream && (def.responseStream || passClientStreams)) {
      return new InterceptingCall(nextCall(callOptions));
    }
    const info: GrpcCallInfo = { method: def.path, options: callOptions };
    let entry = fixed;
    if (entry === undefined) {
      const chosen = (policy as (call: GrpcCallInfo) => string | PolicyEntry)(info);
      entry = typeof chosen === 'string' ? levee.policy(chosen) : chosen;
    }
    const key = keyOf !== undefined ? keyOf(info) : (callOptions.host ?? authority);
    return new InterceptingCall(new LeveeCall(levee, entry, key, callOptions, nextCall, onRetry));
  };
}

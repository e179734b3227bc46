// The host-scenario runner of the JavaScript host (conformance/hosts/README.md): every
// conformance/hosts/*.json is replayed through the public API (`run` for `api: call`, `leveeFetch`
// over an in-process fetch for `api: http`) on a VirtualClock, with a RecordingSink and the
// FaultInjector of levee-resilience/testing, and the observed trace must equal the scenario's
// `expect` field by field (a field left out is not checked).

import assert from 'node:assert/strict';
import { AsyncLocalStorage } from 'node:async_hooks';
import { readFileSync, readdirSync } from 'node:fs';
import { test } from 'node:test';
import { LeveeError, errorClassName, leveeFetch, loadSync, outcomeOfError } from '../dist/index.js';
import { FaultInjector, RecordingSink, VirtualClock, metricKey } from '../dist/testing.js';

const DIR = new URL('../../../conformance/hosts/', import.meta.url);
const FILES = readdirSync(DIR)
  .filter((f) => f.endsWith('.json') && f !== 'schema.json')
  .sort();
const REAL_TIMEOUT_MS = 20_000; // a replay that has not ended by then is a deadlock
const CONTRACT_HEADERS = ['x-levee-attempt', 'idempotency-key', 'x-idempotency-key'];

// Scenarios this host cannot replay through its public API, with the reason (reported to the lead).
const SKIP = {
  'http-key-userinfo-dropped':
    "WHATWG fetch refuses a URL with credentials (new Request('http://user:pw@...') throws a TypeError " +
    'before any call starts), so the fetch integration never sends one; the scenario says such a client skips it',
};

// A call parked in the bulkhead queue sleeps under AbortSignal.any([caller's signal, its wake-up]):
// the runner notes which signals such a composite follows, to tell the call's sleeps.
const FOLLOWS = new WeakMap();
const signalAny = AbortSignal.any;
AbortSignal.any = function any(signals) {
  const composite = signalAny.call(AbortSignal, signals);
  FOLLOWS.set(composite, [...signals]);
  return composite;
};

class ScenarioError extends Error {}

/** A scenario's fault as the FaultInjector takes it (commands in jco's form, from the vectors' JSON form). */
function faultOf(f) {
  const fault = { op: f.op, nth: f.nth, verdict: f.verdict };
  if (f.commands !== undefined) {
    fault.commands = f.commands.map((c) => {
      if ('start' in c) return { tag: 'start', val: { attempt: c.start.attempt, timeout: BigInt(c.start.timeout) } };
      if ('cancel' in c) return { tag: 'cancel', val: c.cancel };
      if ('wait' in c) return { tag: 'wait', val: BigInt(c.wait) };
      return { tag: 'end', val: { attempt: c.end.attempt, verdict: BigInt(c.end.verdict) } };
    });
  }
  return fault;
}

/** The reason the runner aborts a call with at its `cancel_at`. */
class CallerCancelled extends Error {
  name = 'CallerCancelled';
}

const classes = new Map();
/** An Error class whose name, under the naming rule of docs/hosts.md, is `name`. */
function errorClass(name) {
  let C = classes.get(name);
  if (C === undefined) {
    C = { [name]: class extends Error {} }[name];
    classes.set(name, C);
  }
  return C;
}

/** `timeout`, `connection-error`, `http:503`, `error:ClassName`, or null (the scenarios' `last`). */
function outcomeName(err, result) {
  if (err === undefined || err === null) return result instanceof Response ? `http:${result.status}` : null;
  // The attempt timeout's abort reason (what AbortSignal.timeout gives too).
  if (err instanceof DOMException && err.name === 'TimeoutError') return 'timeout';
  const o = outcomeOfError(err);
  if (o.kind === 'http-status') return `http:${o.status}`;
  if (o.kind === 'error-class') return `error:${o.name}`;
  return o.kind;
}

function fetchError(code, message) {
  return new TypeError('fetch failed', { cause: Object.assign(new Error(message), { code }) });
}

class Replay {
  constructor(scn) {
    this.scn = scn;
    this.als = new AsyncLocalStorage();
    this.clock = new VirtualClock({ auto: true, wallStartMs: Number(scn.wall_start ?? 1764547200) * 1000 });
    const vc = this.clock;
    this.signals = new Map(); // the caller signal of each call -> its index
    this.sleeps = scn.calls.map(() => []);
    // The host's sleeps between attempts are made with the caller's signal (or, parked in the
    // bulkhead queue, with a composite that follows it); attempt timeouts and the dependency's own
    // timers are not.
    const clock = {
      now: () => vc.now(),
      wallMs: () => vc.wallMs(),
      sleep: (ms, signal) => {
        const i = this.#caller(signal);
        if (i !== undefined) this.sleeps[i].push(Math.round(ms * 1e6));
        return vc.sleep(ms, signal);
      },
    };
    this.sink = new RecordingSink(() => this.als.getStore());
    this.faults = new FaultInjector();
    this.levee = loadSync(scn.document, {
      seed: BigInt(scn.seed ?? 42),
      clock,
      telemetry: this.sink,
      instantiateCore: this.faults.instantiateCore,
    });
    this.traces = scn.calls.map(() => ({ attempts: [], requests: [], fallbacks: [], on_retry: [], retry_if: [] }));
    const registered = new Map();
    for (const c of scn.calls) {
      for (const [name, spec] of Object.entries(c.fallbacks ?? {})) {
        if (registered.has(name) && JSON.stringify(registered.get(name)) !== JSON.stringify(spec)) {
          throw new ScenarioError(`fallback '${name}' is registered twice with different behaviours`);
        }
        registered.set(name, spec);
      }
    }
    for (const [name, spec] of registered) this.levee.fallback(name, this.#fallback(name, spec));
    for (const [policy, answers] of Object.entries(scn.retry_if_policy ?? {})) {
      this.levee.retryIf(policy, this.#predicate('policy', answers));
    }
    this.nextCall = 1;
    /** Attempts of the dependency still running (a cancelled one may close after its call ended). */
    this.live = 0;
  }

  /** The index of the call whose caller signal `signal` is or follows. */
  #caller(signal) {
    if (signal === undefined) return undefined;
    const i = this.signals.get(signal);
    if (i !== undefined) return i;
    for (const s of FOLLOWS.get(signal) ?? []) {
      const j = this.#caller(s);
      if (j !== undefined) return j;
    }
    return undefined;
  }

  #fallback(name, spec) {
    return () => {
      const i = this.als.getStore();
      this.traces[i].fallbacks.push(name);
      if ('raise' in spec) throw new (errorClass(spec.raise))(`fallback ${name} failed`);
      if (this.scn.calls[i].api === 'http') return new Response(null, { status: Number(spec.return?.status ?? 200) });
      return spec.return;
    };
  }

  /** The dependency's side of one attempt: record it, wait as the step says, answer. */
  async #attempt(i, ctx, answer) {
    const trace = this.traces[i];
    const script = this.scn.calls[i].script;
    const n = trace.attempts.length;
    if (n >= script.length) {
      throw new ScenarioError(`call ${i}: the host asked for attempt ${n + 1}; the script has ${script.length}`);
    }
    const step = script[n];
    const rec = { at: Number(this.clock.now()) };
    if (this.sink.entries.some((e) => e.kind === 'event' && e.name === 'engine-fault' && e.label === i)) {
      rec.degraded = true;
    }
    trace.attempts.push(rec);
    // The host stops waiting at the attempt's timeout or the caller's cancel, or when it answers.
    const signal = ctx.signal;
    const stop = () => {
      if (rec.end === undefined) rec.end = Number(this.clock.now());
    };
    signal.addEventListener('abort', stop, { once: true });
    this.live++;
    try {
      if (this.scn.calls[i].hedge) return await this.#hedgedAttempt(step, signal, rec, answer);
      if (step.hang) {
        await new Promise((_, reject) => {
          if (signal.aborted) reject(signal.reason);
          signal.addEventListener('abort', () => reject(signal.reason), { once: true });
        });
      }
      if ('late' in step) {
        // Ignores cancellation: answers after `late`, whatever happened to its signal.
        await this.clock.sleep(Number(step.late) / 1e6);
      } else if (step.after) {
        await this.clock.sleep(Number(step.after) / 1e6);
      }
      return answer(step);
    } finally {
      stop();
      signal.removeEventListener('abort', stop);
      this.live--;
    }
  }

  /**
   * An attempt of a hedged call: it runs its step until its signal aborts, as a well-behaved
   * dependency does. An abort that is not its own timeout (the core's cancel, the caller's) marks
   * it `cancelled`; an `unwind` step then takes that long to close (`closed`) before it rejects.
   */
  async #hedgedAttempt(step, signal, rec, answer) {
    try {
      if ('late' in step) {
        await this.clock.sleep(Number(step.late) / 1e6);
        return answer(step);
      }
      if (signal.aborted) throw signal.reason;
      await new Promise((resolve, reject) => {
        signal.addEventListener('abort', () => reject(signal.reason), { once: true });
        if (!step.hang) this.clock.sleep(Number(step.after ?? 0) / 1e6, signal).then(resolve, () => undefined);
      });
    } catch (reason) {
      rec.end = Number(this.clock.now());
      if (!(reason instanceof DOMException && reason.name === 'TimeoutError')) rec.cancelled = true;
      if (step.unwind) {
        await this.clock.sleep(Number(step.unwind) / 1e6);
        rec.closed = Number(this.clock.now());
      }
      throw reason;
    }
    return answer(step);
  }

  #callAnswer(step) {
    if ('raise' in step) throw new (errorClass(step.raise))('scripted failure');
    if (step.refuse) throw fetchError('ECONNREFUSED', 'connect ECONNREFUSED 127.0.0.1:1');
    if (step.connect_timeout || step.tls_certificate) {
      throw new ScenarioError('connect_timeout and tls_certificate are steps of http calls');
    }
    return step.return;
  }

  #httpAnswer(step) {
    if ('raise' in step) throw new (errorClass(step.raise))('scripted failure');
    if (step.refuse) throw fetchError('ECONNREFUSED', 'connect ECONNREFUSED 127.0.0.1:1');
    if (step.connect_timeout) throw fetchError('UND_ERR_CONNECT_TIMEOUT', 'Connect Timeout Error');
    if (step.tls_certificate)
      throw fetchError('UNABLE_TO_VERIFY_LEAF_SIGNATURE', 'unable to verify the first certificate');
    if ('status' in step) return new Response(null, { status: Number(step.status), headers: step.headers ?? {} });
    return new Response(null, { status: 200 });
  }

  /** A predicate that plays `answers` in order (null past the end) and records what it saw. */
  #predicate(by, answers) {
    let k = 0;
    return (r) => {
      const i = this.als.getStore();
      const seen = { by };
      if (r.threw) seen.error = outcomeName(r.error);
      else if (r.value instanceof Response) seen.status = r.value.status;
      else seen.value = r.value === undefined ? null : r.value;
      this.traces[i].retry_if.push(seen);
      const answer = k < answers.length ? answers[k++] : null;
      if (answer === 'raise') throw new (errorClass('PredicateBroke'))('the predicate broke');
      return answer === null ? undefined : answer;
    };
  }

  #onRetry(i) {
    return (info) =>
      this.traces[i].on_retry.push({ attempt: info.attempt, delay: info.delay, error: outcomeName(info.error) });
  }

  async #call(i) {
    const c = this.scn.calls[i];
    const trace = this.traces[i];
    if (c.at) await this.clock.sleep(Number(c.at) / 1e6);
    const controller = new AbortController();
    this.signals.set(controller.signal, i);
    if ('cancel_at' in c) {
      void this.clock
        .sleep(Number(c.cancel_at - (c.at ?? 0)) / 1e6)
        .then(() => controller.abort(new CallerCancelled('the caller cancelled')));
    }
    const id = this.nextCall++;
    if (c.faults?.length) this.faults.inject(id, ...c.faults.map(faultOf));
    this.ids[i] = id;
    try {
      if ((c.api ?? 'call') === 'http') {
        const h = c.http;
        const fetch = async (request) => {
          trace.requests.push(
            Object.fromEntries(
              CONTRACT_HEADERS.filter((k) => request.headers.has(k)).map((k) => [k, request.headers.get(k)]),
            ),
          );
          await request.arrayBuffer();
          return this.#attempt(i, request, (step) => this.#httpAnswer(step));
        };
        const init = { method: h.method, headers: h.headers ?? {}, signal: controller.signal };
        if (h.body === 'bytes') init.body = 'payload';
        if (h.body === 'stream') {
          init.body = new ReadableStream({
            start(s) {
              s.enqueue(new TextEncoder().encode('part-1'));
              s.enqueue(new TextEncoder().encode('part-2'));
              s.close();
            },
          });
          init.duplex = 'half';
        }
        const response = await leveeFetch(this.levee, c.policy, {
          fetch,
          onRetry: this.#onRetry(i),
          retryIf: c.retry_if === undefined ? undefined : this.#predicate('call', c.retry_if),
        })(h.url, init);
        trace.result = { status: response.status };
      } else {
        const value = await this.levee.run(c.policy, (ctx) => this.#attempt(i, ctx, (step) => this.#callAnswer(step)), {
          key: c.key ?? '',
          signal: controller.signal,
          idempotent: c.idempotent ?? true,
          idempotencyKey: c.idempotency_key ?? false,
          onRetry: this.#onRetry(i),
          retryIf: c.retry_if === undefined ? undefined : this.#predicate('call', c.retry_if),
        });
        trace.result = { value: value === undefined ? null : value };
      }
    } catch (err) {
      if (err instanceof ScenarioError) throw err;
      if (err instanceof CallerCancelled) trace.result = { cancelled: true };
      else if (err instanceof LeveeError) {
        trace.result = {
          error: { reason: err.reason, attempts: err.attempts, last: outcomeName(err.lastError, err.lastResult) },
        };
      } else trace.result = { raised: errorClassName(err) };
    } finally {
      // A success held back for batching is sent now, in this call's context (its events are its own).
      this.levee.flush();
    }
  }

  async run() {
    this.ids = [];
    const done = this.scn.calls.map(() => false);
    const calls = this.scn.calls.map((_, i) =>
      this.als
        .run(i, () => this.#call(i))
        .finally(() => {
          done[i] = true;
        }),
    );
    const all = Promise.all(calls);
    let failed;
    all.catch((err) => (failed = err));
    const t0 = performance.now();
    // Deadlock: a call still blocked when no timer is pending.
    for (;;) {
      await this.clock.settle();
      if (failed !== undefined) throw failed;
      if (done.every(Boolean)) break;
      if (this.clock.pending === 0) {
        // Idle for good: no timer and no time passing over a few more turns (a hedged call waits a
        // turn of the event loop, with no timer set, before it reports the attempts that closed).
        const at = this.clock.now();
        let idle = true;
        for (let k = 0; k < 3 && idle; k++) {
          await this.clock.settle();
          idle = !done.every(Boolean) && this.clock.pending === 0 && this.clock.now() === at;
        }
        if (idle) {
          throw new ScenarioError(
            `deadlock: calls ${done.map((d, i) => (d ? '' : i)).join(' ')} blocked, no timer pending`,
          );
        }
      }
      if (performance.now() - t0 > REAL_TIMEOUT_MS) throw new ScenarioError('the replay did not end');
    }
    await all;
    // Attempts a hedged call cancelled close (and are reported) after the call ended.
    while (this.live > 0) {
      await this.clock.settle();
      if (this.live > 0 && this.clock.pending === 0) {
        throw new ScenarioError(`deadlock: ${this.live} attempts never close, no timer pending`);
      }
      if (performance.now() - t0 > REAL_TIMEOUT_MS) throw new ScenarioError('the replay did not end');
    }
    await this.clock.settle();
    return this.#finish();
  }

  #finish() {
    return this.scn.calls.map((c, i) => {
      const t = this.traces[i];
      const trace = { attempts: t.attempts };
      if (c.api === 'http') trace.requests = t.requests;
      trace.sleeps = this.sleeps[i];
      trace.fallbacks = t.fallbacks;
      trace.result = t.result;
      const events = [];
      const metrics = {};
      for (const e of this.sink.entries) {
        if (e.label !== i) continue;
        if (e.kind === 'event') {
          const { 'levee.policy': policy, 'levee.key': key, 'levee.call': call, ...rest } = e.attributes;
          assert.equal(policy, c.policy, `event ${e.name}: levee.policy`);
          if (call !== undefined) assert.equal(call, this.ids[i], `event ${e.name}: levee.call`);
          void key;
          events.push({ name: e.name, ...rest });
        } else if (e.kind === 'add') {
          const k = metricKey(e.name, e.attributes);
          metrics[k] = (metrics[k] ?? 0) + e.value;
        } else if (e.kind === 'record') {
          const k = metricKey(e.name, e.attributes);
          const h = (metrics[k] ??= { count: 0, sum: 0 });
          h.count += 1;
          h.sum += e.value;
        }
      }
      trace.events = events;
      trace.metrics = Object.fromEntries(Object.entries(metrics).sort(([a], [b]) => (a < b ? -1 : a > b ? 1 : 0)));
      trace.on_retry = t.on_retry;
      if (c.retry_if !== undefined || this.scn.retry_if_policy !== undefined) trace.retry_if = t.retry_if;
      return trace;
    });
  }
}

/** Floats as the blessing host wrote them: compare numbers to 12 significant digits. */
function normalise(value) {
  if (typeof value === 'number' && !Number.isInteger(value)) return Number(value.toPrecision(12));
  if (Array.isArray(value)) return value.map(normalise);
  if (value !== null && typeof value === 'object') {
    return Object.fromEntries(Object.entries(value).map(([k, v]) => [k, normalise(v)]));
  }
  return value;
}

test('the host scenarios are there', () => {
  assert.ok(FILES.length >= 80, `${FILES.length} scenarios in conformance/hosts`);
});

for (const file of FILES) {
  const scn = JSON.parse(readFileSync(new URL(file, DIR), 'utf8'));
  const skip = SKIP[scn.name];
  test(`host scenario ${scn.name}`, skip ? { skip } : {}, async () => {
    // A predicate that raises is reported as an uncaught error on a microtask (as a callback's
    // would be): the scripted ones (PredicateBroke) are expected here.
    const real = globalThis.queueMicrotask;
    globalThis.queueMicrotask = (fn) =>
      real(() => {
        try {
          fn();
        } catch (err) {
          if (err?.name !== 'PredicateBroke' && err?.constructor?.name !== 'PredicateBroke') throw err;
        }
      });
    let traces;
    try {
      traces = await new Replay(scn).run();
    } finally {
      globalThis.queueMicrotask = real;
    }
    scn.calls.forEach((c, k) => {
      for (const [field, want] of Object.entries(c.expect ?? {})) {
        assert.deepEqual(normalise(traces[k][field]), normalise(want), `call ${k}: ${field}`);
      }
    });
  });
}

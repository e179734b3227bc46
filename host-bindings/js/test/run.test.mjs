// The host API without I/O: run(), signals, errors, fallbacks, events, metrics, verdict decoding.

import assert from 'node:assert/strict';
import { describe, test } from 'node:test';
import {
  GrpcStatusError,
  HttpStatusError,
  LeveeError,
  OpenTelemetrySink,
  PolicyLoadError,
  decodeVerdict,
  encodeVerdict,
  errorClassName,
  load,
  loadSync,
  outcomeOfError,
  sleep,
  startFlags,
  instantiateComponent,
  constants,
} from '../dist/index.js';
import { recordEvents } from './helpers.mjs';

const DOC = `
policies:
  quick:
    attempts: 3
    backoff: { kind: constant, base: 1ms, jitter: none }
    retry-on: [timeout, connection-error, "error:FlakyError", "http:503"]
  timed:
    attempts: 2
    attempt-timeout: 50ms
    backoff: { kind: constant, base: 1ms, jitter: none }
  slow-retry:
    attempts: 3
    backoff: { kind: constant, base: 10s, jitter: none }
    retry-on: ["error:*"]
  chain:
    attempts: 1
    retry-on: ["error:*"]
    fallbacks: [first, second]
  single:
    attempts: 1
`;

class FlakyError extends Error {}
class FatalError extends Error {}

describe('verdicts', () => {
  test('decode and encode are inverse, exactly, for every field width', () => {
    for (const [kind, detail, payload, pending] of [
      [0, 1, 0, false],
      [3, 0, 768, true],
      [5, 12, 2 ** 48 - 1, true],
      [6, 4, 0, false],
      [1, 255, 123456789012, false],
    ]) {
      const v = encodeVerdict(kind, detail, payload, pending);
      const d = decodeVerdict(v);
      assert.deepEqual([d.kindCode, d.detail, d.payload, d.eventsPending], [kind, detail, payload, pending]);
    }
    assert.equal(decodeVerdict(50331651n).kind, 'retry');
    assert.equal(decodeVerdict(50331651n).payload, 768);
  });

  test('start flags carry idempotency and the HTTP method', () => {
    assert.equal(startFlags(undefined), 0);
    assert.equal(startFlags({ idempotent: false }), 1);
    assert.equal(startFlags({ idempotencyKey: true }), 2);
    assert.equal(startFlags({ idempotencyKey: 'order-17' }), 2);
    assert.equal(startFlags({ idempotencyKey: '' }), 0);
    assert.equal(startFlags({ method: 'POST' }), 3 << 8);
    // RFC 9110 methods are case-sensitive (docs/hosts.md, section 6): `post` is another token.
    assert.equal(startFlags({ method: 'post' }), 15 << 8);
    assert.equal(startFlags({ method: 'BREW' }), 15 << 8);
    assert.equal(startFlags({ method: 'constructor' }), 15 << 8);
  });
});

describe('strings into the component', () => {
  test('keys round-trip exactly through the glue, ASCII or not, short or long', () => {
    const { Engine } = instantiateComponent().engineApi;
    const engine = Engine.load('policies:\n  p:\n    attempts: 2\n', 1n);
    const keys = [
      'svc',
      'api.example.test:443',
      'ключ-🙂',
      'a'.repeat(256),
      'b'.repeat(300),
      'c'.repeat(255) + 'é',
      '\u007f\u0000x',
    ];
    keys.forEach((key, i) => {
      const call = BigInt(i + 1);
      engine.start(call, 0, key, 0, 1000n, 0n, 0n, 0n);
      assert.equal(engine.callInfo(call).key, key);
      assert.equal(engine.policyIndex(key), undefined);
    });
    assert.equal(engine.policyIndex('p'), 0);
  });

  test('keys that run() lowers into guest memory itself arrive exactly (and others through the glue)', async () => {
    const levee = loadSync(DOC, { seed: 1n });
    const seen = [];
    levee.on('retry-scheduled', (e) => seen.push(e.key));
    const keys = [
      'svc',
      'api.example.test:443',
      'ключ-🙂',
      'a'.repeat(300),
      'c'.repeat(255) + 'é',
      '\u007f\u0000x',
      '',
    ];
    for (const key of keys) {
      const value = await levee.run(
        'quick',
        ({ attempt }) => {
          if (attempt === 1) throw new FlakyError('first try');
          return key;
        },
        { key },
      );
      assert.equal(value, key);
    }
    assert.deepEqual(seen, keys);
  });
});

describe('outcomes of errors', () => {
  test('classes, statuses and connection errors', () => {
    assert.deepEqual(outcomeOfError(new FlakyError('x')), { kind: 'error-class', name: 'FlakyError' });
    assert.deepEqual(outcomeOfError(new TypeError('x')), { kind: 'error-class', name: 'TypeError' });
    assert.deepEqual(outcomeOfError(new HttpStatusError(503, { retryAfter: '2' })), {
      kind: 'http-status',
      status: 503,
      retryAfter: '2',
      overloaded: false,
    });
    const refused = new TypeError('fetch failed', { cause: Object.assign(new Error('x'), { code: 'ECONNREFUSED' }) });
    assert.deepEqual(outcomeOfError(refused), { kind: 'connection-error' });
    assert.deepEqual(outcomeOfError(Object.assign(new Error('x'), { code: 'UND_ERR_HEADERS_TIMEOUT' })), {
      kind: 'timeout',
    });
    assert.equal(errorClassName(new DOMException('x', 'AbortError')), 'AbortError');
    // docs/hosts.md, "The name of an error": a thrown value that is not an Error is "Error".
    assert.equal(errorClassName('a string'), 'Error');
    assert.equal(errorClassName({ name: 'Lookalike' }), 'Error');
    class Plain extends Error {}
    assert.equal(errorClassName(new Plain('x')), 'Plain');
    // A connect timeout cannot connect: connection-error; a bad certificate is its own class.
    const connectTimeout = new TypeError('fetch failed', {
      cause: Object.assign(new Error('x'), { code: 'UND_ERR_CONNECT_TIMEOUT' }),
    });
    assert.deepEqual(outcomeOfError(connectTimeout), { kind: 'connection-error' });
    const badCert = new TypeError('fetch failed', {
      cause: Object.assign(new Error('x'), { code: 'CERT_HAS_EXPIRED' }),
    });
    assert.deepEqual(outcomeOfError(badCert), { kind: 'error-class', name: 'tls-certificate' });
  });
});

describe('sleep', () => {
  test('an aborted signal ends the sleep with its reason', async () => {
    const c = new AbortController();
    const p = sleep(10_000, c.signal);
    c.abort(new Error('stop'));
    await assert.rejects(p, /stop/);
  });
});

describe('run', () => {
  test('a call that succeeds first time returns its value, once', async () => {
    const levee = loadSync(DOC, { seed: 1n });
    let calls = 0;
    const value = await levee.run('quick', ({ attempt }) => {
      calls++;
      return `v${attempt}`;
    });
    assert.equal(value, 'v1');
    assert.equal(calls, 1);
  });

  test('retryable error classes are retried, others are not', async () => {
    const levee = loadSync(DOC, { seed: 1n });
    const events = recordEvents(levee);
    const attempts = [];
    const value = await levee.run('quick', async ({ attempt }) => {
      attempts.push(attempt);
      if (attempt < 3) throw new FlakyError('again');
      return 'third';
    });
    assert.equal(value, 'third');
    assert.deepEqual(attempts, [1, 2, 3]);
    assert.equal(events.filter((e) => e.kind === 'retry-scheduled').length, 2);

    await assert.rejects(
      levee.run('quick', () => {
        throw new FatalError('no');
      }),
      (err) => {
        assert.ok(err instanceof LeveeError);
        assert.equal(err.reason, 'non-retryable');
        assert.equal(err.attempts, 1);
        assert.ok(err.lastError instanceof FatalError);
        assert.equal(err.cause, err.lastError);
        return true;
      },
    );
  });

  test('retries run out: a typed error with the reason and the last error', async () => {
    const levee = loadSync(DOC, { seed: 1n });
    let n = 0;
    await assert.rejects(
      levee.run('quick', () => {
        throw new FlakyError(`failure ${++n}`);
      }),
      (err) => {
        assert.equal(err.reason, 'retries-exhausted');
        assert.equal(err.attempts, 3);
        assert.equal(err.lastError.message, 'failure 3');
        return true;
      },
    );
  });

  test('gRPC statuses are reported with their pushback', async () => {
    const levee = loadSync(
      'policies:\n  g:\n    attempts: 3\n    backoff: { kind: constant, base: 1ms, jitter: none }\n',
      {
        seed: 1n,
      },
    );
    let n = 0;
    const value = await levee.run('g', () => {
      if (++n === 1) throw new GrpcStatusError(14);
      return 'ok';
    });
    assert.equal(value, 'ok');
    await assert.rejects(
      levee.run('g', () => {
        throw new GrpcStatusError(8, { pushback: '-1' });
      }),
      (err) => err.reason === 'pushback',
    );
  });

  test('outcomeOf reports a returned value as an HTTP status', async () => {
    const levee = loadSync(DOC, { seed: 1n });
    const values = [503, 200];
    const value = await levee.run('quick', () => values.shift(), {
      outcomeOf: (status) => ({ kind: 'http-status', status }),
    });
    assert.equal(value, 200);
  });

  test('the per-attempt timeout aborts the attempt signal, even if the attempt ignores it', async () => {
    const levee = loadSync(DOC, { seed: 1n });
    const signals = [];
    // It ignores its signal and answers at 80 ms: the call waits for it (it holds its bulkhead
    // slot until it has ended, issue 39), and its answer is a timeout all the same.
    await assert.rejects(
      levee.run('timed', ({ signal, timeoutMs }) => {
        assert.equal(timeoutMs, 50);
        signals.push(signal);
        return new Promise((resolve) => setTimeout(() => resolve('too late'), 80));
      }),
      (err) => {
        assert.equal(err.reason, 'retries-exhausted');
        assert.equal(err.attempts, 2);
        assert.equal(err.lastError.name, 'TimeoutError');
        return true;
      },
    );
    assert.equal(signals.length, 2);
    assert.ok(signals.every((s) => s.aborted && s.reason.name === 'TimeoutError'));
  });

  test('an attempt signal first read after its timeout fired is already aborted', async () => {
    const levee = loadSync(DOC, { seed: 1n });
    const late = [];
    await assert.rejects(
      levee.run('timed', async (ctx) => {
        await new Promise((r) => setTimeout(r, 80));
        late.push(ctx.signal);
      }),
      (err) => err.reason === 'retries-exhausted',
    );
    await new Promise((r) => setTimeout(r, 100));
    assert.equal(late.length, 2);
    assert.ok(late.every((s) => s.aborted && s.reason.name === 'TimeoutError'));
  });

  test('a synchronous attempt under a timeout or a caller signal returns its value', async () => {
    const levee = loadSync(DOC, { seed: 1n });
    assert.equal(await levee.run('timed', () => 'sync'), 'sync');
    assert.equal(await levee.run('quick', () => 'sync', { signal: new AbortController().signal }), 'sync');
  });

  test('the caller signal cancels a retry sleep', async () => {
    const levee = loadSync(DOC, { seed: 1n });
    const controller = new AbortController();
    const pending = levee.run(
      'slow-retry',
      () => {
        setTimeout(() => controller.abort(new Error('shutdown')), 5);
        throw new Error('fails');
      },
      { signal: controller.signal },
    );
    // The caller's cancellation ends the call with the signal's reason (docs/hosts.md, section 5).
    await assert.rejects(pending, (err) => {
      assert.equal(err.message, 'shutdown');
      return true;
    });
  });

  test('an already aborted signal starts nothing', async () => {
    const levee = loadSync(DOC, { seed: 1n });
    let calls = 0;
    await assert.rejects(
      levee.run('quick', () => calls++, { signal: AbortSignal.abort() }),
      (err) => err.name === 'AbortError',
    );
    assert.equal(calls, 0);
  });

  test('fallbacks registered by name run in the chain order', async () => {
    const levee = loadSync(DOC, { seed: 1n, fallbacks: { first: () => Promise.reject(new Error('first failed')) } });
    levee.fallback('second', (ctx) => `second after ${ctx.fallbackError.message} (${ctx.lastError.message})`);
    const events = recordEvents(levee);
    const value = await levee.run('chain', () => {
      throw new Error('primary');
    });
    assert.equal(value, 'second after first failed (primary)');
    assert.deepEqual(
      events.filter((e) => e.kind === 'fallback-chosen').map((e) => e.name),
      ['first', 'second'],
    );
  });

  test('every fallback fails: fallbacks-failed with the last error', async () => {
    const levee = loadSync(DOC, { seed: 1n });
    await assert.rejects(
      levee.run(
        'chain',
        () => {
          throw new Error('primary');
        },
        {
          fallbacks: {
            first: () => {
              throw new Error('f1');
            },
            second: () => {
              throw new Error('f2');
            },
          },
        },
      ),
      (err) => {
        assert.equal(err.reason, 'fallbacks-failed');
        // The cause is the last attempt's error (docs/hosts.md, section 5).
        assert.equal(err.lastError.message, 'primary');
        return true;
      },
    );
  });

  test('many interleaved calls: every held-back success is settled, no step is out of order', async () => {
    const levee = loadSync(DOC, { seed: 9n });
    const steps = [];
    const traced = loadSync(DOC, { seed: 9n, trace: (s) => steps.push(s) });
    for (const l of [levee, traced]) {
      const results = await Promise.all(
        Array.from({ length: 300 }, (_, i) =>
          l.run('quick', async ({ attempt }) => {
            await new Promise((r) => setTimeout(r, i % 7));
            if (i % 3 === 0 && attempt === 1) throw new FlakyError('first try');
            return i;
          }),
        ),
      );
      assert.deepEqual(
        results,
        Array.from({ length: 300 }, (_, i) => i),
      );
      l.flush();
      for (let call = 1n; call <= 300n; call++) assert.equal(l.callInfo(call), undefined, `call ${call} ended`);
    }
    assert.ok(steps.every((s) => s.verdict.kind !== 'invalid'));
  });

  test('a held success that rode on the next start leaves the event loop nothing to turn for', async () => {
    // A ref'd immediate makes the loop turn once more at once (a poll that does not wait): for a
    // lone caller that is one more turn per call than the work needs. Counted by Node itself.
    const immediates = () => process.getActiveResourcesInfo().filter((r) => r === 'Immediate').length;
    const levee = loadSync(DOC, { seed: 1n });
    const base = immediates();
    assert.equal(await levee.run('single', () => 1), 1);
    assert.equal(immediates(), base + 1, 'the held success schedules its flush');
    let during = -1;
    const second = () => {
      during = immediates(); // its start carried the held success
      return 2;
    };
    assert.equal(await levee.run('single', second), 2);
    assert.equal(during, base, 'the flush has nothing left to send: the loop may wait');
    assert.equal(immediates(), base + 1, 'the next held success needs its flush again');
    await new Promise((r) => setImmediate(r));
    assert.equal(immediates(), base, 'flushed in this turn of the loop');
    assert.equal(levee.callInfo(2n), undefined, 'the second success was sent');
  });

  test('close sends the held success and refuses further calls', async () => {
    const levee = loadSync(DOC, { seed: 1n });
    assert.equal(await levee.run('single', () => 1), 1);
    levee.close();
    await assert.rejects(
      levee.run('single', () => 1),
      /closed/,
    );
  });

  test('an unknown policy name is refused before anything runs', async () => {
    const levee = loadSync(DOC, { seed: 1n });
    await assert.rejects(
      levee.run('nope', () => 1),
      RangeError,
    );
  });

  test('policies are listed as the core filled them in', () => {
    const levee = loadSync(DOC, { seed: 1n });
    assert.deepEqual(
      levee.policies.map((p) => p.name),
      ['quick', 'timed', 'slow-retry', 'chain', 'single'],
    );
    const timed = levee.policy('timed');
    assert.equal(timed.maxAttempts, 2);
    assert.equal(timed.attemptTimeoutNs, 50_000_000);
    assert.deepEqual(levee.policy('chain').fallbacks, ['first', 'second']);
    assert.ok(JSON.parse(levee.policyJson('quick')));
  });

  test('the core module called directly (ASCII keys) answers as the glue does (other keys)', async () => {
    const runs = [];
    for (const key of ['', 'k', 'ключ']) {
      const steps = [];
      const levee = loadSync(DOC, { seed: 5n, trace: (s) => steps.push(s) });
      const proto = levee.component.engineApi.Engine.prototype;
      const glueStart = proto.start;
      let glueCalls = 0;
      proto.start = function (...args) {
        glueCalls++;
        return glueStart.apply(this, args);
      };
      for (let i = 0; i < 20; i++) {
        await levee.run(
          'quick',
          ({ attempt }) => {
            if (i % 4 === 0 && attempt === 1) throw new FlakyError('first try');
            return i;
          },
          { key },
        );
      }
      levee.flush();
      assert.equal(glueCalls, key === 'ключ' ? 20 : 0, `start through the glue with key "${key}"`);
      runs.push(steps.map((s) => [s.op, s.call, s.verdict]));
    }
    assert.ok(runs[0].length > 20);
    assert.deepEqual(runs[0], runs[1]);
    assert.deepEqual(runs[0], runs[2]);
  });

  test('a verdict with the top bit set comes out of the core module as a u64', async () => {
    // fail, retry-after-too-long, payload 2^48-1: negative as the core module's i64.
    const verdict = encodeVerdict(5, 9, 2 ** 48 - 1, false);
    const levee = loadSync(DOC, {
      seed: 1n,
      instantiateCore: (module, imports) => {
        const exports = { ...new WebAssembly.Instance(module, imports).exports };
        for (const name of Object.keys(exports)) {
          if (name.endsWith('[method]engine.start')) exports[name] = () => BigInt.asIntN(64, verdict);
        }
        return { exports };
      },
    });
    await assert.rejects(
      levee.run('single', () => 1),
      (err) => {
        assert.ok(err instanceof LeveeError);
        assert.equal(err.reason, 'retry-after-too-long');
        assert.equal(err.retryAfterMs, (2 ** 48 - 1) / 1e6);
        return true;
      },
    );
  });

  test('a held-back success is settled on the next start with its events', async () => {
    const levee = loadSync(DOC, { seed: 1n });
    for (let i = 0; i < 5; i++) assert.equal(await levee.run('single', () => i), i);
    levee.flush();
    const state = levee.exportState();
    assert.ok(state.length > 0);
    levee.importState(state);
  });
});

describe('load', () => {
  test('an invalid document names the field path', async () => {
    await assert.rejects(load('policies:\n  p:\n    attempts: 0\n', { meter: null }), (err) => {
      assert.ok(err instanceof PolicyLoadError);
      assert.equal(err.errors[0].path, 'policies.p.attempts');
      assert.match(err.message, /policies\.p\.attempts/);
      return true;
    });
  });

  test('reload keeps the engine and changes the policies; a bad reload changes nothing', () => {
    const levee = loadSync(DOC, { seed: 1n });
    levee.reload('policies:\n  other:\n    attempts: 2\n');
    assert.deepEqual(
      levee.policies.map((p) => p.name),
      ['other'],
    );
    assert.throws(() => levee.reload('policies:\n  other:\n    attempts: -1\n'), PolicyLoadError);
    assert.deepEqual(
      levee.policies.map((p) => p.name),
      ['other'],
    );
  });
});

describe('metrics', () => {
  function fakeMeter() {
    const recorded = [];
    const instrument = (name) => ({
      add: (value, attributes) => recorded.push({ name, value, attributes }),
      record: (value, attributes) => recorded.push({ name, value, attributes }),
    });
    return { recorded, meter: { createCounter: instrument, createHistogram: instrument } };
  }

  test('events become OpenTelemetry instruments', async () => {
    const { recorded, meter } = fakeMeter();
    const levee = loadSync(DOC, { seed: 1n, meter });
    await levee.run('quick', ({ attempt }) => {
      if (attempt === 1) throw new FlakyError('x');
      return 1;
    });
    const retries = recorded.filter((r) => r.name === 'levee.retries');
    assert.equal(retries.length, 1);
    assert.deepEqual(retries[0].attributes, { 'levee.policy': 'quick' });
    // seconds (docs/telemetry.md)
    assert.ok(recorded.some((r) => r.name === 'levee.retry.delay' && r.value === 0.001));
    const attempts = recorded.filter((r) => r.name === 'levee.attempts').map((r) => r.attributes['levee.outcome']);
    assert.deepEqual(attempts, ['error-class', 'success']);
    const calls = recorded.filter((r) => r.name === 'levee.calls');
    assert.deepEqual(calls[0].attributes, {
      'levee.policy': 'quick',
      'levee.result': 'success',
      'levee.retried': true,
    });
  });

  test("each instrument has the contract's unit and description (INSTRUMENTS)", async () => {
    const made = new Map();
    const instrument = (name, options) => {
      made.set(name, options);
      return { add: () => undefined, record: () => undefined };
    };
    const meter = { createCounter: instrument, createHistogram: instrument, createGauge: instrument };
    const doc =
      'policies:\n  k:\n    attempts: 1\n    keys: { max: 1 }\n    breaker: { window: { kind: count, size: 2 }, minimum-calls: 2, failure-rate: 50, open-duration: 1h }\n';
    const levee = loadSync(doc, { seed: 1n, meter });
    const down = () => Promise.reject(new FlakyError('x'));
    await levee.run('k', () => 1, { key: 'a' });
    await levee.run('k', () => 1, { key: 'b' }); // evicts a
    for (let i = 0; i < 2; i++) await assert.rejects(levee.run('k', down, { key: 'b' }));
    await levee.run('k', () => 1, { key: 'c' }); // overflows: b holds protection
    levee.flush();
    assert.ok(made.has('levee.keys.evicted') && made.has('levee.keys.overflow'), [...made.keys()].join());
    for (const [name, , unit, description] of constants.INSTRUMENTS) {
      if (made.has(name)) assert.deepEqual(made.get(name), { unit, description }, name);
    }
  });

  test('the breaker gauge carries the key, unless the sink is told to drop it', async () => {
    const BREAKER =
      'policies:\n  b:\n    attempts: 1\n    breaker: { window: { kind: count, size: 2 }, minimum-calls: 2, failure-rate: 50, open-duration: 1s }\n';
    for (const gaugeKey of [true, false]) {
      const gauges = [];
      const meter = {
        createCounter: () => ({ add: () => undefined }),
        createHistogram: () => ({ record: () => undefined }),
        createGauge: (name) => ({ record: (value, attributes) => gauges.push({ name, value, attributes }) }),
      };
      const levee = loadSync(BREAKER, { seed: 1n, telemetry: new OpenTelemetrySink(meter, undefined, { gaugeKey }) });
      for (let i = 0; i < 2; i++) {
        await assert.rejects(levee.run('b', () => Promise.reject(new FatalError('x')), { key: 'db-1' }));
      }
      const expected = gaugeKey ? { 'levee.policy': 'b', 'levee.key': 'db-1' } : { 'levee.policy': 'b' };
      assert.deepEqual(gauges, [{ name: 'levee.breaker.state', value: 1, attributes: expected }]);
    }
  });

  test('with @opentelemetry/api installed, load() uses its global meter', async () => {
    const api = await import('@opentelemetry/api');
    const { recorded, meter } = fakeMeter();
    api.metrics.setGlobalMeterProvider({ getMeter: () => meter });
    try {
      const levee = await load(DOC, { seed: 1n });
      await assert.rejects(levee.run('quick', () => Promise.reject(new FatalError('x'))));
      assert.ok(
        recorded.some(
          (r) =>
            r.name === 'levee.calls' &&
            r.attributes['levee.result'] === 'failure' &&
            r.attributes['levee.reason'] === 'non-retryable',
        ),
      );
    } finally {
      api.metrics.disable();
    }
  });
});

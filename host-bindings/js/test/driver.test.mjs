// The driver alone (sans-I/O): verdicts in, actions out, no component, no clock, no timer.
// Every check of docs/hosts.md section 2 and every branch of the recovery path of section 3.

import assert from 'node:assert/strict';
import { describe, test } from 'node:test';
import {
  ACT_ATTEMPT,
  ACT_DEGRADED,
  ACT_DONE,
  ACT_END_ATTEMPT,
  ACT_END_FALLBACK,
  ACT_FAIL,
  ACT_FALLBACK,
  ACT_FAULT,
  ACT_SLEEP,
  CallDriver,
} from '../dist/driver.js';
import { encodeVerdict } from '../dist/index.js';

const MS = 1_000_000;
const policy = (over = {}) => ({
  index: 0,
  name: 'p',
  maxAttempts: 3,
  attemptTimeoutNs: 0,
  deadlineNs: 0,
  deadlineBig: 0n,
  fallbacks: ['cache'],
  ...over,
});
const timed = (timeout, deadline) =>
  policy({ attemptTimeoutNs: timeout, deadlineNs: deadline, deadlineBig: BigInt(deadline) });
const attempt = (n, timeout = 0, events = false) => encodeVerdict(0, n, timeout, events);
const retry = (delay) => encodeVerdict(3, 0, delay, false);
const wait = (delay) => encodeVerdict(1, 6, delay, false);
const done = encodeVerdict(2, 0, 0, false);
const fallback = (index, reason = 2) => encodeVerdict(4, reason, index, false);
const fail = (reason, hint = 0) => encodeVerdict(5, reason, hint, false);
const invalid = encodeVerdict(6, 1, 0, false);

describe('the driver relays verdicts that keep the contract', () => {
  test('attempt, retry, attempt, done', () => {
    const d = new CallDriver(policy(), 0n);
    assert.equal(d.next(attempt(1), 0n), ACT_ATTEMPT);
    assert.equal(d.attempts, 1);
    assert.equal(d.timeoutNs, 0);
    assert.equal(d.op, 'report');
    assert.equal(d.next(retry(100 * MS), 5n), ACT_SLEEP);
    assert.equal(d.sleepNs, 100 * MS);
    assert.equal(d.retry, true);
    assert.equal(d.op, 'acquire');
    assert.equal(d.next(attempt(2, 0, true), 100n), ACT_ATTEMPT);
    assert.equal(d.events, true);
    assert.equal(d.next(done, 200n), ACT_DONE);
  });

  test('a rate-limit wait is a sleep, not a retry', () => {
    const d = new CallDriver(policy(), 0n);
    assert.equal(d.next(wait(7 * MS), 0n), ACT_SLEEP);
    assert.equal(d.retry, false);
  });

  test('fallback and fail carry the core reason and hint', () => {
    const d = new CallDriver(policy(), 0n, 1, 'report');
    assert.equal(d.next(fallback(0, 3), 0n), ACT_FALLBACK);
    assert.equal(d.fallbackName, 'cache');
    assert.equal(d.reason, 'non-retryable');
    assert.equal(d.op, 'report-fallback');
    assert.equal(d.next(fail(5, 900 * MS), 0n), ACT_FAIL);
    assert.equal(d.reason, 'breaker-open');
    assert.equal(d.hintNs, 900 * MS);
  });

  test('the timeout may be the time left before the deadline', () => {
    const d = new CallDriver(timed(2000 * MS, 3000 * MS), 0n);
    assert.equal(d.next(attempt(1, 2000 * MS), 0n), ACT_ATTEMPT);
    assert.equal(d.next(retry(500 * MS), 2000n * BigInt(MS)), ACT_SLEEP);
    assert.equal(d.next(attempt(2, 500 * MS), 2500n * BigInt(MS)), ACT_ATTEMPT);
    assert.equal(d.timeoutNs, 500 * MS);
  });
});

describe('verdicts that break the contract are guest faults', () => {
  const cases = [
    ['an unknown kind', policy(), 'start', 0, encodeVerdict(7, 0, 0, false)],
    ['reserved bits', policy(), 'start', 0, attempt(1) | 0x40n],
    ['the wrong attempt number', policy(), 'start', 0, attempt(2)],
    ['an attempt past the maximum', policy({ maxAttempts: 1 }), 'acquire', 1, attempt(2)],
    ['a timeout above the policy', timed(1000 * MS, 0), 'start', 0, attempt(1, 1001 * MS)],
    ['a timeout past the deadline', timed(0, 1000 * MS), 'start', 0, attempt(1, 1001 * MS)],
    ['no timeout under an attempt timeout', timed(1000 * MS, 0), 'start', 0, attempt(1, 0)],
    ['no timeout under a deadline', timed(0, 1000 * MS), 'start', 0, attempt(1, 0)],
    ['a retry past the deadline', timed(0, 1000 * MS), 'report', 1, retry(1001 * MS)],
    ['a wait with an unknown reason', policy(), 'start', 0, encodeVerdict(1, 200, 5, false)],
    ['a fallback index out of range', policy(), 'report', 1, fallback(1)],
    ['fail without a reason', policy(), 'report', 1, fail(0)],
    ['fail with an unknown reason', policy(), 'report', 1, fail(99)],
    ['done to start', policy(), 'start', 0, done],
    ['done to acquire', policy(), 'acquire', 1, done],
  ];
  for (const [what, p, op, attempts, v] of cases) {
    test(what, () => {
      const d = new CallDriver(p, 0n, attempts, op);
      assert.equal(d.next(v, 0n), ACT_FAULT);
      assert.equal(d.fault, 'contract');
      assert.match(d.detail, new RegExp(`answered to ${op}`));
    });
  }

  test('invalid is its own fault', () => {
    const d = new CallDriver(policy(), 0n, 1, 'report');
    assert.equal(d.next(invalid, 0n), ACT_FAULT);
    assert.equal(d.fault, 'invalid');
  });

  test('a huge payload is exact (BigInt path) and still checked', () => {
    const d = new CallDriver(timed(0, 1000 * MS), 0n, 1, 'report');
    assert.equal(d.next(retry(2 ** 48 - 1), 0n), ACT_FAULT);
  });
});

describe('the one recovery path', () => {
  test('after a report: the attempt stands; after a report-fallback: the fallback stands', () => {
    assert.equal(new CallDriver(policy(), 0n, 1, 'report').recover(0n), ACT_END_ATTEMPT);
    assert.equal(new CallDriver(policy(), 0n, 1, 'report-fallback').recover(0n), ACT_END_FALLBACK);
  });

  test('after start or acquire: one degraded attempt under min(attempt-timeout, time left)', () => {
    const d = new CallDriver(timed(2000 * MS, 3000 * MS), 0n);
    assert.equal(d.recover(0n), ACT_DEGRADED);
    assert.equal(d.attempts, 1);
    assert.equal(d.timeoutNs, 2000 * MS);
    const late = new CallDriver(timed(2000 * MS, 3000 * MS), 0n, 1, 'acquire');
    assert.equal(late.recover(2500n * BigInt(MS)), ACT_DEGRADED);
    assert.equal(late.attempts, 2);
    assert.equal(late.timeoutNs, 500 * MS);
    const none = new CallDriver(policy(), 0n);
    assert.equal(none.recover(0n), ACT_DEGRADED);
    assert.equal(none.timeoutNs, 0);
  });

  test('no time left: the typed deadline error, no attempt', () => {
    const d = new CallDriver(timed(0, 1000 * MS), 0n, 1, 'acquire');
    assert.equal(d.recover(1000n * BigInt(MS)), ACT_FAIL);
    assert.equal(d.reason, 'deadline');
    assert.equal(d.attempts, 1);
  });
});

#!/usr/bin/env python3
"""The conformance scenarios: the source of `vectors/*.json`.

Each scenario is a policy, a seed and a trace. Where a person can state the right answer
(the anchors of ../shared/ANCHORS.md: exact backoff values, the gRPC A6 throttling sequence,
Retry-After forms, breaker transitions, ...) it is written here as a partial expectation
(`kind`, `reason`, `payload`, ...). The Rust runner then fills in every expectation in full
from the native engine (`LEVEE_BLESS=1 cargo test --release -p levee-conformance`), and
refuses to do so if the engine disagrees with anything written here. The JSON files are the
contract the hosts replay; regenerate them only when the core's intended behaviour changes.

    python3 conformance/scenarios.py            # write vectors/ (expectations as written)
    LEVEE_BLESS=1 cargo test --release -p levee-conformance --test vectors   # fill in the rest
"""

import json
import os
import sys

MS = 1_000_000
S = 1_000 * MS
VECTORS = []

# start flags
NON_IDEMPOTENT = 1
IDEMPOTENCY_KEY = 2
GET, HEAD, POST, PUT, DELETE, PATCH = (m << 8 for m in (1, 2, 3, 4, 5, 6))
OTHER_METHOD = 15 << 8
OVERLOADED = 1


ERRORS = True  # load_errors placeholder: "this document must not load" (the runner fills in the list)


def vec(name, description, features, document, steps, seed=42, load_errors=None):
    assert all(v["name"] != name for v in VECTORS), name
    if load_errors is None and not steps:
        load_errors = ERRORS
    VECTORS.append({
        "name": name,
        "description": description,
        "features": features,
        "document": document,
        "seed": seed,
        "load_errors": load_errors,
        "steps": steps,
    })


def _x(expect):
    return {} if expect is None else {"expect": expect}


def start(call, now, policy="p", key="", flags=0, expect=None, settle=None):
    s = {"op": "start", "call": call, "policy": policy, "key": key, "flags": flags, "now": now}
    if settle:
        s.update({"settle_call": settle[0], "settle_at": settle[1], "settle_elapsed": settle[2]})
    s.update(_x(expect))
    return s


def acquire(call, now, expect=None):
    return {"op": "acquire", "call": call, "now": now, **_x(expect)}


def report(call, now, kind="success", code=0, text="", elapsed=0, wall=0, flags=0, expect=None):
    return {"op": "report", "call": call, "now": now, "elapsed": elapsed, "kind": kind, "code": code,
            "text": text, "wall_secs": wall, "flags": flags, **_x(expect)}


def fallback(call, now, ok, expect=None):
    return {"op": "report_fallback", "call": call, "now": now, "ok": ok, **_x(expect)}


def cancel(call, now):
    return {"op": "cancel", "call": call, "now": now}


def drain(expect=None):
    return {"op": "drain_events", **_x(expect)}


def wakes(expect):
    """`take-wakes`: the calls granted a bulkhead slot since the last take, in grant order."""
    return {"op": "take_wakes", "expect": expect}


def breaker(now, policy="p", key="", expect=None):
    return {"op": "breaker_state", "policy": policy, "key": key, "now": now, **_x(expect)}


def force(state, now, policy="p", key="", expect=None):
    return {"op": "set_breaker_state", "policy": policy, "key": key, "state": state, "now": now, **_x(expect)}


def info(call, expect=None):
    return {"op": "call_info", "call": call, **_x(expect)}


def pinfo(policy="p", expect=None):
    return {"op": "policy_info", "policy": policy, **_x(expect)}


def analyze(layers, policy="p", expect=None):
    return {"op": "analyze", "policy": policy, "layers": layers, **_x(expect)}


def export_import():
    return {"op": "export_import"}


def reload(document, expect=None):
    return {"op": "reload", "document": document, **_x(expect)}


def import_hex(data, expect=None):
    return {"op": "import_state", "bytes_hex": data.hex(), **_x(expect)}


# Partial verdict expectations.
def attempt(n=None, timeout=None):
    e = {"kind": "attempt"}
    if n is not None:
        e["detail"] = n
    if timeout is not None:
        e["payload"] = timeout
    return e


def retry(delay=None):
    e = {"kind": "retry"}
    if delay is not None:
        e["payload"] = delay
    return e


def wait(d=None):
    e = {"kind": "wait", "reason": "rate-limited"}
    if d is not None:
        e["payload"] = d
    return e


DONE = {"kind": "done", "payload": 0}


def fail(reason, hint=None):
    e = {"kind": "fail", "reason": reason}
    if hint is not None:
        e["payload"] = hint
    return e


def fb(index, reason):
    return {"kind": "fallback", "payload": index, "reason": reason}


def invalid(code):
    return {"kind": "invalid", "detail": code}


def policy(body, name="p"):
    lines = [f"policies:", f"  {name}:"]
    lines += ["    " + line for line in body.strip("\n").split("\n")] if body.strip() else ["    {}"]
    return "\n".join(lines) + "\n"


def fail_then(call, t, kind="http-status", code=503, text="", n=1, **kw):
    """Report a failure at t."""
    return report(call, t, kind=kind, code=code, text=text, **kw)


# --------------------------------------------------------------------------------------
# Attempts, timeouts, deadlines
# --------------------------------------------------------------------------------------

NOJ = "backoff: { kind: constant, base: 100ms, jitter: none }"

vec("attempts-default-three", "The default policy makes 3 attempts and then gives up with retries-exhausted.",
    ["attempts", "defaults"], policy(NOJ), [
        start(1, 0, expect=attempt(1, 0)),
        report(1, 10 * MS, "connection-error", expect=retry(100 * MS)),
        acquire(1, 110 * MS, expect=attempt(2)),
        report(1, 120 * MS, "connection-error", expect=retry(100 * MS)),
        acquire(1, 220 * MS, expect=attempt(3)),
        report(1, 230 * MS, "connection-error", expect=fail("retries-exhausted")),
        drain(),
    ])

vec("attempts-one-means-no-retry", "attempts: 1 makes the first call only.", ["attempts"],
    policy("attempts: 1"), [
        start(1, 0, expect=attempt(1)),
        report(1, MS, "timeout", expect=fail("retries-exhausted")),
        drain(),
    ])

vec("attempts-zero-is-an-error", "attempts: 0 is refused with the field path.", ["attempts", "errors"],
    policy("attempts: 0"), [], load_errors=[{"path": "policies.p.attempts", "message": "must be at least 1 (attempts count the first call; 1 means no retry)"}])

vec("attempts-negative-and-text", "A negative or textual attempts value names the field.", ["attempts", "errors"],
    "policies:\n  a: { attempts: -2 }\n  b: { attempts: three }\n", [])

vec("attempts-max-u32", "attempts may be as large as u32::MAX; the backoff stays capped for late retries.", ["attempts", "backoff"],
    policy("attempts: 4294967295\nbackoff: { base: 1ms, cap: 50ms, jitter: none }"),
    [start(1, 0)] + sum([[report(1, i * S + 1, "timeout"), acquire(1, i * S + S // 2)] for i in range(12)], []) + [drain()])

vec("attempt-timeout-in-verdict", "The per-attempt timeout rides in the attempt verdict.", ["timeout"],
    policy("attempt-timeout: 250ms"), [start(1, 5, expect=attempt(1, 250 * MS)), report(1, 6, expect=DONE)])

vec("deadline-shortens-attempt-timeout", "An attempt never gets more time than the deadline leaves.", ["timeout", "deadline"],
    policy("attempt-timeout: 2s\ndeadline: 3s\n" + NOJ), [
        start(1, 0, expect=attempt(1, 2 * S)),
        report(1, 2 * S, "timeout", elapsed=2 * S, expect=retry(100 * MS)),
        acquire(1, 2100 * MS, expect=attempt(2, 900 * MS)),
        report(1, 3 * S, "timeout", elapsed=900 * MS, expect=fail("deadline")),
    ])

vec("deadline-only-gives-remaining-time", "With a deadline and no attempt timeout, the attempt gets what remains.", ["deadline"],
    policy("deadline: 1s"), [start(1, 100, expect=attempt(1, S)), report(1, 200, expect=DONE)])

vec("deadline-no-retry-past-it", "A retry whose start would fall past the deadline is not scheduled (tenacity #423).", ["deadline"],
    policy("deadline: 1s\nbackoff: { kind: constant, base: 600ms, jitter: none }"), [
        start(1, 0),
        report(1, 300 * MS, "timeout", expect=retry(600 * MS)),
        acquire(1, 900 * MS),
        report(1, 950 * MS, "timeout", expect=fail("deadline")),
        drain(),
    ])

vec("deadline-exact-boundary", "A retry that would start exactly at the deadline is refused.", ["deadline"],
    policy("deadline: 1s\nbackoff: { kind: constant, base: 500ms, jitter: none }"), [
        start(1, 0), report(1, 500 * MS, "timeout", expect=fail("deadline")),
    ])

vec("deadline-passed-at-acquire", "An acquire after the deadline is rejected with reason deadline.", ["deadline"],
    policy("deadline: 1s\n" + NOJ), [
        start(1, 0), report(1, 100 * MS, "timeout", expect=retry(100 * MS)),
        acquire(1, 2 * S, expect=fail("deadline")), drain(),
    ])

vec("duration-needs-unit", "A duration without a unit is refused with a suggestion.", ["errors", "durations"],
    policy("attempt-timeout: 250"), [], load_errors=[{"path": "policies.p.attempt-timeout", "message": "`250` needs a unit: ns, us, ms, s, m or h (such as \"250ms\")"}])

vec("duration-forms", "Durations accept ns, us, ms, s, m, h and fractions.", ["durations"],
    "policies:\n  a: { attempt-timeout: 1500us }\n  b: { attempt-timeout: 1.5s, deadline: 2m }\n  c: { attempt-timeout: 1h }\n",
    [pinfo("a", {"attempt_timeout": 1_500_000}), pinfo("b", {"attempt_timeout": 1_500_000_000, "deadline": 120 * S}), pinfo("c", {"attempt_timeout": 3600 * S})])

vec("duration-bad-unit-and-zero", "An unknown unit and a zero timeout are refused.", ["errors", "durations"],
    "policies:\n  a: { attempt-timeout: 5 weeks }\n  b: { deadline: \"0\" }\n", [])

# --------------------------------------------------------------------------------------
# Backoff and jitter
# --------------------------------------------------------------------------------------

def retries(doc, n, name, desc, features, seed=42, code=503):
    steps = [start(1, 0)]
    t = 0
    for _ in range(n):
        t += MS
        steps.append(report(1, t, "http-status", code=code))
        t += 100 * S
        steps.append(acquire(1, t))
    steps.append(drain())
    vec(name, desc, features, doc, steps, seed=seed)


def expo_steps(delays):
    steps = [start(1, 0)]
    t = 0
    for d in delays:
        t += MS
        steps.append(report(1, t, "http-status", code=503, expect=retry(d)))
        t += d
        steps.append(acquire(1, t, expect=attempt()))
    return steps


vec("backoff-exponential-exact", "expo(n) = min(cap, base * 2^(n-1)) without jitter: 100, 200, 400 ... capped at 5s.", ["backoff"],
    policy("attempts: 10\nbackoff: { kind: exponential, base: 100ms, multiplier: 2, cap: 5s, jitter: none }"),
    expo_steps([100 * MS, 200 * MS, 400 * MS, 800 * MS, 1600 * MS, 3200 * MS, 5 * S, 5 * S, 5 * S]))

vec("backoff-exponential-multiplier-3", "A multiplier of 3: 10, 30, 90, 270ms.", ["backoff"],
    policy("attempts: 5\nbackoff: { base: 10ms, multiplier: 3, cap: 1s, jitter: none }"),
    expo_steps([10 * MS, 30 * MS, 90 * MS, 270 * MS]))

vec("backoff-linear-exact", "linear: base * n, capped.", ["backoff"],
    policy("attempts: 6\nbackoff: { kind: linear, base: 100ms, cap: 350ms, jitter: none }"),
    expo_steps([100 * MS, 200 * MS, 300 * MS, 350 * MS, 350 * MS]))

vec("backoff-constant-exact", "constant: base every time.", ["backoff"],
    policy("attempts: 4\nbackoff: { kind: constant, base: 70ms, jitter: none }"),
    expo_steps([70 * MS, 70 * MS, 70 * MS]))

vec("backoff-overflow-safe", "Exponential backoff stays at the cap for retry 60 and beyond (no overflow, no zero delay: aws-sdk-java #874, Polly #2163).", ["backoff", "overflow"],
    policy("attempts: 80\nbackoff: { base: 1s, multiplier: 10, cap: 1h, jitter: none }"),
    expo_steps([S, 10 * S, 100 * S, 1000 * S] + [3600 * S] * 70))

retries(policy("attempts: 40\nbackoff: { base: 10ms, cap: 2s, jitter: full }"), 39, "jitter-full-seeded",
        "Full jitter U(0, expo(n)) from the seeded PRNG: exact values for seed 7.", ["jitter", "prng"], seed=7)
retries(policy("attempts: 40\nbackoff: { base: 10ms, cap: 2s, jitter: equal }"), 39, "jitter-equal-seeded",
        "Equal jitter expo/2 + U(0, expo/2): exact values for seed 7.", ["jitter", "prng"], seed=7)
retries(policy("attempts: 40\nbackoff: { kind: decorrelated, base: 10ms, cap: 2s }"), 39, "jitter-decorrelated-seeded",
        "Brooker's decorrelated jitter min(cap, U(base, 3*sleep)): exact values for seed 7.", ["jitter", "prng"], seed=7)
retries(policy("attempts: 40\nbackoff: { kind: constant, base: 1s, cap: 2s, jitter: proportional }"), 39, "jitter-polly-proportional-seeded",
        "Polly's constant-backoff jitter d +- 25%: exact values for seed 7.", ["jitter", "prng"], seed=7)
retries(policy("attempts: 40\nbackoff: { base: 10ms, cap: 2s, jitter: full }"), 39, "jitter-full-other-seed",
        "The same policy with another seed gives other, equally exact, delays.", ["jitter", "prng"], seed=123456789)

vec("prng-same-seed-same-decisions", "Two calls with the same seed and trace draw the same jitter as a fresh engine would.", ["prng"],
    policy("attempts: 3\nbackoff: { base: 100ms, cap: 1s, jitter: full }"), [
        start(1, 0), report(1, MS, "timeout"), start(2, 2 * MS), report(2, 3 * MS, "timeout"),
        export_import(), acquire(1, S), report(1, S + MS, "timeout"), acquire(2, S), report(2, S + MS, "timeout"),
    ], seed=2026)

vec("backoff-decorrelated-jitter-mismatch", "decorrelated jitter goes only with the decorrelated kind.", ["errors", "jitter"],
    policy("backoff: { kind: exponential, jitter: decorrelated }"), [])

vec("backoff-decorrelated-kind-other-jitter", "The decorrelated kind has its own jitter: another jitter is refused with a message that does not tell to use the kind it already has.", ["errors", "jitter"],
    policy("backoff: { kind: decorrelated, jitter: full }"), [])

vec("backoff-default-cap-follows-constant-base", "A constant backoff above the default cap (20s) loads without a cap: the default cap follows the base, so 30s is waited every time.", ["backoff", "defaults"],
    policy("attempts: 3\nbackoff: { kind: constant, base: 30s, jitter: none }"),
    expo_steps([30 * S, 30 * S]))

vec("backoff-default-cap-below-growing-base", "A growing backoff whose base is above the default cap (20s) and has no cap is refused with a message that says the cap is the default, not one the user wrote.", ["backoff", "errors", "defaults"],
    "policies:\n  a: { backoff: { base: 30s } }\n  b: { backoff: { kind: linear, base: 1m } }\n  c: { backoff: { kind: decorrelated, base: 21s } }\n  d: { backoff: { base: 30s, cap: 30s } }\n", [],
    load_errors=[{"path": f"policies.{p}.backoff.cap",
                  "message": f"is not written and its default (20s) is below base ({base}): the {kind} kind grows from base up to cap, so write a cap of at least {base}"}
                 for p, kind, base in (("a", "exponential", "30s"), ("b", "linear", "1m"), ("c", "decorrelated", "21s"))])

vec("backoff-errors", "Bad backoff fields are each named: unknown kind (with a suggestion), multiplier below 1, cap below base, unknown field.", ["errors", "backoff"],
    "policies:\n  a: { backoff: { kind: exponentail } }\n  b: { backoff: { multiplier: 0.5 } }\n  c: { backoff: { base: 2s, cap: 1s } }\n  d: { backoff: { jiter: full } }\n  e: { backoff: { jitter: proportional, jitter-ratio: 2 } }\n", [])

# --------------------------------------------------------------------------------------
# Classification
# --------------------------------------------------------------------------------------

def classify_vec(name, desc, body, outcomes):
    steps = []
    for i, (kind, code, text, expect, flags) in enumerate(outcomes, start=1):
        steps.append(start(i, i * S))
        steps.append(report(i, i * S + MS, kind, code=code, text=text, flags=flags, expect=expect))
    vec(name, desc, ["classification"], policy(body), steps)


classify_vec("classify-defaults", "By default: timeouts, connection errors, 429, 502, 503, 504 retry; 400, 401, 403, 404, 422 and 500 do not; 2xx and 3xx succeed.",
             NOJ, [
                 ("timeout", 0, "", retry(), 0), ("connection-error", 0, "", retry(), 0),
                 ("http-status", 429, "", retry(), 0), ("http-status", 502, "", retry(), 0),
                 ("http-status", 503, "", retry(), 0), ("http-status", 504, "", retry(), 0),
                 ("http-status", 400, "", fail("non-retryable"), 0), ("http-status", 401, "", fail("non-retryable"), 0),
                 ("http-status", 403, "", fail("non-retryable"), 0), ("http-status", 404, "", fail("non-retryable"), 0),
                 ("http-status", 422, "", fail("non-retryable"), 0), ("http-status", 500, "", fail("non-retryable"), 0),
                 ("http-status", 200, "", DONE, 0), ("http-status", 302, "", DONE, 0), ("success", 0, "", DONE, 0),
             ])

classify_vec("classify-ranges-and-never", "retry-on http:500-599 with never-retry http:501: 500 and 599 retry, 501 does not.",
             'retry-on: ["http:500-599"]\nnever-retry: ["http:501"]\n' + NOJ, [
                 ("http-status", 500, "", retry(), 0), ("http-status", 599, "", retry(), 0),
                 ("http-status", 501, "", fail("non-retryable"), 0), ("timeout", 0, "", fail("non-retryable"), 0),
             ])

classify_vec("classify-class-5xx", "retry-on http:5xx covers 500-599.", 'retry-on: ["http:5xx"]\n' + NOJ,
             [("http-status", 500, "", retry(), 0), ("http-status", 450, "", fail("non-retryable"), 0)])

classify_vec("classify-grpc", "gRPC: UNAVAILABLE retries; OK succeeds; INVALID_ARGUMENT does not; RESOURCE_EXHAUSTED only with a pushback.",
             NOJ, [
                 ("grpc-status", 14, "", retry(), 0), ("grpc-status", 0, "", DONE, 0),
                 ("grpc-status", 3, "", fail("non-retryable"), 0), ("grpc-status", 8, "", fail("non-retryable"), 0),
                 ("grpc-status", 8, "250", retry(250 * MS), 0),
             ])

classify_vec("classify-grpc-by-name-and-number", "gRPC rules by UPPER_SNAKE name and by number.",
             'retry-on: ["grpc:DEADLINE_EXCEEDED", "grpc:10"]\n' + NOJ,
             [("grpc-status", 4, "", retry(), 0), ("grpc-status", 10, "", retry(), 0), ("grpc-status", 14, "", fail("non-retryable"), 0)])

classify_vec("classify-error-classes", "Named error classes: listed ones retry, others do not.",
             'retry-on: ["error:ThrottlingException", "timeout"]\n' + NOJ,
             [("error-class", 0, "ThrottlingException", retry(), 0), ("error-class", 0, "ValidationException", fail("non-retryable"), 0)])

classify_vec("classify-error-wildcard", "error:* retries any named error class.", 'retry-on: ["error:*"]\n' + NOJ,
             [("error-class", 0, "Anything", retry(), 0), ("http-status", 503, "", fail("non-retryable"), 0)])

classify_vec("classify-envoy-overloaded", "A response marked x-envoy-overloaded is never retried, even a 503.", NOJ,
             [("http-status", 503, "", fail("non-retryable"), OVERLOADED), ("http-status", 503, "", retry(), 0)])

vec("classify-bad-rules", "Bad rules are named by index: unknown kind, status out of range, reversed range, unknown gRPC name, empty error class.",
    ["classification", "errors"],
    policy('retry-on: ["bogus", "http:600", "http:599-500", "grpc:nope", "error:"]'), [])

# --------------------------------------------------------------------------------------
# Idempotency
# --------------------------------------------------------------------------------------

classify_steps = lambda flags_list: sum([[start(i, i * S, flags=f), report(i, i * S + 1, "http-status", code=503, expect=e)]
                                         for i, (f, e) in enumerate(flags_list, start=1)], [])

vec("idempotency-methods", "GET, PUT and DELETE are retried; POST and PATCH are not; an unknown method is not.", ["idempotency"],
    policy(NOJ), classify_steps([(GET, retry()), (PUT, retry()), (DELETE, retry()), (POST, fail("non-idempotent")),
                                 (PATCH, fail("non-idempotent")), (OTHER_METHOD, fail("non-idempotent")), (0, retry())]))

vec("idempotency-key-allows-retry", "A POST that carries an idempotency key is retried.", ["idempotency"],
    policy(NOJ), classify_steps([(POST | IDEMPOTENCY_KEY, retry()), (NON_IDEMPOTENT | IDEMPOTENCY_KEY, retry())]))

vec("idempotency-flag-non-idempotent", "A call flagged non-idempotent is not retried, whatever its method.", ["idempotency"],
    policy(NOJ), classify_steps([(NON_IDEMPOTENT, fail("non-idempotent")), (NON_IDEMPOTENT | GET, fail("non-idempotent"))]))

vec("idempotency-custom-methods", "idempotent-methods can add POST.", ["idempotency"],
    policy("idempotent-methods: [GET, POST]\n" + NOJ), classify_steps([(POST, retry()), (PUT, fail("non-idempotent"))]))

vec("idempotency-bad-method", "An unknown method name in idempotent-methods is an error.", ["idempotency", "errors"],
    policy("idempotent-methods: [GET, FETCH]"), [])

# --------------------------------------------------------------------------------------
# Retry-After and pushback
# --------------------------------------------------------------------------------------

WALL = 784_111_777  # Sun, 06 Nov 1994 08:49:37 GMT


def ra_vec(name, desc, text, wall, expect, body=NOJ, code=503):
    vec(name, desc, ["retry-after"], policy(body), [start(1, 0), report(1, MS, "http-status", code=code, text=text, wall=wall, expect=expect), drain()])


ra_vec("retry-after-delta-seconds", "Retry-After: 3 means 3 seconds, no jitter.", "3", 0, retry(3 * S))
ra_vec("retry-after-120-is-not-a-year", "\"120\" is delta-seconds, never the year 120 (denoland/std #7299).", "120", WALL, retry(120 * S))
ra_vec("retry-after-zero", "Retry-After: 0 retries at once.", "0", 0, retry(0))
ra_vec("retry-after-imf-fixdate", "IMF-fixdate, 30 s after the host's wall clock.", "Sun, 06 Nov 1994 08:49:37 GMT", WALL - 30, retry(30 * S))
ra_vec("retry-after-rfc850", "The obsolete RFC 850 form.", "Sunday, 06-Nov-94 08:49:37 GMT", WALL - 30, retry(30 * S))
ra_vec("retry-after-asctime", "The asctime form.", "Sun Nov  6 08:49:37 1994", WALL - 30, retry(30 * S))
ra_vec("retry-after-date-in-past", "A date in the past means retry now.", "Sun, 06 Nov 1994 08:49:37 GMT", WALL + 100, retry(0))
ra_vec("retry-after-date-without-wall-clock", "An HTTP-date with no wall clock falls back to the backoff.", "Sun, 06 Nov 1994 08:49:37 GMT", 0, retry(100 * MS))
ra_vec("retry-after-garbage-ignored", "An unparseable Retry-After is ignored (RFC 9110): the backoff applies.", "soon-ish", WALL, retry(100 * MS))
ra_vec("retry-after-over-cap-fails", "A Retry-After above the cap (default 300s) gives up with retry-after-too-long.", "301", 0, fail("retry-after-too-long", 301 * S))
ra_vec("retry-after-over-cap-clamps", "over-cap: clamp waits the cap instead.", "3600", 0, retry(10 * S),
       body="retry-after: { cap: 10s, over-cap: clamp }\n" + NOJ)
ra_vec("retry-after-beyond-deadline", "A Retry-After that does not fit the deadline gives up with reason deadline.", "5", 0, fail("deadline"),
       body="deadline: 2s\n" + NOJ)
ra_vec("retry-after-not-honoured", "honor: false ignores Retry-After.", "5", 0, retry(100 * MS), body="retry-after: { honor: false }\n" + NOJ)
ra_vec("retry-after-on-429", "429 with Retry-After waits as told.", "2", 0, retry(2 * S), code=429)
ra_vec("retry-after-on-non-retryable-status", "A Retry-After on a 400 does not make it retryable.", "2", 0, fail("non-retryable"), code=400)


def pb_vec(name, desc, text, expect, body=NOJ):
    vec(name, desc, ["pushback", "grpc"], policy(body), [start(1, 0), report(1, MS, "grpc-status", code=14, text=text, expect=expect), drain()])


pb_vec("pushback-valid", "grpc-retry-pushback-ms: 1500 delays the retry by 1.5 s.", "1500", retry(1500 * MS))
pb_vec("pushback-negative-stops", "A negative pushback means do not retry (gRPC A6).", "-1", fail("pushback"))
pb_vec("pushback-unparseable-stops", "An unparseable pushback means do not retry.", "abc", fail("pushback"))
pb_vec("pushback-over-cap", "A pushback above the cap gives up.", "400000", fail("retry-after-too-long"))

# gRPC A6: "For subsequent retries, the delay period will be reset to the initialBackoff
# setting" after a pushback (grpc-go numRetriesSincePushback, grpc-java
# RetriableStreamTest.pushback). Levee does the same after any server-directed delay.
A6_BACKOFF = "attempts: 6\nbackoff: { base: 100s, multiplier: 2, cap: 700s, jitter: none }"


def restart_steps(kind, code, told):
    steps, t = [start(1, 0, expect=attempt(1))], 0
    for n, (text, delay) in enumerate([(told, S), (told, S), ("", 100 * S), ("", 200 * S), ("", 400 * S)], start=1):
        t += MS
        steps.append(report(1, t, kind, code=code, text=text, expect=retry(delay)))
        t += delay
        steps.append(acquire(1, t, expect=attempt(n + 1)))
    steps += [report(1, t + MS, kind, code=code, expect=fail("retries-exhausted")), drain()]
    return steps


vec("pushback-restarts-backoff", "After a server pushback the next plain retries restart at the initial backoff (gRPC A6, grpc-go numRetriesSincePushback): two 1 s pushbacks, then 100 s, 200 s, 400 s, not 400 s, 700 s, 700 s.",
    ["pushback", "grpc", "backoff", "anchor"], policy(A6_BACKOFF), restart_steps("grpc-status", 14, "1000"))

vec("retry-after-restarts-backoff", "A Retry-After restarts the backoff as a pushback does: two Retry-After: 1, then 100 s, 200 s, 400 s.",
    ["retry-after", "backoff"], policy(A6_BACKOFF), restart_steps("http-status", 503, "1"))

# Seed 7's first two draws, each from U(10ms, 30ms) (the first two draws of
# jitter-decorrelated-seeded's stream; without the restart the second would be drawn from
# U(10ms, min(1s, 3 x 5s)) and be 285_963_717).
RESTART_DECORRELATED = (24_011_530, 15_575_024)

vec("pushback-restarts-decorrelated", "After a server delay the decorrelated recurrence starts again at base (U(10ms, 30ms)), not at 3 x the server's delay; a server-directed retry draws no jitter.",
    ["pushback", "backoff", "jitter", "prng"], policy("attempts: 4\nbackoff: { kind: decorrelated, base: 10ms, cap: 1s }"), [
        start(1, 0),
        report(1, MS, "grpc-status", code=14, text="", expect=retry(RESTART_DECORRELATED[0])),
        acquire(1, S),
        report(1, S + MS, "grpc-status", code=14, text="5000", expect=retry(5 * S)),
        acquire(1, 7 * S),
        report(1, 7 * S + MS, "grpc-status", code=14, text="", expect=retry(RESTART_DECORRELATED[1])),
        drain(),
    ], seed=7)

# --------------------------------------------------------------------------------------
# Budgets
# --------------------------------------------------------------------------------------

# gRPC retry_throttle_test.cc: max 4000 milli-tokens (4), ratio 1600 milli (1.6).
A6 = policy("attempts: 5\nbudget: { kind: token, max-tokens: 4, token-ratio: 1.6 }\n" + NOJ)
a6 = []
call = 0
t = 0
live = None
for outcome, allowed in [("F", True), ("S", None), ("F", True), ("F", False), ("F", False), ("F", False), ("F", False),
                         ("S", None), ("S", None), ("F", True), ("F", False), ("S", None), ("F", False), ("S", None), ("F", True)]:
    t += S
    call += 1
    a6.append(start(call, t, expect=attempt(1)))
    if outcome == "S":
        a6.append(report(call, t + MS, "success", expect=DONE))
    else:
        a6.append(report(call, t + MS, "http-status", code=503, expect=retry(100 * MS) if allowed else fail("budget")))
        if allowed:
            a6.append(cancel(call, t + 2 * MS))
a6.append(drain())
vec("budget-grpc-a6-sequence", "The exact token sequence of grpc's retry_throttle_test.cc: F->3000 allowed, S->4000, F->3000 allowed, F->2000 refused, ... F->2400 allowed.",
    ["budget", "anchor"], A6, a6)

vec("budget-token-refusal-event", "A token refusal records a budget-refused event with the level in milli-tokens.", ["budget", "events"],
    policy("budget: { kind: token, max-tokens: 3, token-ratio: 0.5 }\n" + NOJ), [
        start(1, 0), report(1, MS, "timeout", expect=retry()), cancel(1, 2 * MS),
        start(2, S), report(2, S + MS, "timeout", expect=fail("budget")), drain(),
    ])

vec("budget-token-non-retryable-costs-nothing", "Non-retryable failures do not drain token throttling.", ["budget"],
    policy("budget: { kind: token, max-tokens: 3, token-ratio: 0.5 }\n" + NOJ),
    sum([[start(i, i * S), report(i, i * S + 1, "http-status", code=404)] for i in range(1, 5)], []) +
    [start(9, 9 * S), report(9, 9 * S + 1, "timeout", expect=retry())])

ratio = policy("attempts: 2\nbudget: { kind: ratio, percent: 20, min-per-second: 0, ttl: 10s }\n" + NOJ)
rs = []
for i in range(1, 11):
    rs.append(start(i, i * MS))
for i in range(1, 11):
    rs.append(report(i, 100 * MS + i, "timeout", expect=retry() if i <= 2 else fail("budget")))
rs.append(drain())
vec("budget-ratio-twenty-percent", "tower's TpsBudget: 10 calls deposit 10; at 20% two retries are allowed, the third is refused.", ["budget", "anchor"], ratio, rs)

vec("budget-ratio-reserve", "min-per-second 1 over a 10 s ttl reserves 10 retries with no traffic.", ["budget"],
    policy("attempts: 2\nbudget: { kind: ratio, percent: 20, min-per-second: 1, ttl: 10s }\n" + NOJ),
    [start(i, 0) for i in range(1, 13)] + [report(i, MS, "timeout") for i in range(1, 13)] + [drain()])

vec("budget-ratio-deposits-expire", "Deposits older than the ttl no longer pay for retries.", ["budget"],
    policy("attempts: 2\nbudget: { kind: ratio, percent: 50, min-per-second: 0, ttl: 1s }\n" + NOJ),
    [start(1, 0), start(2, 1), report(2, 2, "success"), report(1, 2 * S, "timeout", expect=fail("budget"))])

vec("budget-errors", "Budget errors: a missing kind, an unknown kind, an out-of-range ratio, a ttl outside tower's bounds.", ["budget", "errors"],
    "policies:\n  a: { budget: { max-tokens: 3 } }\n  b: { budget: { kind: tokens } }\n  c: { budget: { kind: token, token-ratio: 0 } }\n  d: { budget: { kind: ratio, ttl: 100s } }\n", [])

# --------------------------------------------------------------------------------------
# Documents and errors
# --------------------------------------------------------------------------------------

JSON_DOC = json.dumps({"policies": {"p": {"attempts": 2, "attempt-timeout": "1s", "backoff": {"kind": "constant", "base": "50ms", "jitter": "none"}}}})
vec("document-json", "A JSON document gives the same policy as YAML.", ["documents"], JSON_DOC,
    [pinfo(expect={"max_attempts": 2, "attempt_timeout": S}), start(1, 0), report(1, 1, "timeout", expect=retry(50 * MS))])

vec("document-many-policies", "Several named policies in one document; policy indices follow document order.", ["documents"],
    "policies:\n  fast: { attempts: 1 }\n  slow: { attempts: 5, deadline: 30s }\n  third: {}\n",
    [pinfo("fast", {"name": "fast", "max_attempts": 1}), pinfo("slow", {"max_attempts": 5, "deadline": 30 * S}), pinfo("third", {"max_attempts": 3}),
     pinfo("missing", None), start(1, 0, "slow"), start(2, 0, "fast")])

vec("document-defaults", "An empty policy gets every default.", ["documents", "defaults"], policy(""),
    [pinfo(expect={"max_attempts": 3, "attempt_timeout": 0, "deadline": 0, "fallbacks": []}), analyze(1)])

vec("document-unknown-field-suggests", "A misspelt field is named with a suggestion and the known fields.", ["documents", "errors"],
    policy("atempts: 3"), [])

vec("document-no-policies", "A document without policies says so.", ["documents", "errors"], "version: 1\n", [])
vec("document-duplicate-key", "A key given twice is one error with its line and column (and the first's), not also an unknown field.", ["documents", "errors"],
    "policies:\n  p:\n    deadline: 1s\n    attempts: 2\n    deadline: 2s\n", [])
vec("document-duplicate-key-flow", "A key given twice in a flow mapping is one error with its place.", ["documents", "errors"],
    "policies:\n  p: { backoff: { base: 1s, cap: 2s, base: 3s } }\n", [])
vec("document-empty-value", "A field left empty is an error, never its default: `deadline:` is not \"no deadline\".", ["documents", "errors"],
    "policies:\n  p:\n    attempts:\n    deadline:\n    breaker: ~\n    backoff: { base: }\n  q:\n", [])
vec("document-nan-and-infinity", ".nan and .inf are named as what they are, not as null.", ["documents", "errors"],
    "policies:\n  p: { attempts: .nan, breaker: { failure-rate: .inf }, backoff: { multiplier: -.inf } }\n", [])
vec("document-control-characters-escaped", "Control and bidirectional characters from the document are escaped in errors (RTL override, NUL).", ["documents", "errors"],
    "policies:\n  \"evil\\u202egnp.exe\": {}\n  ok: { \"att\\u0000empts\": 3 }\n", [])
vec("document-empty-policies", "An empty policies mapping is an error.", ["documents", "errors"], "policies: {}\n", [])
vec("document-bad-policy-name", "Policy names are checked.", ["documents", "errors"], "policies:\n  \"bad name!\": {}\n", [])
vec("document-wrong-version", "Only document version 1 exists.", ["documents", "errors"], "version: 2\npolicies:\n  p: {}\n", [])
vec("document-invalid-yaml", "YAML syntax errors give a line and column.", ["documents", "errors"], "policies:\n  p: [1, 2\n", [])
vec("document-invalid-json", "JSON syntax errors give a line and column.", ["documents", "errors"], "{\"policies\": {\"p\": {\"attempts\" 3}}}", [])
vec("document-not-a-mapping", "A policy must be a mapping.", ["documents", "errors"], "policies:\n  p: 3\n", [])
vec("document-too-deep", "Deep nesting is refused, not a stack overflow.", ["documents", "errors"], "policies:\n  p: " + "[" * 100 + "]" * 100 + "\n", [])
vec("document-many-errors-at-once", "Every error is reported, each with its path, not only the first.", ["documents", "errors"],
    "policies:\n  a: { attempts: 0, deadline: soon, backoff: { kind: x } }\n  b: { breaker: { failure-rate: 150 } }\n", [])

# --------------------------------------------------------------------------------------
# Protocol: settling, invalid operations, events, call-info
# --------------------------------------------------------------------------------------

vec("settle-success-on-next-start", "A success held back and settled on the next start gives the same state as reporting it at once.", ["protocol", "batching"],
    policy("attempts: 2\nbulkhead: { max-concurrent: 1 }\n" + NOJ), [
        start(1, 0, expect=attempt(1)),
        start(2, 10, settle=(1, 5, 5), expect=attempt(1)),
        start(3, 20, settle=(2, 15, 5), expect=attempt(1)),
        report(3, 30, "success", expect=DONE),
        info(1, None), info(2, None),
    ])

vec("protocol-invalid-operations", "Protocol errors are invalid verdicts: unknown call, duplicate or zero id, unknown policy, wrong step.", ["protocol", "errors"],
    policy(NOJ), [
        acquire(99, 0, expect=invalid(1)),
        start(0, 0, expect=invalid(2)),
        start(1, 0, expect=attempt(1)),
        start(1, 0, expect=invalid(2)),
        start(2, 0, policy="nope", expect=invalid(3)),
        acquire(1, 0, expect=invalid(4)),
        fallback(1, 0, True, expect=invalid(4)),
        report(1, 1, "timeout", expect=retry()),
        report(1, 2, "timeout", expect=invalid(4)),
        report(77, 2, "timeout", expect=invalid(1)),
        fallback(77, 2, True, expect=invalid(1)),
    ])

vec("call-info-tracks-a-call", "call-info shows attempts, deadline, last reason and whether an attempt is in flight.", ["protocol"],
    policy("deadline: 5s\n" + NOJ), [
        start(1, S), info(1, {"attempts": 1, "deadline": 6 * S, "in_flight": True}),
        report(1, S + 1, "timeout"), info(1, {"in_flight": False}), cancel(1, S + 2), info(1, None),
    ])

vec("events-retry-and-give-up", "Events for a retry scheduled and the give-up, with attempt numbers and delays.", ["events"],
    policy("attempts: 2\n" + NOJ), [start(1, 0), report(1, 5, "timeout"), acquire(1, 100 * MS + 5), report(1, 100 * MS + 9, "timeout"), drain()])

vec("events-drain-empties", "A drain takes every event once.", ["events"], policy("attempts: 1"),
    [start(1, 0), report(1, 1, "timeout"), drain(), drain([])])

vec("analyze-worst-cases", "Worst-case attempts, latency (every attempt at its timeout, every delay at the top of its jitter range) and amplification (3 attempts over 3 layers: 27x).", ["analysis", "anchor"],
    policy("attempts: 3\nattempt-timeout: 1s\nbackoff: { base: 100ms, cap: 1s, jitter: full }\nretry-after: { honor: false }"),
    [analyze(1, expect={"worst_attempts": 3, "worst_latency": 3 * S + 300 * MS, "amplification": 3.0}),
     analyze(3, expect={"amplification": 27.0, "amplification_with_budget": 27.0})])

vec("analyze-deadline-limits-attempts", "A deadline bounds the worst case when even the shortest delays reach it: fewer attempts, and latency at most the deadline.", ["analysis"],
    policy("attempts: 10\nattempt-timeout: 1s\ndeadline: 2500ms\nbackoff: { kind: constant, base: 1s, jitter: none }\nretry-after: { honor: false }"),
    [analyze(1, expect={"worst_attempts": 3, "worst_latency": 2500 * MS})])

vec("analyze-fail-fast-without-timeout", "An attempt can fail at once whatever its timeout: 5 attempts under a 10 s deadline are 5 in the worst case (125x on 3 layers), with no timeout, a short one or a long one.", ["analysis", "deadline"],
    "policies:\n  bare: { attempts: 5, deadline: 10s }\n  timed: { attempts: 5, deadline: 10s, attempt-timeout: 1s }\n  long: { attempts: 5, deadline: 10s, attempt-timeout: 8s }\n",
    [analyze(3, "bare", {"worst_attempts": 5, "worst_latency": 10 * S, "amplification": 125.0}),
     analyze(3, "timed", {"worst_attempts": 5, "worst_latency": 10 * S, "amplification": 125.0}),
     analyze(1, "long", {"worst_attempts": 5, "worst_latency": 10 * S, "amplification": 5.0})])

vec("analyze-server-delays", "When retry-on retries a status and Retry-After is honoured, a server may set each delay from 0 to retry-after.cap: the shortest delay is 0 and the longest the cap.", ["analysis", "retry-after"],
    "policies:\n  http: { attempts: 3, attempt-timeout: 1s, retry-after: { cap: 60s } }\n  quiet: { attempts: 3, attempt-timeout: 1s, retry-after: { cap: 60s, honor: false } }\n  conn: { attempts: 3, attempt-timeout: 1s, retry-on: [connection-error], retry-after: { cap: 60s } }\n  fast: { attempts: 10, deadline: 2500ms, backoff: { kind: constant, base: 1s, jitter: none } }\n",
    [analyze(1, "http", {"worst_attempts": 3, "worst_latency": 123 * S}),
     analyze(1, "quiet", {"worst_attempts": 3, "worst_latency": 3 * S + 300 * MS}),
     analyze(1, "conn", {"worst_attempts": 3, "worst_latency": 3 * S + 300 * MS}),
     analyze(1, "fast", {"worst_attempts": 10, "worst_latency": 2500 * MS})])

vec("analyze-attempts-max-u32", "The analysis is closed-form: attempts up to 2^32-1 answer at once.", ["analysis", "attempts"],
    "policies:\n  open: { attempts: 4294967295 }\n  dead: { attempts: 4294967295, deadline: 1h, retry-after: { honor: false }, backoff: { kind: constant, base: 1s, jitter: none } }\n",
    [analyze(1, "open", {"worst_attempts": 4294967295, "worst_latency": None, "amplification": 4294967295.0}),
     analyze(2, "dead", {"worst_attempts": 3600, "worst_latency": 3600 * S, "amplification": 12960000.0})])

vec("analyze-budgets", "With a budget, amplification is bounded: token throttling long-run 1, a 10% ratio budget 1.1 per layer.", ["analysis", "budget", "anchor"],
    "policies:\n  t: { attempts: 3, budget: { kind: token } }\n  r: { attempts: 4, budget: { kind: ratio, percent: 10 } }\n",
    [analyze(3, "t", {"amplification": 27.0, "amplification_with_budget": 1.0}), analyze(3, "r", {"amplification": 64.0})])

vec("analyze-unbounded", "No timeout and no deadline: the worst latency is unbounded (null).", ["analysis"], policy(""),
    [analyze(1, expect={"worst_latency": None})])

# --------------------------------------------------------------------------------------
# Circuit breaker
# --------------------------------------------------------------------------------------

BRK = "attempts: 1\nbreaker: { window: { kind: count, size: 4 }, minimum-calls: 4, failure-rate: 50, open-duration: 10s, half-open-permits: 2, half-open-permit-timeout: 5s }\n"


def outcomes(seq, t0=0, first_call=1, key=""):
    steps = []
    t = t0
    for i, o in enumerate(seq):
        c = first_call + i
        t += MS
        steps.append(start(c, t, key=key))
        if o == "F":
            steps.append(report(c, t + 1, "http-status", code=503, elapsed=1))
        elif o == "T":
            steps.append(report(c, t + 1, "timeout", elapsed=1))
        else:
            steps.append(report(c, t + 1, "success", elapsed=1))
    return steps


vec("breaker-count-trips", "A count window of 4 with minimum 4 calls trips at a 50% failure rate.", ["breaker"],
    policy(BRK), outcomes("SFSF") + [breaker(10 * MS, expect="open"), start(9, 20 * MS, expect=fail("breaker-open")), drain()])

vec("breaker-minimum-calls", "Three failures out of three do not trip before the minimum number of calls.", ["breaker"],
    policy(BRK), outcomes("FFF") + [breaker(10 * MS, expect="closed"), start(9, 20 * MS, expect=attempt(1))])

vec("breaker-open-hint", "An open breaker rejects with a retry-after hint of the time left open.", ["breaker"],
    policy(BRK), outcomes("FFFF") + [start(9, 4 * MS + 1 + 4 * S, expect=fail("breaker-open", 6 * S))])

vec("breaker-half-open-closes", "After open-duration, exactly 2 trial calls are admitted; two successes close it.", ["breaker"],
    policy(BRK), outcomes("FFFF") + [
        breaker(11 * S, expect="half-open"),
        start(10, 11 * S, expect=attempt(1)), start(11, 11 * S, expect=attempt(1)),
        start(12, 11 * S, expect=fail("breaker-open")),
        report(10, 11 * S + 1, "success"), report(11, 11 * S + 2, "success"),
        breaker(11 * S + 3, expect="closed"), start(13, 11 * S + 3, expect=attempt(1)), drain(),
    ])

vec("breaker-half-open-reopens-longer", "A failed trial reopens the breaker; with a multiplier the second open lasts twice as long.", ["breaker"],
    policy(BRK.replace("open-duration: 10s", "open-duration: 10s, open-duration-max: 30s")), outcomes("FFFF") + [
        start(10, 11 * S), start(11, 11 * S),
        report(10, 11 * S + 1, "timeout"), report(11, 11 * S + 2, "success"),
        breaker(11 * S + 3, expect="open"),
        start(12, 30 * S, expect=fail("breaker-open")), breaker(31 * S + 2, expect="half-open"), drain(),
    ])

vec("breaker-open-duration-capped", "Consecutive trips grow the open duration up to open-duration-max.", ["breaker"],
    policy(BRK.replace("open-duration: 10s", "open-duration: 10s, open-duration-max: 25s").replace("half-open-permits: 2", "half-open-permits: 1")),
    outcomes("FFFF") + [start(10, 11 * S), report(10, 11 * S, "timeout"),
                        start(11, 32 * S), report(11, 32 * S, "timeout"),
                        start(12, 57 * S - 1, expect=fail("breaker-open", 1)), start(13, 57 * S, expect=attempt(1)), drain()])

vec("breaker-permit-expires", "A half-open permit never reported expires and is given back (resilience4j #2172).", ["breaker"],
    policy(BRK), outcomes("FFFF") + [
        start(10, 11 * S), start(11, 11 * S), start(12, 12 * S, expect=fail("breaker-open")),
        start(13, 16 * S, expect=attempt(1)), drain(),
    ])

vec("breaker-cancel-returns-permit-once", "A cancelled trial gives its permit back once; capacity never exceeds the permits (failsafe #391).", ["breaker"],
    policy(BRK), outcomes("FFFF") + [
        start(10, 11 * S), start(11, 11 * S), cancel(10, 11 * S), cancel(10, 11 * S),
        start(12, 11 * S, expect=attempt(1)), start(13, 11 * S, expect=fail("breaker-open")),
    ])

vec("breaker-late-result-after-reopen-ignored", "A trial reported after its half-open episode ended does not count.", ["breaker"],
    policy(BRK.replace("half-open-permits: 2", "half-open-permits: 1")), outcomes("FFFF") + [
        start(10, 11 * S), report(10, 11 * S, "timeout"), breaker(11 * S, expect="open"), drain(),
    ])

vec("breaker-time-window", "A time window forgets outcomes older than its size.", ["breaker"],
    policy("attempts: 1\nbreaker: { window: { kind: time, size: 10s, bucket: 1s }, minimum-calls: 4, failure-rate: 50 }\n"),
    outcomes("FF") + outcomes("FF", t0=20 * S, first_call=20) + [breaker(21 * S, expect="closed")] +
    outcomes("F", t0=21 * S, first_call=40) + [breaker(21 * S + 10 * MS, expect="closed")] +
    outcomes("F", t0=21 * S + 10 * MS, first_call=41) + [breaker(22 * S, expect="open"), drain()])

vec("breaker-slow-calls-trip", "Calls slower than slow-call-duration trip a slow-call-rate breaker even when they succeed.", ["breaker"],
    policy("attempts: 1\nbreaker: { window: { kind: count, size: 3 }, minimum-calls: 3, slow-call-rate: 60, slow-call-duration: 1s }\n"),
    sum([[start(i, i * S), report(i, i * S + 2 * S, "success", elapsed=2 * S)] for i in (1, 2, 3)], []) + [breaker(10 * S, expect="open"), drain()])

vec("breaker-failure-on-custom", "failure-on decides what counts: here 404s count, 503s do not.", ["breaker", "classification"],
    policy('attempts: 1\nbreaker: { window: { kind: count, size: 2 }, minimum-calls: 2, failure-on: ["http:404"] }\n'),
    [start(1, 0), report(1, 1, "http-status", code=503), start(2, 2), report(2, 3, "http-status", code=503), breaker(4, expect="closed"),
     start(3, 5), report(3, 6, "http-status", code=404), start(4, 7), report(4, 8, "http-status", code=404), breaker(9, expect="open")])

vec("breaker-4xx-not-failures-by-default", "Client errors do not count against the dependency by default.", ["breaker", "defaults"],
    policy(BRK), sum([[start(i, i), report(i, i, "http-status", code=404)] for i in range(1, 6)], []) + [breaker(10, expect="closed")])

BRK_LOOP = "attempts: 5\nbreaker: { window: { kind: count, size: 2 }, minimum-calls: 2, open-duration: 1m }\n" + NOJ

vec("breaker-in-retry-loop", "Every retry passes the breaker: when another call opens it during a call's backoff, the retry is rejected with breaker-open.", ["breaker", "retry"],
    policy(BRK_LOOP), [
        start(1, 0), report(1, 1, "timeout", expect=retry(100 * MS)),
        start(2, 2), report(2, 3, "timeout", expect=fail("breaker-open", 60 * S)),
        acquire(1, 100 * MS + 1, expect=fail("breaker-open", 60 * S - 100 * MS + 2)), drain(),
    ])

vec("breaker-open-no-retry-into-it", "A failure that leaves the breaker open past the retry's start ends the call now with breaker-open (the time it stays open as the hint), or takes its breaker-open fallback, instead of a sleep that can only end in a rejection; a forced-open breaker does the same with hint 0.", ["breaker", "retry", "fallback"],
    "policies:\n"
    "  p: { attempts: 5, breaker: { window: { kind: count, size: 2 }, minimum-calls: 2, open-duration: 1m }, backoff: { kind: constant, base: 100ms, jitter: none } }\n"
    "  f: { attempts: 5, breaker: { window: { kind: count, size: 2 }, minimum-calls: 2, open-duration: 1m }, backoff: { kind: constant, base: 100ms, jitter: none }, fallbacks: [{ name: cached, on: [breaker-open] }] }\n", [
        start(1, 0), report(1, 1, "timeout", expect=retry(100 * MS)), acquire(1, 100 * MS + 1, expect=attempt(2)),
        report(1, 100 * MS + 2, "timeout", expect=fail("breaker-open", 60 * S)),
        start(2, 0, policy="f"), report(2, 1, "timeout", expect=retry(100 * MS)), acquire(2, 100 * MS + 1, expect=attempt(2)),
        report(2, 100 * MS + 2, "timeout", expect=fb(0, "breaker-open")), fallback(2, 100 * MS + 3, True, expect=DONE),
        start(3, 0, key="k"), force("forced-open", 1, key="k", expect={"ok": None}),
        report(3, 2, "timeout", expect=fail("breaker-open", 0)),
        drain(),
    ])

vec("breaker-open-retry-when-half-open-by-then", "A retry that starts when the breaker's open duration is over (here a Retry-After of exactly the open duration) is scheduled: the breaker is half-open then and admits it as a trial.", ["breaker", "retry", "retry-after"],
    policy("attempts: 5\nbreaker: { window: { kind: count, size: 2 }, minimum-calls: 2, open-duration: 1s, half-open-permits: 1 }\n" + NOJ), [
        start(1, 0), report(1, 1, "http-status", code=503, expect=retry(100 * MS)), acquire(1, 100 * MS + 1, expect=attempt(2)),
        report(1, 100 * MS + 2, "http-status", code=503, text="1", expect=retry(S)),
        breaker(S + 100 * MS + 1, expect="open"),
        acquire(1, S + 100 * MS + 2, expect=attempt(3)), breaker(S + 100 * MS + 2, expect="half-open"),
        report(1, S + 100 * MS + 3, expect=DONE), breaker(S + 100 * MS + 3, expect="closed"), drain(),
    ])

vec("breaker-reset-clears-a-closed-window", "An operator's closed on a CLOSED breaker clears its window (resilience4j reset()): after S S, a reset and F F F, a count window of 4 with minimum 4 calls holds 3 calls and stays closed; a fourth failure opens it. No transition event for closed -> closed.", ["breaker", "operator"],
    policy(BRK), outcomes("SS") + [force("closed", 10 * MS, expect={"ok": None})] + outcomes("FFF", t0=10 * MS, first_call=10) +
    [breaker(20 * MS, expect="closed"), start(20, 20 * MS, expect=attempt(1)), report(20, 20 * MS + 1, "http-status", code=503, elapsed=1),
     breaker(21 * MS, expect="open"), drain()])

vec("breaker-forced-open", "forced-open rejects every call until an operator sets closed.", ["breaker", "operator"],
    policy(BRK), [force("forced-open", 0, expect={"ok": None}), start(1, 1, expect=fail("breaker-open", 0)), breaker(2, expect="forced-open"),
                  force("closed", 3, expect={"ok": None}), start(2, 4, expect=attempt(1)), drain()])

vec("breaker-forced-closed-records-no-trip", "forced-closed admits everything and never trips.", ["breaker", "operator"],
    policy(BRK), [force("forced-closed", 0)] + outcomes("FFFFFF", t0=1) + [breaker(S, expect="forced-closed"), start(99, S, expect=attempt(1))])

vec("breaker-disabled", "disabled admits everything.", ["breaker", "operator"],
    policy(BRK), [force("disabled", 0)] + outcomes("FFFFF", t0=1) + [breaker(S, expect="disabled")])

vec("breaker-illegal-operator-states", "An operator cannot set open or half-open; a policy without a breaker says so.", ["breaker", "operator", "errors"],
    "policies:\n  p: { breaker: {} }\n  q: {}\n", [force("open", 0), force("half-open", 0), force("forced-open", 0, policy="q"),
                                                  breaker(0, policy="q", expect=None)])

vec("breaker-per-key", "Breakers are per key: one key open, another closed.", ["breaker", "keys"],
    policy(BRK), outcomes("FFFF", key="a") + [start(10, S, key="a", expect=fail("breaker-open")), start(11, S, key="b", expect=attempt(1)),
                                            breaker(S, key="a", expect="open"), breaker(S, key="b", expect="closed")])

vec("breaker-errors", "Breaker fields out of range are named.", ["breaker", "errors"],
    "policies:\n  a: { breaker: { failure-rate: 0 } }\n  b: { breaker: { window: { kind: count, size: 0 } } }\n  c: { breaker: { open-duration: 10s, open-duration-max: 5s } }\n  d: { breaker: { window: { kind: time, size: 1s, bucket: 2s } } }\n  e: { breaker: { half-open-permits: 0 } }\n",
    [])

vec("breaker-defaults-resilience4j", "Default breaker: count window 100, minimum 100 calls, 50% failure rate.", ["breaker", "defaults", "anchor"],
    policy("attempts: 1\nbreaker: {}\n"), outcomes("F" * 99) + [breaker(S, expect="closed")] + outcomes("F", t0=S, first_call=200) + [breaker(2 * S, expect="open")])

# --------------------------------------------------------------------------------------
# Rate limit and bulkhead
# --------------------------------------------------------------------------------------

RATE = "attempts: 2\nrate-limit: { rate: 10, per: 1s, burst: 2, max-wait: 150ms }\n" + NOJ

vec("rate-burst-then-wait", "A burst of 2, then the third caller waits 100 ms for a reserved token.", ["rate-limit"],
    policy(RATE), [start(1, 0, expect=attempt(1)), start(2, 0, expect=attempt(1)), start(3, 0, expect=wait(100 * MS)),
                   acquire(3, 40 * MS, expect=wait(60 * MS)), acquire(3, 100 * MS, expect=attempt(1)), drain()])

vec("rate-reject-over-max-wait", "A wait above max-wait is a rejection with the time until a token.", ["rate-limit"],
    policy(RATE), [start(1, 0), start(2, 0), start(3, 0, expect=wait(100 * MS)), start(4, 0, expect=fail("rate-limited", 200 * MS)), drain()])

vec("rate-wait-must-fit-deadline", "A wait that does not fit the deadline is a rejection.", ["rate-limit", "deadline"],
    policy("deadline: 50ms\n" + RATE), [start(1, 0), start(2, 0), start(3, 0, expect=fail("rate-limited", 100 * MS))])

vec("rate-clock-going-back", "A now earlier than the last counts as no time passed (tikv/pd #10744).", ["rate-limit"],
    policy("attempts: 1\nrate-limit: { rate: 1, per: 1s, burst: 1 }\n"),
    [start(1, 10 * S, expect=attempt(1)), start(2, 0, expect=fail("rate-limited", S)), start(3, 11 * S, expect=attempt(1))])

vec("rate-refill", "Tokens refill at the rate and never above the burst.", ["rate-limit"],
    policy("attempts: 1\nrate-limit: { rate: 2, per: 1s, burst: 2 }\n"),
    [start(i, 100 * S) for i in (1, 2)] + [start(3, 100 * S, expect=fail("rate-limited"))] +
    [start(i, 200 * S) for i in (4, 5)] + [start(6, 200 * S, expect=fail("rate-limited"))])

vec("rate-retries-pass-the-limiter", "Every retry takes a token too.", ["rate-limit", "retry"],
    policy("attempts: 3\nrate-limit: { rate: 1, per: 1s, burst: 1 }\n" + NOJ),
    [start(1, 0), report(1, 1, "timeout", expect=retry(100 * MS)), acquire(1, 100 * MS + 1, expect=fail("rate-limited"))])

vec("rate-errors", "Rate limit errors: rate missing, zero period, unknown field.", ["rate-limit", "errors"],
    "policies:\n  a: { rate-limit: { burst: 3 } }\n  b: { rate-limit: { rate: 5, per: \"0\" } }\n  c: { rate-limit: { rate: 5, burts: 2 } }\n", [])

BULK = "attempts: 3\nbulkhead: { max-concurrent: 2 }\n" + NOJ

vec("bulkhead-limit", "At most 2 attempts in flight; the third is rejected with bulkhead-full.", ["bulkhead"],
    policy(BULK), [start(1, 0), start(2, 0), start(3, 0, expect=fail("bulkhead-full")), report(1, 5, "success"), start(4, 6, expect=attempt(1)), drain()])

vec("bulkhead-not-held-while-sleeping", "A call sleeping before its retry holds no slot.", ["bulkhead"],
    policy(BULK), [start(1, 0), start(2, 0), report(1, 1, "timeout", expect=retry()), start(3, 2, expect=attempt(1)),
                   acquire(1, 100 * MS + 1, expect=fail("bulkhead-full"))])

vec("bulkhead-cancel-releases", "A cancelled call gives its slot back.", ["bulkhead"],
    policy(BULK), [start(1, 0), start(2, 0), cancel(2, 1), start(3, 2, expect=attempt(1))])

vec("bulkhead-per-key", "Slots are per key.", ["bulkhead", "keys"],
    policy(BULK), [start(1, 0, key="a"), start(2, 0, key="a"), start(3, 0, key="b", expect=attempt(1)), start(4, 0, key="a", expect=fail("bulkhead-full"))])

# --------------------------------------------------------------------------------------
# Fallbacks
# --------------------------------------------------------------------------------------

FB = ("attempts: 2\nfallbacks:\n  - { name: cache, on: [retries-exhausted, breaker-open] }\n  - { name: static, on: [any] }\n"
      "breaker: { window: { kind: count, size: 2 }, minimum-calls: 2, open-duration: 10s }\n" + NOJ)

vec("fallback-on-retries-exhausted", "Retries exhausted: the first matching fallback is chosen; its success ends the call done.", ["fallback"],
    policy(FB), [start(1, 0), report(1, 1, "timeout"), acquire(1, 100 * MS + 1), report(1, 100 * MS + 2, "timeout", expect=fb(0, "retries-exhausted")),
                 info(1, {"last_reason": "retries-exhausted"}), fallback(1, 100 * MS + 3, True, expect=DONE), drain()])

vec("fallback-chain", "When a fallback fails the next matching one runs; when all fail, fallbacks-failed.", ["fallback"],
    policy(FB), [start(1, 0), report(1, 1, "timeout"), acquire(1, 100 * MS + 1), report(1, 100 * MS + 2, "timeout", expect=fb(0, "retries-exhausted")),
                 fallback(1, 100 * MS + 3, False, expect=fb(1, "retries-exhausted")), fallback(1, 100 * MS + 4, False, expect=fail("fallbacks-failed")), drain()])

vec("fallback-trigger-filters", "A non-retryable failure skips the fallback that does not list it.", ["fallback"],
    policy(FB), [start(1, 0), report(1, 1, "http-status", code=400, expect=fb(1, "non-retryable"))])

vec("fallback-on-breaker-open", "A breaker rejection triggers the fallback chain.", ["fallback", "breaker"],
    policy("attempts: 1\nfallbacks: [{ name: cache, on: [breaker-open] }]\nbreaker: { window: { kind: count, size: 2 }, minimum-calls: 2 }\n"),
    outcomes("FF") + [start(9, S, expect=fb(0, "breaker-open")), fallback(9, S, True, expect=DONE), drain()])

vec("fallback-on-rate-limit-and-bulkhead", "Rate-limited and bulkhead-full rejections trigger fallbacks that list them.", ["fallback", "rate-limit", "bulkhead"],
    "policies:\n  r: { attempts: 1, rate-limit: { rate: 1, burst: 1 }, fallbacks: [{ name: later, on: [rate-limited] }] }\n"
    "  b: { attempts: 1, bulkhead: { max-concurrent: 1 }, fallbacks: [{ name: shed, on: [bulkhead-full] }] }\n",
    [start(1, 0, "r"), start(2, 0, "r", expect=fb(0, "rate-limited")), start(3, 0, "b"), start(4, 0, "b", expect=fb(0, "bulkhead-full")), drain()])

vec("fallback-on-deadline", "A deadline failure triggers a fallback listing deadline.", ["fallback", "deadline"],
    policy("deadline: 100ms\nfallbacks: [{ name: cached, on: [deadline] }]\nbackoff: { kind: constant, base: 200ms, jitter: none }"),
    [start(1, 0), report(1, 10 * MS, "timeout", expect=fb(0, "deadline"))])

vec("fallback-none-matches", "When no fallback lists the reason, the call fails with it.", ["fallback"],
    policy("attempts: 1\nfallbacks: [{ name: cache, on: [breaker-open] }]"), [start(1, 0), report(1, 1, "timeout", expect=fail("retries-exhausted"))])

vec("fallback-plain-names", "A fallback given as a plain name triggers on any failure.", ["fallback"],
    policy("attempts: 1\nfallbacks: [cache]"), [pinfo(expect={"fallbacks": ["cache"]}), start(1, 0), report(1, 1, "http-status", code=404, expect=fb(0, "non-retryable"))])

vec("fallback-errors", "Fallback errors: a duplicate name, a misspelt trigger, a missing name.", ["fallback", "errors"],
    policy("fallbacks: [a, a, { name: b, on: [breaker-opn] }, { on: [any] }]"), [])

# --------------------------------------------------------------------------------------
# Keys
# --------------------------------------------------------------------------------------

vec("keys-evict-lru", "With keys.max 2, a third key evicts the least recently used key at rest: the key whose breaker is open is kept, and stays open.", ["keys"],
    policy("attempts: 1\nkeys: { max: 2 }\n" + BRK.split("\n", 1)[1]),
    outcomes("FFFF", key="a") + [start(10, S, key="b"), report(10, S, "success"), start(11, S, key="c", expect=attempt(1)), drain(),
                                 breaker(2 * S, key="a", expect="open"), start(12, 2 * S, key="a", expect=fail("breaker-open"))])

vec("keys-busy-keys-survive", "A key with an attempt in flight is evicted only after idle ones.", ["keys"],
    policy("attempts: 1\nkeys: { max: 2 }\nbulkhead: { max-concurrent: 1 }"),
    [start(1, 0, key="a"), start(2, 1, key="b"), report(2, 2, "success"), start(3, 3, key="c"), start(4, 4, key="a", expect=fail("bulkhead-full")), drain()])

def snapshot_import():
    return {"op": "snapshot_import"}


# --------------------------------------------------------------------------------------
# Scope: a strategy's state per key (the default) or one for the policy (issue 39)
# --------------------------------------------------------------------------------------

vec("scope-policy-rate-limit-shared-by-keys", "A rate limit of `scope: policy` is one bucket for every key: a call on key b is refused when key a spent it, while each key keeps its own breaker.", ["scope", "keys", "rate-limit"],
    policy("attempts: 1\nrate-limit: { rate: 1, per: 1h, burst: 2, scope: policy }\n" + BRK.split("\n", 1)[1]),
    [start(1, 0, key="a", expect=attempt(1)), report(1, 1, "success"),
     start(2, 2, key="a", expect=attempt(1)), report(2, 3, "success"),
     start(3, 4, key="b", expect=fail("rate-limited")),
     start(4, 5, expect=fail("rate-limited")), drain()])

vec("scope-key-breaker-policy-rate-limit", "A breaker per key and one rate limit for the policy, in one policy: key a's failures open a's breaker only; key b's calls pass its closed breaker and are counted by the shared limit.", ["scope", "keys", "breaker", "rate-limit"],
    policy("attempts: 1\nrate-limit: { rate: 10, per: 1s, burst: 7, scope: policy }\n" + BRK.split("\n", 1)[1]),
    outcomes("FFFF", key="a") +
    [start(10, 10 * MS, key="a", expect=fail("breaker-open")), start(11, 11 * MS, key="b", expect=attempt(1)), report(11, 12 * MS, "success"),
     breaker(13 * MS, key="a", expect="open"), breaker(13 * MS, key="b", expect="closed"),
     start(12, 14 * MS, key="c", expect=attempt(1)), report(12, 15 * MS, "success"),
     start(13, 16 * MS, key="d", expect=attempt(1)), report(13, 17 * MS, "success"),
     start(14, 18 * MS, key="e", expect=fail("rate-limited")), drain()])

vec("scope-policy-breaker-opens-for-every-key", "A breaker of `scope: policy` counts the failures of every key and, once open, rejects every key; its transitions name the policy's shared state (key \"\"), and an operator forcing it through any key forces the one breaker.", ["scope", "keys", "breaker"],
    policy("attempts: 1\nbreaker: { window: { kind: count, size: 4 }, minimum-calls: 4, failure-rate: 50, open-duration: 10s, scope: policy }"),
    [start(1, 0, key="a"), report(1, 1, "connection-error"), start(2, 2, key="b"), report(2, 3, "connection-error"),
     start(3, 4, key="c"), report(3, 5, "connection-error"), start(4, 6, key="d"), report(4, 7, "connection-error"),
     start(5, 8, key="z", expect=fail("breaker-open")), breaker(9, key="q", expect="open"), breaker(9, expect="open"),
     force("forced-closed", 10, key="a"), start(6, 11, key="y", expect=attempt(1)), report(6, 12, "success"), drain()])

vec("scope-policy-bulkhead-across-keys", "A bulkhead of `scope: policy` counts the attempts in flight of every key against one limit.", ["scope", "keys", "bulkhead"],
    policy("attempts: 1\nbulkhead: { max-concurrent: 2, scope: policy }"),
    [start(1, 0, key="a", expect=attempt(1)), start(2, 1, key="b", expect=attempt(1)), start(3, 2, key="c", expect=fail("bulkhead-full")),
     report(1, 3, "success"), start(4, 4, key="c", expect=attempt(1)), drain()])

vec("scope-policy-state-survives-key-churn", "The policy's shared state is never evicted and does not count against keys.max: churning keys past the bound keeps the shared limit spent.", ["scope", "keys", "rate-limit"],
    policy("attempts: 1\nkeys: { max: 2 }\nrate-limit: { rate: 1, per: 1h, burst: 1, scope: policy }"),
    [start(1, 0, key="a", expect=attempt(1)), report(1, 1, "success")] +
    [start(10 + i, 2 + i, key="k%d" % i, expect=fail("rate-limited")) for i in range(5)] + [drain()])

vec("scope-policy-state-export-import", "Exported and imported again, the policy's shared state is kept: the shared limit stays spent.", ["scope", "state", "rate-limit"],
    policy("attempts: 1\nkeys: { max: 2 }\nrate-limit: { rate: 1, per: 1h, burst: 1, scope: policy }"),
    [start(1, 0, key="a", expect=attempt(1)), report(1, 1, "success"), export_import(), snapshot_import(),
     start(2, 2, key="b", expect=fail("rate-limited")), drain()])

vec("scope-policy-bad-value", "`scope` is `key` or `policy`; anything else is refused with its path.", ["scope", "errors"],
    policy("breaker: { scope: global }"), [])


HOUR = 3600 * S
RATE_HOUR = "attempts: 1\nrate-limit: { rate: 1, per: 1h, burst: 1 }\nkeys: { max: 2 }"

vec("keys-evict-keeps-spent-limit", "A key whose rate limit is spent is never evicted to make room: churning other keys cannot reset it (anticapture PR #2148).", ["keys", "rate-limit"],
    policy(RATE_HOUR),
    [start(1, 0, key="a", expect=attempt(1)), report(1, 1, "success"),
     start(2, 2, key="b", expect=attempt(1)), report(2, 3, "success"),
     start(3, 4, key="c", expect=attempt(1)), report(3, 5, "success"),
     start(4, 6, key="d", expect=fail("rate-limited")),
     start(5, 7, key="a", expect=fail("rate-limited")), drain()])

vec("keys-evict-once-protection-ends", "A guarded key whose protection ended by itself (its limiter's debt repaid) is evicted for a new key.", ["keys", "rate-limit"],
    policy("attempts: 1\nrate-limit: { rate: 10, per: 1s, burst: 1 }\nkeys: { max: 2 }"),
    [start(1, 0, key="a"), report(1, 1, "success"), start(2, 2, key="b"), report(2, 3, "success"),
     start(3, 50 * MS, key="c", expect=attempt(1)), report(3, 50 * MS + 1, "success"),
     start(4, 300 * MS, key="d", expect=attempt(1)), report(4, 300 * MS + 1, "success"), drain()])

vec("keys-overflow-shares-state", "When every key holds protection, a new key is decided against one shared overflow entry, never looser than a fresh key; an operator cannot force a key with no state of its own.", ["keys", "breaker"],
    policy("attempts: 1\nkeys: { max: 1 }\n" + BRK.split("\n", 1)[1]),
    outcomes("FFFF", key="a") + outcomes("FFFF", t0=10 * MS, first_call=10, key="b") +
    [start(20, 30 * MS, key="c", expect=fail("breaker-open")), breaker(30 * MS, key="a", expect="open"),
     breaker(30 * MS, key="levee:overflow", expect="open"), force("forced-closed", 30 * MS, key="c"), drain()])

vec("keys-too-long", "A key longer than 1024 bytes gets no state of its own: it is decided against the overflow entry, and the event names its first 1024 bytes.", ["keys"],
    policy("attempts: 1"),
    [start(1, 0, key="k" * 1025, expect=attempt(1)), report(1, 1, "success"), drain()])

vec("state-snapshot-keeps-protection", "The snapshot (export-snapshot) carries only keys holding protection: a fresh engine that imports it keeps an open breaker open and a spent limit spent, and a key at rest comes back fresh (its closed breaker's failures forgotten).", ["state", "keys"],
    "policies:\n  p:\n" + "\n".join("    " + l for l in BRK.strip().splitlines()) + "\n"
    "  r: { attempts: 1, rate-limit: { rate: 1, per: 1h, burst: 1 } }\n",
    outcomes("FFFF", key="open") + outcomes("FFF", t0=10 * MS, first_call=10, key="rest") +
    [start(20, 20 * MS, "r", key="spent", expect=attempt(1)), report(20, 20 * MS + 1, "success"),
     snapshot_import(),
     breaker(30 * MS, key="open", expect="open"), start(21, 30 * MS, key="open", expect=fail("breaker-open")),
     start(22, 30 * MS, "r", key="spent", expect=fail("rate-limited")),
     start(23, 30 * MS, key="rest", expect=attempt(1)), report(23, 30 * MS + 1, "http-status", code=503, elapsed=1),
     breaker(31 * MS, key="rest", expect="closed"), drain()])

vec("keys-errors", "keys.max must be at least 1.", ["keys", "errors"], policy("keys: { max: 0 }"), [])

# --------------------------------------------------------------------------------------
# State export and import, reload
# --------------------------------------------------------------------------------------

vec("state-breaker-survives-restart", "An open breaker stays open across export and import into a fresh engine.", ["state"],
    policy(BRK), outcomes("FFFF") + [export_import(), start(10, S, expect=fail("breaker-open")), breaker(S, expect="open"),
                                    start(11, 11 * S, expect=attempt(1))])

vec("state-budget-survives-restart", "Token throttling levels survive export and import.", ["state", "budget"],
    A6, [start(1, 0), report(1, 1, "timeout", expect=retry()), cancel(1, 2),
         export_import(), start(2, 3), report(2, 4, "timeout", expect=fail("budget"))])

vec("state-limiter-survives-restart", "A spent rate limiter stays spent across export and import.", ["state", "rate-limit"],
    policy("attempts: 1\nrate-limit: { rate: 1, per: 10s, burst: 1 }\n"),
    [start(1, S), export_import(), start(2, 2 * S, expect=fail("rate-limited", 9 * S))])

vec("state-identical-future-decisions", "After export and import, jitter and every decision continue exactly as without the round trip.", ["state", "prng"],
    policy("attempts: 4\nbackoff: { base: 100ms, cap: 10s, jitter: full }\nbudget: { kind: ratio, percent: 50 }\n"),
    [start(1, 0), report(1, 1, "timeout"), export_import(), acquire(1, S), report(1, S + 1, "timeout"), start(2, S + 2), report(2, S + 3, "timeout")],
    seed=99)

vec("state-import-garbage", "Importing garbage is an error and changes nothing.", ["state", "errors"],
    policy(BRK), outcomes("FFFF") + [import_hex(b"not json at all"), import_hex(b'{"format":"levee-state","version":9}'),
                                    import_hex(b'{"format":"other"}'), breaker(S, expect="open")])

vec("state-import-wrong-shapes", "Importing state with wrong shapes names the field and changes nothing.", ["state", "errors"],
    policy(BRK), [import_hex(b'{"format":"levee-state","version":1,"rng":[1,2,3],"tick":0,"policies":[]}'),
                  import_hex(b'{"format":"levee-state","version":1,"rng":[1,2,3,4],"tick":0,"policies":[{"name":"p","keys":[{"key":"","last_used":1,"breaker":{"state":"ajar"}}]}]}'),
                  breaker(0, expect="closed")])

vec("reload-keeps-breaker", "A hot reload that changes retries keeps the open breaker.", ["state", "reload"],
    policy(BRK), outcomes("FFFF") + [reload(policy(BRK.replace("attempts: 1", "attempts: 3")), {"ok": None}), breaker(S, expect="open"),
                                    pinfo(expect={"max_attempts": 3})])

vec("reload-changed-window-resets-counts", "A reload that changes the window keeps the breaker's state but starts a fresh window.", ["state", "reload", "breaker"],
    policy(BRK), outcomes("FFF") + [reload(policy(BRK.replace("size: 4", "size: 8"))), start(20, S), report(20, S, "timeout"), breaker(S, expect="closed")])

vec("reload-error-leaves-engine", "A reload with errors changes nothing.", ["state", "reload", "errors"],
    policy(BRK), outcomes("FFFF") + [reload(policy("attempts: 0")), breaker(S, expect="open"), pinfo(expect={"max_attempts": 1})])

vec("reload-drops-removed-policy", "A reload that removes a policy drops its state; live calls of kept policies continue.", ["state", "reload"],
    "policies:\n  p: { attempts: 2, backoff: { kind: constant, base: 100ms, jitter: none } }\n  q: {}\n",
    [start(1, 0), report(1, 1, "timeout", expect=retry()), reload("policies:\n  p: { attempts: 2, backoff: { kind: constant, base: 100ms, jitter: none } }\n"),
     acquire(1, 100 * MS + 1, expect=attempt(2)), pinfo("q", None)])


# Time that runs backwards (issue 20): a `now` earlier than one already seen counts as no time
# passed in every time-based part, as hosts with many threads deliver slightly out-of-order
# times.
BACK_RATIO = policy("attempts: 2\nbudget: { kind: ratio, percent: 20, min-per-second: 0, ttl: 10s }\n" + NOJ)
vec("clock-backwards-ratio-budget", "A ratio budget keeps its newer deposits when a call starts at an earlier now.", ["budget", "clock"],
    BACK_RATIO, [step for i in range(1, 11) for step in (start(i, 5 * S), report(i, 5 * S))]
    + [start(11, 1 * S), report(11, 1 * S + MS, "timeout", expect=retry(100 * MS)), drain()])

vec("clock-backwards-rate-wait", "A waiter that starts at an earlier now waits on the limiter's clock, not the stale one.", ["rate-limit", "clock"],
    policy("attempts: 2\nrate-limit: { rate: 1, per: 1s, burst: 1, max-wait: 2s }\n" + NOJ),
    [start(1, 10 * S, expect=attempt(1)), start(2, 10 * S + 500 * MS, expect=wait(500 * MS)),
     start(3, 10 * S, expect=wait(1500 * MS)), acquire(3, 11 * S + 500 * MS, expect=wait(500 * MS)),
     acquire(3, 12 * S, expect=attempt(1)), drain()])

vec("clock-backwards-deadline", "An acquire at an earlier now than the call's last report does not lengthen the attempt's timeout.", ["deadline", "clock"],
    policy("attempts: 3\ndeadline: 5s\n" + NOJ),
    [start(1, 10 * S, expect=attempt(1, 5 * S)), report(1, 12 * S, "timeout", expect=retry(100 * MS)),
     acquire(1, 11 * S, expect=attempt(2, 3 * S)), drain()])

vec("retry-after-wall-top-bit", "A wall clock of 2^63 s is a time far in the future, not a negative one: a past date means no wait.", ["retry-after", "clock"],
    policy(NOJ), [start(1, 0), report(1, MS, "http-status", code=503, text="Sun, 06 Nov 1994 08:49:37 GMT", wall=1 << 63,
                                     expect=retry(0)), drain()])

vec("late-success-is-timeout", "A success reported with an elapsed that reaches the attempt's timeout (a host that could not stop waiting) is a timeout: retried, and a failure for the breaker. Just under the timeout it is a success.", ["timeout", "classification"],
    policy("attempts: 3\nattempt-timeout: 100ms\nbreaker: { window: { kind: count, size: 2 }, minimum-calls: 2, failure-rate: 50 }\n" + NOJ),
    [start(1, 0, expect=attempt(1, 100 * MS)), report(1, 150 * MS, elapsed=150 * MS, expect=retry(100 * MS)),
     acquire(1, 250 * MS, expect=attempt(2, 100 * MS)), report(1, 350 * MS, elapsed=100 * MS - 1, expect=DONE), drain()])

vec("late-success-deadline", "A late success past the deadline (the attempt's timeout was the rest of the deadline) fails with deadline instead of returning.", ["timeout", "deadline"],
    policy("attempts: 3\ndeadline: 1s\n" + NOJ),
    [start(1, 0, expect=attempt(1, S)), report(1, 2 * S, elapsed=2 * S, expect=fail("deadline")), drain()])

vec("late-settle-ends-call", "A late success held back against the protocol (passed as settle) is a timeout whose answer nobody hears: the call is ended, not left live.", ["timeout", "batching"],
    policy("attempts: 3\nattempt-timeout: 100ms\n" + NOJ),
    [start(1, 0, expect=attempt(1, 100 * MS)), start(2, 300 * MS, settle=(1, 200 * MS, 200 * MS), expect=attempt(1, 100 * MS)),
     info(1, None), acquire(1, 400 * MS, expect=invalid(1)), drain()])

CALLER = policy("attempts: 3\nbreaker: { window: { kind: count, size: 2 }, minimum-calls: 2, failure-rate: 50 }\n" + NOJ)
vec("caller-predicate-retries-a-result", "Report flag bit 1: the caller's predicate calls a returned result a failure (retry_if_result): it is retried, but the breaker does not count it as the dependency failing.", ["classification", "predicates"],
    CALLER, [start(1, 0), report(1, MS, flags=2, expect=retry()), acquire(1, 200 * MS, expect=attempt(2)),
             report(1, 201 * MS, flags=2, expect=retry()), acquire(1, 500 * MS, expect=attempt(3)),
             report(1, 501 * MS, flags=2, expect=fail("retries-exhausted")), breaker(600 * MS, expect="closed"), drain()])

vec("caller-predicate-refuses-a-retryable", "Report flag bit 2: the caller's predicate says never retry a 503 that retry-on would retry: non-retryable, and still a breaker failure.", ["classification", "predicates"],
    CALLER, [start(1, 0), report(1, MS, "http-status", code=503, flags=4, expect=fail("non-retryable")),
             start(2, 10 * MS), report(2, 11 * MS, "http-status", code=503, flags=4, expect=fail("non-retryable")),
             breaker(12 * MS, expect="open"), drain()])

vec("caller-predicate-retries-an-error-the-policy-would-not", "The caller's predicate retries error:Fatal, which the default retry-on does not name; no-retry wins when both bits are set.", ["classification", "predicates"],
    CALLER, [start(1, 0), report(1, MS, "error-class", text="Fatal", flags=2, expect=retry()), acquire(1, 300 * MS, expect=attempt(2)),
             report(1, 301 * MS, "error-class", text="Fatal", flags=6, expect=fail("non-retryable")), drain()])

vec("caller-predicate-keeps-the-ladder", "A caller's retry does not override the rest of the ladder: a non-idempotent call is not retried, and an overloaded response never is.", ["classification", "predicates", "idempotency"],
    CALLER, [start(1, 0, flags=1), report(1, MS, "error-class", text="Boom", flags=2, expect=fail("non-idempotent")),
             start(2, 10 * MS), report(2, 11 * MS, "http-status", code=503, flags=1 | 2, expect=fail("non-retryable")), drain()])

ANY = "attempts: 2\nretry-on: [any]\n" + NOJ
vec("retry-on-any", "`retry-on: [any]` retries every failure, error classes included; the default never-retry still holds (404 is not retried) until it is emptied.", ["classification", "predicates"],
    "policies:\n  p: { attempts: 2, retry-on: [any], backoff: { jitter: none } }\n  q: { attempts: 2, retry-on: [any], never-retry: [], backoff: { jitter: none } }\n",
    [start(1, 0), report(1, MS, "error-class", text="Anything", expect=retry()), cancel(1, 2 * MS),
     start(2, 10 * MS), report(2, 11 * MS, "http-status", code=404, expect=fail("non-retryable")),
     start(3, 20 * MS, policy="q"), report(3, 21 * MS, "http-status", code=404, expect=retry()), cancel(3, 22 * MS),
     start(4, 30 * MS), report(4, 31 * MS, "grpc-status", code=3, expect=retry()), cancel(4, 32 * MS),
     pinfo("p"), drain()])

TOKENS10 = policy("attempts: 2\nbudget: { kind: token, max-tokens: 10, token-ratio: 0.1 }\n" + NOJ)
vec("reload-scales-token-budget", "A reload from max-tokens 10 to 20 keeps the level in proportion (6 of 10 becomes 12 of 20), as gRPC does.", ["budget", "reload"],
    TOKENS10, [step for i in range(1, 5) for step in (start(i, i * S), report(i, i * S, "timeout", expect=retry()), cancel(i, i * S))]
    + [reload(TOKENS10.replace("max-tokens: 10", "max-tokens: 20"), {"ok": None}),
       start(5, 10 * S), report(5, 10 * S, "timeout", expect=retry(100 * MS)), drain()])

# --- Durable calls (policy-core/src/durable.rs, docs/durable.md) --------------------------
# The record flows from step to step: a durable step without `record_hex` works on the record
# the last successful durable step returned. Expectations carry the record's hex, so every
# host proves it writes the same bytes.
W0 = 1_800_000_000 * S  # a wall-clock time, ns since the Unix epoch
DNI = 1  # durable-begin flag: not idempotent


def d_begin(wall, policy="p", key="", idem="", flags=0, expect=None):
    return {"op": "durable_begin", "policy": policy, "key": key, "idempotency_key": idem, "flags": flags,
            "wall_now": wall, **_x(expect)}


def d_step(wall, owner="w1", elapsed=0, expect=None, record=None):
    s = {"op": "durable_step", "owner": owner, "wall_now": wall, "elapsed": elapsed}
    if record is not None:
        s["record_hex"] = record
    return {**s, **_x(expect)}


def d_renew(wall, owner="w1", elapsed=0, expect=None):
    return {"op": "durable_renew", "owner": owner, "wall_now": wall, "elapsed": elapsed, **_x(expect)}


def d_out(wall, kind="success", code=0, text="", message="", owner="w1", elapsed=0, flags=0, expect=None):
    return {"op": "durable_outcome", "owner": owner, "wall_now": wall, "elapsed": elapsed, "kind": kind, "code": code,
            "text": text, "message": message, "flags": flags, **_x(expect)}


def d_cancel(wall, expect=None):
    return {"op": "durable_cancel", "wall_now": wall, **_x(expect)}


def d_revive(wall, expect=None):
    return {"op": "durable_revive", "wall_now": wall, **_x(expect)}


def d_inspect(expect=None, record=None):
    s = {"op": "durable_inspect"}
    if record is not None:
        s["record_hex"] = record
    return {**s, **_x(expect)}


def ok(action, **kw):
    return {"ok": {"action": action, **kw}}


def derr(path):
    return {"err": {"path": path}}


DCONST = "policies:\n  p:\n    attempts: 3\n    attempt-timeout: 5s\n    backoff: { kind: constant, base: 2s, cap: 2s, jitter: none }\n"

vec("durable-run-fail-wait-succeed", "A durable call is begun, runs, fails, waits its backoff on wall time and succeeds on attempt 2.",
    ["durable"], DCONST,
    [d_begin(W0, key="host-a", expect=ok("wait", wait=0, next_at=W0)),
     d_step(W0, expect=ok("run", attempt=1, timeout=5 * S, lease_until=W0 + 30 * S)),
     d_out(W0 + 100 * MS, "http-status", 503, message="Service Unavailable", expect=ok("wait", wait=2 * S, next_at=W0 + 2100 * MS)),
     d_inspect(),
     d_step(W0 + 1100 * MS, owner="w2", expect=ok("wait", wait=S)),
     d_step(W0 + 2100 * MS, owner="w2", expect=ok("run", attempt=2)),
     d_out(W0 + 2200 * MS, owner="w2", expect=ok("done", attempt=2, next_at=0, lease_until=0)),
     d_inspect()])

vec("durable-elapsed-on-the-monotonic-clock", "After a wait in one process only the monotonic elapsed time counts: a wall clock that jumped back does not delay the attempt.",
    ["durable", "clock"], DCONST,
    [d_begin(W0), d_step(W0), d_out(W0, "timeout", expect=ok("wait", wait=2 * S)),
     d_step(W0 - 3600 * S, elapsed=2 * S, expect=ok("run", attempt=2))])

vec("durable-backwards-clock-never-lengthens", "On restore with a wall clock an hour behind, the wait left is next-at minus the last wall time seen, not an hour more.",
    ["durable", "clock"], DCONST,
    [d_begin(W0), d_step(W0), d_out(W0 + S, "timeout", expect=ok("wait", wait=2 * S, next_at=W0 + 3 * S)),
     d_step(W0 - 3600 * S, owner="w2", expect=ok("wait", wait=2 * S, next_at=W0 + 3 * S))])

vec("durable-wait-clamped-to-largest-delay", "A wait already scheduled is bounded by the policy's largest delay when a reload shortened it.",
    ["durable", "clock", "reload"],
    "policies:\n  p:\n    backoff: { kind: constant, base: 60s, cap: 60s, jitter: none }\n    retry-after: { honor: false }\n",
    [d_begin(W0), d_step(W0), d_out(W0, "timeout", expect=ok("wait", wait=60 * S)),
     reload("policies:\n  p:\n    backoff: { kind: constant, base: 5s, cap: 5s, jitter: none }\n    retry-after: { honor: false }\n", {"ok": None}),
     d_step(W0 + S, owner="w2", expect=ok("wait", wait=5 * S, next_at=W0 + 6 * S, policy_changed=True))])

vec("durable-crash-keyed-is-retried", "A non-idempotent call with an idempotency key whose process died mid-attempt is a crash: retried after its backoff, attempt numbers continue.",
    ["durable", "crash", "idempotency"], DCONST,
    [d_begin(W0, idem="order-17", flags=DNI), d_step(W0, expect=ok("run", attempt=1)),
     d_step(W0 + 10 * S, owner="w2", expect=derr("record.lease")),
     d_step(W0 + 30 * S, owner="w2", expect=ok("wait", wait=2 * S, attempt=1, next_at=W0 + 32 * S)),
     d_step(W0 + 32 * S, owner="w2", expect=ok("run", attempt=2)),
     d_inspect()])

vec("durable-crash-non-idempotent-gives-up", "A non-idempotent call without a key cut off mid-attempt has an unknown outcome: it is given up, not run twice.",
    ["durable", "crash", "idempotency"], DCONST,
    [d_begin(W0, flags=DNI), d_step(W0), d_step(W0 + 31 * S, owner="w2", expect=ok("dead", reason="unknown-outcome")),
     d_inspect()])

vec("durable-crash-limit-stops-poison", "A call whose attempts keep killing their process is given up after max-crashes crashes.",
    ["durable", "crash"],
    "policies:\n  p:\n    attempts: 50\n    durable: { lease: 1s, max-crashes: 2 }\n    backoff: { kind: constant, base: 1s, cap: 1s, jitter: none }\n",
    [d_begin(W0), d_step(W0, expect=ok("run", attempt=1, lease_until=W0 + S)),
     d_step(W0 + S, owner="w2", expect=ok("wait", wait=S)), d_step(W0 + 2 * S, owner="w2", expect=ok("run", attempt=2)),
     d_step(W0 + 3 * S, owner="w3", expect=ok("dead", reason="crash-limit", attempt=2)), d_inspect()])

vec("durable-same-owner-restart-is-a-crash", "A process that comes back under its own name and finds its attempt running treats it as cut off.",
    ["durable", "crash"], DCONST,
    [d_begin(W0), d_step(W0), d_step(W0 + S, expect=ok("wait", wait=2 * S))])

vec("durable-renew-extends-lease", "Renewing keeps the lease live; a stale owner's outcome is refused.",
    ["durable", "lease"], DCONST,
    [d_begin(W0), d_step(W0), d_renew(W0 + 10 * S, expect=ok("run", lease_until=W0 + 40 * S)),
     d_step(W0 + 35 * S, owner="w2", expect=derr("record.lease")),
     d_out(W0 + 36 * S, owner="w2", expect=derr("record.lease")),
     d_renew(W0 + 36 * S, owner="w2", expect=derr("record.lease")),
     d_out(W0 + 36 * S, expect=ok("done"))])

vec("durable-outcome-not-running", "An outcome for a record that is not running is refused (its lease was taken over, or it finished).",
    ["durable", "errors"], DCONST,
    [d_begin(W0), d_out(W0, expect=derr("record.state"))])

vec("durable-retries-exhausted", "The third failure of a three-attempt policy gives the call up with its last error.",
    ["durable", "retry"], DCONST + '    retry-on: [timeout, connection-error, "error:IOError"]\n',
    [d_begin(W0), d_step(W0), d_out(W0, "timeout"), d_step(W0 + 2 * S), d_out(W0 + 2 * S, "connection-error", message="refused"),
     d_step(W0 + 4 * S), d_out(W0 + 4 * S, "error-class", text="IOError", message="disk full", expect=ok("dead", reason="retries-exhausted", attempt=3)),
     d_inspect()])

vec("durable-non-retryable", "A 404 is never retried; a marked-overloaded 503 neither.",
    ["durable", "classification"], DCONST,
    [d_begin(W0), d_step(W0), d_out(W0, "http-status", 404, expect=ok("dead", reason="non-retryable")),
     d_begin(W0), d_step(W0), d_out(W0, "http-status", 503, flags=1, expect=ok("dead", reason="non-retryable"))])

vec("durable-non-idempotent-failure", "A failure of a non-idempotent call without a key is not retried.",
    ["durable", "idempotency"], DCONST,
    [d_begin(W0, flags=DNI), d_step(W0), d_out(W0, "timeout", expect=ok("dead", reason="non-idempotent"))])

vec("durable-retry-after", "A Retry-After of 7 s sets the wait; one above the cap gives up.",
    ["durable", "retry-after"], DCONST + "    retry-after: { cap: 60s }\n",
    [d_begin(W0), d_step(W0), d_out(W0, "http-status", 503, "7", expect=ok("wait", wait=7 * S)),
     d_step(W0 + 7 * S), d_out(W0 + 7 * S, "http-status", 429, "120", expect=ok("dead", reason="retry-after-too-long"))])

vec("durable-pushback-restarts-backoff", "A durable call restarts its backoff after a server-directed delay as a plain call does (gRPC A6): two 1 s pushbacks, then 100 s, 200 s, 400 s; the record keeps where the backoff restarted.",
    ["durable", "pushback", "backoff"], "policies:\n  p:\n    " + A6_BACKOFF.replace("\n", "\n    ") + "\n", [
        d_begin(W0), d_step(W0),
        d_out(W0, "grpc-status", 14, "1000", expect=ok("wait", wait=S)), d_step(W0 + S),
        d_out(W0 + S, "grpc-status", 14, "1000", expect=ok("wait", wait=S)), d_step(W0 + 2 * S),
        d_out(W0 + 2 * S, "grpc-status", 14, "", expect=ok("wait", wait=100 * S)), d_step(W0 + 102 * S),
        d_out(W0 + 102 * S, "grpc-status", 14, "", expect=ok("wait", wait=200 * S)), d_inspect(), d_step(W0 + 302 * S),
        d_out(W0 + 302 * S, "grpc-status", 14, "", expect=ok("wait", wait=400 * S)),
    ])

vec("durable-retry-after-http-date", "An HTTP-date Retry-After is read against the record's wall clock.",
    ["durable", "retry-after"], DCONST,
    [d_begin(W0), d_step(W0), d_out(W0, "http-status", 503, "Fri, 15 Jan 2027 08:00:10 GMT", expect=ok("wait", wait=10 * S))])

vec("durable-pushback-stop", "A negative gRPC pushback gives the call up.",
    ["durable", "retry-after"], DCONST,
    [d_begin(W0), d_step(W0), d_out(W0, "grpc-status", 14, "-1", expect=ok("dead", reason="pushback"))])

vec("durable-deadline-wall-clock", "The deadline is a wall-clock time: a retry that would start past it gives up, and a call found after it is dead.",
    ["durable", "deadline"], DCONST + "    deadline: 3s\n",
    [d_begin(W0, expect=ok("wait")), d_step(W0, expect=ok("run", timeout=3 * S)), d_out(W0 + 1500 * MS, "timeout", expect=ok("dead", reason="deadline")),
     d_begin(W0), d_step(W0 + 4 * S, expect=ok("dead", reason="deadline"))])

vec("durable-full-jitter-position", "Jitter draws come from the record's own generator: restoring the bytes elsewhere continues the same sequence.",
    ["durable", "jitter"],
    "policies:\n  p:\n    attempts: 5\n    backoff: { kind: exponential, base: 1s, cap: 30s, jitter: full }\n",
    [d_begin(W0), d_step(W0), d_out(W0, "timeout"), d_inspect(), d_step(W0 + 60 * S, owner="w2"), d_out(W0 + 60 * S, "timeout", owner="w2"),
     d_step(W0 + 120 * S, owner="w3"), d_out(W0 + 120 * S, "timeout", owner="w3")], seed=7)

vec("durable-cancel-and-revive", "A cancelled call stays cancelled; an operator's retry gives it fresh attempts due now; a done call cannot be cancelled.",
    ["durable", "cancel"], DCONST,
    [d_begin(W0), d_step(W0), d_cancel(W0 + S, expect=ok("cancelled", reason="cancelled")),
     d_out(W0 + S, expect=derr("record.state")), d_step(W0 + S, expect=ok("cancelled")),
     d_revive(W0 + 5 * S, expect=ok("wait", wait=0, next_at=W0 + 5 * S, attempt=0)),
     d_step(W0 + 5 * S, expect=ok("run", attempt=1)), d_out(W0 + 5 * S, expect=ok("done")),
     d_cancel(W0 + 6 * S, expect=derr("record.state")), d_revive(W0 + 6 * S, expect=derr("record.state"))])

vec("durable-bad-records-are-named", "Garbage, a wrong version, a flipped bit and a truncated record are refused with an error naming what is wrong.",
    ["durable", "errors"], DCONST,
    [d_step(W0, record="00"), d_inspect(record="4c564452"), d_step(W0, record="4c56445202" + "00" * 140),
     d_begin(W0), d_inspect(),
     d_begin(W0, key="k" * 4097, expect=derr("key")), d_begin(W0, policy="nope", expect=derr("policy")),
     d_begin(W0, flags=6, expect=derr("flags")), d_step(W0, owner="")])

vec("durable-policy-gone-after-reload", "A record whose policy a reload removed is refused with an error naming the policy (the host quarantines it); a changed definition goes on and says so.",
    ["durable", "reload", "errors"], "policies:\n  p: { attempts: 3 }\n  q: { attempts: 3 }\n",
    [d_begin(W0, policy="q"), reload("policies:\n  p: { attempts: 3 }\n", {"ok": None}), d_step(W0, expect=derr("record.policy")),
     d_begin(W0, policy="p"), reload("policies:\n  p: { attempts: 4 }\n", {"ok": None}), d_step(W0, expect=ok("run", policy_changed=True))])

# --- Fleet-wide state (policy-core/src/fleet, docs/fleet.md) -------------------------------
# One engine stands for several processes: it publishes the evidence of key `x` as nodes `a`
# and `b` (the shared bytes flow from step to step, as a durable record does) and applies the
# result to key `y` as node `c`. The quorum rule is the core's: these vectors pin it.

def f_merge(now, wall, node, key="x", policy="p", shared=None, expect=None):
    s = {"op": "fleet_merge", "policy": policy, "key": key, "node": node, "now": now, "wall_ms": wall}
    if shared is not None:
        s["shared_hex"] = shared
    return {**s, **_x(expect)}


def f_apply(now, wall, node, key="y", policy="p", shared=None, expect=None):
    s = {"op": "fleet_apply", "policy": policy, "key": key, "node": node, "now": now, "wall_ms": wall}
    if shared is not None:
        s["shared_hex"] = shared
    return {**s, **_x(expect)}


def f_trip(key, t0, first_call):
    steps = []
    for i in range(2):
        steps += [start(first_call + i, t0 + 2 * i, key=key, expect=attempt(1)), report(first_call + i, t0 + 2 * i + 1, "timeout")]
    return steps


FLEET = ("policies:\n  p:\n    attempts: 1\n"
         "    breaker: { window: { kind: count, size: 2 }, minimum-calls: 2, failure-rate: 50, open-duration: 1s, half-open-permits: 1 }\n"
         "    budget: { kind: token, max-tokens: 10, token-ratio: 1 }\n"
         "    fleet: { quorum: 2, within: 30s, ttl: 60s, publish-every: 100ms }\n"
         "  q: { attempts: 1 }\n")
OPEN = {"state": "open"}

vec("fleet-one-open-process-is-not-a-quorum", "One process whose breaker opened on its own window publishes it; a process with a quorum of 2 stays closed: one bad node lowers only its own traffic.",
    ["fleet", "breaker"], FLEET,
    f_trip("x", 0, 1) + [breaker(10, key="x", expect="open"), f_merge(10, 1000, "a"), drain(),
     f_apply(20, 1000, "c", expect={"ok": None}), breaker(20, key="y", expect="closed"), drain(expect=[])])

vec("fleet-quorum-opens-a-closed-breaker", "Two processes open within `within` open a third, closed one (closed -> open, an event named fleet-quorum with the count); its record says it was opened by the fleet and does not count.",
    ["fleet", "breaker"], FLEET,
    f_trip("x", 0, 1) + [f_merge(10, 1000, "a"), f_merge(10, 1000, "b"), drain(),
     f_apply(20, 1000, "c", expect={"ok": None}), breaker(20, key="y", expect="open"),
     drain(expect=[{"kind": "breaker-transition", "key": "y", "state_from": "closed", "state_to": "open", "name": "fleet-quorum", "value": 2}]),
     f_merge(30, 1000, "c", key="y")])

vec("fleet-quorum-counts-only-recent-openings", "Openings older than `within` (30 s) do not count toward the quorum.",
    ["fleet", "breaker"], FLEET,
    f_trip("x", 0, 1) + [f_merge(10, 1000, "a"), f_merge(10, 1000, "b"), drain(),
     f_apply(20, 31_001, "c", expect={"ok": None}), breaker(20, key="y", expect="closed"),
     f_apply(20, 30_999, "c", expect={"ok": None}), breaker(20, key="y", expect="open")])

vec("fleet-probe-one-process-at-a-time", "An open breaker about to go half-open takes the fleet's probe; another process's open breaker then stays open until that probe's lease ends, and the holder's goes half-open on time.",
    ["fleet", "breaker", "half-open"], FLEET,
    f_trip("x", 0, 1) + f_trip("z", 0, 3) + [f_merge(950 * MS, 1950, "a"), f_merge(950 * MS, 1950, "b", key="z"),
     f_apply(950 * MS, 1950, "a", key="x", expect={"ok": None}), f_apply(950 * MS, 1950, "b", key="z", expect={"ok": None}),
     breaker(1100 * MS, key="x", expect="half-open"), breaker(1100 * MS, key="z", expect="open"),
     breaker(1950 * MS, key="z", expect="open"), breaker(2100 * MS, key="z", expect="half-open")])

vec("fleet-plan", "The fleet plan a host reads: the store key prefix hashed by policy, publication, timeouts and the GCRA parameters, its max-wait capped by the deadline; none without a fleet section.",
    ["fleet"], "policies:\n  p:\n    attempts: 1\n    fleet: { publish: strict, timeout: 3ms, rate-limit: { rate: 1000, burst: 20, max-wait: 5ms } }\n  q: { attempts: 1 }\n"
    "  d:\n    deadline: 2ms\n    fleet: { rate-limit: { rate: 10, max-wait: 1s } }\n",
    [{"op": "fleet_plan", "policy": "p"}, {"op": "fleet_plan", "policy": "q", "expect": None}, {"op": "fleet_plan", "policy": "d"}])

vec("fleet-bad-bytes-are-refused", "Shared bytes that are not the core's (garbage, another version, truncated), an empty node name and a policy without a fleet section are errors naming what is wrong.",
    ["fleet", "errors"], FLEET,
    [f_merge(0, 1, "a", shared="00"), f_merge(0, 1, "a", shared="4c4602"), f_merge(0, 1, "a", shared="4c460100"),
     f_merge(0, 1, ""), f_merge(0, 1, "a", policy="q"), f_apply(0, 1, "a", shared="4c46"),
     {"op": "fleet_inspect", "shared_hex": "4c4601000000000100"}, {"op": "fleet_inspect", "shared_hex": "4c46010000000000"}])

vec("fleet-ratio-budget-shared", "A ratio budget is shared: deposits and withdrawals merge into a ledger of slots of the store's clock (ttl / 10 each). Ten calls on x published as node a pay a retry on y, whose own single deposit would not (5 per retry at 20 %); the retry's withdrawal is published as node c.",
    ["fleet", "budget"], "policies:\n  p:\n    attempts: 2\n    budget: { kind: ratio, percent: 20, min-per-second: 0, ttl: 10s }\n    fleet: { publish-every: 100ms }\n",
    sum(([start(1 + i, i * MS, key="x", expect=attempt(1)), report(1 + i, i * MS + 1, expect=DONE)] for i in range(10)), [])
    + [f_merge(20 * MS, 1000, "a", key="x"),
       f_merge(30 * MS, 1000, "c", key="y"),
       f_apply(30 * MS, 1000, "c", key="y"),
       start(11, 40 * MS, key="y", expect=attempt(1)),
       report(11, 41 * MS, "timeout", expect=retry()),
       f_merge(50 * MS, 1050, "c", key="y"),
       {"op": "fleet_plan", "policy": "p"}])

vec("fleet-errors-are-named", "Every invalid fleet field is named: quorum 0, a ttl shorter than two publications, a timeout above 1 s, a lease above the burst, a shared aws-adaptive budget, a bad prefix, a section that shares nothing, an unknown field.",
    ["fleet", "errors"],
    "policies:\n"
    "  a: { breaker: {}, fleet: { quorum: 0, ttl: 100ms, publish-every: 1s, timeout: 2s } }\n"
    "  b: { fleet: { rate-limit: { rate: 10, burst: 5 }, lease: 6, prefix: \"a b\" } }\n"
    "  c: { budget: { kind: aws-adaptive }, fleet: { budget: shared } }\n"
    "  d: { fleet: { publish: sometimes } }\n"
    "  e: { breaker: {}, fleet: { quorom: 2 } }\n", [])

PRESETS = [
    ("levee", 3, 3), ("temporal", 3, 3), ("durable-task", 3, 3),
    ("step-functions", 3, 4), ("celery", 3, 4), ("sidekiq", 3, 4),
]
for preset, n, total in PRESETS:
    vec(f"attempts-preset-{preset}", f"Under `attempts-preset: {preset}`, `attempts: {n}` means {total} attempts in all (durable and in-process alike).",
        ["attempts", "presets", "durable"],
        f"policies:\n  p: {{ attempts-preset: {preset}, attempts: {n}, backoff: {{ kind: constant, base: 1s, jitter: none }} }}\n",
        [pinfo(expect={"max_attempts": total})]
        + sum(([d_step(W0 + i * S), d_out(W0 + i * S, "timeout")] for i in range(total)), [d_begin(W0)])
        + [d_inspect()])
    # the last outcome above is the give-up: checked by the blessed expectation

vec("attempts-preset-zero", "`attempts: 0` is unlimited under temporal, no retry under step-functions, celery and sidekiq, and an error elsewhere.",
    ["attempts", "presets"],
    "policies:\n  t: { attempts-preset: temporal, attempts: 0 }\n  s: { attempts-preset: step-functions, attempts: 0 }\n  c: { attempts-preset: celery, attempts: 0 }\n  k: { attempts-preset: sidekiq, attempts: 0 }\n  d: { attempts-preset: sidekiq }\n",
    [pinfo("t", {"max_attempts": 4294967295}), pinfo("s", {"max_attempts": 1}), pinfo("c", {"max_attempts": 1}),
     pinfo("k", {"max_attempts": 1}), pinfo("d", {"max_attempts": 26})])

vec("attempts-preset-errors", "An unknown preset, 0 under durable-task and a negative count are errors naming the field.",
    ["attempts", "presets", "errors"],
    "policies:\n  a: { attempts-preset: temporall }\n  b: { attempts-preset: durable-task, attempts: 0 }\n  c: { attempts-preset: celery, attempts: -1 }\n  d: { durable: { max-crashes: 0, lease: \"0\" } }\n", [])

# --------------------------------------------------------------------------------------
# Adaptive concurrency limits (ANCHORS.md "Adaptive concurrency"; docs/policy.md)
# The limit is observed as the number of calls admitted at once: `admitted(n, ...)` starts
# n calls that must all be admitted, then one more that must be rejected (bulkhead-full).
# --------------------------------------------------------------------------------------


def admitted(n, first, t, key=""):
    return [start(first + i, t, key=key, expect=attempt(1)) for i in range(n)] + \
        [start(first + n, t, key=key, expect=fail("bulkhead-full"))]


def ok_after(call, t, elapsed):
    return report(call, t, "success", elapsed=elapsed, expect=DONE)


ENVOY = "attempts: 1\nconcurrency: { kind: adaptive, algorithm: envoy-gradient, initial-limit: 100, min-rtt-samples: 3 }\n"

for sample_ms, limit in [(25, 57), (5, 214)]:
    # Envoy: the limit is pinned at min-rtt-concurrency (3) while minRTT is measured (3 samples
    # of 10 ms, p50 10 ms); then L = 100; a window (100 ms) of samples with p50 `sample_ms`
    # gives g = clamp(10 * 1.25 / sample, 0.5, 2) and L = floor(L g + sqrt(L g)):
    # 25 ms: 100 * 0.5 = 50, + 7.07 = 57; 5 ms: 100 * 2 = 200, + 14.14 = 214 (ANCHORS.md).
    vec(f"adaptive-envoy-gradient-{sample_ms}ms", f"Envoy's gradient: L 100, minRTT 10 ms, a window's p50 of {sample_ms} ms gives {limit}.",
        ["adaptive"], policy(ENVOY),
        admitted(3, 1, 0)
        + [ok_after(1, 10 * MS, 10 * MS), ok_after(2, 10 * MS, 10 * MS), ok_after(3, 10 * MS, 10 * MS)]
        + [start(10, 20 * MS), ok_after(10, 20 * MS + sample_ms * MS, sample_ms * MS)]
        + [start(11, 30 * MS), ok_after(11, 30 * MS + sample_ms * MS, sample_ms * MS)]
        + admitted(100, 100, 50 * MS) + [cancel(100 + i, 60 * MS) for i in range(100)]
        + [start(20, 120 * MS), ok_after(20, 120 * MS + sample_ms * MS, sample_ms * MS)]
        + admitted(limit, 1000, 200 * MS))

vec("adaptive-timeouts-are-not-samples", "A timeout or a cancellation is no latency sample: minRTT is still being measured (limit pinned at 3) until a success reports one.",
    ["adaptive"], policy("attempts: 1\nconcurrency: { kind: adaptive, algorithm: envoy-gradient, initial-limit: 50, min-rtt-samples: 1 }\n"),
    admitted(3, 1, 0)
    + [report(1, 5 * MS, "timeout", elapsed=5 * MS, expect=fail("retries-exhausted")), cancel(2, 6 * MS),
       report(3, 7 * MS, "connection-error", elapsed=7 * MS, expect=fail("retries-exhausted"))]
    + admitted(3, 5, 8 * MS)
    + [ok_after(5, 9 * MS, MS)]
    + admitted(48, 100, 10 * MS))

# Vegas: L 20 (lg 1, alpha 3, beta 6). 20 calls in flight; #1 (100 ms) sets noload; #2 at
# 100 ms with 19 in flight: queue 0 -> L + 6 = 26; #3 at 200 ms with 18 in flight: queue
# ceil(26 * 100 / 200) = 13 > 6 -> 25. 17 remain in flight: 8 more are admitted, not 9.
vec("adaptive-vegas", "Vegas: noload from the first sample; queue 0 adds beta (20 -> 26), queue 13 > beta takes lg (26 -> 25).",
    ["adaptive"], policy("attempts: 1\nconcurrency: { kind: adaptive, algorithm: vegas }\n"),
    admitted(20, 1, 0)
    + [ok_after(1, 100 * MS, 100 * MS), ok_after(2, 100 * MS, 100 * MS), ok_after(3, 200 * MS, 200 * MS)]
    + admitted(8, 100, 300 * MS))

# Gradient2: L 20, samples with in-flight >= L/2. Three samples of 100 us (long 100, g = 1):
# estimate 20 -> 20.8 -> 21.6 -> 22.4 (the queue term, 0.2 * 4, while g is 1); 17 in flight
# plus 5 = 22. Then 1000 us with 21 in flight: long = (3 * 100 + 1000) / 4 = 325,
# g = 1.5 * 325 / 1000 = 0.4875 -> 0.5, no queue term: 22.4 * 0.8 + 11.2 * 0.2 = 20.16 -> 20,
# with 21 in flight: none admitted.
US = 1000
vec("adaptive-gradient2", "Gradient2: steady latency grows the limit by the queue term only while the gradient is 1 (20 -> 22); a tenfold latency halves the gradient (22 -> 20).",
    ["adaptive"], policy("attempts: 1\nconcurrency: { kind: adaptive, algorithm: gradient2 }\n"),
    admitted(20, 1, 0)
    + [ok_after(1, 100 * US, 100 * US), ok_after(2, 100 * US, 100 * US), ok_after(3, 100 * US, 100 * US)]
    + admitted(5, 100, 200 * US)[:5] + [start(105, 200 * US, expect=fail("bulkhead-full"))]
    + [ok_after(4, 1000 * US, 1000 * US), start(200, 1100 * US, expect=fail("bulkhead-full"))])

# AIMD: L 4; a timeout multiplies it by 0.9: floor(3.6) = 3 (3 in flight: none admitted); a
# success with in-flight * 2 >= L adds 1 (2 in flight: 2 more admitted).
vec("adaptive-aimd", "AIMD: a timeout multiplies the limit by 0.9 (4 -> 3); a success while the limit is in use adds 1 (3 -> 4).",
    ["adaptive"], policy("attempts: 1\nconcurrency: { kind: adaptive, algorithm: aimd, initial-limit: 4 }\n"),
    admitted(4, 1, 0)
    + [report(1, MS, "timeout", elapsed=MS), start(10, 2 * MS, expect=fail("bulkhead-full"))]
    + [ok_after(2, 3 * MS, MS)] + admitted(2, 20, 5 * MS))

vec("adaptive-state-survives-export", "The adaptive limit is exported and imported with the state.",
    ["adaptive", "state"], policy("attempts: 1\nconcurrency: { kind: adaptive, algorithm: aimd, initial-limit: 4 }\n"),
    admitted(4, 1, 0)
    + [report(1, MS, "timeout", elapsed=MS), cancel(2, MS), cancel(3, MS), cancel(4, MS), export_import()]
    + admitted(3, 10, 2 * MS))

vec("adaptive-errors", "Adaptive limits name their errors: a missing kind, an unknown algorithm, min above initial, and a bulkhead beside it.",
    ["adaptive", "errors"],
    "policies:\n  a: { concurrency: { algorithm: vegas } }\n  b: { concurrency: { kind: adaptive, algorithm: gradient3 } }\n"
    "  c: { concurrency: { kind: adaptive, initial-limit: 5, min-limit: 6 } }\n  d: { bulkhead: {}, concurrency: { kind: adaptive } }\n"
    "  e: { concurrency: { kind: adaptive, algorithm: aimd, backoff-ratio: 1, smoothing: 0.5 } }\n", [])


# --------------------------------------------------------------------------------------
# AWS adaptive retry: the CUBIC client rate (budget kind aws-adaptive; ANCHORS.md)
# --------------------------------------------------------------------------------------

AWS = "attempts: 3\nbackoff: { kind: constant, base: 10ms, jitter: none }\nbudget: { kind: aws-adaptive }\n"
RL_WAIT = {"kind": "wait", "reason": "rate-limited"}

# The first response is a throttle: nothing was measured, so Wmax = 0 and the rate 0; the
# bucket fills at its floor of 0.5/s from empty: 10 ms later it holds 0.005 tokens, so the
# retry waits (1 - 0.005) / 0.5 = 1.99 s; then it runs without asking again.
vec("budget-aws-adaptive-throttle-waits", "AWS adaptive: after a throttle every attempt takes a token of the CUBIC rate; the retry waits 1.99 s for one at the 0.5/s floor.",
    ["budget", "aws-adaptive"], policy(AWS),
    [start(1, 0, expect=attempt(1)), report(1, MS, "http-status", code=429, expect=retry(10 * MS)),
     acquire(1, 11 * MS, expect={**RL_WAIT, "payload": 1_990_000_000}),
     acquire(1, 11 * MS + 1_000 * MS, expect={**RL_WAIT, "payload": 990_000_000}),
     acquire(1, 11 * MS + 1_990 * MS, expect=attempt(2)), report(1, 2_100 * MS, expect=DONE), drain()])

vec("budget-aws-adaptive-max-wait", "AWS adaptive: a wait for a token above max-wait is a rejection (rate-limited) with the wait as its hint.",
    ["budget", "aws-adaptive"], policy(AWS.replace("kind: aws-adaptive", "kind: aws-adaptive, max-wait: 1s")),
    [start(1, 0), report(1, MS, "http-status", code=429, expect=retry(10 * MS)),
     acquire(1, 11 * MS, expect=fail("rate-limited", 1_990_000_000)),
     start(2, 12 * MS, expect=fail("rate-limited")), drain()])

# 20 responses a second for 2 s: measured = 0.8 * 20 + 0.2 * (the previous) = 19.98/s; the
# bucket, refilled meanwhile at the CUBIC rate from Wmax 0.5 (about 1.2/s), holds 1.18 tokens.
# A throttle: Wmax = 19.98, rate = 0.7 * 19.98 = 13.986/s. One call runs at once, the next
# waits (1 - 0.176) / 13.986 = 58.9 ms (blessed: 58.949 ms; an independent float model of
# botocore gives 58.917 ms: the core keeps rates in milli-requests per second, rounded down,
# so its bucket refilled 0.0004 tokens less over the 40 responses). After export and import
# the debt is kept: one more call waits (1.810 / 13.986 =) 129.45 ms.
steady = []
for i in range(40):
    steady += [start(100 + i, i * 50 * MS), report(100 + i, i * 50 * MS, expect=DONE)]
vec("budget-aws-adaptive-cubic-rate", "AWS adaptive: a throttle after a steady 20/s sets Wmax to the measured rate and the rate to 0.7 of it; the bucket then spaces attempts at that rate.",
    ["budget", "aws-adaptive"], policy("attempts: 1\nbudget: { kind: aws-adaptive }\n"),
    steady + [start(1, 2_000 * MS), report(1, 2_000 * MS, "http-status", code=429, expect=fail("retries-exhausted")),
              start(2, 2_000 * MS, expect=attempt(1)), start(3, 2_000 * MS, expect=RL_WAIT),
              export_import(), start(4, 2_001 * MS, expect=RL_WAIT)])

vec("budget-aws-adaptive-errors", "aws-adaptive is its own rate limiter: not with rate-limit; its fields are checked.",
    ["budget", "aws-adaptive", "errors"],
    "policies:\n  a: { budget: { kind: aws-adaptive }, rate-limit: { rate: 5 } }\n  b: { budget: { kind: aws-adaptive, max-tokens: 3, throttle-on: [\"http:4299\"] } }\n", [])


# --------------------------------------------------------------------------------------
# Bulkhead queue (cockatiel's bulkhead(limit, queue), Polly's concurrency limiter queue)
# --------------------------------------------------------------------------------------


def qwait(d=None):
    e = {"kind": "wait", "reason": "bulkhead-full"}
    if d is not None:
        e["payload"] = d
    return e


BQ = "attempts: 1\nbulkhead: { max-concurrent: 1, queue: 2, queue-timeout: 1s }\n"
vec("bulkhead-queue-fifo", "A full bulkhead queues calls FIFO (wait, reason bulkhead-full) up to its queue length; when a slot frees the oldest waiter is admitted, a later one waits the rest of its time.",
    ["bulkhead", "bulkhead-queue"], policy(BQ),
    [start(1, 0, expect=attempt(1)), start(2, 0, expect=qwait(1000 * MS)), start(3, 10 * MS, expect=qwait(1000 * MS)),
     start(4, 10 * MS, expect=fail("bulkhead-full")),
     report(1, 100 * MS, expect=DONE),
     acquire(3, 100 * MS, expect=qwait(910 * MS)), acquire(2, 100 * MS, expect=attempt(1)),
     report(2, 200 * MS, expect=DONE), acquire(3, 200 * MS, expect=attempt(1)), drain()])

vec("bulkhead-queue-timeout", "A waiter whose queue-timeout has passed with no slot free is rejected (bulkhead-full); one that finds a slot free is admitted even after it.",
    ["bulkhead", "bulkhead-queue"], policy("attempts: 1\nbulkhead: { max-concurrent: 1, queue: 2, queue-timeout: 100ms }\n"),
    [start(1, 0), start(2, 0, expect=qwait(100 * MS)), start(3, 0, expect=qwait(100 * MS)),
     acquire(2, 100 * MS, expect=fail("bulkhead-full")),
     report(1, 150 * MS, expect=DONE), acquire(3, 300 * MS, expect=attempt(1)), drain()])

vec("bulkhead-queue-deadline", "The wait in the queue never passes the call's deadline.",
    ["bulkhead", "bulkhead-queue", "deadline"], policy("attempts: 1\ndeadline: 50ms\nbulkhead: { max-concurrent: 1, queue: 1 }\n"),
    [start(1, 0), start(2, 10 * MS, expect=qwait(50 * MS)), acquire(2, 60 * MS, expect=fail("deadline")),
     start(3, 61 * MS, expect=qwait(50 * MS))])

vec("bulkhead-queue-cancel", "A cancelled waiter leaves the queue: the next one moves up.",
    ["bulkhead", "bulkhead-queue"], policy(BQ),
    [start(1, 0), start(2, 0, expect=qwait()), start(3, 0, expect=qwait()), cancel(2, MS),
     start(4, MS, expect=qwait()), report(1, 2 * MS, expect=DONE), acquire(3, 2 * MS, expect=attempt(1))])

vec("bulkhead-queue-no-overtaking", "A call that arrives while others wait queues behind them even when a slot is free.",
    ["bulkhead", "bulkhead-queue"], policy(BQ),
    [start(1, 0), start(2, 0, expect=qwait()), report(1, MS, expect=DONE), start(3, MS, expect=qwait(1000 * MS)),
     acquire(2, 2 * MS, expect=attempt(1)), report(2, 3 * MS, expect=DONE), acquire(3, 3 * MS, expect=attempt(1))])

vec("bulkhead-queue-retry-requeues", "A retry of a call needs a slot again: it queues like any attempt.",
    ["bulkhead", "bulkhead-queue"], policy("attempts: 2\nbackoff: { kind: constant, base: 10ms, jitter: none }\nbulkhead: { max-concurrent: 1, queue: 1 }\n"),
    [start(1, 0), report(1, MS, "http-status", code=503, expect=retry(10 * MS)), start(2, 2 * MS, expect=attempt(1)),
     acquire(1, 11 * MS, expect=qwait(1000 * MS)), report(2, 20 * MS, expect=DONE), acquire(1, 20 * MS, expect=attempt(2))])

# The core names the calls to wake (docs/policy.md, "The queue"): each slot freed on a key with
# waiters is granted to the oldest, reserved for it, and its id is listed by take-wakes.
BQ3 = "attempts: 1\nbulkhead: { max-concurrent: 1, queue: 3, queue-timeout: 1s }\n"
vec("bulkhead-queue-wakes-on-report", "A report that frees a slot grants it to the oldest waiter only: take-wakes names that call, and its acquire takes the slot.",
    ["bulkhead", "bulkhead-queue", "bulkhead-wakes"], policy(BQ3),
    [start(1, 0, expect=attempt(1)), start(2, MS, expect=qwait()), start(3, 2 * MS, expect=qwait()), start(4, 3 * MS, expect=qwait()),
     wakes([]),
     report(1, 10 * MS, expect=DONE), wakes([2]), wakes([]),
     acquire(3, 10 * MS, expect=qwait(992 * MS)), acquire(2, 10 * MS, expect=attempt(1)),
     report(2, 20 * MS, "http-status", code=503, expect=fail("retries-exhausted")), wakes([3]),
     acquire(3, 20 * MS, expect=attempt(1)), report(3, 30 * MS, expect=DONE), wakes([4]),
     acquire(4, 30 * MS, expect=attempt(1)), report(4, 40 * MS, expect=DONE), wakes([]), drain()])

vec("bulkhead-queue-wakes-in-grant-order", "Two slots freed grant the two oldest waiters, in order; a newcomer queues behind the grants even with no one left waiting, and is granted at once when a slot is free beyond them.",
    ["bulkhead", "bulkhead-queue", "bulkhead-wakes"], policy("attempts: 1\nbulkhead: { max-concurrent: 2, queue: 4, queue-timeout: 1s }\n"),
    [start(1, 0), start(2, 0), start(3, MS, expect=qwait()), start(4, 2 * MS, expect=qwait()),
     report(2, 5 * MS, expect=DONE), report(1, 6 * MS, expect=DONE), wakes([3, 4]),
     acquire(4, 6 * MS, expect=attempt(1)), report(4, 7 * MS, expect=DONE),
     start(5, 8 * MS, expect=qwait(1000 * MS)), wakes([5]),
     acquire(3, 9 * MS, expect=attempt(1)), acquire(5, 9 * MS, expect=attempt(1)), wakes([])])

vec("bulkhead-queue-wakes-on-cancel", "Cancelling the call in flight grants its slot to the oldest waiter; cancelling a waiter grants nothing.",
    ["bulkhead", "bulkhead-queue", "bulkhead-wakes"], policy(BQ3),
    [start(1, 0), start(2, MS, expect=qwait()), start(3, 2 * MS, expect=qwait()),
     cancel(2, 3 * MS), wakes([]), cancel(1, 4 * MS), wakes([3]), acquire(3, 4 * MS, expect=attempt(1))])

vec("bulkhead-queue-granted-call-cancelled", "A granted call that is cancelled before it acquires gives its reservation to the next waiter.",
    ["bulkhead", "bulkhead-queue", "bulkhead-wakes"], policy(BQ3),
    [start(1, 0), start(2, MS, expect=qwait()), start(3, 2 * MS, expect=qwait()),
     report(1, 5 * MS, expect=DONE), wakes([2]), start(4, 6 * MS, expect=qwait()),
     cancel(2, 7 * MS), wakes([3]), acquire(4, 8 * MS, expect=qwait(998 * MS)), acquire(3, 8 * MS, expect=attempt(1))])

vec("bulkhead-queue-wakes-on-timeout", "An attempt that times out frees its slot for the oldest waiter; a waiter whose time is over without a grant is rejected and wakes no one.",
    ["bulkhead", "bulkhead-queue", "bulkhead-wakes"], policy("attempts: 1\nbulkhead: { max-concurrent: 1, queue: 3, queue-timeout: 100ms }\n"),
    [start(1, 0), start(2, MS, expect=qwait(100 * MS)), start(3, 50 * MS, expect=qwait(100 * MS)),
     acquire(2, 101 * MS, expect=fail("bulkhead-full")), wakes([]),
     report(1, 120 * MS, "timeout", elapsed=120 * MS, expect=fail("retries-exhausted")), wakes([3]),
     acquire(3, 200 * MS, expect=attempt(1)), drain()])

vec("bulkhead-queue-grant-passed-on-deadline", "A granted call whose deadline has passed when it acquires is rejected (deadline), and its reservation goes to the next waiter.",
    ["bulkhead", "bulkhead-queue", "bulkhead-wakes", "deadline"], policy("attempts: 1\ndeadline: 50ms\nbulkhead: { max-concurrent: 1, queue: 3, queue-timeout: 1s }\n"),
    [start(1, 0), start(2, 10 * MS, expect=qwait(50 * MS)), start(3, 30 * MS, expect=qwait(50 * MS)),
     report(1, 40 * MS, expect=DONE), wakes([2]), acquire(2, 61 * MS, expect=fail("deadline")), wakes([3]),
     acquire(3, 61 * MS, expect=attempt(1))])

vec("bulkhead-queue-wakes-retry-requeues", "A failed attempt's slot goes to the oldest waiter; the call's retry queues behind, and is woken when that waiter's attempt ends.",
    ["bulkhead", "bulkhead-queue", "bulkhead-wakes"], policy("attempts: 2\nbackoff: { kind: constant, base: 10ms, jitter: none }\nbulkhead: { max-concurrent: 1, queue: 2, queue-timeout: 1s }\n"),
    [start(1, 0), start(2, MS, expect=qwait()), report(1, 2 * MS, "http-status", code=503, expect=retry(10 * MS)), wakes([2]),
     acquire(1, 12 * MS, expect=qwait(1000 * MS)), acquire(2, 12 * MS, expect=attempt(1)), wakes([]),
     report(2, 20 * MS, expect=DONE), wakes([1]), acquire(1, 20 * MS, expect=attempt(2)), drain()])

vec("bulkhead-queue-wakes-after-reload", "A reload does not carry the queues over: every queued or granted call is named to wake and acquires again under the new policy.",
    ["bulkhead", "bulkhead-queue", "bulkhead-wakes", "reload"], policy(BQ3),
    [start(1, 0), start(2, MS, expect=qwait()), start(3, 2 * MS, expect=qwait()), report(1, 3 * MS, expect=DONE), wakes([2]),
     reload("policies:\n  p:\n    attempts: 1\n    bulkhead: { max-concurrent: 2, queue: 3, queue-timeout: 1s }\n", expect={"ok": None}),
     wakes([2, 3]), acquire(3, 4 * MS, expect=attempt(1)), acquire(2, 4 * MS, expect=attempt(1))])

vec("bulkhead-queue-grant-then-rate-limit", "A granted call that must then wait for the rate limiter does not keep its slot: it is granted to the next waiter at once (which waits for the limiter too), and the first takes a free slot when its token comes.",
    ["bulkhead", "bulkhead-queue", "bulkhead-wakes", "rate-limit"],
    policy("attempts: 1\nrate-limit: { rate: 1, per: 1s, burst: 1, max-wait: 3s }\nbulkhead: { max-concurrent: 1, queue: 3, queue-timeout: 5s }\n"),
    [start(1, 0, expect=attempt(1)), start(2, MS, expect=qwait()), start(3, 2 * MS, expect=qwait()),
     report(1, 10 * MS, expect=DONE), wakes([2]),
     acquire(2, 10 * MS, expect=wait(990 * MS)), wakes([3]),
     acquire(3, 10 * MS, expect=wait(1990 * MS)), wakes([]),
     acquire(2, 1000 * MS, expect=attempt(1)), report(2, 1100 * MS, expect=DONE), wakes([]),
     acquire(3, 2000 * MS, expect=attempt(1)), drain()])

vec("bulkhead-queue-errors", "The queue's fields are checked.", ["bulkhead", "bulkhead-queue", "errors"],
    "policies:\n  a: { bulkhead: { queue: -1 } }\n  b: { bulkhead: { queue: 2, queue-timeout: \"0\" } }\n", [])



# --------------------------------------------------------------------------------------
# Hedging (docs/policy.md, "Hedging"): gRPC A6 by default, Polly, failsafe-go and Envoy presets.
# --------------------------------------------------------------------------------------

def hstep(call, now, expect=None):
    return {"op": "hedge_step", "call": call, "now": now, **_x(expect)}


def hreport(call, attempt, now, kind="success", code=0, text="", elapsed=0, wall=0, flags=0, expect=None):
    return {"op": "report_attempt", "call": call, "attempt": attempt, "now": now, "elapsed": elapsed, "kind": kind,
            "code": code, "text": text, "wall_secs": wall, "flags": flags, **_x(expect)}


def cmds(*c):
    return {"commands": list(c)}


def hs(attempt, timeout=0):
    return {"start": {"attempt": attempt, "timeout": timeout}}


def hc(attempt):
    return {"cancel": attempt}


def hw(delay):
    return {"wait": delay}


def hend(attempt, verdict):
    return {"end": {"attempt": attempt, "verdict": verdict}}


def hedged(timeout=0):
    return {"kind": "hedge", "detail": 1, "payload": timeout}


UNAVAILABLE = 14  # gRPC UNAVAILABLE
A6 = "hedge: { attempts: 4, delay: 500ms, non-fatal: [\"grpc:unavailable\"] }\n"

vec("hedge-a6-example", "gRPC A6's example: 4 attempts, delay 500 ms, UNAVAILABLE non-fatal: #1 at 0, #2 at 500, #1 fails UNAVAILABLE at 700 so #3 starts at once, #2 succeeds at 900 and #3 is cancelled; #4 never starts. The cancelled attempt is reported when it has closed, and the call then leaves the table.",
    ["hedge"], policy(A6), [
        start(1, 0, expect=hedged()),
        hstep(1, 0, expect=cmds(hw(500 * MS))),
        hstep(1, 499 * MS, expect=cmds(hw(1 * MS))),
        hstep(1, 500 * MS, expect=cmds(hs(2), hw(500 * MS))),
        hreport(1, 1, 700 * MS, kind="grpc-status", code=UNAVAILABLE, elapsed=700 * MS, expect=cmds(hs(3), hw(500 * MS))),
        info(1),
        hreport(1, 2, 900 * MS, kind="grpc-status", code=0, elapsed=400 * MS, expect=cmds(hc(3), hend(2, DONE))),
        info(1),
        hstep(1, 2000 * MS, expect=cmds()),
        hreport(1, 3, 910 * MS, kind="grpc-status", code=1, elapsed=210 * MS, expect=cmds()),
        info(1),
        drain(),
    ])

vec("hedge-delay-zero-sends-all", "`delay: 0` starts every attempt at once; the first success cancels the others.",
    ["hedge"], policy("attempt-timeout: 1s\nhedge: { attempts: 3, delay: 0 }\n"), [
        start(1, 0, expect=hedged(1 * S)),
        hstep(1, 0, expect=cmds(hs(2, 1 * S), hs(3, 1 * S))),
        hreport(1, 3, 20 * MS, elapsed=20 * MS, expect=cmds(hc(1), hc(2), hend(3, DONE))),
        hreport(1, 1, 25 * MS, kind="timeout", elapsed=25 * MS, expect=cmds()),
        hreport(1, 2, 25 * MS, kind="connection-error", elapsed=25 * MS, expect=cmds()),
        info(1),
    ])

vec("hedge-fatal-cancels-the-rest", "A fatal outcome (not non-fatal) ends the call at once with that attempt's failure (non-retryable) and cancels the attempts in flight.",
    ["hedge"], policy("hedge: { attempts: 3, delay: 100ms }\n"), [
        start(1, 0, expect=hedged()),
        hstep(1, 100 * MS, expect=cmds(hs(2), hw(100 * MS))),
        hreport(1, 2, 150 * MS, kind="http-status", code=500, elapsed=50 * MS, expect=cmds(hc(1), hend(2, fail("non-retryable")))),
        hreport(1, 1, 160 * MS, kind="http-status", code=200, elapsed=160 * MS, expect=cmds()),
        info(1),
        drain(),
    ])

vec("hedge-all-fail-no-retry", "When every attempt fails non-fatally the call fails with the last failure (retries-exhausted): hedged calls are never retried.",
    ["hedge"], policy("hedge: { attempts: 2, delay: 100ms }\n"), [
        start(1, 0, expect=hedged()),
        hreport(1, 1, 30 * MS, kind="http-status", code=503, elapsed=30 * MS, expect=cmds(hs(2))),
        hreport(1, 2, 60 * MS, kind="http-status", code=503, elapsed=30 * MS, expect=cmds(hend(2, fail("retries-exhausted")))),
        info(1),
    ])

vec("hedge-throttled", "A6 throttling: a hedge is sent only while the token budget holds more than half its tokens, and each non-fatal failure costs a token. Five failures of call 1 take 10 tokens to 5; call 2 then sends no hedge (budget-refused) and fails with its original's failure, reason budget.",
    ["hedge", "budget"], policy("hedge: { attempts: 5, delay: 0 }\nbudget: { kind: token, max-tokens: 10, token-ratio: 0.1 }\n"), [
        start(1, 0, expect=hedged()),
        hstep(1, 0, expect=cmds(hs(2), hs(3), hs(4), hs(5))),
        hreport(1, 1, 10 * MS, kind="http-status", code=503, elapsed=10 * MS, expect=cmds()),
        hreport(1, 2, 10 * MS, kind="http-status", code=503, elapsed=10 * MS, expect=cmds()),
        hreport(1, 3, 10 * MS, kind="http-status", code=503, elapsed=10 * MS, expect=cmds()),
        hreport(1, 4, 10 * MS, kind="http-status", code=503, elapsed=10 * MS, expect=cmds()),
        hreport(1, 5, 10 * MS, kind="http-status", code=503, elapsed=10 * MS, expect=cmds(hend(5, fail("retries-exhausted")))),
        start(2, 20 * MS, expect=hedged()),
        hstep(2, 20 * MS, expect=cmds()),
        hreport(2, 1, 30 * MS, kind="http-status", code=503, elapsed=10 * MS, expect=cmds(hend(1, fail("budget")))),
        drain(),
    ])

vec("hedge-pushback", "gRPC pushback: a valid pushback of n ms after a non-fatal failure starts the next hedge n ms later instead of at once; a negative one sends no more hedges, and when the rest fail the call fails for pushback.",
    ["hedge", "retry-after"], policy("hedge: { attempts: 3, delay: 500ms, non-fatal: [\"grpc:unavailable\"] }\n"), [
        start(1, 0, expect=hedged()),
        hreport(1, 1, 100 * MS, kind="grpc-status", code=UNAVAILABLE, text="300", elapsed=100 * MS, expect=cmds(hw(300 * MS))),
        hstep(1, 400 * MS, expect=cmds(hs(2), hw(500 * MS))),
        hreport(1, 2, 450 * MS, kind="grpc-status", code=UNAVAILABLE, text="-1", elapsed=50 * MS, expect=cmds(hend(2, fail("pushback")))),
        info(1),
    ])

vec("hedge-preset-polly", "Polly: when every attempt fails, the primary's failure is returned; up to 10 hedges.",
    ["hedge"], policy("hedge: { attempts: 3, delay: 50ms, preset: polly }\n"), [
        start(1, 0, expect=hedged()),
        hreport(1, 1, 10 * MS, kind="timeout", elapsed=10 * MS, expect=cmds(hs(2), hw(50 * MS))),
        hreport(1, 2, 20 * MS, kind="connection-error", elapsed=10 * MS, expect=cmds(hs(3))),
        hreport(1, 3, 30 * MS, kind="connection-error", elapsed=10 * MS, expect=cmds(hend(1, fail("retries-exhausted")))),
    ])

vec("hedge-preset-failsafe", "failsafe-go: hedges go by time only: a non-fatal failure does not send the next hedge early.",
    ["hedge"], policy("hedge: { attempts: 3, delay: 500ms, preset: failsafe }\n"), [
        start(1, 0, expect=hedged()),
        hreport(1, 1, 100 * MS, kind="http-status", code=503, elapsed=100 * MS, expect=cmds(hw(400 * MS))),
        hstep(1, 500 * MS, expect=cmds(hs(2), hw(500 * MS))),
        hreport(1, 2, 600 * MS, kind="http-status", code=200, elapsed=100 * MS, expect=cmds(hend(2, DONE))),
    ])

vec("hedge-preset-envoy", "Envoy's hedge_on_per_try_timeout: the next hedge starts when the latest attempt has run for attempt-timeout, which does not end it (attempts get no timeout of their own; the deadline still bounds them).",
    ["hedge", "deadline"], policy("attempt-timeout: 200ms\ndeadline: 1s\nhedge: { attempts: 2, preset: envoy }\n"), [
        start(1, 0, expect=hedged(1 * S)),
        hstep(1, 0, expect=cmds(hw(200 * MS))),
        hstep(1, 200 * MS, expect=cmds(hs(2, 800 * MS))),
        hreport(1, 1, 250 * MS, kind="http-status", code=200, elapsed=250 * MS, expect=cmds(hc(2), hend(1, DONE))),
        hreport(1, 2, 260 * MS, kind="timeout", elapsed=60 * MS, expect=cmds()),
    ])

vec("hedge-late-outcome-is-a-timeout", "An attempt's outcome whose elapsed reaches its timeout is a timeout (non-fatal by default): the next hedge starts at once.",
    ["hedge", "late"], policy("attempt-timeout: 100ms\nhedge: { attempts: 2, delay: 1s }\n"), [
        start(1, 0, expect=hedged(100 * MS)),
        hreport(1, 1, 150 * MS, kind="http-status", code=400, elapsed=150 * MS, expect=cmds(hs(2, 100 * MS))),
        hreport(1, 2, 200 * MS, elapsed=50 * MS, expect=cmds(hend(2, DONE))),
    ])

vec("hedge-bulkhead-slot-held-until-closed", "Each hedged attempt takes a bulkhead slot; a cancelled attempt keeps its slot until it is reported closed, never at cancel time.",
    ["hedge", "bulkhead"], policy("bulkhead: { max-concurrent: 2 }\nhedge: { attempts: 2, delay: 0 }\n"), [
        start(1, 0, expect=hedged()),
        hstep(1, 0, expect=cmds(hs(2))),
        start(2, 1 * MS, expect=fail("bulkhead-full")),
        hreport(1, 1, 10 * MS, elapsed=10 * MS, expect=cmds(hc(2), hend(1, DONE))),
        info(1),
        start(3, 11 * MS, expect=hedged()),
        hstep(3, 11 * MS, expect=cmds()),
        hreport(1, 2, 12 * MS, kind="timeout", elapsed=12 * MS, expect=cmds()),
        info(1),
        hreport(3, 1, 13 * MS, kind="http-status", code=503, elapsed=2 * MS, expect=cmds(hend(1, fail("bulkhead-full")))),
        start(4, 14 * MS, expect=hedged()),
        hstep(4, 14 * MS, expect=cmds(hs(2))),
    ])

vec("hedge-bulkhead-queue-wakes", "A hedged attempt that closes frees its slot for the oldest waiter in the bulkhead queue, named by take-wakes; no hedge takes a slot while a call waits or holds a grant.",
    ["hedge", "bulkhead", "bulkhead-queue", "bulkhead-wakes"], policy("bulkhead: { max-concurrent: 2, queue: 2, queue-timeout: 1s }\nhedge: { attempts: 2, delay: 0 }\n"), [
        start(1, 0, expect=hedged()),
        hstep(1, 0, expect=cmds(hs(2))),
        start(2, 1 * MS, expect=qwait(1000 * MS)),
        wakes([]),
        hreport(1, 1, 10 * MS, elapsed=10 * MS, expect=cmds(hc(2), hend(1, DONE))),
        wakes([2]),
        acquire(2, 10 * MS, expect=hedged()),
        hstep(2, 10 * MS),
        hreport(1, 2, 12 * MS, kind="timeout", elapsed=12 * MS, expect=cmds()),
        wakes([]),
    ])

vec("hedge-non-idempotent", "A hedge is a second request: an operation that is not idempotent and has no idempotency key is never hedged (and nothing waits for a hedge: call 4, with a delay); with an idempotency key it is.",
    ["hedge", "idempotency"], "policies:\n  p: { hedge: { attempts: 2, delay: 0 } }\n  d: { hedge: { attempts: 2, delay: 100ms } }\n", [
        start(1, 0, flags=1, expect=hedged()),
        hstep(1, 0, expect=cmds()),
        hreport(1, 1, 10 * MS, kind="http-status", code=503, elapsed=10 * MS, expect=cmds(hend(1, fail("non-idempotent")))),
        start(2, 20 * MS, flags=1 | 2, expect=hedged()),
        hstep(2, 20 * MS, expect=cmds(hs(2))),
        start(3, 30 * MS, flags=(3 << 8), expect=hedged()),
        hstep(3, 30 * MS, expect=cmds()),
        start(4, 40 * MS, policy="d", flags=1, expect=hedged()),
        hstep(4, 40 * MS, expect=cmds()),
        hreport(4, 1, 50 * MS, kind="http-status", code=503, elapsed=10 * MS, expect=cmds(hend(1, fail("non-idempotent")))),
    ])

vec("hedge-fallback", "A hedged call that fails takes the policy's fallback chain like any call: the end command carries the fallback verdict, and report-fallback goes on as after report.",
    ["hedge", "fallback"], policy("hedge: { attempts: 2, delay: 10ms }\nfallbacks: [cache]\n"), [
        start(1, 0, expect=hedged()),
        hstep(1, 10 * MS, expect=cmds(hs(2))),
        hreport(1, 2, 15 * MS, kind="error-class", text="ValueError", elapsed=5 * MS, expect=cmds(hc(1), hend(2, fb(0, "non-retryable")))),
        fallback(1, 16 * MS, True, expect=DONE),
        info(1),
        hreport(1, 1, 17 * MS, kind="timeout", elapsed=17 * MS, expect=cmds()),
        info(1),
    ])

vec("hedge-no-wait-into-an-open-breaker", "A hedge due while the breaker stays open is not waited for: the second attempt's failure opens the breaker, its 300 ms pushback would delay the next hedge into the open breaker, and with nothing in flight the call fails for breaker-open at once.",
    ["hedge", "breaker", "retry-after"], policy("breaker: { window: { kind: count, size: 2 }, minimum-calls: 2, open-duration: 1m }\nhedge: { attempts: 3, delay: 500ms, non-fatal: [\"grpc:unavailable\"] }\n"), [
        start(1, 0, expect=hedged()),
        hreport(1, 1, 100 * MS, kind="grpc-status", code=UNAVAILABLE, text="300", elapsed=100 * MS, expect=cmds(hw(300 * MS))),
        hstep(1, 400 * MS, expect=cmds(hs(2), hw(500 * MS))),
        hreport(1, 2, 450 * MS, kind="grpc-status", code=UNAVAILABLE, text="300", elapsed=50 * MS, expect=cmds(hend(2, fail("breaker-open")))),
        info(1, expect=None),
        drain(),
    ])

vec("hedge-breaker-counts-attempts", "Every hedged attempt that ends counts in the breaker: two failing attempts of one call open it, and the next call is rejected (breaker-open).",
    ["hedge", "breaker"], policy("breaker: { window: { kind: count, size: 4 }, minimum-calls: 2, failure-rate: 50 }\nhedge: { attempts: 3, delay: 0 }\n"), [
        start(1, 0, expect=hedged()),
        hstep(1, 0, expect=cmds(hs(2), hs(3))),
        hreport(1, 1, 10 * MS, kind="http-status", code=503, elapsed=10 * MS, expect=cmds()),
        hreport(1, 2, 11 * MS, kind="http-status", code=503, elapsed=11 * MS, expect=cmds()),
        breaker(12 * MS),
        hreport(1, 3, 13 * MS, elapsed=13 * MS, expect=cmds(hend(3, DONE))),
        start(2, 14 * MS, expect=fail("breaker-open")),
        drain(),
    ])

vec("hedge-protocol-errors", "hedge-step on an unknown call, and on a call that is not hedged, answers end with an invalid verdict (unknown call, wrong step); report-attempt of an attempt never started or already reported too. A hedged call answers report and acquire with wrong step.",
    ["hedge", "invalid"], "policies:\n  h: { hedge: { attempts: 2, delay: 1s } }\n  p: {}\n", [
        hstep(9, 0, expect=cmds(hend(0, invalid(1)))),
        start(1, 0, policy="p", expect=attempt(1)),
        hstep(1, 0, expect=cmds(hend(0, invalid(4)))),
        start(2, 0, policy="h", expect=hedged()),
        hreport(2, 2, 1 * MS, expect=cmds(hend(0, invalid(4)))),
        report(2, 1 * MS, expect=invalid(4)),
        acquire(2, 1 * MS, expect=invalid(4)),
        hreport(2, 1, 2 * MS, elapsed=2 * MS, expect=cmds(hend(1, DONE))),
        hreport(2, 1, 3 * MS, elapsed=3 * MS, expect=cmds(hend(0, invalid(1)))),
    ])

vec("hedge-cancel-releases-every-attempt", "Cancelling a hedged call frees every attempt's slot at once.",
    ["hedge", "bulkhead", "cancel"], policy("bulkhead: { max-concurrent: 3 }\nhedge: { attempts: 3, delay: 0 }\n"), [
        start(1, 0, expect=hedged()),
        hstep(1, 0, expect=cmds(hs(2), hs(3))),
        start(2, 1 * MS, expect=fail("bulkhead-full")),
        cancel(1, 2 * MS),
        info(1),
        start(3, 3 * MS, expect=hedged()),
        hstep(3, 3 * MS, expect=cmds(hs(2), hs(3))),
    ])

vec("hedge-policy-info", "A hedged policy makes one call-level attempt (max-attempts 1); its JSON shows the hedge section with every default.",
    ["hedge"], policy("hedge: {}\n"), [
        pinfo(),
    ])

vec("hedge-wait-never-passes-the-deadline", "A hedge due at or after the deadline is never waited for: with the default delay of 2 s and a 1 s deadline hedge-step answers nothing (the attempt's own timeout is the deadline), a non-fatal failure still sends the next hedge at once; under failsafe, the next hedge's time past the deadline leaves the attempt in flight alone, and when it fails the call fails for the deadline.",
    ["hedge", "deadline"], "policies:\n  p: { deadline: 1s, hedge: { attempts: 2 } }\n  f: { deadline: 1s, hedge: { attempts: 3, delay: 800ms, preset: failsafe } }\n", [
        start(1, 0, expect=hedged(1 * S)),
        hstep(1, 0, expect=cmds()),
        hreport(1, 1, 500 * MS, kind="http-status", code=503, elapsed=500 * MS, expect=cmds(hs(2, 500 * MS))),
        hreport(1, 2, 600 * MS, elapsed=100 * MS, expect=cmds(hend(2, DONE))),
        start(2, 0, policy="f", expect=hedged(1 * S)),
        hstep(2, 0, expect=cmds(hw(800 * MS))),
        hstep(2, 800 * MS, expect=cmds(hs(2, 200 * MS))),
        hreport(2, 1, 900 * MS, kind="http-status", code=503, elapsed=900 * MS, expect=cmds()),
        hreport(2, 2, 1000 * MS, kind="timeout", elapsed=200 * MS, expect=cmds(hend(2, fail("deadline")))),
    ])

vec("hedge-analyze", "`levee check`'s worst cases of a hedged policy: every hedge can start (3 attempts, 27x on 3 layers), the last starts (attempts - 1) x delay after the first and runs to its timeout (1.2 s); under envoy only the deadline bounds it; a token budget bounds hedges as it bounds retries.",
    ["hedge", "analyze"], "policies:\n"
    "  p: { attempt-timeout: 1s, deadline: 5s, hedge: { attempts: 3, delay: 100ms } }\n"
    "  e: { attempt-timeout: 1s, deadline: 5s, hedge: { attempts: 4, preset: envoy }, budget: { kind: token } }\n", [
        analyze(3, policy="p"),
        analyze(3, policy="e"),
    ])

vec("hedge-errors", "Hedging names its errors: attempts beside hedge, hedge.attempts above 5 (11 under polly), an unknown preset, envoy without attempt-timeout or with a delay, a delay without a unit, an unknown field.",
    ["hedge", "errors"], "policies:\n"
    "  a: { attempts: 3, hedge: {} }\n"
    "  b: { hedge: { attempts: 6 } }\n"
    "  c: { hedge: { attempts: 12, preset: polly } }\n"
    "  d: { hedge: { preset: gprc } }\n"
    "  e: { hedge: { preset: envoy } }\n"
    "  f: { attempt-timeout: 1s, hedge: { preset: envoy, delay: 1s } }\n"
    "  g: { hedge: { delay: 5 } }\n"
    "  h: { hedge: { attemps: 2 } }\n", [])


# --------------------------------------------------------------------------------------
# gRPC's service config (issue 43, docs/grpc.md): the policies `levee import
# grpc-service-config` writes from gRFC A6's examples (pinned in grpc/service-config/ by
# policy-core/tests/grpc_service_config.rs), deciding as A6 describes, in every host.
# --------------------------------------------------------------------------------------

def imported(name):
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "grpc", "service-config", name)
    with open(path) as f:
        return f.read()


A6_METHOD = "levee.flaky.v1.Flaky-Unary"
A6_RETRY = imported("a6-retry.levee.yaml")
A6_HEDGING = imported("a6-hedging.levee.yaml")
INVALID_ARGUMENT, INTERNAL, ABORTED, RESOURCE_EXHAUSTED = 3, 13, 10, 8


def g_start(call, now, expect=None):
    return start(call, now, policy=A6_METHOD, expect=expect)


def g_report(call, now, code, pushback="", expect=None):
    return report(call, now, kind="grpc-status", code=code, text=pushback, elapsed=10 * MS, expect=expect)


vec("grpc-service-config-a6-retry", "A6's retryPolicy example imported (maxAttempts 4, initialBackoff 0.1s, maxBackoff 1s, backoffMultiplier 2, UNAVAILABLE): UNAVAILABLE is retried three times (full jitter under 100, 200, 400 ms), the fourth attempt is the last; INVALID_ARGUMENT and RESOURCE_EXHAUSTED (even with a pushback) are not retried.",
    ["grpc", "anchor", "retry"], A6_RETRY, [
        g_start(1, 0, expect=attempt(1)),
        g_report(1, 10 * MS, UNAVAILABLE, expect=retry()),
        acquire(1, 110 * MS, expect=attempt(2)),
        g_report(1, 120 * MS, UNAVAILABLE, expect=retry()),
        acquire(1, 320 * MS, expect=attempt(3)),
        g_report(1, 330 * MS, UNAVAILABLE, expect=retry()),
        acquire(1, 730 * MS, expect=attempt(4)),
        g_report(1, 740 * MS, UNAVAILABLE, expect=fail("retries-exhausted")),
        g_start(2, S, expect=attempt(1)),
        g_report(2, S + 10 * MS, INVALID_ARGUMENT, expect=fail("non-retryable")),
        g_start(3, 2 * S, expect=attempt(1)),
        g_report(3, 2 * S + 10 * MS, RESOURCE_EXHAUSTED, pushback="10", expect=fail("non-retryable")),
        drain(),
    ], seed=7)

vec("grpc-service-config-a6-pushback", "A6's retryPolicy example imported: a pushback of 750 ms sets the next delay exactly, the backoff then restarts at initialBackoff (under 100 ms), and a negative pushback stops the retries.",
    ["grpc", "anchor", "retry-after"], A6_RETRY, [
        g_start(1, 0, expect=attempt(1)),
        g_report(1, 10 * MS, UNAVAILABLE, pushback="750", expect=retry(750 * MS)),
        acquire(1, 760 * MS, expect=attempt(2)),
        g_report(1, 770 * MS, UNAVAILABLE, expect=retry()),
        acquire(1, 870 * MS, expect=attempt(3)),
        g_report(1, 880 * MS, UNAVAILABLE, pushback="-1", expect=fail("pushback")),
        drain(),
    ], seed=3)

throttle = []
for c in range(1, 5):
    throttle += [g_start(c, c * MS, expect=attempt(1)), g_report(c, c * MS + 1, UNAVAILABLE, expect=retry()), cancel(c, c * MS + 2)]
throttle += [g_start(5, 10 * MS, expect=attempt(1)), g_report(5, 11 * MS, UNAVAILABLE, expect=fail("budget"))]
for c in range(6, 17):
    throttle += [g_start(c, c * 10 * MS, expect=attempt(1)), g_report(c, c * 10 * MS + 1, 0, expect=DONE)]
throttle += [g_start(17, S, expect=attempt(1)), g_report(17, S + 1, UNAVAILABLE, expect=retry()), drain()]
vec("grpc-service-config-a6-throttling", "A6's retryThrottling example imported (maxTokens 10, tokenRatio 0.1): each UNAVAILABLE costs a token and a retry needs more than 5, so calls 1-4 retry (9, 8, 7, 6 left) and call 5 is refused (5); eleven successes bring 5.0 to 6.1, and the next failure (5.1 left) is retried.",
    ["grpc", "anchor", "budget"], A6_RETRY, throttle)

vec("grpc-service-config-a6-hedging", "A6's hedgingPolicy example imported (maxAttempts 4, hedgingDelay 0.5s, UNAVAILABLE, INTERNAL and ABORTED non-fatal), on A6's timeline: #1 at 0, #2 at 500 ms, #1 fails UNAVAILABLE at 700 ms so #3 starts at once, #2 succeeds at 900 ms and #3 is cancelled; #4 never starts.",
    ["grpc", "anchor", "hedge"], A6_HEDGING, [
        g_start(1, 0, expect=hedged()),
        hstep(1, 0, expect=cmds(hw(500 * MS))),
        hstep(1, 500 * MS, expect=cmds(hs(2), hw(500 * MS))),
        hreport(1, 1, 700 * MS, kind="grpc-status", code=UNAVAILABLE, elapsed=700 * MS, expect=cmds(hs(3), hw(500 * MS))),
        hreport(1, 2, 900 * MS, kind="grpc-status", code=0, elapsed=400 * MS, expect=cmds(hc(3), hend(2, DONE))),
        hreport(1, 3, 910 * MS, kind="grpc-status", code=1, elapsed=210 * MS, expect=cmds()),
        info(1),
        drain(),
    ])

vec("grpc-service-config-a6-hedging-fatal", "A6's hedgingPolicy example imported: INTERNAL and ABORTED send the next hedge at once; INVALID_ARGUMENT is fatal: the call ends with it and the attempt in flight is cancelled.",
    ["grpc", "anchor", "hedge"], A6_HEDGING, [
        g_start(1, 0, expect=hedged()),
        hstep(1, 0, expect=cmds(hw(500 * MS))),
        hreport(1, 1, 100 * MS, kind="grpc-status", code=INTERNAL, elapsed=100 * MS, expect=cmds(hs(2), hw(500 * MS))),
        hreport(1, 2, 200 * MS, kind="grpc-status", code=ABORTED, elapsed=100 * MS, expect=cmds(hs(3), hw(500 * MS))),
        hstep(1, 700 * MS, expect=cmds(hs(4))),
        hreport(1, 3, 750 * MS, kind="grpc-status", code=INVALID_ARGUMENT, elapsed=550 * MS, expect=cmds(hc(4), hend(3, fail("non-retryable")))),
        hreport(1, 4, 760 * MS, kind="grpc-status", code=1, elapsed=60 * MS, expect=cmds()),
        info(1),
        drain(),
    ])


def main():
    out_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vectors")
    os.makedirs(out_dir, exist_ok=True)
    names = set()
    for v in VECTORS:
        names.add(v["name"])
        path = os.path.join(out_dir, v["name"] + ".json")
        with open(path, "w") as f:
            json.dump(v, f, indent=2)
            f.write("\n")
    for stale in os.listdir(out_dir):
        if stale.endswith(".json") and stale[:-5] not in names:
            os.remove(os.path.join(out_dir, stale))
    print(f"{len(VECTORS)} vectors written to {out_dir}", file=sys.stderr)


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""The host scenarios: the source of `conformance/hosts/*.json` (README.md, schema.json).

Each scenario is a policy document, a seed, and calls made through a host's public API against
a scripted dependency, under virtual time. The expected trace of each call is produced by the
Python host (the only one that blesses) and checked, before it is written, against the
scenario's `intent`: assertions a person wrote from the rules (docs/hosts.md, docs/policy.md,
docs/telemetry.md), such as "the error's reason is deadline and no sleep ends past the
deadline". A wrong Python host therefore cannot bless a wrong trace: the intent refuses it.

    cd host-bindings/python
    LEVEE_BLESS=1 .venv/bin/python tests/hosts_runner.py   # replay, check intents, write *.json
    .venv/bin/python tests/hosts_runner.py                 # replay and compare (what CI runs)
    python3 conformance/hosts/scenarios.py --check         # the *.json match this file (inputs)

A scenario changes only when intended behaviour changes, with the reason in the commit.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from email.utils import formatdate
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
NS = 1
US = 1_000
MS = 1_000_000
S = 1_000_000_000
WALL = 1_764_547_200  # 2025-12-01T00:00:00Z: the virtual wall clock at virtual time 0

Trace = dict[str, Any]
Intent = Callable[[dict[str, Any], list[Trace]], None]

SCENARIOS: list[dict[str, Any]] = []
INTENTS: dict[str, Intent] = {}
UNCHECKED: dict[str, dict[int, tuple[str, ...]]] = {}


# ---------------------------------------------------------------------------- documents


def _scalar(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    s = str(v)
    plain = s and all(c.isalnum() or c in "-_." for c in s) and not s[0].isdigit()
    return s if plain or _is_duration(s) else json.dumps(s)


def _is_duration(s: str) -> bool:
    for unit in ("ns", "us", "ms", "s", "m", "h"):
        if s.endswith(unit) and s[: -len(unit)].replace(".", "", 1).isdigit():
            return True
    return False


def _flow(v: Any) -> str:
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k}: {_flow(x)}" for k, x in v.items()) + " }"
    if isinstance(v, list):
        return "[" + ", ".join(_flow(x) for x in v) + "]"
    return _scalar(v)


def doc(**policies: dict[str, Any]) -> str:
    """A policy document: one line of flow YAML per field of each policy."""
    lines = ["policies:"]
    for name, fields in policies.items():
        if not fields:
            lines.append(f"  {name}: {{}}")
            continue
        lines.append(f"  {name}:")
        for k, v in fields.items():
            lines.append(f"    {k}: {_flow(v)}")
    return "\n".join(lines) + "\n"


CONST = {"kind": "constant", "base": "100ms", "jitter": "none"}


def const(base: str) -> dict[str, str]:
    return {"kind": "constant", "base": base, "jitter": "none"}


# ---------------------------------------------------------------------------- calls and steps


def call(*script: dict[str, Any], api: str = "call", at: int = 0, policy: str = "p", **extra: Any) -> dict[str, Any]:
    c: dict[str, Any] = {"api": api, "at": at, "policy": policy}
    c.update(extra)
    c["script"] = list(script)
    return c


def http(method: str, url: str, *script: dict[str, Any], headers: dict[str, str] | None = None,
         body: str | None = None, **extra: Any) -> dict[str, Any]:  # fmt: skip
    h: dict[str, Any] = {"method": method, "url": url}
    if headers:
        h["headers"] = headers
    if body is not None:
        h["body"] = body
    return call(*script, api="http", http=h, **extra)


def ok(value: Any = "ok", after: int = 0) -> dict[str, Any]:
    return {"return": value, **({"after": after} if after else {})}


def boom(cls: str = "Boom", after: int = 0) -> dict[str, Any]:
    return {"raise": cls, **({"after": after} if after else {})}


def status(code: int, after: int = 0, **headers: str) -> dict[str, Any]:
    s: dict[str, Any] = {"status": code}
    if headers:
        s["headers"] = {k.replace("_", "-"): v for k, v in headers.items()}
    if after:
        s["after"] = after
    return s


HANG = {"hang": True}
REFUSE = {"refuse": True}
CONNECT_TIMEOUT = {"connect_timeout": True}
TLS = {"tls_certificate": True}


def late(ns: int, value: Any = "late") -> dict[str, Any]:
    return {"late": ns, "return": value}


def trap(op: str, nth: int = 1) -> dict[str, Any]:
    return {"op": op, "nth": nth, "trap": True}


def verdict(op: str, packed: int, nth: int = 1) -> dict[str, Any]:
    return {"op": op, "nth": nth, "verdict": f"{packed:#x}"}


def packed(kind: int, detail: int = 0, payload: int = 0) -> int:
    """A packed verdict (wit/levee.wit): kind in bits 0-3, detail 8-15, payload 16-63."""
    return kind | (detail << 8) | (payload << 16)


ATTEMPT, WAIT, DONE, RETRY, FALLBACK, FAIL, INVALID = range(7)
R = {
    "none": 0, "deadline": 1, "retries-exhausted": 2, "non-retryable": 3, "budget": 4, "breaker-open": 5,
    "rate-limited": 6, "bulkhead-full": 7, "non-idempotent": 8, "retry-after-too-long": 9, "pushback": 10,
    "cancelled": 11, "fallbacks-failed": 12,
}  # fmt: skip


def scenario(name: str, description: str, covers: list[str], document: str, calls: list[dict[str, Any]],
             intent: Intent, seed: int = 42, unchecked: dict[int, tuple[str, ...]] | None = None) -> None:  # fmt: skip
    """`unchecked`: fields of a call's trace left out of `expect` (host-specific by the rules)."""
    assert all(s["name"] != name for s in SCENARIOS), name
    SCENARIOS.append({
        "name": name, "description": description, "covers": covers, "document": document, "seed": seed,
        "wall_start": WALL, "calls": calls,
    })  # fmt: skip
    INTENTS[name] = intent
    if unchecked:
        UNCHECKED[name] = unchecked


# ---------------------------------------------------------------------------- intent helpers


def check(cond: bool, what: str) -> None:
    if not cond:
        raise AssertionError(what)


def value(t: Trace, v: Any) -> None:
    check(t["result"] == {"value": v}, f"the call returns {v!r}, not {t['result']}")


def http_status(t: Trace, code: int) -> None:
    check(t["result"] == {"status": code}, f"the call returns the response {code}, not {t['result']}")


def error(t: Trace, reason: str, attempts: int | None = None, last: Any = ...) -> None:
    r = t["result"]
    check("error" in r, f"the call fails with a typed error, not {r}")
    e = r["error"]
    check(e["reason"] == reason, f"the reason is {reason}, not {e['reason']}")
    if attempts is not None:
        check(e["attempts"] == attempts, f"the error says {attempts} attempts, not {e['attempts']}")
    if last is not ...:
        check(e["last"] == last, f"the error's cause is {last}, not {e['last']}")


def raised(t: Trace, cls: str) -> None:
    check(t["result"] == {"raised": cls}, f"the user's own {cls} is raised, not {t['result']}")


def n_attempts(t: Trace, n: int) -> None:
    check(len(t["attempts"]) == n, f"{n} attempts, not {len(t['attempts'])}")


def starts(t: Trace, *at: int) -> None:
    got = tuple(a["at"] for a in t["attempts"])
    check(got == at, f"attempts start at {at}, not {got}")


def ends(t: Trace, *end: int) -> None:
    got = tuple(a["end"] for a in t["attempts"])
    check(got == end, f"attempts end at {end}, not {got}")


def sleeps(t: Trace, *ns: int) -> None:
    check(tuple(t["sleeps"]) == ns, f"sleeps {ns}, not {tuple(t['sleeps'])}")


def names(t: Trace) -> list[str]:
    return [e["name"] for e in t["events"]]


def has_event(t: Trace, name: str, **attrs: Any) -> dict[str, Any]:
    for e in t["events"]:
        if e["name"] == name and all(e.get(k.replace("_", ".")) == v for k, v in attrs.items()):
            return e
    raise AssertionError(f"no {name} event with {attrs} in {t['events']}")


def no_event(t: Trace, name: str) -> None:
    check(name not in names(t), f"no {name} event, but {t['events']}")


def metric(t: Trace, key: str, v: Any) -> None:
    check(t["metrics"].get(key) == v, f"metric {key} = {v}, not {t['metrics'].get(key)}")


def fault(t: Trace, kind: str) -> None:
    has_event(t, "engine-fault", **{"levee_fault": kind})
    metric(t, "levee.engine.faults{levee.fault=" + kind + "}", 1)


def degraded(t: Trace, n: int) -> None:
    got = [a for a in t["attempts"] if a.get("degraded")]
    check(len(got) == n, f"{n} degraded attempts, not {len(got)}")
    if n:
        check(t["attempts"][-1].get("degraded") is True, "the degraded attempt is the last")


def within(t: Trace, start: int, deadline: int) -> None:
    """Nothing of the call runs past its deadline: no attempt ends and no sleep ends after it."""
    for a in t["attempts"]:
        check(a["end"] <= start + deadline, f"an attempt ends at {a['end']}, past the deadline {start + deadline}")
    # each sleep starts when the attempt before it ended
    for a, s in zip(t["attempts"], t["sleeps"], strict=False):
        check(a["end"] + s <= start + deadline, f"a sleep ends at {a['end'] + s}, past the deadline")


def calls_metric(t: Trace, policy: str, result: str, retried: bool, reason: str | None = None) -> None:
    attrs = [f"levee.policy={policy}"]
    if reason is not None:
        attrs.insert(0, f"levee.reason={reason}")
    key = "levee.calls{" + ",".join([*attrs, f"levee.result={result}", f"levee.retried={str(retried).lower()}"]) + "}"
    # attributes sorted by name
    parts = sorted(key[len("levee.calls{") : -1].split(","))
    metric(t, "levee.calls{" + ",".join(parts) + "}", 1)


def all_of(*fs: Callable[[list[Trace]], None]) -> Intent:
    def intent(scn: dict[str, Any], traces: list[Trace]) -> None:
        for f in fs:
            f(traces)

    return intent


# ---------------------------------------------------------------------------- the scenarios
# Retries and backoff

scenario(
    "retry-then-success",
    "Two failures of a retried error class, then a success: two constant 100 ms sleeps, the third attempt's value.",
    ["retry", "backoff:constant", "telemetry"],
    doc(p={"attempts": 3, "backoff": CONST, "retry-on": ["error:Boom"]}),
    [call(boom(), boom(), ok("done"))],
    all_of(lambda t: value(t[0], "done"), lambda t: starts(t[0], 0, 100 * MS, 200 * MS),
           lambda t: sleeps(t[0], 100 * MS, 100 * MS),
           lambda t: check(names(t[0]) == ["retry-scheduled", "retry-scheduled"], f"events {names(t[0])}"),
           lambda t: metric(t[0], "levee.retries{levee.policy=p}", 2),
           lambda t: calls_metric(t[0], "p", "success", True),
           lambda t: metric(t[0], "levee.attempts{levee.outcome=error-class,levee.policy=p}", 2),
           lambda t: metric(t[0], "levee.attempts{levee.outcome=success,levee.policy=p}", 1),
           lambda t: check([r["attempt"] for r in t[0]["on_retry"]] == [1, 2], "on_retry after attempts 1 and 2"),
           lambda t: check(all(r["error"] == "error:Boom" and r["delay"] == 0.1 for r in t[0]["on_retry"]),
                           "on_retry gets the error and the 0.1 s delay")),  # fmt: skip
)

scenario(
    "retries-exhausted",
    "Every attempt fails: the typed retries-exhausted error says 3 attempts and names the last error.",
    ["retry", "error-naming"],
    doc(p={"attempts": 3, "backoff": CONST, "retry-on": ["error:Boom"]}),
    [call(boom(), boom(), boom())],
    all_of(lambda t: error(t[0], "retries-exhausted", 3, "error:Boom"), lambda t: n_attempts(t[0], 3),
           lambda t: has_event(t[0], "gave-up", levee_reason="retries-exhausted", levee_attempt=3),
           lambda t: calls_metric(t[0], "p", "failure", True, "retries-exhausted")),  # fmt: skip
)

scenario(
    "non-retryable-error-class",
    "An error class no rule retries ends the call after one attempt with non-retryable.",
    ["classification", "error-naming"],
    doc(p={"attempts": 3, "backoff": CONST, "retry-on": ["error:Boom"]}),
    [call(boom("ValueError"), ok())],
    all_of(lambda t: error(t[0], "non-retryable", 1, "error:ValueError"), lambda t: n_attempts(t[0], 1),
           lambda t: sleeps(t[0]), lambda t: calls_metric(t[0], "p", "failure", False, "non-retryable")),  # fmt: skip
)

scenario(
    "never-retry-wins",
    "error:* retries everything but never-retry names the class: one attempt, non-retryable.",
    ["classification"],
    doc(p={"attempts": 3, "backoff": CONST, "retry-on": ["error:*"], "never-retry": ["error:Fatal"]}),
    [call(boom("Fatal"), ok())],
    all_of(lambda t: error(t[0], "non-retryable", 1, "error:Fatal")),
)

scenario(
    "error-class-wildcard-retried",
    "error:* retries an error of any class; the name travels as the class name.",
    ["classification", "error-naming"],
    doc(p={"attempts": 2, "backoff": CONST, "retry-on": ["error:*"]}),
    [call(boom("SomethingOdd"), ok(7))],
    all_of(lambda t: value(t[0], 7), lambda t: sleeps(t[0], 100 * MS),
           lambda t: check(t[0]["on_retry"][0]["error"] == "error:SomethingOdd", "the hook sees the class name")),
)

scenario(
    "backoff-exponential-no-jitter",
    "Exponential backoff without jitter: 100, 200, 400 ms, then the cap of 500 ms.",
    ["backoff:exponential"],
    doc(p={"attempts": 5, "backoff": {"kind": "exponential", "base": "100ms", "cap": "500ms", "jitter": "none"},
           "retry-on": ["error:Boom"]}),  # fmt: skip
    [call(boom(), boom(), boom(), boom(), ok())],
    all_of(lambda t: sleeps(t[0], 100 * MS, 200 * MS, 400 * MS, 500 * MS), lambda t: value(t[0], "ok")),
)

scenario(
    "backoff-linear",
    "Linear backoff: base * n.",
    ["backoff:linear"],
    doc(p={"attempts": 4, "backoff": {"kind": "linear", "base": "50ms", "jitter": "none"}, "retry-on": ["error:Boom"]}),
    [call(boom(), boom(), boom(), ok())],
    all_of(lambda t: sleeps(t[0], 50 * MS, 100 * MS, 150 * MS), lambda t: value(t[0], "ok")),
)


def _full_jitter(t: list[Trace]) -> None:
    s = t[0]["sleeps"]
    check(len(s) == 3, "three sleeps")
    for n, d in enumerate(s):
        check(0 <= d <= 100 * MS * 2**n, f"sleep {n + 1} ({d}) within U(0, {100 * 2**n} ms)")
    check(len(set(s)) == 3, "the seeded jitter differs per retry")
    check([round(r["delay"] * 1e9) for r in t[0]["on_retry"]] == s, "the hook's delays are the sleeps")
    check([round(e["levee.delay"] * 1e9) for e in t[0]["events"] if e["name"] == "retry-scheduled"] == s,
          "the events' delays are the sleeps")  # fmt: skip


scenario(
    "backoff-full-jitter-seeded",
    "Full jitter from the engine's seeded PRNG: the same seed gives the same delays in every host.",
    ["backoff:jitter", "determinism"],
    doc(p={"attempts": 4, "backoff": {"kind": "exponential", "base": "100ms", "jitter": "full"},
           "retry-on": ["error:Boom"]}),  # fmt: skip
    [call(boom(), boom(), boom(), ok())],
    all_of(_full_jitter, lambda t: value(t[0], "ok")),
    seed=7,
)

scenario(
    "backoff-equal-jitter-seeded",
    "Equal jitter: each delay in [d/2, d].",
    ["backoff:jitter"],
    doc(p={"attempts": 3, "backoff": {"kind": "constant", "base": "200ms", "jitter": "equal"},
           "retry-on": ["error:Boom"]}),  # fmt: skip
    [call(boom(), boom(), ok())],
    all_of(lambda t: check(all(100 * MS <= d <= 200 * MS for d in t[0]["sleeps"]) and len(t[0]["sleeps"]) == 2,
                           f"equal jitter in [100, 200] ms: {t[0]['sleeps']}"),
           lambda t: value(t[0], "ok")),  # fmt: skip
    seed=99,
)

scenario(
    "on-retry-hook-sees-results",
    "The on_retry hook runs before each sleep with the failed attempt, the delay in seconds and the error name.",
    ["on_retry", "telemetry"],
    doc(p={"attempts": 3, "backoff": const("250ms"), "retry-on": ["error:Flaky", "timeout"],
           "attempt-timeout": "1s"}),  # fmt: skip
    [call(boom("Flaky"), HANG, ok())],
    all_of(lambda t: check(t[0]["on_retry"] == [{"attempt": 1, "delay": 0.25, "error": "error:Flaky"},
                                                {"attempt": 2, "delay": 0.25, "error": "timeout"}],
                           f"hook calls {t[0]['on_retry']}"),
           lambda t: starts(t[0], 0, 250 * MS, 1500 * MS), lambda t: ends(t[0], 0, 1250 * MS, 1500 * MS),
           lambda t: value(t[0], "ok")),  # fmt: skip
)

# Deadlines

scenario(
    "retry-delay-past-deadline-fails",
    "issue 13: a retry whose delay would end past the deadline is never slept: the call fails with deadline at once.",
    ["deadline", "issue-13: retry delay past the deadline"],
    doc(p={"attempts": 5, "deadline": "1s", "backoff": const("800ms"), "retry-on": ["error:Boom"]}),
    [call(boom(after=300 * MS), ok())],
    all_of(lambda t: error(t[0], "deadline", 1, "error:Boom"), lambda t: sleeps(t[0]),
           lambda t: within(t[0], 0, S), lambda t: n_attempts(t[0], 1)),  # fmt: skip
)

scenario(
    "retry-delay-fits-deadline",
    "A retry that ends before the deadline is slept; the next attempt's timeout is what the deadline leaves.",
    ["deadline", "deadline-clamp"],
    doc(p={"attempts": 5, "deadline": "1s", "backoff": const("500ms"), "retry-on": ["error:Boom", "timeout"]}),
    [call(boom(after=300 * MS), HANG)],
    all_of(lambda t: starts(t[0], 0, 800 * MS), lambda t: ends(t[0], 300 * MS, S),
           lambda t: error(t[0], "deadline", 2, "timeout"), lambda t: within(t[0], 0, S)),  # fmt: skip
)

scenario(
    "attempt-timeout-clamped-to-deadline",
    "attempt-timeout 800 ms under a 1 s deadline: the second attempt gets the 100 ms left, never past the deadline.",
    ["deadline-clamp", "timeout"],
    doc(p={"attempts": 3, "deadline": "1s", "attempt-timeout": "800ms", "backoff": CONST}),
    [call(HANG, HANG, ok())],
    all_of(lambda t: starts(t[0], 0, 900 * MS), lambda t: ends(t[0], 800 * MS, S),
           lambda t: error(t[0], "deadline", 2, "timeout"), lambda t: within(t[0], 0, S)),  # fmt: skip
)

scenario(
    "deadline-cuts-a-hanging-attempt",
    "With a deadline and no attempt-timeout, a hanging attempt is cut at the deadline.",
    ["deadline", "timeout"],
    doc(p={"attempts": 3, "deadline": "2s", "backoff": CONST}),
    [call(HANG, ok())],
    all_of(lambda t: ends(t[0], 2 * S), lambda t: error(t[0], "deadline", 1, "timeout")),
)

scenario(
    "attempt-timeout-then-success",
    "A hanging attempt is cancelled at its 500 ms timeout and retried.",
    ["timeout", "retry"],
    doc(p={"attempts": 2, "attempt-timeout": "500ms", "backoff": CONST}),
    [call(HANG, ok("second"))],
    all_of(lambda t: value(t[0], "second"), lambda t: ends(t[0], 500 * MS, 600 * MS),
           lambda t: metric(t[0], "levee.attempts{levee.outcome=timeout,levee.policy=p}", 1),
           lambda t: metric(t[0], "levee.attempt.duration{levee.outcome=timeout,levee.policy=p}",
                            {"count": 1, "sum": 0.5})),  # fmt: skip
)

scenario(
    "late-success-is-timeout",
    "issue 13: an attempt that ignores cancellation and succeeds after its timeout counts as a timeout (the core decides from elapsed) and is retried.",
    ["late-result", "issue-13: late results"],
    doc(p={"attempts": 2, "attempt-timeout": "1s", "backoff": CONST}),
    [call(late(1500 * MS, "too late"), ok("in time"))],
    all_of(lambda t: value(t[0], "in time"), lambda t: n_attempts(t[0], 2),
           lambda t: has_event(t[0], "retry-scheduled", levee_attempt=1)),  # fmt: skip
    unchecked={0: ("attempts", "sleeps", "metrics", "on_retry")},
)

scenario(
    "late-success-on-last-attempt",
    "A late success on the last attempt is a timeout: retries-exhausted with a timeout cause, not the late value.",
    ["late-result", "issue-13: late results"],
    doc(p={"attempts": 1, "attempt-timeout": "1s"}),
    [call(late(2 * S, "too late"))],
    all_of(lambda t: error(t[0], "retries-exhausted", 1)),
    unchecked={0: ("attempts", "metrics", "result")},
)

scenario(
    "success-within-timeout-is-success",
    "A success just before its timeout is a success.",
    ["timeout"],
    doc(p={"attempts": 2, "attempt-timeout": "1s"}),
    [call(ok("fast", after=999 * MS))],
    all_of(lambda t: value(t[0], "fast"), lambda t: n_attempts(t[0], 1)),
)


# Circuit breakers

BREAKER = {"window": {"kind": "count", "size": 2}, "minimum-calls": 2, "failure-rate": 50, "open-duration": "1s",
           "half-open-permits": 1}  # fmt: skip
BRK = doc(p={"attempts": 1, "breaker": BREAKER})


def _tripped(t: list[Trace]) -> None:
    error(t[0], "non-retryable", 1, "error:Boom")  # Boom is no retry-on rule's: the typed error, caused by it
    error(t[1], "non-retryable", 1, "error:Boom")
    has_event(t[1], "breaker-transition", levee_breaker_from="closed", levee_breaker_to="open")
    metric(t[1], "levee.breaker.transitions{levee.breaker.from=closed,levee.breaker.to=open,levee.policy=p}", 1)
    error(t[2], "breaker-open", 0, None)
    n_attempts(t[2], 0)
    e = has_event(t[2], "rejected", levee_reason="breaker-open")
    check(e["levee.delay"] == 0.9, f"the rejection's hint is the 0.9 s left open, not {e['levee.delay']}")
    metric(t[2], "levee.rejections{levee.policy=p,levee.reason=breaker-open}", 1)


scenario(
    "breaker-opens-and-rejects",
    "Two failures in a count window of 2 open the breaker; the next call is rejected with the time left open as its hint.",
    ["breaker", "rejection", "telemetry"],
    BRK,
    [call(boom()), call(boom(), at=100 * MS), call(ok(), at=200 * MS)],
    lambda scn, t: _tripped(t),
)

scenario(
    "breaker-half-open-probe-closes",
    "After open-duration one probe is let through (open -> half-open); its success closes the breaker.",
    ["breaker", "half-open"],
    BRK,
    [call(boom()), call(boom(), at=100 * MS), call(ok(), at=200 * MS), call(ok("probe"), at=1200 * MS),
     call(ok("normal"), at=1300 * MS)],  # fmt: skip
    all_of(_tripped, lambda t: value(t[3], "probe"),
           lambda t: has_event(t[3], "breaker-transition", levee_breaker_from="open", levee_breaker_to="half-open"),
           lambda t: has_event(t[3], "breaker-transition", levee_breaker_from="half-open", levee_breaker_to="closed"),
           lambda t: value(t[4], "normal")),  # fmt: skip
)

scenario(
    "breaker-half-open-probe-reopens",
    "A failing half-open probe opens the breaker again; the next call is rejected.",
    ["breaker", "half-open"],
    BRK,
    [call(boom()), call(boom(), at=100 * MS), call(ok(), at=200 * MS), call(boom(), at=1200 * MS),
     call(ok(), at=1300 * MS)],  # fmt: skip
    all_of(_tripped, lambda t: error(t[3], "non-retryable", 1, "error:Boom"),
           lambda t: has_event(t[3], "breaker-transition", levee_breaker_from="half-open", levee_breaker_to="open"),
           lambda t: error(t[4], "breaker-open", 0, None)),  # fmt: skip
)

scenario(
    "breaker-half-open-one-permit",
    "half-open-permits 1: while the probe is in flight a second call is rejected.",
    ["breaker", "half-open"],
    BRK,
    [call(boom()), call(boom(), at=100 * MS), call(ok("probe", after=500 * MS), at=1200 * MS),
     call(ok(), at=1300 * MS)],  # fmt: skip
    all_of(lambda t: value(t[2], "probe"), lambda t: error(t[3], "breaker-open", 0, None)),
)

scenario(
    "breaker-per-key",
    "Breakers are per key: key a open does not reject key b.",
    ["breaker", "keys"],
    BRK,
    [call(boom(), key="a"), call(boom(), at=100 * MS, key="a"), call(ok(), at=200 * MS, key="a"),
     call(ok("b is fine"), at=300 * MS, key="b")],  # fmt: skip
    all_of(lambda t: error(t[2], "breaker-open", 0, None), lambda t: value(t[3], "b is fine")),
)

scenario(
    "breaker-open-mid-retries",
    "A breaker that a call's own failure opens, and that stays open past its next retry, ends the call at once: breaker-open after 2 attempts and one sleep, with no retry scheduled into it (issue 39).",
    ["breaker", "retry", "issue-39: no retry into an open breaker"],
    doc(p={"attempts": 4, "backoff": CONST, "retry-on": ["error:Boom"], "breaker": BREAKER}),
    [call(boom(), boom(), ok())],
    all_of(lambda t: error(t[0], "breaker-open", 2, "error:Boom"), lambda t: n_attempts(t[0], 2),
           lambda t: sleeps(t[0], 100 * MS), lambda t: no_event(t[0], "rejected"),
           lambda t: has_event(t[0], "breaker-transition", levee_breaker_to="open")),  # fmt: skip
)

scenario(
    "breaker-ignores-client-errors",
    "A 404 does not count as a breaker failure (failure-on defaults): the breaker stays closed.",
    ["breaker", "http"],
    doc(p={"attempts": 1, "breaker": BREAKER}),
    [http("GET", "http://svc.test/a", status(404)), http("GET", "http://svc.test/a", status(404), at=100 * MS),
     http("GET", "http://svc.test/a", status(200), at=200 * MS)],  # fmt: skip
    all_of(lambda t: http_status(t[0], 404), lambda t: http_status(t[1], 404), lambda t: http_status(t[2], 200),
           lambda t: no_event(t[1], "breaker-transition")),  # fmt: skip
)

# Budgets

scenario(
    "token-budget-refuses-retry",
    "gRPC A6 token budget (max 3): the first retry is allowed (2 > 1.5), the second refused (1 <= 1.5): budget.",
    ["budget"],
    doc(p={"attempts": 5, "backoff": CONST, "retry-on": ["error:Boom"],
           "budget": {"kind": "token", "max-tokens": 3, "token-ratio": 0.1}}),  # fmt: skip
    [call(boom(), boom(), ok())],
    all_of(lambda t: error(t[0], "budget", 2, "error:Boom"), lambda t: sleeps(t[0], 100 * MS),
           lambda t: has_event(t[0], "budget-refused", levee_attempt=2)),  # fmt: skip
)

scenario(
    "token-budget-shared-by-calls",
    "The budget is shared by the calls of a policy: after one call spent it, the next call's first retry is refused.",
    ["budget"],
    doc(p={"attempts": 3, "backoff": CONST, "retry-on": ["error:Boom"],
           "budget": {"kind": "token", "max-tokens": 3, "token-ratio": 0.1}}),  # fmt: skip
    [call(boom(), boom()), call(boom(), ok(), at=1 * S)],
    all_of(lambda t: error(t[0], "budget", 2), lambda t: error(t[1], "budget", 1, "error:Boom"),
           lambda t: sleeps(t[1])),  # fmt: skip
)

scenario(
    "ratio-budget-reserve",
    "A ratio budget's reserve (min-per-second x ttl) lets a first retry through even with no deposits.",
    ["budget"],
    doc(p={"attempts": 2, "backoff": CONST, "retry-on": ["error:Boom"],
           "budget": {"kind": "ratio", "percent": 10, "min-per-second": 1, "ttl": "1s"}}),  # fmt: skip
    [call(boom(), ok("retried"))],
    all_of(lambda t: value(t[0], "retried")),
)

# Rate limits

RATE = {"rate": 1, "per": "1s", "burst": 1}

scenario(
    "rate-limit-wait",
    "A rate limiter with max-wait makes the second call wait 900 ms for its token: a rate-limit-wait event and a sleep.",
    ["rate-limit", "wait"],
    doc(p={"attempts": 1, "rate-limit": {**RATE, "max-wait": "2s"}}),
    [call(ok(1)), call(ok(2), at=100 * MS)],
    all_of(lambda t: value(t[1], 2), lambda t: sleeps(t[1], 900 * MS), lambda t: starts(t[1], S),
           lambda t: has_event(t[1], "rate-limit-wait", levee_delay=0.9)),  # fmt: skip
)

scenario(
    "rate-limited-reject",
    "No max-wait: the second call is rejected with rate-limited and the 900 ms hint.",
    ["rate-limit", "rejection"],
    doc(p={"attempts": 1, "rate-limit": RATE}),
    [call(ok(1)), call(ok(2), at=100 * MS)],
    all_of(lambda t: error(t[1], "rate-limited", 0, None), lambda t: n_attempts(t[1], 0),
           lambda t: has_event(t[1], "rejected", levee_reason="rate-limited", levee_delay=0.9),
           lambda t: metric(t[1], "levee.rejections{levee.policy=p,levee.reason=rate-limited}", 1)),  # fmt: skip
)

scenario(
    "rate-limit-wait-past-deadline",
    "A wait that would end past the deadline is not taken: rate-limited at once.",
    ["rate-limit", "deadline"],
    doc(p={"attempts": 1, "deadline": "500ms", "rate-limit": {**RATE, "max-wait": "2s"}}),
    [call(ok(1)), call(ok(2), at=100 * MS)],
    all_of(lambda t: error(t[1], "rate-limited", 0, None), lambda t: sleeps(t[1])),
)

scenario(
    "rate-limit-retry-takes-a-token",
    "Every retry takes a token too: a retry of a 1/s limiter waits for the next token.",
    ["rate-limit", "retry"],
    doc(p={"attempts": 2, "backoff": const("10ms"), "retry-on": ["error:Boom"],
           "rate-limit": {**RATE, "max-wait": "5s"}}),  # fmt: skip
    [call(boom(), ok("second"))],
    all_of(lambda t: value(t[0], "second"), lambda t: starts(t[0], 0, S),
           lambda t: check(sum(t[0]["sleeps"]) == S, f"10 ms backoff then the wait: {t[0]['sleeps']}")),  # fmt: skip
)

# Bulkheads

BULK = doc(p={"attempts": 2, "backoff": const("500ms"), "retry-on": ["error:Boom"],
              "bulkhead": {"max-concurrent": 1}})  # fmt: skip

scenario(
    "bulkhead-full-rejects",
    "max-concurrent 1: a second call while the first attempt runs is rejected with bulkhead-full.",
    ["bulkhead", "rejection"],
    BULK,
    [call(ok(1, after=500 * MS)), call(ok(2), at=100 * MS), call(ok(3), at=600 * MS)],
    all_of(lambda t: value(t[0], 1), lambda t: error(t[1], "bulkhead-full", 0, None), lambda t: value(t[2], 3),
           lambda t: has_event(t[1], "rejected", levee_reason="bulkhead-full")),  # fmt: skip
)

scenario(
    "bulkhead-slot-free-during-sleep",
    "A call sleeping before its retry holds no slot: another call runs meanwhile.",
    ["bulkhead", "retry"],
    BULK,
    [call(boom(after=100 * MS), ok("retried")), call(ok("between"), at=200 * MS)],
    all_of(lambda t: value(t[0], "retried"), lambda t: value(t[1], "between"), lambda t: starts(t[0], 0, 600 * MS)),
)

scenario(
    "bulkhead-slot-freed-by-cancel",
    "A cancelled call gives its slot back: the next call is admitted.",
    ["bulkhead", "cancellation"],
    BULK,
    [call(HANG, cancel_at=200 * MS), call(ok("admitted"), at=300 * MS)],
    all_of(lambda t: check(t[0]["result"] == {"cancelled": True}, "the first call is cancelled"),
           lambda t: ends(t[0], 200 * MS), lambda t: value(t[1], "admitted")),  # fmt: skip
)

# Fallbacks

scenario(
    "fallback-returns",
    "Retries exhausted: the fallback's value ends the call; fallback-chosen names it and the reason.",
    ["fallback"],
    doc(p={"attempts": 2, "backoff": CONST, "retry-on": ["error:Boom"], "fallbacks": ["cache"]}),
    [call(boom(), boom(), fallbacks={"cache": {"return": "cached"}})],
    all_of(lambda t: value(t[0], "cached"), lambda t: check(t[0]["fallbacks"] == ["cache"], "cache ran"),
           lambda t: has_event(t[0], "fallback-chosen", levee_fallback="cache", levee_reason="retries-exhausted"),
           lambda t: metric(t[0], "levee.fallbacks{levee.fallback=cache,levee.policy=p,levee.reason=retries-exhausted}", 1),
           lambda t: calls_metric(t[0], "p", "fallback", True)),  # fmt: skip
)

scenario(
    "fallback-raises-then-next",
    "The first fallback raises: the next one of the chain runs and its value ends the call.",
    ["fallback"],
    doc(p={"attempts": 1, "fallbacks": ["primary", "secondary"]}),
    [call(boom(), fallbacks={"primary": {"raise": "CacheDown"}, "secondary": {"return": "default"}})],
    all_of(lambda t: value(t[0], "default"), lambda t: check(t[0]["fallbacks"] == ["primary", "secondary"], "both ran")),
)

scenario(
    "fallbacks-all-fail",
    "Every fallback raises: the call fails with fallbacks-failed.",
    ["fallback"],
    doc(p={"attempts": 1, "fallbacks": ["primary", "secondary"]}),
    [call(boom(), fallbacks={"primary": {"raise": "CacheDown"}, "secondary": {"raise": "AlsoDown"}})],
    all_of(lambda t: error(t[0], "fallbacks-failed", 1), lambda t: check(len(t[0]["fallbacks"]) == 2, "both ran")),
)

scenario(
    "fallback-only-on-its-reasons",
    "A fallback on breaker-open only does not run when the call fails for another reason.",
    ["fallback"],
    doc(p={"attempts": 1, "fallbacks": [{"name": "cache", "on": ["breaker-open"]}]}),
    [call(boom(), fallbacks={"cache": {"return": "cached"}})],
    all_of(lambda t: error(t[0], "non-retryable", 1, "error:Boom"), lambda t: check(t[0]["fallbacks"] == [], "no fallback ran")),
)

scenario(
    "fallback-on-breaker-open",
    "A rejected call (breaker open) falls back without an attempt.",
    ["fallback", "breaker"],
    doc(p={"attempts": 1, "breaker": BREAKER, "fallbacks": [{"name": "cache", "on": ["breaker-open"]}]}),
    [call(boom()), call(boom(), at=100 * MS), call(ok(), at=200 * MS, fallbacks={"cache": {"return": "cached"}})],
    all_of(lambda t: value(t[2], "cached"), lambda t: n_attempts(t[2], 0),
           lambda t: has_event(t[2], "fallback-chosen", levee_reason="breaker-open")),  # fmt: skip
)

scenario(
    "fallback-on-non-retryable",
    "A non-retryable failure falls back when the chain lists it.",
    ["fallback", "classification"],
    doc(p={"attempts": 3, "retry-on": ["error:Boom"], "fallbacks": [{"name": "cache", "on": ["non-retryable"]}]}),
    [call(boom("Fatal"), fallbacks={"cache": {"return": 0}})],
    all_of(lambda t: value(t[0], 0), lambda t: n_attempts(t[0], 1)),
)

scenario(
    "fallback-on-rate-limited",
    "A rate-limited rejection falls back.",
    ["fallback", "rate-limit"],
    doc(p={"attempts": 1, "rate-limit": RATE, "fallbacks": ["cache"]}),
    [call(ok(1)), call(ok(2), at=100 * MS, fallbacks={"cache": {"return": "cached"}})],
    all_of(lambda t: value(t[1], "cached"), lambda t: has_event(t[1], "fallback-chosen", levee_reason="rate-limited")),
)

scenario(
    "fallback-on-deadline",
    "A call that runs out of deadline falls back.",
    ["fallback", "deadline"],
    doc(p={"attempts": 3, "deadline": "1s", "attempt-timeout": "600ms", "backoff": CONST, "fallbacks": ["cache"]}),
    [call(HANG, HANG, fallbacks={"cache": {"return": "stale"}})],
    all_of(lambda t: value(t[0], "stale"), lambda t: within(t[0], 0, S),
           lambda t: has_event(t[0], "fallback-chosen", levee_reason="deadline")),  # fmt: skip
)


# HTTP: Retry-After, methods, idempotency headers, bodies, keys

RA = doc(p={"attempts": 2, "backoff": CONST})
U = "http://svc.test/r"


def _date(offset_s: int) -> str:
    return formatdate(WALL + offset_s, usegmt=True)


scenario(
    "retry-after-delta-seconds",
    "A 503 with Retry-After: 2 (delta-seconds) waits 2 s instead of the 100 ms backoff.",
    ["retry-after", "http"],
    RA,
    [http("GET", U, status(503, Retry_After="2"), status(200))],
    all_of(lambda t: http_status(t[0], 200), lambda t: sleeps(t[0], 2 * S), lambda t: starts(t[0], 0, 2 * S),
           lambda t: check(t[0]["requests"] == [{"x-levee-attempt": "1"}, {"x-levee-attempt": "2"}],
                           f"x-levee-attempt on every attempt: {t[0]['requests']}")),  # fmt: skip
)

scenario(
    "retry-after-http-date",
    "A 503 with an HTTP-date Retry-After 3 s after the wall clock waits 3 s (the host passes its virtual wall clock).",
    ["retry-after", "http", "virtual-time"],
    RA,
    [http("GET", U, status(503, Retry_After=_date(3)), status(200))],
    all_of(lambda t: http_status(t[0], 200), lambda t: sleeps(t[0], 3 * S)),
)

scenario(
    "retry-after-http-date-later",
    "The wall clock advances with virtual time: an HTTP-date 10 s after the start, received at 4 s, waits 6 s.",
    ["retry-after", "http", "virtual-time"],
    RA,
    [http("GET", U, status(503, after=4 * S, Retry_After=_date(10)), status(200))],
    all_of(lambda t: http_status(t[0], 200), lambda t: sleeps(t[0], 6 * S), lambda t: starts(t[0], 0, 10 * S)),
)

scenario(
    "retry-after-429",
    "429 is retried and its Retry-After honoured.",
    ["retry-after", "http"],
    RA,
    [http("GET", U, status(429, Retry_After="1"), status(200))],
    all_of(lambda t: http_status(t[0], 200), lambda t: sleeps(t[0], S)),
)

scenario(
    "retry-after-too-long",
    "Retry-After above the 300 s cap gives up with retry-after-too-long; the HTTP integration returns the 503 itself.",
    ["retry-after", "http", "http-result"],
    RA,
    [http("GET", U, status(503, Retry_After="400"), status(200))],
    all_of(lambda t: http_status(t[0], 503), lambda t: sleeps(t[0]),
           lambda t: has_event(t[0], "gave-up", levee_reason="retry-after-too-long")),  # fmt: skip
)

scenario(
    "retry-after-clamped",
    "over-cap: clamp waits the cap (1 s) for a Retry-After of 10 s.",
    ["retry-after", "http"],
    doc(p={"attempts": 2, "backoff": CONST, "retry-after": {"cap": "1s", "over-cap": "clamp"}}),
    [http("GET", U, status(503, Retry_After="10"), status(200))],
    all_of(lambda t: http_status(t[0], 200), lambda t: sleeps(t[0], S)),
)

scenario(
    "retry-after-past-deadline",
    "A Retry-After that does not fit the deadline gives up with deadline; the 503 is returned.",
    ["retry-after", "deadline", "http", "http-result"],
    doc(p={"attempts": 3, "deadline": "2s", "backoff": CONST}),
    [http("GET", U, status(503, Retry_After="5"), status(200))],
    all_of(lambda t: http_status(t[0], 503), lambda t: sleeps(t[0]),
           lambda t: has_event(t[0], "gave-up", levee_reason="deadline")),  # fmt: skip
)

scenario(
    "retry-after-not-honoured",
    "retry-after.honor false: the backoff applies.",
    ["retry-after", "http"],
    doc(p={"attempts": 2, "backoff": CONST, "retry-after": {"honor": False}}),
    [http("GET", U, status(503, Retry_After="5"), status(200))],
    all_of(lambda t: sleeps(t[0], 100 * MS), lambda t: http_status(t[0], 200)),
)

scenario(
    "retry-after-garbage-ignored",
    "A Retry-After that is neither digits nor a date is ignored: the backoff applies.",
    ["retry-after", "http"],
    RA,
    [http("GET", U, status(503, Retry_After="soon"), status(200))],
    all_of(lambda t: http_status(t[0], 200), lambda t: sleeps(t[0], 100 * MS)),
)

scenario(
    "envoy-overloaded-not-retried",
    "A 503 marked x-envoy-overloaded is never retried; the 503 is returned.",
    ["classification", "http", "http-result"],
    RA,
    [http("GET", U, status(503, x_envoy_overloaded="true"), status(200))],
    all_of(lambda t: http_status(t[0], 503), lambda t: n_attempts(t[0], 1)),
)

scenario(
    "http-404-not-retried",
    "404 is in never-retry: one attempt, the response returned.",
    ["classification", "http", "http-result"],
    RA,
    [http("GET", U, status(404), status(200))],
    all_of(lambda t: http_status(t[0], 404), lambda t: n_attempts(t[0], 1)),
)

scenario(
    "http-retries-exhausted-returns-last-response",
    "Every attempt answers 502: the integration returns the last 502, as a client without Levee would.",
    ["http", "http-result"],
    doc(p={"attempts": 3, "backoff": CONST}),
    [http("GET", U, status(502), status(502), status(502))],
    all_of(lambda t: http_status(t[0], 502), lambda t: n_attempts(t[0], 3),
           lambda t: has_event(t[0], "gave-up", levee_reason="retries-exhausted")),  # fmt: skip
)

M = doc(p={"attempts": 2, "backoff": CONST})

scenario(
    "http-get-retried",
    "GET is idempotent: a 503 is retried.",
    ["methods", "http"],
    M,
    [http("GET", U, status(503), status(200))],
    all_of(lambda t: http_status(t[0], 200), lambda t: n_attempts(t[0], 2)),
)

scenario(
    "http-post-not-retried",
    "POST is not idempotent: a 503 is not retried (non-idempotent) and is returned.",
    ["methods", "http", "idempotency"],
    M,
    [http("POST", U, status(503), status(200), body="bytes")],
    all_of(lambda t: http_status(t[0], 503), lambda t: n_attempts(t[0], 1),
           lambda t: has_event(t[0], "gave-up", levee_reason="non-idempotent")),  # fmt: skip
)

scenario(
    "http-put-retried",
    "PUT is idempotent (RFC 9110): retried, its bytes body sent again.",
    ["methods", "http"],
    M,
    [http("PUT", U, status(503), status(200), body="bytes")],
    all_of(lambda t: http_status(t[0], 200), lambda t: n_attempts(t[0], 2)),
)

scenario(
    "http-unknown-method-not-idempotent",
    "A method outside the nine registered tokens (PURGE) is code 15, other: not idempotent, not retried.",
    ["methods", "http"],
    M,
    [http("PURGE", U, status(503), status(200))],
    all_of(lambda t: http_status(t[0], 503), lambda t: has_event(t[0], "gave-up", levee_reason="non-idempotent")),
)

scenario(
    "http-idempotent-methods-policy",
    "idempotent-methods [POST] makes POST retryable and GET not.",
    ["methods", "http"],
    doc(p={"attempts": 2, "backoff": CONST, "idempotent-methods": ["POST"]}),
    [http("POST", U, status(503), status(200), body="bytes"), http("GET", U, status(503), status(200), at=S)],
    all_of(lambda t: http_status(t[0], 200), lambda t: http_status(t[1], 503)),
)

scenario(
    "http-idempotency-key-header",
    "A POST with an Idempotency-Key header is retried; the header reaches every attempt.",
    ["idempotency", "http", "issue-13: Idempotency-Key"],
    M,
    [http("POST", U, status(503), status(200), headers={"Idempotency-Key": "k-1"}, body="bytes")],
    all_of(lambda t: http_status(t[0], 200),
           lambda t: check(t[0]["requests"] == [{"x-levee-attempt": "1", "idempotency-key": "k-1"},
                                                {"x-levee-attempt": "2", "idempotency-key": "k-1"}],
                           f"requests {t[0]['requests']}")),  # fmt: skip
)

scenario(
    "http-x-idempotency-key-header",
    "X-Idempotency-Key counts as an idempotency key too (names compared case-insensitively).",
    ["idempotency", "http", "issue-13: X-Idempotency-Key"],
    M,
    [http("POST", U, status(503), status(200), headers={"x-IDEMPOTENCY-key": "k-2"}, body="bytes")],
    all_of(lambda t: http_status(t[0], 200), lambda t: n_attempts(t[0], 2)),
)

scenario(
    "http-empty-idempotency-key-ignored",
    "An empty Idempotency-Key is no key: the POST is not retried.",
    ["idempotency", "http"],
    M,
    [http("POST", U, status(503), status(200), headers={"Idempotency-Key": ""}, body="bytes")],
    all_of(lambda t: http_status(t[0], 503), lambda t: n_attempts(t[0], 1)),
)

scenario(
    "http-stream-body-not-retried",
    "issue 13: a body that cannot be sent twice makes the call non-idempotent at start, even with an Idempotency-Key: the reason reaches the events.",
    ["idempotency", "http", "issue-13: non-replayable bodies"],
    M,
    [http("POST", U, status(503), status(200), headers={"Idempotency-Key": "k-3"}, body="stream")],
    all_of(lambda t: http_status(t[0], 503), lambda t: n_attempts(t[0], 1),
           lambda t: has_event(t[0], "gave-up", levee_reason="non-idempotent")),  # fmt: skip
)

scenario(
    "http-stream-body-put-not-retried",
    "Even an idempotent method (PUT) with a streamed body is started non-idempotent: not retried.",
    ["idempotency", "http", "issue-13: non-replayable bodies"],
    M,
    [http("PUT", U, status(503), status(200), body="stream")],
    all_of(lambda t: http_status(t[0], 503), lambda t: has_event(t[0], "gave-up", levee_reason="non-idempotent")),
)

KEYB_BREAKER = {"window": {"kind": "count", "size": 1}, "minimum-calls": 1, "failure-rate": 100, "open-duration": "10s"}
KEYB = doc(p={"attempts": 1, "breaker": KEYB_BREAKER})

scenario(
    "http-key-host-port",
    "issue 13: the HTTP key is host:port, the host lower-cased and the default port written: https://API.example.com/a and https://api.example.com:443/b share a breaker; http:// (port 80) and :8443 do not.",
    ["http-key", "issue-13: the HTTP key"],
    KEYB,
    [http("GET", "https://API.example.com/a", status(503)),
     http("GET", "https://api.example.com:443/b", status(200), at=100 * MS),
     http("GET", "http://api.example.com/c", status(200), at=200 * MS),
     http("GET", "https://api.example.com:8443/d", status(200), at=300 * MS)],  # fmt: skip
    all_of(lambda t: http_status(t[0], 503), lambda t: error(t[1], "breaker-open", 0, None),
           lambda t: http_status(t[2], 200), lambda t: http_status(t[3], 200)),  # fmt: skip
)

scenario(
    "http-key-ipv6",
    "An IPv6 literal keeps its brackets: http://[::1]:8080/x and http://[::1]:8080/y share a key; http://[::1]/ (port 80) does not.",
    ["http-key", "issue-13: the HTTP key"],
    KEYB,
    [http("GET", "http://[::1]:8080/x", status(503)),
     http("GET", "http://[::1]:8080/y", status(200), at=100 * MS),
     http("GET", "http://[::1]/z", status(200), at=200 * MS)],  # fmt: skip
    all_of(lambda t: http_status(t[0], 503), lambda t: error(t[1], "breaker-open", 0, None),
           lambda t: http_status(t[2], 200)),  # fmt: skip
)

scenario(
    "http-key-userinfo-dropped",
    "Userinfo is no part of the key: http://user:pw@svc.test/ and http://svc.test/ share a breaker. (A client that refuses credentials in a URL, as fetch does, skips this one.)",
    ["http-key", "issue-13: the HTTP key"],
    KEYB,
    [http("GET", "http://user:pw@svc.test/a", status(503)), http("GET", "http://svc.test/b", status(200), at=100 * MS)],
    all_of(lambda t: http_status(t[0], 503), lambda t: error(t[1], "breaker-open", 0, None)),
)

scenario(
    "http-key-explicit-default-port",
    "http://svc.test:80/ and http://svc.test/ are one key.",
    ["http-key"],
    KEYB,
    [http("GET", "http://svc.test:80/", status(500)), http("GET", "http://svc.test/", status(200), at=100 * MS)],
    all_of(lambda t: error(t[1], "breaker-open", 0, None)),
)

# Errors: connections, connect timeouts, TLS, names

scenario(
    "http-connection-refused-retried",
    "A refused connection is a connection-error: retried.",
    ["error-naming", "http", "issue-13: connection refused"],
    M,
    [http("GET", U, REFUSE, status(200))],
    all_of(lambda t: http_status(t[0], 200), lambda t: n_attempts(t[0], 2),
           lambda t: metric(t[0], "levee.attempts{levee.outcome=connection-error,levee.policy=p}", 1)),  # fmt: skip
)

scenario(
    "http-connection-refused-exhausted",
    "No response at all: the typed error, its cause connection-error.",
    ["error-naming", "http", "http-result"],
    M,
    [http("GET", U, REFUSE, REFUSE)],
    all_of(lambda t: error(t[0], "retries-exhausted", 2, "connection-error")),
)

scenario(
    "http-connect-timeout-is-connection-error",
    "issue 13: a connect timeout is a connection-error, not a timeout: a policy retrying only connection errors retries it.",
    ["error-naming", "http", "issue-13: connect timeout"],
    doc(p={"attempts": 2, "backoff": CONST, "retry-on": ["connection-error"]}),
    [http("GET", U, CONNECT_TIMEOUT, status(200))],
    all_of(lambda t: http_status(t[0], 200), lambda t: n_attempts(t[0], 2)),
)

scenario(
    "http-connect-timeout-not-a-timeout",
    "A policy retrying only timeouts does not retry a connect timeout: non-retryable, cause connection-error.",
    ["error-naming", "http", "issue-13: connect timeout"],
    doc(p={"attempts": 2, "backoff": CONST, "retry-on": ["timeout"]}),
    [http("GET", U, CONNECT_TIMEOUT, status(200))],
    all_of(lambda t: error(t[0], "non-retryable", 1, "connection-error")),
)

scenario(
    "http-tls-certificate-not-retried",
    "issue 13: a certificate that fails verification is the error class tls-certificate, which no default rule retries.",
    ["error-naming", "http", "issue-13: TLS"],
    M,
    [http("GET", U, TLS, status(200))],
    all_of(lambda t: error(t[0], "non-retryable", 1, "error:tls-certificate"), lambda t: n_attempts(t[0], 1)),
)

scenario(
    "http-tls-certificate-retry-rule",
    "A policy can still retry it by name.",
    ["error-naming", "http"],
    doc(p={"attempts": 2, "backoff": CONST, "retry-on": ["error:tls-certificate"]}),
    [http("GET", U, TLS, status(200))],
    all_of(lambda t: http_status(t[0], 200)),
)

scenario(
    "http-timeout-attempt",
    "A hanging request is cut at the attempt timeout and retried.",
    ["timeout", "http"],
    doc(p={"attempts": 2, "attempt-timeout": "300ms", "backoff": CONST}),
    [http("GET", U, HANG, status(200))],
    all_of(lambda t: http_status(t[0], 200), lambda t: ends(t[0], 300 * MS, 400 * MS)),
)

scenario(
    "http-timeout-exhausted",
    "Every attempt times out: the typed error, its cause timeout.",
    ["timeout", "http", "http-result"],
    doc(p={"attempts": 2, "attempt-timeout": "300ms", "backoff": CONST}),
    [http("GET", U, HANG, HANG)],
    all_of(lambda t: error(t[0], "retries-exhausted", 2, "timeout"), lambda t: ends(t[0], 300 * MS, 700 * MS)),
)

scenario(
    "call-connection-refused-retried",
    "Through the call API a refused connection is a connection-error as well.",
    ["error-naming", "issue-13: connection refused"],
    M,
    [call(REFUSE, ok("connected"))],
    all_of(lambda t: value(t[0], "connected"), lambda t: n_attempts(t[0], 2)),
)

scenario(
    "error-name-is-the-class",
    "The error-class name is the class's own name (no module): a rule names it.",
    ["error-naming", "issue-13: error naming"],
    doc(p={"attempts": 2, "backoff": CONST, "retry-on": ["error:ThrottlingException"]}),
    [call(boom("ThrottlingException"), ok("after throttling"))],
    all_of(lambda t: value(t[0], "after throttling"),
           lambda t: metric(t[0], "levee.attempts{levee.outcome=error-class,levee.policy=p}", 1)),  # fmt: skip
)

# Idempotency through the call API

scenario(
    "call-non-idempotent-not-retried",
    "idempotent=false: a retryable failure ends the call with non-idempotent.",
    ["idempotency"],
    doc(p={"attempts": 3, "backoff": CONST, "retry-on": ["error:Boom"]}),
    [call(boom(), ok(), idempotent=False)],
    all_of(lambda t: error(t[0], "non-idempotent", 1, "error:Boom")),
)

scenario(
    "call-idempotency-key-rescues",
    "A non-idempotent call with an idempotency key is retried.",
    ["idempotency"],
    doc(p={"attempts": 3, "backoff": CONST, "retry-on": ["error:Boom"]}),
    [call(boom(), ok("once"), idempotent=False, idempotency_key="order-17")],
    all_of(lambda t: value(t[0], "once"), lambda t: n_attempts(t[0], 2)),
)


# Guest faults: traps, verdicts that break the contract, invalid (docs/hosts.md, sections 2-3)

RP = doc(p={"attempts": 3, "backoff": CONST, "retry-on": ["error:Boom"]})


def _recovered(t: Trace, kind: str, attempts: int, degraded_n: int) -> None:
    fault(t, kind)
    n_attempts(t, attempts)
    degraded(t, degraded_n)
    check("retry-scheduled" not in names(t)[names(t).index("engine-fault"):], "no retry after the fault")


scenario(
    "trap-at-start-degraded-attempt",
    "The guest traps at start: re-instantiated, engine-fault (trap), exactly one degraded attempt whose value ends the call; the next call is guarded again.",
    ["trap-recovery", "issue-13: degraded attempt after a trap at start"],
    RP,
    [call(ok("unguarded"), faults=[trap("start")]), call(boom(), ok("guarded"), at=S)],
    all_of(lambda t: value(t[0], "unguarded"), lambda t: _recovered(t[0], "trap", 1, 1),
           lambda t: value(t[1], "guarded"), lambda t: n_attempts(t[1], 2), lambda t: no_event(t[1], "engine-fault")),  # fmt: skip
)

scenario(
    "trap-at-start-degraded-error-is-the-users",
    "issue 13: after a trap at start the degraded attempt's own error is raised as the user's error, never an engine-fault reason, and it is not retried.",
    ["trap-recovery", "issue-13: the user's original error afterwards"],
    RP,
    [call(boom(), ok(), faults=[trap("start")])],
    all_of(lambda t: raised(t[0], "Boom"), lambda t: _recovered(t[0], "trap", 1, 1)),
)

scenario(
    "trap-at-start-timeout-is-attempt-timeout",
    "issue 13: the degraded attempt runs under the policy's attempt-timeout (200 ms) when it is shorter than the time left.",
    ["trap-recovery", "deadline-clamp", "issue-13: degraded attempt timeout"],
    doc(p={"attempts": 3, "attempt-timeout": "200ms", "deadline": "1s", "backoff": CONST}),
    [call(HANG, faults=[trap("start")])],
    all_of(lambda t: ends(t[0], 200 * MS), lambda t: degraded(t[0], 1), lambda t: fault(t[0], "trap")),
    unchecked={0: ("result",)},
)

scenario(
    "trap-at-start-timeout-clamped-to-deadline",
    "issue 13: the degraded attempt's timeout is clamped to the deadline (300 ms), not the 2 s attempt-timeout.",
    ["trap-recovery", "deadline-clamp", "issue-13: degraded attempt timeout clamped to the deadline"],
    doc(p={"attempts": 3, "attempt-timeout": "2s", "deadline": "300ms", "backoff": CONST}),
    [call(HANG, faults=[trap("start")])],
    all_of(lambda t: ends(t[0], 300 * MS), lambda t: degraded(t[0], 1), lambda t: within(t[0], 0, 300 * MS)),
    unchecked={0: ("result",)},
)

scenario(
    "trap-at-acquire-degraded-attempt",
    "issue 13: a trap at the acquire after a retry: one degraded attempt, its value ends the call.",
    ["trap-recovery", "issue-13: degraded attempt after a trap at acquire"],
    RP,
    [call(boom(), ok("degraded"), faults=[trap("acquire")])],
    all_of(lambda t: value(t[0], "degraded"), lambda t: _recovered(t[0], "trap", 2, 1), lambda t: sleeps(t[0], 100 * MS),
           lambda t: starts(t[0], 0, 100 * MS)),  # fmt: skip
)

scenario(
    "trap-at-acquire-degraded-timeout-clamped",
    "After a trap at acquire the degraded attempt gets what the deadline leaves (600 ms at 400 ms of 1 s).",
    ["trap-recovery", "deadline-clamp"],
    doc(p={"attempts": 3, "deadline": "1s", "attempt-timeout": "800ms", "backoff": const("100ms"),
           "retry-on": ["error:Boom"]}),  # fmt: skip
    [call(boom(after=300 * MS), HANG, faults=[trap("acquire")])],
    all_of(lambda t: starts(t[0], 0, 400 * MS), lambda t: ends(t[0], 300 * MS, S), lambda t: degraded(t[0], 1)),
    unchecked={0: ("result",)},
)

scenario(
    "trap-at-report-raises-the-attempts-error",
    "issue 13: a trap at the report of a failed attempt ends the call with that attempt's own error: no retry, no engine-fault reason.",
    ["trap-recovery", "issue-13: degraded attempt after a trap at report"],
    RP,
    [call(boom(), ok(), faults=[trap("report")])],
    all_of(lambda t: raised(t[0], "Boom"), lambda t: _recovered(t[0], "trap", 1, 0), lambda t: sleeps(t[0])),
)

scenario(
    "trap-at-second-report",
    "The second report traps: the second attempt's own error stands.",
    ["trap-recovery"],
    RP,
    [call(boom(), boom("Second"), ok(), faults=[trap("report", 2)])],
    all_of(lambda t: raised(t[0], "Second"), lambda t: n_attempts(t[0], 2), lambda t: fault(t[0], "trap")),
)

scenario(
    "trap-at-report-of-an-http-response",
    "A trap at the report of a 503: the HTTP integration returns that response.",
    ["trap-recovery", "http", "http-result"],
    doc(p={"attempts": 3, "backoff": CONST}),
    [http("GET", U, status(503), status(200), faults=[trap("report")])],
    all_of(lambda t: http_status(t[0], 503), lambda t: n_attempts(t[0], 1), lambda t: fault(t[0], "trap")),
)

scenario(
    "trap-at-start-http",
    "A trap at start of an HTTP call: one degraded request, its response returned.",
    ["trap-recovery", "http"],
    doc(p={"attempts": 3, "backoff": CONST}),
    [http("GET", U, status(503), status(200), faults=[trap("start")])],
    all_of(lambda t: http_status(t[0], 503), lambda t: degraded(t[0], 1),
           lambda t: check(t[0]["requests"] == [{"x-levee-attempt": "1"}], f"one request: {t[0]['requests']}")),  # fmt: skip
)

scenario(
    "trap-at-report-fallback-value-stands",
    "A trap at report-fallback after the fallback returned: its value stands.",
    ["trap-recovery", "fallback"],
    doc(p={"attempts": 1, "fallbacks": ["cache"]}),
    [call(boom(), fallbacks={"cache": {"return": "cached"}}, faults=[trap("report-fallback")])],
    all_of(lambda t: value(t[0], "cached"), lambda t: fault(t[0], "trap")),
)

scenario(
    "trap-at-report-fallback-error-stands",
    "A trap at report-fallback after the fallback raised: the fallback's own error is raised, the next fallback does not run.",
    ["trap-recovery", "fallback"],
    doc(p={"attempts": 1, "fallbacks": ["primary", "secondary"]}),
    [call(boom(), fallbacks={"primary": {"raise": "CacheDown"}, "secondary": {"return": "unused"}},
          faults=[trap("report-fallback")])],  # fmt: skip
    all_of(lambda t: raised(t[0], "CacheDown"), lambda t: check(t[0]["fallbacks"] == ["primary"], "only primary ran")),
)

scenario(
    "trap-never-reopens-a-tripped-breaker",
    "The snapshot taken at the breaker's transition is restored after a trap: the breaker is still open for the call after the faulted one.",
    ["trap-recovery", "breaker", "snapshot"],
    BRK,
    [call(boom()), call(boom(), at=100 * MS), call(ok("degraded"), at=200 * MS, faults=[trap("start")]),
     call(ok(), at=300 * MS)],  # fmt: skip
    all_of(lambda t: value(t[2], "degraded"), lambda t: degraded(t[2], 1), lambda t: error(t[3], "breaker-open", 0, None)),
)

scenario(
    "contract-attempt-number",
    "A start verdict with attempt number 2 for a new call breaks the contract: a guest fault (contract), the degraded attempt.",
    ["contract", "issue-13: verdicts that break the contract"],
    RP,
    [call(ok("degraded"), faults=[verdict("start", packed(ATTEMPT, 2, 0))])],
    all_of(lambda t: value(t[0], "degraded"), lambda t: _recovered(t[0], "contract", 1, 1)),
)

scenario(
    "contract-attempt-past-maximum",
    "issue 13: an attempt past the policy's maximum is a guest fault, never run as an attempt: the degraded attempt.",
    ["contract", "issue-13: an attempt past the maximum"],
    doc(p={"attempts": 2, "backoff": CONST, "retry-on": ["error:Boom"]}),
    [call(boom(), ok("degraded"), faults=[verdict("acquire", packed(ATTEMPT, 3, 0))])],
    all_of(lambda t: value(t[0], "degraded"), lambda t: _recovered(t[0], "contract", 2, 1)),
)

scenario(
    "contract-attempt-timeout-above-policy",
    "An attempt timeout above the policy's attempt-timeout breaks the contract: the degraded attempt runs under the policy's 1 s.",
    ["contract", "deadline-clamp"],
    doc(p={"attempts": 3, "attempt-timeout": "1s", "backoff": CONST}),
    [call(HANG, faults=[verdict("start", packed(ATTEMPT, 1, 5 * S))])],
    all_of(lambda t: ends(t[0], S), lambda t: degraded(t[0], 1), lambda t: fault(t[0], "contract")),
    unchecked={0: ("result",)},
)

scenario(
    "contract-attempt-timeout-past-deadline",
    "issue 13: a timeout past the deadline breaks the contract (the host does not clamp it): the degraded attempt under the time left.",
    ["contract", "deadline-clamp", "issue-13: a timeout past the deadline"],
    doc(p={"attempts": 3, "deadline": "500ms", "backoff": CONST}),
    [call(HANG, faults=[verdict("start", packed(ATTEMPT, 1, 2 * S))])],
    all_of(lambda t: ends(t[0], 500 * MS), lambda t: degraded(t[0], 1), lambda t: fault(t[0], "contract")),
    unchecked={0: ("result",)},
)

scenario(
    "contract-no-timeout-under-attempt-timeout",
    "A timeout of 0 under a policy with an attempt-timeout breaks the contract.",
    ["contract"],
    doc(p={"attempts": 3, "attempt-timeout": "1s", "backoff": CONST}),
    [call(ok("degraded"), faults=[verdict("start", packed(ATTEMPT, 1, 0))])],
    all_of(lambda t: value(t[0], "degraded"), lambda t: _recovered(t[0], "contract", 1, 1)),
)

scenario(
    "contract-retry-past-deadline",
    "issue 13: a retry delay that ends past the deadline breaks the contract: the attempt's own error, no sleep.",
    ["contract", "deadline", "issue-13: a delay past the deadline"],
    doc(p={"attempts": 3, "deadline": "1s", "backoff": CONST, "retry-on": ["error:Boom"]}),
    [call(boom(), ok(), faults=[verdict("report", packed(RETRY, 0, 5 * S))])],
    all_of(lambda t: raised(t[0], "Boom"), lambda t: sleeps(t[0]), lambda t: _recovered(t[0], "contract", 1, 0)),
)

scenario(
    "contract-wait-past-deadline",
    "A rate-limit wait past the deadline breaks the contract: the degraded attempt instead of the wait.",
    ["contract", "deadline"],
    doc(p={"attempts": 3, "deadline": "1s", "backoff": CONST, "retry-on": ["error:Boom"]}),
    [call(boom(), ok("degraded"), faults=[verdict("acquire", packed(WAIT, R["rate-limited"], 10 * S))])],
    all_of(lambda t: value(t[0], "degraded"), lambda t: sleeps(t[0], 100 * MS), lambda t: _recovered(t[0], "contract", 2, 1)),
)

scenario(
    "contract-fallback-index-out-of-range",
    "issue 13: a fallback index past the chain breaks the contract: no fallback runs, the attempt's own error stands.",
    ["contract", "fallback", "issue-13: a fallback index out of range"],
    doc(p={"attempts": 1, "fallbacks": ["cache"]}),
    [call(boom(), fallbacks={"cache": {"return": "unused"}},
          faults=[verdict("report", packed(FALLBACK, R["retries-exhausted"], 5))])],  # fmt: skip
    all_of(lambda t: raised(t[0], "Boom"), lambda t: check(t[0]["fallbacks"] == [], "no fallback ran"),
           lambda t: fault(t[0], "contract")),  # fmt: skip
)

scenario(
    "contract-fail-without-reason",
    "fail with reason none breaks the contract.",
    ["contract"],
    RP,
    [call(boom(), faults=[verdict("report", packed(FAIL, 0, 0))])],
    all_of(lambda t: raised(t[0], "Boom"), lambda t: fault(t[0], "contract")),
)

scenario(
    "contract-unknown-reason",
    "fail with a reason the WIT does not have breaks the contract.",
    ["contract"],
    RP,
    [call(boom(), faults=[verdict("report", packed(FAIL, 200, 0))])],
    all_of(lambda t: raised(t[0], "Boom"), lambda t: fault(t[0], "contract")),
)

scenario(
    "contract-unknown-kind",
    "A verdict kind above 6 breaks the contract.",
    ["contract"],
    RP,
    [call(ok("degraded"), faults=[verdict("start", 0x7)])],
    all_of(lambda t: value(t[0], "degraded"), lambda t: _recovered(t[0], "contract", 1, 1)),
)

scenario(
    "contract-reserved-bits",
    "Bits 6-7 set break the contract (bit 5 is the wakes bit).",
    ["contract"],
    RP,
    [call(ok("degraded"), faults=[verdict("start", packed(ATTEMPT, 1, 0) | 0x40)])],
    all_of(lambda t: value(t[0], "degraded"), lambda t: fault(t[0], "contract")),
)

scenario(
    "contract-done-to-acquire",
    "done answered to acquire breaks the contract: the degraded attempt.",
    ["contract"],
    RP,
    [call(boom(), ok("degraded"), faults=[verdict("acquire", packed(DONE))])],
    all_of(lambda t: value(t[0], "degraded"), lambda t: _recovered(t[0], "contract", 2, 1)),
)

scenario(
    "invalid-at-report-evicted-call",
    "issue 13: invalid (unknown call: evicted at MAX_LIVE_CALLS) at a report: engine-fault (invalid), the attempt's own error, no retry.",
    ["invalid", "eviction", "issue-13: invalid and evicted calls"],
    RP,
    [call(boom(), ok(), faults=[verdict("report", packed(INVALID, 1))])],
    all_of(lambda t: raised(t[0], "Boom"), lambda t: _recovered(t[0], "invalid", 1, 0)),
)

scenario(
    "invalid-at-start",
    "issue 13: invalid at start: one degraded attempt (never an unguarded run with retries, never an 'invalid' error).",
    ["invalid", "issue-13: invalid and evicted calls"],
    RP,
    [call(ok("degraded"), faults=[verdict("start", packed(INVALID, 1))])],
    all_of(lambda t: value(t[0], "degraded"), lambda t: _recovered(t[0], "invalid", 1, 1)),
)

scenario(
    "invalid-at-acquire",
    "invalid at acquire after a retry: one degraded attempt.",
    ["invalid", "issue-13: invalid and evicted calls"],
    RP,
    [call(boom(), boom(), ok(), faults=[verdict("acquire", packed(INVALID, 1))])],
    all_of(lambda t: raised(t[0], "Boom"), lambda t: _recovered(t[0], "invalid", 2, 1)),
)

# Cancellation

scenario(
    "cancel-during-sleep",
    "The caller cancels during the 1 s retry sleep: the sleep is cut short, no further attempt, the language's own cancellation.",
    ["cancellation", "issue-13: cancellation during a sleep"],
    doc(p={"attempts": 3, "backoff": const("1s"), "retry-on": ["error:Boom"]}),
    [call(boom(), ok(), cancel_at=500 * MS), call(ok("after"), at=2 * S)],
    all_of(lambda t: check(t[0]["result"] == {"cancelled": True}, f"cancelled, not {t[0]['result']}"),
           lambda t: n_attempts(t[0], 1), lambda t: calls_metric(t[0], "p", "cancelled", False),
           lambda t: value(t[1], "after")),  # fmt: skip
)

scenario(
    "cancel-during-attempt",
    "The caller cancels a hanging attempt: it ends at the cancel and is not reported (no levee.attempts).",
    ["cancellation"],
    doc(p={"attempts": 3, "backoff": CONST}),
    [call(HANG, cancel_at=300 * MS)],
    all_of(lambda t: ends(t[0], 300 * MS), lambda t: check(t[0]["result"] == {"cancelled": True}, "cancelled"),
           lambda t: check(not any(k.startswith("levee.attempts") for k in t[0]["metrics"]), "the attempt is not counted")),  # fmt: skip
)

scenario(
    "cancel-during-rate-limit-wait",
    "Cancelled while waiting for a rate-limit token: cancelled, no attempt.",
    ["cancellation", "rate-limit"],
    doc(p={"attempts": 1, "rate-limit": {**RATE, "max-wait": "2s"}}),
    [call(ok(1)), call(ok(2), at=100 * MS, cancel_at=500 * MS)],
    all_of(lambda t: check(t[1]["result"] == {"cancelled": True}, "cancelled"), lambda t: n_attempts(t[1], 0)),
)

scenario(
    "cancel-http-during-sleep",
    "An HTTP call cancelled during its Retry-After sleep.",
    ["cancellation", "http"],
    RA,
    [http("GET", U, status(503, Retry_After="5"), status(200), cancel_at=S)],
    all_of(lambda t: check(t[0]["result"] == {"cancelled": True}, "cancelled"), lambda t: n_attempts(t[0], 1)),
)

# Keys and eviction

scenario(
    "key-evicted",
    "keys.max 1: a second key evicts the first (key-evicted).",
    ["eviction", "keys"],
    doc(p={"attempts": 1, "keys": {"max": 1}, "breaker": BREAKER}),
    [call(ok(), key="a"), call(ok(), key="b", at=100 * MS)],
    all_of(lambda t: has_event(t[1], "key-evicted"), lambda t: no_event(t[0], "key-evicted"),
           lambda t: value(t[0], "ok"), lambda t: value(t[1], "ok")),  # fmt: skip
)

scenario(
    "evicted-key-starts-fresh",
    "An evicted key's open breaker is forgotten: the key starts fresh when it comes back.",
    ["eviction", "keys", "breaker"],
    doc(p={"attempts": 1, "keys": {"max": 1}, "breaker": BREAKER}),
    [call(boom(), key="a"), call(boom(), key="a", at=100 * MS), call(ok(), key="a", at=200 * MS),
     call(ok("b"), key="b", at=300 * MS), call(ok("a again"), key="a", at=400 * MS)],  # fmt: skip
    all_of(lambda t: error(t[2], "breaker-open", 0, None), lambda t: value(t[3], "b"), lambda t: value(t[4], "a again")),
)

# Telemetry and more deadline edges

scenario(
    "telemetry-first-time-success",
    "A first-time success: levee.calls (success, not retried), one levee.attempts and its duration, no events.",
    ["telemetry"],
    doc(p={"attempts": 3}),
    [call(ok("fine", after=250 * MS))],
    all_of(lambda t: calls_metric(t[0], "p", "success", False),
           lambda t: metric(t[0], "levee.attempts{levee.outcome=success,levee.policy=p}", 1),
           lambda t: metric(t[0], "levee.attempt.duration{levee.outcome=success,levee.policy=p}", {"count": 1, "sum": 0.25}),
           lambda t: check(t[0]["events"] == [], "no events"), lambda t: value(t[0], "fine")),  # fmt: skip
)

scenario(
    "telemetry-failure-metrics",
    "A failed call: levee.calls with its reason, levee.retries and the retry-delay histogram.",
    ["telemetry"],
    doc(p={"attempts": 2, "backoff": const("300ms"), "retry-on": ["error:Boom"]}),
    [call(boom(), boom())],
    all_of(lambda t: calls_metric(t[0], "p", "failure", True, "retries-exhausted"),
           lambda t: metric(t[0], "levee.retry.delay{levee.policy=p}", {"count": 1, "sum": 0.3}),
           lambda t: metric(t[0], "levee.retries{levee.policy=p}", 1),
           lambda t: error(t[0], "retries-exhausted", 2, "error:Boom")),  # fmt: skip
)

scenario(
    "deadline-retry-start-at-deadline",
    "A retry whose start would fall exactly at the deadline is not scheduled: deadline.",
    ["deadline"],
    doc(p={"attempts": 3, "deadline": "1s", "backoff": CONST, "retry-on": ["error:Boom"]}),
    [call(boom(after=900 * MS), ok())],
    all_of(lambda t: error(t[0], "deadline", 1, "error:Boom"), lambda t: sleeps(t[0])),
)

scenario(
    "deadline-spans-calls-retries",
    "The deadline spans every attempt and sleep: the third attempt gets only the 200 ms left.",
    ["deadline", "deadline-clamp"],
    doc(p={"attempts": 5, "deadline": "1s", "backoff": const("100ms"), "retry-on": ["error:Boom", "timeout"]}),
    [call(boom(after=300 * MS), boom(after=300 * MS), HANG)],
    all_of(lambda t: starts(t[0], 0, 400 * MS, 800 * MS), lambda t: ends(t[0], 300 * MS, 700 * MS, S),
           lambda t: error(t[0], "deadline", 3, "timeout")),  # fmt: skip
)

scenario(
    "concurrent-calls-interleave",
    "Two calls run concurrently on one engine, each with its own attempts and sleeps.",
    ["concurrency", "retry"],
    doc(p={"attempts": 3, "backoff": const("200ms"), "retry-on": ["error:Boom"]}),
    [call(boom(after=50 * MS), ok("one", after=50 * MS)), call(boom(after=10 * MS), ok("two"), at=120 * MS)],
    all_of(lambda t: value(t[0], "one"), lambda t: value(t[1], "two"), lambda t: starts(t[0], 0, 250 * MS),
           lambda t: starts(t[1], 120 * MS, 330 * MS)),  # fmt: skip
)


# More HTTP: fallbacks, lower-case methods, the hook on responses, a date in the past

scenario(
    "http-fallback-response",
    "An HTTP call rejected by an open breaker falls back; the fallback's response is returned.",
    ["fallback", "http", "breaker"],
    doc(p={"attempts": 1, "breaker": KEYB_BREAKER, "fallbacks": [{"name": "static", "on": ["breaker-open"]}]}),
    [http("GET", U, status(500)), http("GET", U, status(200), at=100 * MS, fallbacks={"static": {"return": {"status": 203}}})],
    all_of(lambda t: http_status(t[0], 500), lambda t: http_status(t[1], 203), lambda t: n_attempts(t[1], 0),
           lambda t: check(t[1]["fallbacks"] == ["static"], "the fallback ran")),  # fmt: skip
)

scenario(
    "http-lowercase-unknown-method",
    "issue 13: methods are case-sensitive; a lower-case token outside the registered nine (purge) is other (15) in every host, whatever the library does to its case: not idempotent, not retried.",
    ["methods", "http", "issue-13: HTTP methods incl. lower-case"],
    M,
    [http("purge", U, status(503), status(200))],
    all_of(lambda t: http_status(t[0], 503), lambda t: has_event(t[0], "gave-up", levee_reason="non-idempotent")),
)

scenario(
    "on-retry-hook-http-response",
    "The on_retry hook of an HTTP retry after a 503 gets the response, not an error (error: null).",
    ["on_retry", "http"],
    M,
    [http("GET", U, status(503), status(200))],
    all_of(lambda t: check(t[0]["on_retry"] == [{"attempt": 1, "delay": 0.1, "error": None}], f"{t[0]['on_retry']}"),
           lambda t: http_status(t[0], 200)),  # fmt: skip
)

scenario(
    "retry-after-date-in-the-past",
    "An HTTP-date Retry-After already past means retry now: the next attempt starts when the first ended.",
    ["retry-after", "http"],
    RA,
    [http("GET", U, status(503, after=5 * S, Retry_After=_date(1)), status(200))],
    all_of(lambda t: http_status(t[0], 200), lambda t: starts(t[0], 0, 5 * S),
           lambda t: has_event(t[0], "retry-scheduled", levee_delay=0.0)),  # fmt: skip
    unchecked={0: ("sleeps",)},
)


# Predicates in code (docs/hosts.md, section 9; docs/policy.md, "Predicates in code"): a call's
# `retry_if` answers, one per reported attempt, in order (true, false, null, or "raise": the
# predicate raises); `retry_if` in the trace is what the predicate was given, per attempt.

PRED = doc(p={"attempts": 3, "backoff": CONST, "retry-on": ["error:Boom"]})


def seen(t: Trace, *subjects: dict[str, Any]) -> None:
    check(t["retry_if"] == list(subjects), f"the predicate is given {list(subjects)}, not {t['retry_if']}")


scenario(
    "predicate-retries-a-result",
    "retry_if answers true for a returned result (tenacity's retry_if_result): the result is retried after the backoff; the next result, answered null, ends the call.",
    ["predicate", "retry", "issue-16: predicates in code"],
    PRED,
    [call(ok("pending"), ok("ready"), retry_if=[True, None])],
    all_of(lambda t: value(t[0], "ready"), lambda t: starts(t[0], 0, 100 * MS), lambda t: sleeps(t[0], 100 * MS),
           lambda t: seen(t[0], {"by": "call", "value": "pending"}, {"by": "call", "value": "ready"}),
           lambda t: has_event(t[0], "retry-scheduled")),  # fmt: skip
)

scenario(
    "predicate-retries-an-error",
    "retry_if answers true for error:Fatal, which retry-on does not name: it is retried; the predicate sees the error, then the value.",
    ["predicate", "retry", "issue-16: predicates in code"],
    PRED,
    [call(boom("Fatal"), ok("done"), retry_if=[True])],
    all_of(lambda t: value(t[0], "done"), lambda t: n_attempts(t[0], 2), lambda t: sleeps(t[0], 100 * MS),
           lambda t: seen(t[0], {"by": "call", "error": "error:Fatal"}, {"by": "call", "value": "done"})),  # fmt: skip
)

scenario(
    "predicate-refuses-a-retryable",
    "retry_if answers false for error:Boom, which retry-on retries: one attempt, no sleep, the call fails non-retryable with Boom as its cause.",
    ["predicate", "issue-16: predicates in code"],
    PRED,
    [call(boom(), ok("never"), retry_if=[False])],
    all_of(lambda t: n_attempts(t[0], 1), lambda t: sleeps(t[0]), lambda t: no_event(t[0], "retry-scheduled"),
           lambda t: error(t[0], "non-retryable", 1, "error:Boom"),
           lambda t: seen(t[0], {"by": "call", "error": "error:Boom"})),  # fmt: skip
)

scenario(
    "predicate-raises-counts-as-none",
    "A predicate that raises is reported and counts as null: the policy's rules decide (error:Boom is retried, error:Fatal is not).",
    ["predicate", "issue-16: predicates in code"],
    PRED,
    [call(boom(), ok("second"), retry_if=["raise", "raise"]), call(boom("Fatal"), ok("never"), at=S, retry_if=["raise"])],
    all_of(lambda t: value(t[0], "second"), lambda t: n_attempts(t[0], 2), lambda t: sleeps(t[0], 100 * MS),
           lambda t: seen(t[0], {"by": "call", "error": "error:Boom"}, {"by": "call", "value": "second"}),
           lambda t: n_attempts(t[1], 1), lambda t: sleeps(t[1]),
           lambda t: seen(t[1], {"by": "call", "error": "error:Fatal"})),  # fmt: skip
)

scenario(
    "predicate-keeps-the-ladder",
    "retry_if answers true on a non-idempotent call: the ladder still refuses (gave-up non-idempotent), one attempt.",
    ["predicate", "idempotency", "issue-16: predicates in code"],
    PRED,
    [call(boom(), ok("never"), idempotent=False, retry_if=[True])],
    all_of(lambda t: n_attempts(t[0], 1), lambda t: sleeps(t[0]),
           lambda t: has_event(t[0], "gave-up", levee_reason="non-idempotent"), lambda t: error(t[0], "non-idempotent", 1),
           lambda t: seen(t[0], {"by": "call", "error": "error:Boom"})),  # fmt: skip
)

scenario(
    "predicate-of-the-policy-and-the-calls-wins",
    "A policy's predicate (Engine.retry_if) decides for calls without their own: it retries error:Fatal; a call's own predicate wins over it (false: no retry of error:Boom).",
    ["predicate", "issue-16: predicates in code"],
    PRED,
    [call(boom("Fatal"), ok("by-policy")), call(boom(), ok("never"), at=S, retry_if=[False])],
    all_of(lambda t: value(t[0], "by-policy"), lambda t: n_attempts(t[0], 2),
           lambda t: seen(t[0], {"by": "policy", "error": "error:Fatal"}, {"by": "policy", "value": "by-policy"}),
           lambda t: n_attempts(t[1], 1), lambda t: seen(t[1], {"by": "call", "error": "error:Boom"})),  # fmt: skip
)
SCENARIOS[-1]["retry_if_policy"] = {"p": [True, None]}

scenario(
    "predicate-http-response",
    "An HTTP integration's predicate sees the response: true retries a 200 (a body the caller calls a failure), false refuses a 503 retry-on would retry, and the 503 is returned.",
    ["predicate", "http", "issue-16: predicates in code"],
    doc(p={"attempts": 3, "backoff": CONST}),
    [http("GET", U, status(200), status(200), retry_if=[True, None]),
     http("GET", U, status(503), status(200), at=S, retry_if=[False])],
    all_of(lambda t: http_status(t[0], 200), lambda t: n_attempts(t[0], 2), lambda t: sleeps(t[0], 100 * MS),
           lambda t: seen(t[0], {"by": "call", "status": 200}, {"by": "call", "status": 200}),
           lambda t: http_status(t[1], 503), lambda t: n_attempts(t[1], 1),
           lambda t: seen(t[1], {"by": "call", "status": 503})),  # fmt: skip
)

scenario(
    "retry-on-any",
    "retry-on: [any] retries an error class no rule names; the default never-retry still holds for a 404.",
    ["retry", "classification", "issue-16: retry any error"],
    doc(p={"attempts": 2, "backoff": CONST, "retry-on": ["any"]}),
    [call(boom("Whatever"), ok("retried")), http("GET", U, status(404), status(200), at=S)],
    all_of(lambda t: value(t[0], "retried"), lambda t: n_attempts(t[0], 2), lambda t: sleeps(t[0], 100 * MS),
           lambda t: http_status(t[1], 404), lambda t: n_attempts(t[1], 1)),  # fmt: skip
)


# The bulkhead queue (docs/policy.md, "The queue"): a parked call sleeps until its payload
# elapses or the core names it in take-wakes (it granted the call a freed slot); only the named
# call is woken, so a parked call sleeps once (a host that woke every waiter on every report
# would record a second, shorter sleep for each waiter left behind). A parked call's sleep is
# recorded with the payload the verdict asked for, like a sleep cut short.

QUEUE = doc(p={"attempts": 1, "bulkhead": {"max-concurrent": 1, "queue": 2, "queue-timeout": "1s"}})


def queued(t: Trace) -> None:
    # the event's core reason is bulkhead-full; docs/telemetry.md gives rate-limit-wait no
    # levee.reason attribute, so the trace shows the wait and its delay only
    check(any(e["name"] == "rate-limit-wait" for e in t["events"]), f"a rate-limit-wait event in {t['events']}")


scenario(
    "bulkhead-queue-fifo-wake-on-report",
    "Two calls queue behind a running one; each report grants the slot to the oldest waiter, which alone is woken and starts at that instant (no polling): FIFO, the later one sleeps on until its own grant.",
    ["bulkhead", "bulkhead-queue", "issue-16: bulkhead queue", "issue-20: named wakes"],
    QUEUE,
    [call(ok(0, after=100 * MS)), call(ok(1, after=100 * MS), at=10 * MS), call(ok(2, after=100 * MS), at=20 * MS)],
    all_of(lambda t: value(t[0], 0), lambda t: value(t[1], 1), lambda t: value(t[2], 2),
           lambda t: starts(t[1], 100 * MS), lambda t: starts(t[2], 200 * MS),
           lambda t: sleeps(t[1], S), lambda t: sleeps(t[2], S), lambda t: queued(t[1]), lambda t: queued(t[2])),  # fmt: skip
)

scenario(
    "bulkhead-queue-wakes-only-the-granted-call",
    "Five calls queue behind one slot; each report wakes only the call the core granted the slot to: every waiter sleeps once (one park, one wait event) and starts the instant its turn comes. A host that woke every waiter on each report would show each later waiter sleeping again, once per report before its turn.",
    ["bulkhead", "bulkhead-queue", "issue-20: named wakes"],
    doc(p={"attempts": 1, "bulkhead": {"max-concurrent": 1, "queue": 5, "queue-timeout": "2s"}}),
    [call(ok(i, after=100 * MS), at=i * 10 * MS) for i in range(6)],
    all_of(*[(lambda i: lambda t: value(t[i], i))(i) for i in range(6)],
           *[(lambda i: lambda t: starts(t[i], i * 100 * MS))(i) for i in range(1, 6)],
           *[(lambda i: lambda t: sleeps(t[i], 2 * S))(i) for i in range(1, 6)],
           *[(lambda i: lambda t: check(names(t[i]).count("rate-limit-wait") == 1, f"one wait event for call {i}: {names(t[i])}"))(i) for i in range(1, 6)]),  # fmt: skip
)

scenario(
    "bulkhead-queue-wake-on-cancel",
    "Cancelling the running call grants its slot to the waiter, woken at the cancel, which starts then.",
    ["bulkhead", "bulkhead-queue", "cancellation", "issue-16: bulkhead queue"],
    QUEUE,
    [call(HANG, cancel_at=100 * MS), call(ok("next"), at=10 * MS)],
    all_of(lambda t: check(t[0]["result"] == {"cancelled": True}, "the first call is cancelled"),
           lambda t: value(t[1], "next"), lambda t: starts(t[1], 100 * MS), lambda t: sleeps(t[1], S)),  # fmt: skip
)

scenario(
    "bulkhead-queue-waiter-cancelled",
    "A waiter cancelled in the queue leaves it without an attempt; the one behind it moves up and starts when the slot frees.",
    ["bulkhead", "bulkhead-queue", "cancellation", "issue-16: bulkhead queue"],
    QUEUE,
    [call(ok(0, after=300 * MS)), call(ok("never"), at=10 * MS, cancel_at=100 * MS), call(ok(2), at=20 * MS)],
    all_of(lambda t: value(t[0], 0), lambda t: check(t[1]["result"] == {"cancelled": True}, "the waiter is cancelled"),
           lambda t: n_attempts(t[1], 0), lambda t: value(t[2], 2), lambda t: starts(t[2], 300 * MS)),  # fmt: skip
)

scenario(
    "bulkhead-queue-timeout",
    "A waiter that no slot reaches within queue-timeout is rejected with bulkhead-full at its end, without an attempt.",
    ["bulkhead", "bulkhead-queue", "rejection", "issue-16: bulkhead queue"],
    doc(p={"attempts": 1, "bulkhead": {"max-concurrent": 1, "queue": 2, "queue-timeout": "100ms"}}),
    [call(ok(0, after=500 * MS)), call(ok("never"), at=10 * MS)],
    all_of(lambda t: value(t[0], 0), lambda t: error(t[1], "bulkhead-full", 0, None), lambda t: n_attempts(t[1], 0),
           lambda t: sleeps(t[1], 100 * MS), lambda t: queued(t[1]),
           lambda t: has_event(t[1], "rejected", levee_reason="bulkhead-full")),  # fmt: skip
)

scenario(
    "bulkhead-queue-full-rejects",
    "With the queue full (queue 1) a further call is rejected at once with bulkhead-full, no sleep; the queued one runs when the slot frees.",
    ["bulkhead", "bulkhead-queue", "rejection", "issue-16: bulkhead queue"],
    doc(p={"attempts": 1, "bulkhead": {"max-concurrent": 1, "queue": 1, "queue-timeout": "1s"}}),
    [call(ok(0, after=300 * MS)), call(ok(1), at=10 * MS), call(ok("never"), at=20 * MS)],
    all_of(lambda t: value(t[0], 0), lambda t: value(t[1], 1), lambda t: starts(t[1], 300 * MS),
           lambda t: error(t[2], "bulkhead-full", 0, None), lambda t: sleeps(t[2]), lambda t: n_attempts(t[2], 0)),  # fmt: skip
)


# ---------------------------------------------------------------------------- hedging
# docs/policy.md, "Hedging": the core's commands (start, cancel, wait, end) carried out through
# the public API. Calls marked `hedge` record, per attempt, whether it was cancelled (and, for an
# `unwind` step, when it closed). The host's waits for the core's `wait` commands are sleeps of
# the call: each is recorded with the delay the command asked for, even when an attempt's end
# cuts it short. Hedged calls are never replayed through the sync API (their attempts overlap).


def hedged(*script: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return call(*script, hedge=True, **extra)


def hedged_http(method: str, url: str, *script: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return http(method, url, *script, hedge=True, **extra)


def unwinding(step: dict[str, Any], ns: int) -> dict[str, Any]:
    """The step, taking `ns` to close once cancelled (it unwinds its connection)."""
    return {**step, "unwind": ns}


def cancelled(t: Trace, *numbers: int) -> None:
    got = tuple(k + 1 for k, a in enumerate(t["attempts"]) if a.get("cancelled"))
    check(got == numbers, f"attempts {numbers} are cancelled, not {got}")


def hedges(t: Trace, *numbers: int) -> None:
    got = tuple(e["levee.attempt"] for e in t["events"] if e["name"] == "hedge-started")
    check(got == numbers, f"hedges {numbers} start (hedge-started), not {got}")
    if numbers:
        metric(t, "levee.hedges{levee.policy=p}", len(numbers))
    else:
        check(not any(k.startswith("levee.hedges") for k in t["metrics"]), f"no levee.hedges in {t['metrics']}")


def cancelled_result(traces: list[Trace]) -> None:
    t = traces[0]
    check(t["result"] == {"cancelled": True}, f"the call is cancelled, not {t['result']}")


A6 = doc(p={"hedge": {"attempts": 4, "delay": "500ms", "non-fatal": ["error:Unavailable"]}})

scenario(
    "hedge-a6-example",
    "The gRPC A6 example through the public API: #1 at 0, #2 at 500 ms, #1 fails (non-fatal) at 700 ms so #3 starts at once, #2 succeeds at 900 ms and #3 is cancelled; #4 never starts.",
    ["hedging", "hedge:grpc", "cancellation", "telemetry", "issue-16: hedging"],
    A6,
    [hedged(boom("Unavailable", after=700 * MS), ok("second", after=400 * MS), HANG, ok("never"))],
    all_of(lambda t: value(t[0], "second"), lambda t: starts(t[0], 0, 500 * MS, 700 * MS),
           lambda t: ends(t[0], 700 * MS, 900 * MS, 900 * MS), lambda t: cancelled(t[0], 3),
           lambda t: hedges(t[0], 2, 3), lambda t: sleeps(t[0], 500 * MS, 500 * MS, 500 * MS),
           lambda t: metric(t[0], "levee.attempts{levee.outcome=error-class,levee.policy=p}", 1),
           lambda t: metric(t[0], "levee.attempts{levee.outcome=success,levee.policy=p}", 1),
           lambda t: check(not any("timeout" in k for k in t[0]["metrics"]), "the cancelled #3 is not counted"),
           lambda t: calls_metric(t[0], "p", "success", True)),  # fmt: skip
)

scenario(
    "hedge-a6-example-http",
    "The A6 example through the HTTP integration: each hedge is its own request (x-levee-attempt 1, 2, 3); #1's 503 at 700 ms sends #3 at once; #2's 200 at 900 ms is the response and the request of #3 is cancelled.",
    ["hedging", "hedge:grpc", "http", "cancellation", "issue-16: hedging"],
    doc(p={"hedge": {"attempts": 4, "delay": "500ms", "non-fatal": ["http:503"]}}),
    [hedged_http("GET", U, status(503, after=700 * MS), status(200, after=400 * MS), HANG, status(200))],
    all_of(lambda t: http_status(t[0], 200), lambda t: starts(t[0], 0, 500 * MS, 700 * MS),
           lambda t: ends(t[0], 700 * MS, 900 * MS, 900 * MS), lambda t: cancelled(t[0], 3),
           lambda t: check([r.get("x-levee-attempt") for r in t[0]["requests"]] == ["1", "2", "3"],
                           f"each hedge is its own request: {t[0]['requests']}"),
           lambda t: hedges(t[0], 2, 3)),  # fmt: skip
)

scenario(
    "hedge-all-fail-last-failure",
    "gRPC A6: every attempt fails (non-fatal): the call fails with retries-exhausted and the LAST failure, and is never retried.",
    ["hedging", "hedge:grpc", "error-naming", "issue-16: hedging"],
    doc(p={"hedge": {"attempts": 3, "delay": "100ms", "non-fatal": ["error:*"]}}),
    [hedged(boom("First", after=30 * MS), boom("Second", after=10 * MS), boom("Third", after=20 * MS))],
    all_of(lambda t: error(t[0], "retries-exhausted", 3, "error:Third"), lambda t: starts(t[0], 0, 30 * MS, 40 * MS),
           lambda t: ends(t[0], 30 * MS, 40 * MS, 60 * MS), lambda t: cancelled(t[0]), lambda t: hedges(t[0], 2, 3),
           lambda t: calls_metric(t[0], "p", "failure", True, "retries-exhausted")),  # fmt: skip
)

scenario(
    "hedge-fatal-cancels-the-rest",
    "A fatal failure (not in non-fatal) ends the call at once with non-retryable and cancels the attempt in flight.",
    ["hedging", "hedge:grpc", "cancellation", "issue-16: hedging"],
    doc(p={"hedge": {"attempts": 3, "delay": "100ms", "non-fatal": ["error:Unavailable"]}}),
    [hedged(HANG, boom("Fatal", after=50 * MS), ok("never"))],
    all_of(lambda t: error(t[0], "non-retryable", 2, "error:Fatal"), lambda t: starts(t[0], 0, 100 * MS),
           lambda t: ends(t[0], 150 * MS, 150 * MS), lambda t: cancelled(t[0], 1), lambda t: hedges(t[0], 2)),  # fmt: skip
)

scenario(
    "hedge-throttled",
    "A6 throttling (token budget 4, ratio 1.6): each non-fatal failure costs a token; at 2 of 4 (not above half) the budget refuses the next hedge, so call 1 fails with budget after its two attempts, and call 2's hedge is never sent.",
    ["hedging", "hedge:grpc", "budget", "issue-16: hedging"],
    doc(p={"hedge": {"attempts": 3, "delay": "100ms", "non-fatal": ["error:Unavailable"]},
           "budget": {"kind": "token", "max-tokens": 4, "token-ratio": 1.6}}),  # fmt: skip
    [hedged(boom("Unavailable", after=10 * MS), boom("Unavailable", after=10 * MS), ok("never")),
     hedged(ok("alone", after=300 * MS), ok("never"), at=S)],  # fmt: skip
    all_of(lambda t: error(t[0], "budget", 2, "error:Unavailable"), lambda t: starts(t[0], 0, 10 * MS),
           lambda t: hedges(t[0], 2), lambda t: has_event(t[0], "budget-refused"),
           lambda t: value(t[1], "alone"), lambda t: n_attempts(t[1], 1), lambda t: hedges(t[1]),
           lambda t: has_event(t[1], "budget-refused")),  # fmt: skip
)

scenario(
    "hedge-preset-polly",
    "Polly v8: when every attempt fails the PRIMARY's failure is returned (A6 would return the last).",
    ["hedging", "hedge:polly", "error-naming", "issue-16: hedging"],
    doc(p={"hedge": {"attempts": 3, "delay": "50ms", "non-fatal": ["error:*"], "preset": "polly"}}),
    [hedged(boom("First", after=30 * MS), boom("Second", after=10 * MS), boom("Third", after=20 * MS))],
    all_of(lambda t: error(t[0], "retries-exhausted", 3, "error:First"), lambda t: starts(t[0], 0, 30 * MS, 40 * MS),
           lambda t: hedges(t[0], 2, 3)),  # fmt: skip
)

scenario(
    "hedge-preset-failsafe",
    "failsafe-go: hedges go by time only; #1's non-fatal failure at 100 ms does not send #2 early: #2 starts at the 500 ms delay and wins.",
    ["hedging", "hedge:failsafe", "issue-16: hedging"],
    doc(p={"hedge": {"attempts": 3, "delay": "500ms", "non-fatal": ["error:Unavailable"], "preset": "failsafe"}}),
    [hedged(boom("Unavailable", after=100 * MS), ok("timed", after=50 * MS), ok("never"))],
    all_of(lambda t: value(t[0], "timed"), lambda t: starts(t[0], 0, 500 * MS), lambda t: ends(t[0], 100 * MS, 550 * MS),
           lambda t: hedges(t[0], 2)),  # fmt: skip
)

scenario(
    "hedge-preset-envoy",
    "Envoy hedge_on_per_try_timeout: #2 starts when #1 has run for the 200 ms attempt-timeout, which does not end #1; #1's 200 at 250 ms wins and #2 is cancelled.",
    ["hedging", "hedge:envoy", "http", "attempt-timeout", "issue-16: hedging"],
    doc(p={"attempt-timeout": "200ms", "deadline": "1s", "hedge": {"attempts": 2, "preset": "envoy"}}),
    [hedged_http("GET", U, status(200, after=250 * MS), HANG)],
    all_of(lambda t: http_status(t[0], 200), lambda t: starts(t[0], 0, 200 * MS), lambda t: ends(t[0], 250 * MS, 250 * MS),
           lambda t: cancelled(t[0], 2), lambda t: hedges(t[0], 2), lambda t: within(t[0], 0, S)),  # fmt: skip
)

scenario(
    "hedge-bulkhead-slot-held-until-closed",
    "A cancelled attempt holds its bulkhead slot until it has closed, not from the cancel: call A's #1 is cancelled at 150 ms but unwinds until 350 ms, so with call C's attempt the bulkhead (2) is full for call D at 250 ms and C's hedge at 300 ms; call E at 400 ms gets the freed slot.",
    ["hedging", "bulkhead", "cancellation", "issue-16: hedging"],
    doc(p={"bulkhead": {"max-concurrent": 2}, "hedge": {"attempts": 2, "delay": "100ms"}}),
    [hedged(unwinding(ok("slow", after=S), 200 * MS), ok("fast", after=50 * MS)),
     hedged(ok("c", after=500 * MS), ok("never"), at=200 * MS),
     hedged(ok("never"), at=250 * MS),
     hedged(ok("e", after=10 * MS), at=400 * MS)],  # fmt: skip
    all_of(lambda t: value(t[0], "fast"), lambda t: cancelled(t[0], 1),
           lambda t: check(t[0]["attempts"][0].get("closed") == 350 * MS, f"#1 closes at 350 ms: {t[0]['attempts']}"),
           lambda t: value(t[1], "c"), lambda t: n_attempts(t[1], 1), lambda t: hedges(t[1]),
           lambda t: error(t[2], "bulkhead-full", 0, None), lambda t: n_attempts(t[2], 0),
           lambda t: value(t[3], "e"), lambda t: starts(t[3], 400 * MS)),  # fmt: skip
)

scenario(
    "hedge-caller-cancels",
    "The caller cancels a hedged call with two attempts in flight: both are aborted at the cancel, none is reported, the call counts as cancelled.",
    ["hedging", "cancellation", "issue-16: hedging"],
    doc(p={"hedge": {"attempts": 3, "delay": "100ms"}}),
    [hedged(HANG, HANG, ok("never"), cancel_at=150 * MS)],
    all_of(cancelled_result, lambda t: starts(t[0], 0, 100 * MS), lambda t: ends(t[0], 150 * MS, 150 * MS),
           lambda t: cancelled(t[0], 1, 2), lambda t: hedges(t[0], 2),
           lambda t: check(not any(k.startswith("levee.attempts") for k in t[0]["metrics"]), "no attempt is counted"),
           lambda t: calls_metric(t[0], "p", "cancelled", True)),  # fmt: skip
)

scenario(
    "hedge-stream-body-not-hedged",
    "A request whose body is a stream cannot be sent twice: the transport starts it non-idempotent and the core sends no hedge; a replayable body is hedged.",
    ["hedging", "http", "idempotency", "issue-16: hedging"],
    doc(p={"hedge": {"attempts": 2, "delay": "100ms"}}),
    [hedged_http("POST", U, status(200, after=300 * MS), status(200), body="stream"),
     hedged_http("POST", U, status(200, after=300 * MS), status(201, after=50 * MS), body="bytes",
                 headers={"Idempotency-Key": "k-1"}, at=S)],  # fmt: skip
    all_of(lambda t: http_status(t[0], 200), lambda t: n_attempts(t[0], 1), lambda t: hedges(t[0]),
           lambda t: http_status(t[1], 201), lambda t: n_attempts(t[1], 2), lambda t: cancelled(t[1], 1)),  # fmt: skip
)

scenario(
    "hedge-non-idempotent-call-not-hedged",
    "A call started non-idempotent through the public API (and without an idempotency key) is never hedged: one attempt, however slow.",
    ["hedging", "idempotency", "issue-16: hedging"],
    doc(p={"hedge": {"attempts": 3, "delay": "100ms"}}),
    [hedged(ok("once", after=500 * MS), ok("never"), idempotent=False)],
    all_of(lambda t: value(t[0], "once"), lambda t: n_attempts(t[0], 1), lambda t: hedges(t[0])),
)

scenario(
    "hedge-fallback-after-all-fail",
    "Every hedged attempt fails: the policy's fallback runs (once, for retries-exhausted) and its value is the call's.",
    ["hedging", "fallback", "issue-16: hedging"],
    doc(p={"hedge": {"attempts": 2, "delay": "50ms", "non-fatal": ["error:Boom"]}, "fallbacks": ["cache"]}),
    [hedged(boom(after=100 * MS), boom(after=20 * MS), fallbacks={"cache": {"return": "cached"}})],
    all_of(lambda t: value(t[0], "cached"), lambda t: check(t[0]["fallbacks"] == ["cache"], "the fallback runs once"),
           lambda t: starts(t[0], 0, 50 * MS), lambda t: has_event(t[0], "fallback-chosen", levee_reason="retries-exhausted"),
           lambda t: calls_metric(t[0], "p", "fallback", True)),  # fmt: skip
)


# Guest faults in a hedged call (docs/hosts.md, section 3, for hedging): a command that breaks
# the contract, or a trap, is the one recovery path. The attempt whose report faulted keeps its
# own result; else the oldest attempt in flight (already running, with the core's leave) goes on
# alone and its own result stands; every other attempt is cancelled and nothing more is reported
# to the core. Only when no attempt is in flight does the host run one degraded attempt.


def answer(op: str, nth: int, *commands: dict[str, Any]) -> dict[str, Any]:
    """The guest's answer to the `nth` `op` (hedge-step, report-attempt) replaced by `commands`."""
    return {"op": op, "nth": nth, "commands": list(commands)}


scenario(
    "hedge-contract-start-twice",
    "At the hedge delay, hedge-step answers a start of attempt 1, which is already running: a contract fault; no hedge starts, attempt 1 goes on alone (no degraded attempt) and its value is the call's.",
    ["hedging", "recovery", "contract", "issue-16: hedging"],
    doc(p={"hedge": {"attempts": 3, "delay": "100ms"}}),
    [hedged(ok("first", after=300 * MS), ok("never"),
            faults=[answer("hedge-step", 2, {"start": {"attempt": 1, "timeout": 0}})])],  # fmt: skip
    all_of(lambda t: value(t[0], "first"), lambda t: n_attempts(t[0], 1), lambda t: degraded(t[0], 0),
           lambda t: fault(t[0], "contract"), lambda t: ends(t[0], 300 * MS), lambda t: hedges(t[0]),
           lambda t: calls_metric(t[0], "p", "success", False)),  # fmt: skip
)

scenario(
    "hedge-contract-wait-past-deadline",
    "At the hedge delay, hedge-step answers a wait that ends past the 1 s deadline: a contract fault; no hedge starts and attempt 1 goes on alone under its own timeout.",
    ["hedging", "recovery", "contract", "deadline", "issue-16: hedging"],
    doc(p={"deadline": "1s", "hedge": {"attempts": 2, "delay": "100ms"}}),
    [hedged(ok("first", after=200 * MS), ok("never"), faults=[answer("hedge-step", 2, {"wait": 5 * S})])],
    all_of(lambda t: value(t[0], "first"), lambda t: n_attempts(t[0], 1), lambda t: fault(t[0], "contract"),
           lambda t: degraded(t[0], 0), lambda t: hedges(t[0]), lambda t: sleeps(t[0], 100 * MS)),  # fmt: skip
)

scenario(
    "hedge-trap-report-attempt",
    "The guest traps on the report of attempt 2's failure: that attempt's own error is raised as the user's own, and attempt 1, in flight, is cancelled.",
    ["hedging", "recovery", "trap", "cancellation", "issue-16: hedging"],
    doc(p={"hedge": {"attempts": 3, "delay": "100ms", "non-fatal": ["error:Unavailable"]}}),
    [hedged(HANG, boom("Unavailable", after=50 * MS), ok("never"), faults=[trap("report-attempt", 1)])],
    all_of(lambda t: raised(t[0], "Unavailable"), lambda t: n_attempts(t[0], 2), lambda t: cancelled(t[0], 1),
           lambda t: ends(t[0], 150 * MS, 150 * MS), lambda t: fault(t[0], "trap"), lambda t: degraded(t[0], 0)),  # fmt: skip
)


# ---------------------------------------------------------------------------- output


def build() -> list[dict[str, Any]]:
    """The scenarios as written (no `expect`): fresh copies."""
    return json.loads(json.dumps(SCENARIOS))


def check_intent(scn: dict[str, Any], traces: list[Trace]) -> None:
    """Raise AssertionError when the traces break the scenario's intent."""
    INTENTS[scn["name"]](scn, traces)


def _strip(scn: dict[str, Any]) -> dict[str, Any]:
    out = json.loads(json.dumps(scn))
    for i, fields in UNCHECKED.get(scn["name"], {}).items():
        for f in fields:
            out["calls"][i]["expect"].pop(f, None)
    return out


def write(scn: dict[str, Any]) -> Path:
    """Write a blessed scenario (every call has its `expect`), minus its unchecked fields."""
    path = HERE / f"{scn['name']}.json"
    path.write_text(json.dumps(_strip(scn), indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return path


def remove_stale() -> list[str]:
    known = {s["name"] for s in SCENARIOS}
    gone = []
    for p in HERE.glob("*.json"):
        if p.name != "schema.json" and p.stem not in known:
            p.unlink()
            gone.append(p.name)
    return gone


def check_files() -> int:
    """Every scenario has its file, and each file's inputs are this generator's."""
    bad = 0
    for scn in SCENARIOS:
        path = HERE / f"{scn['name']}.json"
        if not path.exists():
            print(f"missing {path.name}: bless it (LEVEE_BLESS=1 python tests/hosts_runner.py in host-bindings/python)")
            bad += 1
            continue
        on_disk = json.loads(path.read_text(encoding="utf-8"))
        for c in on_disk.get("calls", []):
            c.pop("expect", None)
        if on_disk != scn:
            print(f"stale {path.name}: its inputs differ from scenarios.py; bless again")
            bad += 1
    names = {s["name"] for s in SCENARIOS}
    for p in HERE.glob("*.json"):
        if p.name != "schema.json" and p.stem not in names:
            print(f"{p.name} has no scenario in scenarios.py")
            bad += 1
    print(f"{len(SCENARIOS)} scenarios, {bad} problems")
    return 1 if bad else 0


if __name__ == "__main__":
    if sys.argv[1:] == ["--check"]:
        sys.exit(check_files())
    if sys.argv[1:] == ["--list"]:
        for s in SCENARIOS:
            print(f"{s['name']}: {s['description']}")
        sys.exit(0)
    print(__doc__)
    sys.exit(2)

"""The host-scenario runner of the Python host (conformance/hosts/README.md).

Every scenario is replayed through the public API under a `levee.testing.VirtualClock`: the
asyncio decorator (`api: call`) and `AsyncLeveeTransport` over `httpx.MockTransport`
(`api: http`); where a scenario allows it (no concurrency, no cancel, no hang or late step)
also through the synchronous decorator and `LeveeTransport`. The trace it observes is compared
with the scenario's `expect`.

    python tests/hosts_runner.py             # replay every scenario, print mismatches
    LEVEE_BLESS=1 python tests/hosts_runner.py   # write the traces into conformance/hosts/*.json,
                                             # after checking each against its intent in scenarios.py
"""

from __future__ import annotations

import asyncio
import contextvars
import importlib.util
import json
import os
import ssl
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any, cast

import httpx

import levee
from levee.http import AsyncLeveeTransport, LeveeTransport
from levee.outcomes import outcome_for_exception
from levee.testing import Fault, RecordingSink, VirtualClock, faults, metric_key
from levee.types import OutcomeKind

ROOT = Path(__file__).resolve().parents[3]
SCENARIOS = ROOT / "conformance" / "hosts"

CALL: contextvars.ContextVar[int | None] = contextvars.ContextVar("scenario_call", default=None)
HANG = 10**7  # seconds: a hang is a sleep no scenario reaches (every one ends by a timeout or a cancel)
REAL_TIMEOUT = 30.0  # real seconds: a replay that does not end by then is a deadlock


class ScenarioError(AssertionError):
    """The scenario cannot be replayed as written (a host asked for more attempts, a deadlock)."""


class TraceClock(VirtualClock):
    """The virtual clock, recording every sleep the host asks for, per call."""

    def __init__(self, wall: float) -> None:
        super().__init__(0.0, wall=wall)
        self.sleeps: dict[int, list[int]] = {}

    def _note(self, seconds: float) -> None:
        i = CALL.get()
        if i is not None:
            self.sleeps.setdefault(i, []).append(round(seconds * 1e9))

    def sleep(self, seconds: float) -> None:
        self._note(seconds)
        super().sleep(seconds)

    async def sleep_async(self, seconds: float) -> None:
        self._note(seconds)
        await super().sleep_async(seconds)

    async def dep_sleep(self, ns: int) -> None:
        """A sleep of the dependency (not the host's)."""
        await VirtualClock.sleep_async(self, ns / 1e9)

    def dep_sleep_sync(self, ns: int) -> None:
        VirtualClock.sleep(self, ns / 1e9)


_CLASSES: dict[str, type[Exception]] = {}


def error_class(name: str) -> type[Exception]:
    """An exception class whose `__name__` is `name` (the naming rule of docs/hosts.md)."""
    cls = _CLASSES.get(name)
    if cls is None:
        cls = _CLASSES[name] = type(name, (Exception,), {})
    return cls


def outcome_name(exc: BaseException | None, result: Any = None) -> str | None:
    """`timeout`, `connection-error`, `http:503`, `error:ClassName`, or None."""
    if exc is None:
        if isinstance(result, httpx.Response):
            return f"http:{result.status_code}"
        return None
    o = outcome_for_exception(exc)
    if o.kind is OutcomeKind.HTTP_STATUS:
        return f"http:{o.code}"
    if o.kind is OutcomeKind.ERROR_CLASS:
        return f"error:{o.text}"
    return o.kind.wit


def _parse_verdict(v: str | int) -> int:
    return int(v, 0) if isinstance(v, str) else int(v)


def _command(c: dict[str, Any]) -> dict[str, Any]:
    """A scripted hedge command, with an `end`'s verdict as an int."""
    if "end" in c:
        return {"end": {"attempt": int(c["end"]["attempt"]), "verdict": _parse_verdict(c["end"]["verdict"])}}
    return c


def _faults(call: dict[str, Any]) -> tuple[Fault, ...]:
    out = []
    for f in call.get("faults", []):
        verdict = _parse_verdict(f["verdict"]) if "verdict" in f else None
        commands = tuple(_command(c) for c in f["commands"]) if "commands" in f else None
        out.append(Fault(f["op"], int(f.get("nth", 1)), verdict, commands))
    return tuple(out)


class Replay:
    """One replay of a scenario: a fresh engine, clock and sink."""

    def __init__(self, scn: dict[str, Any], sync: bool = False) -> None:
        self.scn = scn
        self.sync = sync
        self.clock = TraceClock(float(scn.get("wall_start", 1764547200)))
        self.sink = RecordingSink(label=CALL)
        self.engine = levee.loads(scn["document"], seed=int(scn.get("seed", 42)), clock=self.clock,
                                  telemetry=self.sink)  # fmt: skip
        n = len(scn["calls"])
        self.traces: list[dict[str, Any]] = [
            {"attempts": [], "sleeps": [], "fallbacks": [], "on_retry": []} for _ in range(n)
        ]
        self.requests: list[list[dict[str, str]]] = [[] for _ in range(n)]
        #: dependency attempts still running (a cancelled one may unwind after its call ended)
        self.live = 0
        self.quiet = asyncio.Event()
        registered: dict[str, dict[str, Any]] = {}
        for c in scn["calls"]:
            for name, spec in (c.get("fallbacks") or {}).items():
                if name in registered and registered[name] != spec:
                    raise ScenarioError(f"fallback {name!r} is registered twice with different behaviours")
                registered[name] = spec
        for name, spec in registered.items():
            self.engine.register_fallback(name, self._fallback(name, spec))
        # the policies' retry predicates (`Engine.retry_if`): one answer per call of the predicate,
        # across the calls of that policy, in order
        for name, answers in (scn.get("retry_if_policy") or {}).items():
            self.engine.retry_if(name, self._predicate("policy", list(answers)))

    # ------------------------------------------------------------ retry predicates

    def _predicate(self, by: str, answers: list[Any]) -> Callable[[Any], bool | None]:
        """A predicate answering `answers` in turn (`"raise"`: it raises; past the end: None),
        recording in the running call's trace what it was given."""
        used = [0]

        def predicate(subject: Any) -> bool | None:
            i = CALL.get()
            assert i is not None
            seen: dict[str, Any] = {"by": by}
            if isinstance(subject, httpx.Response):
                seen["status"] = subject.status_code
            elif isinstance(subject, BaseException):
                seen["error"] = outcome_name(subject)
            else:
                seen["value"] = subject
            self.traces[i].setdefault("retry_if", []).append(seen)
            n = used[0]
            used[0] += 1
            answer = answers[n] if n < len(answers) else None
            if answer == "raise":
                raise error_class("PredicateBroke")("a scripted predicate failure")
            return cast("bool | None", answer)

        return predicate

    # ------------------------------------------------------------ the fake dependency

    def _fallback(self, name: str, spec: dict[str, Any]) -> Callable[[levee.FallbackContext], Any]:
        def run(ctx: levee.FallbackContext) -> Any:
            i = CALL.get()
            assert i is not None
            self.traces[i]["fallbacks"].append(name)
            if "raise" in spec:
                raise error_class(spec["raise"])(f"fallback {name} failed")
            value = spec.get("return")
            if self.scn["calls"][i].get("api") == "http":
                status = value.get("status", 200) if isinstance(value, dict) else 200
                return httpx.Response(int(status))
            return value

        return run

    def _begin_attempt(self, i: int) -> tuple[dict[str, Any], dict[str, Any]]:
        trace = self.traces[i]
        n = len(trace["attempts"])
        script = self.scn["calls"][i]["script"]
        if n >= len(script):
            raise ScenarioError(f"call {i}: the host asked for attempt {n + 1}; the script has {len(script)}")
        rec: dict[str, Any] = {"at": self.clock.monotonic_ns()}
        if any(e.kind == "event" and e.name == "engine-fault" and e.label == i for e in self.sink.entries):
            rec["degraded"] = True
        trace["attempts"].append(rec)
        return script[n], rec

    async def _play(self, i: int, step: dict[str, Any]) -> None:
        """Wait as the step says (before it answers)."""
        if step.get("hang"):
            await self.clock.dep_sleep(HANG * 10**9)
            raise ScenarioError(f"call {i}: a hanging attempt was never ended")
        if "late" in step:
            # ignores cancellation: its work goes on (shielded) and answers after `late`; the
            # host stops waiting at its timeout and discards the answer (docs/hosts.md, 4)
            await asyncio.shield(asyncio.ensure_future(self.clock.dep_sleep(int(step["late"]))))
            return
        if step.get("after"):
            await self.clock.dep_sleep(int(step["after"]))

    async def _cancelled(self, i: int, step: dict[str, Any], rec: dict[str, Any]) -> None:
        """The attempt was cancelled. In a hedged call the trace says so when it was not its own
        timeout (a hedge cancel or the caller's); an `unwind` step then takes that long to close
        (the host reports it only then), and `closed` says when."""
        rec["end"] = self.clock.monotonic_ns()
        if not self.scn["calls"][i].get("hedge"):
            return
        left = levee.attempt_timeout()
        if left is None or left > 0:
            rec["cancelled"] = True
        if step.get("unwind"):
            await self.clock.dep_sleep(int(step["unwind"]))
            rec["closed"] = self.clock.monotonic_ns()

    def _closed(self, rec: dict[str, Any]) -> None:
        rec.setdefault("end", self.clock.monotonic_ns())
        self.live -= 1
        if not self.live:
            self.quiet.set()

    def _play_sync(self, i: int, step: dict[str, Any]) -> None:
        ns = int(step["late"]) if "late" in step else int(step.get("after", 0))
        if step.get("hang"):
            raise ScenarioError("a hang cannot be replayed synchronously")
        if ns:
            self.clock.dep_sleep_sync(ns)

    def _answer(self, step: dict[str, Any]) -> Any:
        if "raise" in step:
            raise error_class(step["raise"])("scripted failure")
        if step.get("refuse"):
            raise ConnectionRefusedError(111, "Connection refused")
        if step.get("connect_timeout") or step.get("tls_certificate"):
            raise ScenarioError("connect_timeout and tls_certificate are steps of http calls")
        return step.get("return")

    def _http_answer(self, step: dict[str, Any], request: httpx.Request) -> httpx.Response:
        if "raise" in step:
            raise error_class(step["raise"])("scripted failure")
        if step.get("refuse"):
            raise httpx.ConnectError("[Errno 111] Connection refused", request=request) from ConnectionRefusedError(
                111, "Connection refused"
            )
        if step.get("connect_timeout"):
            raise httpx.ConnectTimeout("timed out while connecting", request=request)
        if step.get("tls_certificate"):
            cause = ssl.SSLCertVerificationError(1, "[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed")
            raise httpx.ConnectError(str(cause), request=request) from cause
        if "status" in step:
            return httpx.Response(int(step["status"]), headers=step.get("headers") or {})
        return httpx.Response(200)

    def _seen(self, i: int, request: httpx.Request) -> None:
        wanted = ("x-levee-attempt", "idempotency-key", "x-idempotency-key")
        self.requests[i].append({k: request.headers[k] for k in wanted if k in request.headers})

    # ------------------------------------------------------------ the calls

    def _handle(self, i: int) -> levee.Policy:
        c = self.scn["calls"][i]
        trace = self.traces[i]

        def on_retry(info: levee.RetryInfo) -> None:
            trace["on_retry"].append({"attempt": info.attempt, "delay": info.delay, "error": outcome_name(info.error)})

        retry_if = self._predicate("call", list(c["retry_if"])) if "retry_if" in c else None
        return self.engine.policy(
            c["policy"],
            key=c.get("key", ""),
            idempotent=c.get("idempotent", True),
            idempotency_key=bool(c.get("idempotency_key")),
            on_retry=on_retry,
            # an HTTP call's predicate goes to the transport (`retry_if=`), a call's to its handle
            retry_if=retry_if if c.get("api", "call") != "http" else None,
        )

    def _http_predicate(self, i: int) -> Callable[[Any], bool | None] | None:
        c = self.scn["calls"][i]
        return self._predicate("call", list(c["retry_if"])) if "retry_if" in c else None

    def _request(self, c: dict[str, Any], client_body: Callable[[], Any]) -> dict[str, Any]:
        h = c["http"]
        kwargs: dict[str, Any] = {"headers": h.get("headers") or {}}
        body = h.get("body")
        if body == "bytes":
            kwargs["content"] = b"payload"
        elif body == "stream":
            kwargs["content"] = client_body()
        return kwargs

    async def _run_async(self, i: int) -> None:
        c = self.scn["calls"][i]
        CALL.set(i)
        if c.get("at"):
            await self.clock.dep_sleep(int(c["at"]))
        trace = self.traces[i]
        try:
            with faults(self.engine, *_faults(c)):
                if c.get("api", "call") == "http":
                    trace["result"] = await self._http_async(i, c)
                else:
                    trace["result"] = await self._call_async(i)
        except asyncio.CancelledError:
            trace["result"] = {"cancelled": True}
        except levee.CallFailed as e:
            trace["result"] = self._failed(e)
        except ScenarioError:
            raise
        except Exception as e:
            trace["result"] = {"raised": type(e).__name__}

    async def _call_async(self, i: int) -> dict[str, Any]:
        @self._handle(i)
        async def dependency() -> Any:
            step, rec = self._begin_attempt(i)
            self.live += 1
            try:
                await self._play(i, step)
                return self._answer(step)
            except asyncio.CancelledError:
                await self._cancelled(i, step, rec)
                raise
            finally:
                self._closed(rec)

        return {"value": await dependency()}

    async def _http_async(self, i: int, c: dict[str, Any]) -> dict[str, Any]:
        async def handler(request: httpx.Request) -> httpx.Response:
            step, rec = self._begin_attempt(i)
            self._seen(i, request)
            self.live += 1
            try:
                await request.aread()
                await self._play(i, step)
                return self._http_answer(step, request)
            except asyncio.CancelledError:
                await self._cancelled(i, step, rec)
                raise
            finally:
                self._closed(rec)

        async def stream() -> AsyncIterator[bytes]:
            yield b"part-1"
            yield b"part-2"

        transport = AsyncLeveeTransport(self.engine, self._handle(i), transport=httpx.MockTransport(handler),
                                        retry_if=self._http_predicate(i))  # fmt: skip
        async with httpx.AsyncClient(transport=transport) as client:
            h = c["http"]
            response = await client.request(h["method"], h["url"], **self._request(c, stream))
        return {"status": response.status_code}

    def _failed(self, e: levee.CallFailed) -> dict[str, Any]:
        return {
            "error": {"reason": e.reason.wit, "attempts": e.attempts, "last": outcome_name(e.last_error, e.last_result)}
        }

    # ------------------------------------------------------------ sync

    def _run_sync(self, i: int) -> None:
        c = self.scn["calls"][i]
        token = CALL.set(i)
        trace = self.traces[i]
        at = int(c.get("at", 0))
        if self.clock.monotonic_ns() > at:
            raise ScenarioError("calls overlap: not replayable synchronously")
        self.clock.dep_sleep_sync(at - self.clock.monotonic_ns())
        try:
            with faults(self.engine, *_faults(c)):
                if c.get("api", "call") == "http":
                    trace["result"] = self._http_sync(i, c)
                else:
                    trace["result"] = self._call_sync(i)
        except levee.CallFailed as e:
            trace["result"] = self._failed(e)
        except ScenarioError:
            raise
        except Exception as e:
            trace["result"] = {"raised": type(e).__name__}
        finally:
            CALL.reset(token)

    def _call_sync(self, i: int) -> dict[str, Any]:
        @self._handle(i)
        def dependency() -> Any:
            step, rec = self._begin_attempt(i)
            try:
                self._play_sync(i, step)
                return self._answer(step)
            finally:
                rec["end"] = self.clock.monotonic_ns()

        return {"value": dependency()}

    def _http_sync(self, i: int, c: dict[str, Any]) -> dict[str, Any]:
        def handler(request: httpx.Request) -> httpx.Response:
            step, rec = self._begin_attempt(i)
            self._seen(i, request)
            try:
                request.read()
                self._play_sync(i, step)
                return self._http_answer(step, request)
            finally:
                rec["end"] = self.clock.monotonic_ns()

        def stream() -> Iterator[bytes]:
            yield b"part-1"
            yield b"part-2"

        transport = LeveeTransport(self.engine, self._handle(i), transport=httpx.MockTransport(handler),
                                   retry_if=self._http_predicate(i))  # fmt: skip
        with httpx.Client(transport=transport) as client:
            h = c["http"]
            response = client.request(h["method"], h["url"], **self._request(c, stream))
        return {"status": response.status_code}

    # ------------------------------------------------------------ the trace

    def _finish(self) -> list[dict[str, Any]]:
        out = []
        for i, (c, t) in enumerate(zip(self.scn["calls"], self.traces, strict=True)):
            trace: dict[str, Any] = {"attempts": t["attempts"]}
            if c.get("api") == "http":
                trace["requests"] = self.requests[i]
            trace["sleeps"] = self.clock.sleeps.get(i, [])
            trace["fallbacks"] = t["fallbacks"]
            trace["result"] = t.get("result")
            events = []
            counters: dict[str, Any] = {}
            for e in self.sink.entries:
                if e.label != i:
                    continue
                if e.kind == "event":
                    attrs = {
                        k: v for k, v in e.attributes.items() if k not in ("levee.policy", "levee.key", "levee.call")
                    }
                    events.append({"name": e.name, **attrs})
                elif e.kind == "add":
                    k = metric_key(e.name, e.attributes)
                    counters[k] = counters.get(k, 0) + int(e.value)
                elif e.kind == "record":
                    k = metric_key(e.name, e.attributes)
                    h = counters.setdefault(k, {"count": 0, "sum": 0.0})
                    h["count"] += 1
                    h["sum"] += e.value
            trace["events"] = events
            trace["metrics"] = dict(sorted(counters.items()))
            trace["on_retry"] = t["on_retry"]
            if "retry_if" in c or self.scn.get("retry_if_policy") or "retry_if" in t:
                trace["retry_if"] = t.get("retry_if", [])
            out.append(trace)
        return out

    async def run_async(self) -> list[dict[str, Any]]:
        tasks = [asyncio.create_task(self._run_async(i)) for i in range(len(self.scn["calls"]))]

        async def canceller(i: int, at: int) -> None:
            await self.clock.dep_sleep(at)
            tasks[i].cancel()

        cancels = [
            asyncio.create_task(canceller(i, int(c["cancel_at"])))
            for i, c in enumerate(self.scn["calls"])
            if "cancel_at" in c
        ]
        try:
            done, pending = await asyncio.wait(tasks, timeout=REAL_TIMEOUT)
            if pending:
                for t in pending:
                    t.cancel()
                raise ScenarioError("deadlock: a call is blocked with no timer pending")
            for t in done:
                t.result()  # a ScenarioError
            # attempts a hedged call cancelled close (and are reported) after the call ended
            while self.live:
                self.quiet.clear()
                await asyncio.wait_for(self.quiet.wait(), REAL_TIMEOUT)
            for _ in range(3):
                await asyncio.sleep(0)  # their reports run in the tasks' done callbacks
        finally:
            for t in cancels:
                t.cancel()
        return self._finish()

    def run_sync(self) -> list[dict[str, Any]]:
        order = sorted(range(len(self.scn["calls"])), key=lambda i: int(self.scn["calls"][i].get("at", 0)))
        for i in order:
            self._run_sync(i)
        return self._finish()


def sync_replayable(scn: dict[str, Any]) -> bool:
    """Whether the synchronous API can replay the scenario: calls one after another (each ends
    before the next starts), no cancel, no hang, no late step, no step that its timeout cuts."""
    calls = scn["calls"]
    ends: list[tuple[int, int]] = []
    for c in calls:
        if "cancel_at" in c or "expect" not in c or c.get("hedge"):
            return False  # a hedged call's attempts overlap: the sync API runs them in threads
        attempts = c["expect"].get("attempts", [])
        for step, a in zip(c["script"], attempts, strict=False):
            if step.get("hang") or "late" in step:
                return False
            if "end" in a and a["end"] - a["at"] < int(step.get("after", 0)):
                return False
        at = int(c.get("at", 0))
        last = max([a.get("end", at) for a in attempts] + [at])
        ends.append((at, last))
    ends.sort()
    return all(ends[k][1] <= ends[k + 1][0] for k in range(len(ends) - 1))


def replay(scn: dict[str, Any], sync: bool = False) -> list[dict[str, Any]]:
    r = Replay(scn, sync)
    if sync:
        return r.run_sync()
    return asyncio.run(r.run_async())


def compare(expect: dict[str, Any], got: dict[str, Any]) -> list[str]:
    """The fields of `expect` that `got` does not match (a field left out is not checked)."""
    diffs = []
    for k, v in expect.items():
        if got.get(k) != v:
            diffs.append(f"{k}: expected {json.dumps(v)}, got {json.dumps(got.get(k))}")
    return diffs


def load_generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("levee_host_scenarios", SCENARIOS / "scenarios.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def scenario_files() -> list[Path]:
    return sorted(p for p in SCENARIOS.glob("*.json") if p.name != "schema.json")


def bless() -> int:
    """Replay every generated scenario, check its intent, write it with its trace."""
    gen = load_generator()
    failures = 0
    written = 0
    for scn in gen.build():
        name = scn["name"]
        try:
            traces = replay(scn)
            gen.check_intent(scn, traces)
        except AssertionError as e:
            print(f"NOT BLESSED {name}: {e}")
            failures += 1
            continue
        for c, t in zip(scn["calls"], traces, strict=True):
            c["expect"] = t
        if sync_replayable(scn):
            sync_traces = replay(scn, sync=True)
            for k, (c, t) in enumerate(zip(scn["calls"], sync_traces, strict=True)):
                d = compare(c["expect"], t)
                if d:
                    print(f"NOT BLESSED {name}: call {k}: the sync API disagrees: {'; '.join(d)}")
                    failures += 1
                    break
            else:
                gen.write(scn)
                written += 1
                continue
            continue
        gen.write(scn)
        written += 1
    gen.remove_stale()
    print(f"blessed {written} scenarios, {failures} refused")
    return 1 if failures else 0


def check_all() -> int:
    bad = 0
    for path in scenario_files():
        scn = json.loads(path.read_text())
        modes = [False] + ([True] if sync_replayable(scn) else [])
        for sync in modes:
            try:
                traces = replay(scn, sync)
            except AssertionError as e:
                print(f"FAIL {path.name} ({'sync' if sync else 'async'}): {e}")
                bad += 1
                continue
            for k, (c, t) in enumerate(zip(scn["calls"], traces, strict=True)):
                d = compare(c.get("expect", {}), t)
                if d:
                    print(f"FAIL {path.name} ({'sync' if sync else 'async'}) call {k}: " + "; ".join(d))
                    bad += 1
    print(f"{len(scenario_files())} scenarios, {bad} failures")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(bless() if os.environ.get("LEVEE_BLESS") else check_all())

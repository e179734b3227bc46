"""Replay every conformance vector through the component with the Python binding (`levee._abi`).

Each step's result is rendered as JSON exactly as the Rust runner renders it
(`conformance/runner/src/lib.rs`) and compared the same way: an object expectation compares
the fields it names (recursively), everything else compares exactly. Blessed vectors name
every field, so every verdict and every event is compared in full.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from levee._abi import Core, LoadErrors
from levee.engine import _runtime
from levee.types import (
    BreakerState,
    ClaimedCall,
    DurableStep,
    ExecAbandon,
    ExecClaim,
    ExecClaimed,
    ExecClaimFailed,
    ExecCommand,
    ExecDueIn,
    ExecEvent,
    ExecFinished,
    ExecIdle,
    ExecLog,
    ExecNextDue,
    ExecPoll,
    ExecQuarantine,
    ExecRenew,
    ExecRun,
    ExecSleep,
    ExecutorConfig,
    ExecWritten,
    LoadError,
    OutcomeKind,
    Reason,
    RowWrite,
    Verdict,
    VerdictKind,
    WriteFailed,
    WriteResult,
)

VECTORS = Path(os.environ.get("LEVEE_VECTORS_DIR") or Path(__file__).resolve().parents[3] / "conformance" / "vectors")

# Vectors this host may skip, each with a reason. None today.
SKIP: dict[str, str] = {}

UNKNOWN_POLICY = 4294967295


def _files() -> list[Path]:
    return sorted(VECTORS.glob("*.json"))


def test_vectors_exist() -> None:
    assert _files(), f"no conformance vectors in {VECTORS}"


def matches(expected: Any, actual: Any) -> bool:
    """The Rust runner's `matches_expectation`."""
    if isinstance(expected, dict) and isinstance(actual, dict):
        return all(k in actual and matches(v, actual[k]) for k, v in expected.items())
    if isinstance(expected, list) and isinstance(actual, list):
        return len(expected) == len(actual) and all(matches(x, y) for x, y in zip(expected, actual, strict=True))
    if isinstance(expected, bool) or isinstance(actual, bool):
        return type(expected) is type(actual) and expected == actual
    return bool(expected == actual)


def verdict_json(raw: int) -> dict[str, Any]:
    v = Verdict.unpack(raw)
    kind = v.kind.wit if isinstance(v.kind, VerdictKind) else "?"
    out: dict[str, Any] = {"verdict": raw, "kind": kind, "detail": v.detail}
    if v.kind in (VerdictKind.WAIT, VerdictKind.RETRY, VerdictKind.FALLBACK, VerdictKind.FAIL):
        out["reason"] = Reason.from_code(v.detail).wit
    out["payload"] = v.payload
    out["events_pending"] = v.events_pending
    return out


def hedge_json(commands: list[Any], events_pending: bool) -> dict[str, Any]:
    """The Rust runner's `hedge_json`: `{"commands": [...], "events_pending": b}`."""
    out: list[Any] = []
    for case, val in commands:
        if case == "start":
            out.append({"start": {"attempt": val["attempt"], "timeout": val["timeout"]}})
        elif case == "end":
            out.append({"end": {"attempt": val["attempt"], "verdict": verdict_json(val["verdict"])}})
        else:
            out.append({case: val})
    return {"commands": out, "events_pending": events_pending}


def event_json(raw: dict[str, Any]) -> dict[str, Any]:
    return {k.replace("-", "_"): v for k, v in raw.items()}


def row_json(w: RowWrite) -> dict[str, Any]:
    """The Rust runner's `row_json`."""
    return {
        "id": w.id,
        "status": w.status,
        "next_at": w.next_at,
        "attempts": w.attempts,
        "record_hex": w.record.hex(),
        "lease": w.lease,
        "keep_result": w.keep_result,
        "error": w.error,
    }


def command_json(c: ExecCommand) -> Any:
    """The Rust runner's `commands_json`, one command."""
    if isinstance(c, ExecClaim):
        return {"claim": {"limit": c.limit, "hold": c.hold}}
    if isinstance(c, RowWrite):
        return {"write": row_json(c)}
    if isinstance(c, ExecRun):
        return {"run": {"id": c.id, "attempt": c.attempt, "timeout": c.timeout, "renew_every": c.renew_every}}
    if isinstance(c, ExecAbandon):
        return {"abandon": c.id}
    if isinstance(c, ExecQuarantine):
        return {"quarantine": {"id": c.id, "error": c.error}}
    if isinstance(c, ExecNextDue):
        return "next_due"
    if isinstance(c, ExecSleep):
        return {"sleep": c.until}
    if isinstance(c, ExecIdle):
        return "idle"
    assert isinstance(c, ExecLog)
    return {"log": {"level": c.level, "id": c.id, "text": c.text}}


class Runner:
    def __init__(self, vector: dict[str, Any], core: Core) -> None:
        self.vector = vector
        self.core = core
        # The record of the last durable step that succeeded (steps without `record_hex` use it).
        self.record = b""
        self.shared = b""
        # The trace's executor (an `executor` step makes it), a resource handle of `core`.
        self.executor = 0

    def policy(self, step: dict[str, Any]) -> int:
        name = step.get("policy")
        idx = self.core.policy_index(name) if isinstance(name, str) else None
        return UNKNOWN_POLICY if idx is None else idx

    def run(self, step: dict[str, Any]) -> tuple[bool, Any]:
        """Run one step; returns (has_result, result as JSON)."""
        op = step["op"]
        c = self.core

        def u(field: str) -> int:
            value = step.get(field, 0)
            return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0

        def s(field: str) -> str:
            value = step.get(field, "")
            return value if isinstance(value, str) else ""

        if op == "start":
            p = self.policy(step)
            flags = u("flags")
            return True, verdict_json(
                c.start(u("call"), p, s("key"), flags, u("now"), u("settle_call"), u("settle_at"), u("settle_elapsed"))
            )
        if op == "acquire":
            return True, verdict_json(c.acquire(u("call"), u("now")))
        if op == "report":
            code = step.get("code", 0)
            return True, verdict_json(
                c.report(
                    u("call"),
                    u("now"),
                    u("elapsed"),
                    OutcomeKind(s("kind")),
                    code if isinstance(code, int) else 0,
                    s("text"),
                    u("wall_secs"),
                    u("flags"),
                )
            )
        if op == "report_fallback":
            return True, verdict_json(c.report_fallback(u("call"), u("now"), step.get("ok") is True))
        if op == "hedge_step":
            return True, hedge_json(*c.hedge_step(u("call"), u("now")))
        if op == "report_attempt":
            code = step.get("code", 0)
            return True, hedge_json(
                *c.report_attempt(
                    u("call"),
                    u("attempt"),
                    u("now"),
                    u("elapsed"),
                    OutcomeKind(s("kind")),
                    code if isinstance(code, int) else 0,
                    s("text"),
                    u("wall_secs"),
                    u("flags"),
                )
            )
        if op == "cancel":
            c.cancel(u("call"), u("now"))
            return False, None
        if op == "drain_events":
            return True, [event_json(e) for e in c.drain_events()]
        if op == "take_wakes":
            return True, c.take_wakes()
        if op == "breaker_state":
            p = self.policy(step)
            st = c.breaker_state(p, s("key"), u("now"))
            return True, None if st is None else st.wit
        if op == "set_breaker_state":
            p = self.policy(step)
            err = c.set_breaker_state(p, s("key"), BreakerState(s("state")), u("now"))
            return True, {"ok": None} if err is None else {"err": err}
        if op == "call_info":
            ci = c.call_info(u("call"))
            if ci is None:
                return True, None
            return True, {
                "policy": ci.policy,
                "key": ci.key,
                "attempts": ci.attempts,
                "deadline": ci.deadline,
                "last_reason": ci.last_reason.wit,
                "in_flight": ci.in_flight,
            }
        if op == "policy_info":
            pi = c.policy_info(self.policy(step))
            if pi is None:
                return True, None
            return True, {
                "name": pi.name,
                "max_attempts": pi.max_attempts,
                "attempt_timeout": pi.attempt_timeout,
                "deadline": pi.deadline,
                "fallbacks": list(pi.fallbacks),
            }
        if op == "analyze":
            an = c.analyze(self.policy(step), u("layers"))
            if an is None:
                return True, None
            return True, {
                "worst_attempts": an.worst_attempts,
                "worst_latency": an.worst_latency,
                "amplification": an.amplification,
                "amplification_with_budget": an.amplification_with_budget,
            }
        if op in ("export_import", "snapshot_import"):
            # snapshot_import: the bytes of export-snapshot (only the keys holding protection)
            state = c.export_state() if op == "export_import" else c.export_snapshot()
            fresh = Core(_runtime(None), self.vector["document"], int(self.vector["seed"]))
            bad = fresh.import_state(state)
            assert bad is None, f"import_state of an export failed: {bad}"
            c.close()
            self.core = fresh
            return False, None
        if op == "reload":
            errs = c.reload(s("document"))
            if errs is None:
                return True, {"ok": None}
            return True, {"err": [{"path": e.path, "message": e.message} for e in errs]}
        if op == "import_state":
            ierr = c.import_state(bytes.fromhex(s("bytes_hex")))
            if ierr is None:
                return True, {"ok": None}
            return True, {"err": {"path": ierr.path, "message": ierr.message}}
        if op.startswith("durable_"):
            return True, self.durable(op, step, u, s)
        if op == "executor" or op.startswith("exec_"):
            return self.exec(op, step, u, s)
        if op.startswith("fleet_"):
            return True, self.fleet(op, step, u, s)
        raise AssertionError(f"unknown op {op!r}")

    def exec(self, op: str, step: dict[str, Any], u: Callable[[str], int], s: Callable[[str], str]) -> tuple[bool, Any]:
        """The executor steps (conformance/README.md, "Executor steps"): the record flows as
        the Rust runner's does (a claimed row or an operator without `record_hex` carries the
        trace's record; the last `write` an executor step answers becomes it)."""
        c = self.core

        def i(field: str, v: dict[str, Any] = step) -> int:
            value = v.get(field, 0)
            return value if isinstance(value, int) and not isinstance(value, bool) else 0

        def record(v: dict[str, Any]) -> bytes:
            h = v.get("record_hex")
            return bytes.fromhex(h) if isinstance(h, str) else self.record

        if op == "executor":
            cfg = step["config"]
            if self.executor:
                c.executor_drop(self.executor)
            self.executor = c.executor_new(
                ExecutorConfig(
                    owner=str(cfg.get("owner", "")),
                    concurrency=i("concurrency", cfg),
                    poll=i("poll", cfg),
                    claim_hold=i("claim_hold", cfg),
                    until_idle=cfg.get("until_idle") is True,
                )
            )
            for name in step.get("register", []):
                c.executor_register(self.executor, str(name))
            return False, None
        if op == "exec_operator":
            r = c.executor_operator(i("id"), record(step), step.get("revive") is True, u("wall_now"))
            if isinstance(r, LoadError):
                return True, {"err": {"path": r.path, "message": r.message}}
            self.record = r.record
            out = row_json(r)
            out["id"] = i("id")
            return True, {"ok": out}
        assert self.executor, f"{op} before the `executor` step"
        if op == "exec_forget":
            c.executor_forget(self.executor, i("id"))
            return False, None
        if op == "exec_running":
            return True, c.executor_running(self.executor)
        event: ExecEvent
        if op == "exec_poll":
            event = ExecPoll()
        elif op == "exec_claim_failed":
            event = ExecClaimFailed(s("error"))
        elif op == "exec_claimed":
            rows = step["rows"]
            event = ExecClaimed(
                tuple(ClaimedCall(i("id", r), str(r.get("handler", "")), record(r), i("db_now", r)) for r in rows)
            )
        elif op == "exec_next_due":
            due = step.get("due_in")
            event = ExecDueIn(due if isinstance(due, int) and not isinstance(due, bool) else None)
        elif op == "exec_written":
            res = step.get("result")
            result: WriteResult
            if res == "applied" or res == "lost":
                result = res
            elif isinstance(res, dict) and "failed" in res:
                result = WriteFailed(str(res["failed"]))
            else:
                raise AssertionError(f'`result` must be "applied", "lost" or {{"failed": text}}, found {res!r}')
            event = ExecWritten(i("id"), result)
        elif op == "exec_renew":
            event = ExecRenew(i("id"))
        elif op == "exec_finished":
            event = ExecFinished(i("id"), OutcomeKind(s("kind")), i("code"), s("text"), s("message"), u("flags"))
        else:
            raise AssertionError(f"unknown op {op!r}")
        commands = c.executor_feed(self.executor, u("now"), event)
        writes = [w for w in commands if isinstance(w, RowWrite)]
        if writes:
            self.record = writes[-1].record
        return True, [command_json(x) for x in commands]

    def fleet(self, op: str, step: dict[str, Any], u: Callable[[str], int], s: Callable[[str], str]) -> Any:
        """The fleet steps (levee.fleet): the shared bytes flow as the Rust runner's do."""
        c = self.core
        shared = bytes.fromhex(s("shared_hex")) if "shared_hex" in step else self.shared
        if op == "fleet_plan":
            return c.fleet_plan(self.policy(step))
        if op == "fleet_inspect":
            text = c.fleet_inspect(shared)
            return (
                {"err": {"path": text.path, "message": text.message}} if isinstance(text, LoadError) else {"ok": text}
            )
        args = (self.policy(step), s("key"), s("node"), u("now"), u("wall_ms"), shared)
        if op == "fleet_apply":
            err = c.fleet_apply(*args)
            return {"ok": None} if err is None else {"err": {"path": err.path, "message": err.message}}
        if op != "fleet_merge":
            raise AssertionError(f"unknown op {op!r}")
        merged = c.fleet_merge(*args)
        if isinstance(merged, LoadError):
            return {"err": {"path": merged.path, "message": merged.message}}
        state = c.fleet_inspect(merged)
        assert isinstance(state, str), state
        self.shared = merged
        return {"ok": {"hex": merged.hex(), "state": json.loads(state)}}

    def durable(self, op: str, step: dict[str, Any], u: Callable[[str], int], s: Callable[[str], str]) -> Any:
        c = self.core
        rec = bytes.fromhex(s("record_hex")) if "record_hex" in step else self.record
        r: DurableStep | LoadError | str
        if op == "durable_begin":
            r = c.durable_begin(self.policy(step), s("key"), s("idempotency_key"), u("flags"), u("wall_now"))
        elif op == "durable_step":
            r = c.durable_step(rec, s("owner"), u("wall_now"), u("elapsed"))
        elif op == "durable_renew":
            r = c.durable_renew(rec, s("owner"), u("wall_now"), u("elapsed"))
        elif op == "durable_outcome":
            code = step.get("code", 0)
            r = c.durable_outcome(
                rec,
                s("owner"),
                u("wall_now"),
                u("elapsed"),
                OutcomeKind(s("kind")),
                code if isinstance(code, int) else 0,
                s("text"),
                s("message"),
                u("flags"),
            )
        elif op == "durable_cancel":
            r = c.durable_cancel(rec, u("wall_now"))
        elif op == "durable_revive":
            r = c.durable_revive(rec, u("wall_now"))
        elif op == "durable_inspect":
            r = c.durable_inspect(rec)
        else:
            raise AssertionError(f"unknown op {op!r}")
        if isinstance(r, LoadError):
            return {"err": {"path": r.path, "message": r.message}}
        if isinstance(r, str):
            return {"ok": r}
        self.record = r.record
        return {
            "ok": {
                "action": r.action.value,
                "attempt": r.attempt,
                "wait": r.wait,
                "timeout": r.timeout,
                "next_at": r.next_at,
                "lease_until": r.lease_until,
                "reason": r.reason.value,
                "policy_changed": r.policy_changed,
                "record_hex": r.record.hex(),
            }
        }


@pytest.mark.parametrize("path", _files(), ids=lambda p: p.stem)
def test_vector(path: Path) -> None:
    vector = json.loads(path.read_text(encoding="utf-8"))
    name = vector["name"]
    if name in SKIP:
        pytest.skip(SKIP[name])
    assert name == path.stem
    expected_errors = vector.get("load_errors")
    try:
        core = Core(_runtime(None), vector["document"], int(vector["seed"]))
    except LoadErrors as e:
        actual = [{"path": x.path, "message": x.message} for x in e.errors]
        assert expected_errors is not None, f"{name}: the document did not load: {actual}"
        assert expected_errors == actual, f"{name}: load errors differ"
        return
    assert expected_errors is None, f"{name}: the document loaded but errors were expected"
    runner = Runner(vector, core)
    mismatches = []
    for i, step in enumerate(vector["steps"]):
        has_result, actual = runner.run(step)
        if has_result and "expect" in step and not matches(step["expect"], actual):
            mismatches.append(f"{name} step {i} ({step['op']}): expected {step['expect']}, got {actual}")
    runner.core.close()
    assert not mismatches, "\n".join(mismatches)

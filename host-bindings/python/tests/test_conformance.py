"""Replay every conformance vector through the component, with the Python binding (`levee._abi`),
and compare every verdict, event and result exactly."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from levee._abi import Core, LoadErrors
from levee.engine import _runtime
from levee.types import OutcomeKind, Verdict, VerdictKind

VECTORS = Path(os.environ.get("LEVEE_VECTORS_DIR") or Path(__file__).resolve().parents[3] / "conformance" / "vectors")

# Vectors this host may skip, each with a reason. None today.
SKIP: dict[str, str] = {}

UNKNOWN_POLICY = 4294967295


def _files() -> list[Path]:
    return sorted(VECTORS.glob("*.json"))


def test_vectors_exist() -> None:
    assert _files(), f"no conformance vectors in {VECTORS}"


def _snake(d: dict[str, Any]) -> dict[str, Any]:
    return {k.replace("-", "_"): v for k, v in d.items()}


def _check_verdict(got: int, expect: dict[str, Any], where: str) -> None:
    want = int(expect["verdict"])
    if got != want:
        g, w = Verdict.unpack(got), Verdict.unpack(want)
        raise AssertionError(f"{where}: verdict {got} ({g}) != expected {want} ({w})")
    # the decoding written in the vector must agree with the packed value
    v = Verdict.unpack(got)
    kind = v.kind.wit if isinstance(v.kind, VerdictKind) else str(v.kind)
    assert expect.get("kind", kind) == kind, where
    assert expect.get("detail", v.detail) == v.detail, where
    assert expect.get("payload", v.payload) == v.payload, where
    assert expect.get("events_pending", v.events_pending) == v.events_pending, where


class Runner:
    def __init__(self, vector: dict[str, Any]) -> None:
        self.vector = vector
        self.rt = _runtime(None)
        self.core = Core(self.rt, vector["document"], int(vector["seed"]))

    def policy(self, name: str) -> int:
        idx = self.core.policy_index(name)
        return UNKNOWN_POLICY if idx is None else idx

    def step(self, i: int, step: dict[str, Any]) -> None:
        op = step["op"]
        where = f"{self.vector['name']} step {i} ({op})"
        expect: Any = step.get("expect")
        c = self.core
        if op == "start":
            got = c.start(
                int(step["call"]), self.policy(step["policy"]), step.get("key", ""), int(step.get("flags", 0)),
                int(step["now"]), int(step.get("settle_call", 0)), int(step.get("settle_at", 0)),
                int(step.get("settle_elapsed", 0)),
            )  # fmt: skip
            _check_verdict(got, expect, where)
        elif op == "acquire":
            _check_verdict(c.acquire(int(step["call"]), int(step["now"])), expect, where)
        elif op == "report":
            got = c.report(
                int(step["call"]),
                int(step["now"]),
                int(step["elapsed"]),
                OutcomeKind(step["kind"]),
                int(step.get("code", 0)),
                step.get("text", ""),
                int(step.get("wall_secs", 0)),
                int(step.get("flags", 0)),
            )
            _check_verdict(got, expect, where)
        elif op == "report_fallback":
            _check_verdict(c.report_fallback(int(step["call"]), int(step["now"]), bool(step["ok"])), expect, where)
        elif op == "cancel":
            c.cancel(int(step["call"]), int(step["now"]))
        elif op == "drain_events":
            events = [_snake(e) for e in c.drain_events()]
            assert events == expect, f"{where}: events differ\n got: {events}\nwant: {expect}"
        elif op == "breaker_state":
            st = c.breaker_state(self.policy(step["policy"]), step.get("key", ""), int(step["now"]))
            assert (None if st is None else st.wit) == expect, where
        elif op == "set_breaker_state":
            from levee.types import BreakerState

            serr = c.set_breaker_state(
                self.policy(step["policy"]), step.get("key", ""), BreakerState(step["state"]), int(step["now"])
            )
            assert ({"ok": None} if serr is None else {"err": serr}) == expect, where
        elif op == "call_info":
            info = c.call_info(int(step["call"]))
            got_info = None
            if info is not None:
                got_info = {
                    "policy": info.policy, "key": info.key, "attempts": info.attempts, "deadline": info.deadline,
                    "last_reason": info.last_reason.wit, "in_flight": info.in_flight,
                }  # fmt: skip
            assert got_info == expect, where
        elif op == "policy_info":
            pi = c.policy_info(self.policy(step["policy"]))
            got_pi = None
            if pi is not None:
                got_pi = {
                    "name": pi.name, "max_attempts": pi.max_attempts, "attempt_timeout": pi.attempt_timeout,
                    "deadline": pi.deadline, "fallbacks": list(pi.fallbacks),
                }  # fmt: skip
            assert got_pi == expect, where
        elif op == "analyze":
            an = c.analyze(self.policy(step["policy"]), int(step["layers"]))
            got_an = None
            if an is not None:
                got_an = {
                    "worst_attempts": an.worst_attempts, "worst_latency": an.worst_latency,
                    "amplification": an.amplification, "amplification_with_budget": an.amplification_with_budget,
                }  # fmt: skip
            assert got_an == expect, where
        elif op == "export_import":
            state = c.export_state()
            fresh = Core(self.rt, self.vector["document"], int(self.vector["seed"]))
            err = fresh.import_state(state)
            assert err is None, f"{where}: import of exported state failed: {err}"
            c.close()
            self.core = fresh
        elif op == "reload":
            errs = c.reload(step["document"])
            got_r: dict[str, Any] = (
                {"ok": None} if errs is None else {"err": [{"path": e.path, "message": e.message} for e in errs]}
            )
            assert got_r == expect, where
        elif op == "import_state":
            ierr = c.import_state(bytes.fromhex(step["bytes_hex"]))
            got_i: dict[str, Any] = (
                {"ok": None} if ierr is None else {"err": {"path": ierr.path, "message": ierr.message}}
            )
            assert got_i == expect, where
        else:
            raise AssertionError(f"{where}: unknown op {op!r}")


@pytest.mark.parametrize("path", _files(), ids=lambda p: p.stem)
def test_vector(path: Path) -> None:
    vector = json.loads(path.read_text(encoding="utf-8"))
    if vector["name"] in SKIP:
        pytest.skip(SKIP[vector["name"]])
    assert vector["name"] == path.stem
    if vector.get("load_errors") is not None:
        with pytest.raises(LoadErrors) as info:
            Core(_runtime(None), vector["document"], int(vector["seed"]))
        got = [{"path": e.path, "message": e.message} for e in info.value.errors]
        assert got == vector["load_errors"]
        return
    runner = Runner(vector)
    for i, step in enumerate(vector["steps"]):
        runner.step(i, step)
    runner.core.close()

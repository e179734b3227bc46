"""The hand-written binding's two `start` crossings: `start-unkeyed` (no key: the engine named
by its id) and `engine.start` (a key: the engine's handle lent). The vector replay covers
their decisions; these pin what the replay cannot tell apart."""

from __future__ import annotations

import pytest

from levee._abi import Core
from levee.engine import _runtime
from levee.types import BreakerState, Verdict, VerdictKind

SLOW = """
policies:
  p:
    attempts: 1
    breaker: { window: { kind: count, size: 3 }, minimum-calls: 3, slow-call-rate: 60, slow-call-duration: 1s }
"""
S = 1_000_000_000


def test_unkeyed_start_names_the_engine_by_its_id() -> None:
    core = Core(_runtime(None), SLOW, 1)
    try:
        assert Verdict.unpack(core.start(1, 0, "", 0, S, 0, 0, 0)).kind is VerdictKind.ATTEMPT
        core._uw[1] = core.id + 1  # an id that names no engine of the instance
        v = Verdict.unpack(core.start(2, 0, "", 0, S, 0, 0, 0))
        assert (v.kind, v.detail) == (VerdictKind.INVALID, 5)  # unknown-engine: `start-unkeyed` answered
        # a keyed start lends the handle instead, so the id does not matter to it
        assert Verdict.unpack(core.start(3, 0, "k", 0, S, 0, 0, 0)).kind is VerdictKind.ATTEMPT
    finally:
        core.close()


@pytest.mark.parametrize("key", ["", "k"], ids=["unkeyed", "keyed"])
@pytest.mark.parametrize(
    ("elapsed", "state"), [(2 * S, BreakerState.OPEN), (S // 1000, BreakerState.CLOSED)], ids=["slow", "fast"]
)
def test_successes_settled_by_start_reach_the_core(key: str, elapsed: int, state: BreakerState) -> None:
    """Three successes held back and settled by the next `start`: slow ones trip the breaker."""
    core = Core(_runtime(None), SLOW, 1)
    try:
        prev = 0
        for call in range(1, 5):
            now = call * 3 * S
            v = Verdict.unpack(core.start(call, 0, key, 0, now, prev, now, elapsed if prev else 0))
            assert v.kind is (VerdictKind.ATTEMPT if call < 4 or state is BreakerState.CLOSED else VerdictKind.FAIL)
            prev = call
        assert core.breaker_state(0, key, 20 * S) is state
    finally:
        core.close()

"""The cross-language demo: one policy against one URL, each decision on its own line.

python demo.py URL [policy-file] [policy-name]
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import httpx

import levee
from levee._events import describe
from levee.http import LeveeTransport

BUILTIN = """
policies:
  demo:
    attempts: 4
    attempt-timeout: 2s
    deadline: 20s
    backoff: { kind: exponential, base: 200ms, cap: 2s, jitter: full }
    breaker:
      window: { kind: count, size: 10 }
      minimum-calls: 5
      open-duration: 5s
"""


def main(argv: list[str]) -> int:
    url = argv[1]
    root = Path(__file__).resolve().parents[2]
    source = argv[2] if len(argv) > 2 else os.environ.get("LEVEE_DEMO_POLICY") or ""
    for shared in (root / "examples" / "demo" / "policy.yaml", root / "examples" / "demo.yaml"):
        if not source and shared.is_file():
            source = str(shared)
    # One seed for every host (examples/demo/run.sh passes LEVEE_DEMO_SEED): the same jitter.
    seed = int(os.environ.get("LEVEE_DEMO_SEED", "1"))
    engine = levee.load(Path(source), seed=seed) if source else levee.Engine(BUILTIN, seed=seed)
    name = argv[3] if len(argv) > 3 else ("demo" if "demo" in engine.policies else engine.policies[0])
    print(f"policy {name!r} -> {url}")
    n = 0
    pending: list[str] = []

    def trace(step: levee.TraceStep) -> None:
        nonlocal n
        n += 1
        outcome = "-"
        if step.outcome is not None:
            o = step.outcome
            outcome = o.kind.wit + (f" {o.code}" if o.code else "") + (f" ({o.text})" if o.text else "")
        print(
            f"step {n}: {step.op:15s} attempt={step.attempt} outcome={outcome:28s} verdict={step.verdict}", flush=True
        )

    engine.trace = trace
    engine.add_listener(lambda ev: pending.append(f"        event: {describe(ev)}"))
    with httpx.Client(transport=LeveeTransport(engine, name)) as client:
        try:
            r = client.get(url)
            print(f"result: HTTP {r.status_code}")
        except levee.CallFailed as e:
            print(f"result: gave up: {e}")
            return 1
        except httpx.HTTPError as e:
            print(f"result: {type(e).__name__}: {e}")
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

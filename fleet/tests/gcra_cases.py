"""Replay the core's GCRA cases (fleet/tests/gcra-cases.json, written by policy-core's
`fleet::gcra` tests) through fleet/lua/gcra.lua on a real Redis: every answer, granted count,
hint and stored TAT must be the core's, exactly."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import redis

ROOT = Path(__file__).resolve().parents[2]
host, port = sys.argv[1].split(":")
r = redis.Redis(host=host, port=int(port))
script = r.register_script((ROOT / "fleet" / "lua" / "gcra.lua").read_text())
cases = json.loads((ROOT / "fleet" / "tests" / "gcra-cases.json").read_text())
steps = 0
for i, case in enumerate(cases):
    key = f"levee-test:gcra:{i}"
    r.delete(key)
    for s in case["steps"]:
        args = [case["interval"], case["burst"], s["cost"], case["max_wait"], 1 if s["upto"] else 0, s["now"]]
        kind, granted, ns = script(keys=[key], args=args)
        tat = int(r.hget(key, "t") or 0)
        want = (s["kind"], s["granted"], s["ns"], s["tat"])
        if (kind, granted, ns, tat) != want:
            sys.exit(
                f"gcra case {i} at now={s['now']}: the script answered {(kind, granted, ns, tat)}, the core {want}"
            )
        steps += 1
    r.delete(key)
print(f"  ok    {len(cases)} traces, {steps} decisions: the script's answers, hints and TATs are the core's")

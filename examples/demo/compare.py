#!/usr/bin/env python3
"""Print the decisions of every host side by side and say whether they agree.

    python3 compare.py NAME=FILE [NAME=FILE ...]

Each FILE is what one host's demo.sh printed. The hosts print in their own styles; this
reads the decision out of each step line (`... -> attempt #1 (timeout 2s)`, or the Python
host's `verdict=retry(reason=none, ns=...)`) and the final result line. Every host runs with
the same seed (run.sh), so the hosts agree only when they make the same decisions in the same
order with the same delays: a retry's or wait's delay, to the millisecond every host prints,
is part of what is compared.
"""

from __future__ import annotations

import re
import sys


def _ms(text: str) -> str:
    m = re.match(r"([\d.]+)\s*(ns|us|µs|ms|s)\b", text)
    if not m:
        return text
    scale = {"ns": 1e-6, "us": 1e-3, "µs": 1e-3, "ms": 1.0, "s": 1e3}[m.group(2)]
    return f"{float(m.group(1)) * scale:.0f}ms"


def decision(line: str) -> tuple[str, str] | None:
    """(decision compared across hosts, text shown) or None for a line that is not a step."""
    m = re.search(r"verdict=([a-z-]+)(?:\((.*)\))?", line)
    if m:
        kind, args = m.group(1), m.group(2) or ""
        if kind == "attempt":
            n = re.search(r"n=(\d+)", args)
            d = f"attempt {n.group(1) if n else '?'}"
            return d, d
        if kind in ("retry", "wait"):
            ns = re.search(r"ns=(\d+)", args)
            delay = f"{int(ns.group(1)) / 1e6:.0f}ms" if ns else "?"
            return f"{kind} {delay}", f"{kind} {delay}"
        if kind == "fail":
            r = re.search(r"reason=([a-z-]+)", args)
            d = f"fail: {r.group(1) if r else '?'}"
            return d, d
        return kind, kind
    if "->" not in line or " event" in line or "event:" in line:
        return None
    tail = line.rsplit("->", 1)[1].strip()
    if m := re.match(r"attempt #?(\d+)", tail):
        d = f"attempt {m.group(1)}"
        return d, d
    if m := re.match(r"(retry|wait)(?: after)? (\S+)", tail):
        d = f"{m.group(1)} {_ms(m.group(2))}"
        return d, d
    if tail.startswith("done"):
        return "done", "done"
    if m := re.match(r"fail:?\s*([a-z-]+)", tail):
        d = f"fail: {m.group(1)}"
        return d, d
    if tail.startswith("fallback") or tail.startswith("fall back"):
        return "fallback", "fallback"
    return None


def result(line: str) -> str | None:
    if "result" not in line:
        return None
    if m := re.search(r"result:?\s*(?:http|HTTP)\s*(\d{3})", line):
        return f"HTTP {m.group(1)}"
    return "gave up" if "gave up" in line or "error" in line else None


def status(line: str) -> str | None:
    """The HTTP status an attempt got, from the part of a report line before its decision."""
    head = line.split("verdict=", 1)[0] if "verdict=" in line else line.rsplit("->", 1)[0]
    m = re.search(r"(?:http|HTTP)(?:-status)?\s+(\d{3})", head)
    return m.group(1) if m else None


def parse(path: str) -> tuple[list[tuple[str, str]], str]:
    steps: list[tuple[str, str]] = []
    final = "no result"
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            r = result(line)
            if r:
                final = r
                continue
            d = decision(line)
            if d:
                code = status(line)
                steps.append((f"{code}: {d[0]}", f"{code}: {d[1]}") if code else d)
    return steps, final


def main(argv: list[str]) -> int:
    hosts = [a.split("=", 1) for a in argv[1:] if "=" in a]
    if not hosts:
        print("no host ran", file=sys.stderr)
        return 1
    parsed = {name: parse(path) for name, path in hosts}
    width = max(20, *(len(n) for n, _ in hosts))
    names = [n for n, _ in hosts]
    print("step  " + "".join(n.ljust(width + 2) for n in names))
    rows = max(len(s) for s, _ in parsed.values())
    for i in range(rows):
        cells = []
        for n in names:
            steps = parsed[n][0]
            cells.append((steps[i][1] if i < len(steps) else "").ljust(width + 2))
        print(f"{i + 1:>4}  " + "".join(cells))
    print("  =>  " + "".join(parsed[n][1].ljust(width + 2) for n in names))
    sequences = {n: ([d for d, _ in parsed[n][0]], parsed[n][1]) for n in names}
    first = sequences[names[0]]
    if any(not s[0] for s in sequences.values()):
        empty = [n for n in names if not sequences[n][0]]
        print(f"\nno decisions read from: {', '.join(empty)} (see their output above)")
        return 1
    if all(s == first for s in sequences.values()):
        print(f"\nall {len(names)} host(s) agree: {' -> '.join(first[0])} => {first[1]}")
        return 0
    print("\nthe hosts DISAGREE:")
    for n in names:
        print(f"  {n}: {' -> '.join(sequences[n][0])} => {sequences[n][1]}")
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))

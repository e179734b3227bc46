#!/usr/bin/env python3
"""Write out the examples a README marks for the install tests, exactly as the README shows them.

    release/readme_example.py README.md OUT_DIR

A marker `<!-- install-test: FILE -->` on its own line names the file that the next fenced
code block is written to (under OUT_DIR). So the install tests run what a reader copies, and a
README edit that breaks its example breaks the test. Fails when a README has no marker.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

MARKER = re.compile(r"^<!-- install-test: (\S+) -->\s*$")
FENCE = re.compile(r"^(`{3,})")


def extract(readme: Path) -> dict[str, str]:
    lines = readme.read_text().splitlines()
    files: dict[str, str] = {}
    i = 0
    while i < len(lines):
        m = MARKER.match(lines[i])
        i += 1
        if not m:
            continue
        while i < len(lines) and not FENCE.match(lines[i]):
            i += 1
        if i == len(lines):
            sys.exit(f"{readme}: no code block after the marker for {m.group(1)}")
        fence = FENCE.match(lines[i]).group(1)  # type: ignore[union-attr]
        i += 1
        body: list[str] = []
        while i < len(lines) and not lines[i].startswith(fence):
            body.append(lines[i])
            i += 1
        files[m.group(1)] = "\n".join(body) + "\n"
    if not files:
        sys.exit(f"{readme}: no `<!-- install-test: FILE -->` marker")
    return files


def main() -> None:
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    out = Path(sys.argv[2])
    for name, text in extract(Path(sys.argv[1])).items():
        path = out / name
        if not path.resolve().is_relative_to(out.resolve()):
            sys.exit(f"{name}: outside {out}")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"readme_example: {sys.argv[1]} -> {path}")


if __name__ == "__main__":
    main()

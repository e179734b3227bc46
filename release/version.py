#!/usr/bin/env python3
"""One version number for every Levee package: VERSION at the repository root is the source.

    release/version.py            print it
    release/version.py check      fail (naming each file) when a manifest disagrees
    release/version.py set X.Y.Z  write it into VERSION and every manifest

The manifests that carry it: the Cargo workspace (`[workspace.package] version`, which
levee-core and levee-resilience inherit, and the `levee-core` workspace dependency), the
Python package (pyproject.toml and `levee.__version__`), the npm package (package.json and
its lock file), the Go module (`levee.Version`; the module's tag is `host-bindings/go/vX.Y.Z`)
and CHANGELOG.md (a `## X.Y.Z` heading). The WIT package version and the state-format
version are separate on purpose: docs/versioning.md.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SEMVER = re.compile(r"^(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)(-[0-9A-Za-z.-]+)?$")

# (file, pattern whose group 1 is the version, what it is)
PATTERNS: list[tuple[str, str, str]] = [
    ("Cargo.toml", r'(?ms)^\[workspace\.package\]\n(?:#[^\n]*\n)*version = "([^"]+)"', "[workspace.package] version"),
    ("Cargo.toml", r'(?m)^levee-core = \{ path = "policy-core", version = "([^"]+)" \}', "levee-core dependency"),
    ("host-bindings/python/pyproject.toml", r'(?m)^version = "([^"]+)"', "[project] version"),
    ("host-bindings/python/src/levee/__init__.py", r'(?m)^__version__ = "([^"]+)"', "__version__"),
    ("host-bindings/go/version.go", r'(?m)^const Version = "([^"]+)"', "levee.Version"),
    ("host-bindings/js/src/levee.ts", r"getMeter\('levee', '([^']+)'\)", "the OpenTelemetry meter's version"),
]


def read_version() -> str:
    v = (ROOT / "VERSION").read_text().strip()
    if not SEMVER.match(v):
        sys.exit(f"version: VERSION holds {v!r}, not a semantic version X.Y.Z[-pre]")
    return v


def found() -> list[tuple[str, str, str]]:
    """(file, what, version found or '' when missing)."""
    out: list[tuple[str, str, str]] = []
    for file, pattern, what in PATTERNS:
        m = re.search(pattern, (ROOT / file).read_text())
        out.append((file, what, m.group(1) if m else ""))
    pkg = json.loads((ROOT / "host-bindings/js/package.json").read_text())
    out.append(("host-bindings/js/package.json", "version", pkg.get("version", "")))
    lock = json.loads((ROOT / "host-bindings/js/package-lock.json").read_text())
    out.append(("host-bindings/js/package-lock.json", "version", lock.get("version", "")))
    out.append(("host-bindings/js/package-lock.json", 'packages[""].version', lock["packages"][""].get("version", "")))
    changelog = (ROOT / "CHANGELOG.md").read_text()
    heads = re.findall(r"(?m)^## \[?(\d+\.\d+\.\d+[^\] ]*)\]?", changelog)
    out.append(("CHANGELOG.md", "newest `## X.Y.Z` heading", heads[0] if heads else ""))
    return out


def check() -> int:
    v = read_version()
    bad = [(f, w, got) for f, w, got in found() if got != v]
    for f, w, got in bad:
        print(f"version: {f}: {w} is {got or '(missing)'!s}, VERSION is {v}", file=sys.stderr)
    if bad:
        print("version: run `release/version.py set X.Y.Z` to write one version everywhere", file=sys.stderr)
        return 1
    print(f"version: {v} everywhere ({len(found())} places)")
    return 0


def set_version(v: str) -> int:
    if not SEMVER.match(v):
        sys.exit(f"version: {v!r} is not a semantic version X.Y.Z[-pre]")
    (ROOT / "VERSION").write_text(v + "\n")
    for file, pattern, _ in PATTERNS:
        p = ROOT / file
        text = p.read_text()
        m = re.search(pattern, text)
        if m is None:
            sys.exit(f"version: {file}: no version found by {pattern!r}")
        p.write_text(text[: m.start(1)] + v + text[m.end(1) :])
    for name in ("package.json", "package-lock.json"):
        p = ROOT / "host-bindings/js" / name
        data = json.loads(p.read_text())
        data["version"] = v
        if name == "package-lock.json":
            data["packages"][""]["version"] = v
        p.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
    changelog = ROOT / "CHANGELOG.md"
    text = changelog.read_text()
    if not re.search(rf"(?m)^## \[?{re.escape(v)}\b", text):
        text = text.replace("\n## ", f"\n## {v} (unreleased)\n\n- (describe the changes)\n\n## ", 1)
        changelog.write_text(text)
    print(f"version: set to {v}; the Cargo.lock entries follow on the next cargo build")
    return check()


def main() -> int:
    args = sys.argv[1:]
    if not args:
        print(read_version())
        return 0
    if args == ["check"]:
        return check()
    if len(args) == 2 and args[0] == "set":
        return set_version(args[1])
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())

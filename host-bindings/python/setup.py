"""Build hook: put the Levee component into the package, so that wheels and sdists carry it.

Where the component comes from, in order:

1. `$LEVEE_WASM_DIR/levee_policy.wasm` when the variable is set (the justfile sets it to the
   repository's fresh build, `target/levee`);
2. in a checkout of the Levee repository, `<repo>/target/levee/levee_policy.wasm` (built by
   `./dev component`);
3. the copy already in `src/levee/_wasm/`: what an sdist ships, so that building a wheel from
   the sdist needs no Rust toolchain.

Both `build_py` (wheels) and `sdist` refresh `src/levee/_wasm/` from 1 or 2 first.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.sdist import sdist

HERE = Path(__file__).resolve().parent
WASM = "levee_policy.wasm"
PACKAGED = HERE / "src" / "levee" / "_wasm" / WASM
# `\0asm`, then version 0x0d and layer 1: a component, not a core module.
COMPONENT_HEADER = b"\x00asm\x0d\x00\x01\x00"


def _fresh_build() -> Path | None:
    env = os.environ.get("LEVEE_WASM_DIR")
    if env:
        return Path(env) / WASM
    try:
        top = subprocess.run(
            ["git", "rev-parse", "--show-toplevel"], cwd=HERE, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None  # not a checkout: an sdist being built
    candidate = Path(top) / "target" / "levee" / WASM
    return candidate if (Path(top) / "wit" / "levee.wit").is_file() else None


def _place_component() -> None:
    src = _fresh_build()
    if src is not None and src.is_file():
        PACKAGED.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(src, PACKAGED)
    elif src is not None and os.environ.get("LEVEE_WASM_DIR"):
        raise SystemExit(f"levee: LEVEE_WASM_DIR is set but {src} does not exist")
    elif not PACKAGED.is_file():
        raise SystemExit(
            f"levee: the policy component is missing (looked at {src or 'LEVEE_WASM_DIR'} and {PACKAGED}).\n"
            "In the Levee repository build it first: ./dev component\n"
            "or point LEVEE_WASM_DIR at the directory holding levee_policy.wasm."
        )
    if not PACKAGED.read_bytes().startswith(COMPONENT_HEADER):
        raise SystemExit(f"levee: {PACKAGED} is not a WebAssembly component")


class BuildPyWithComponent(build_py):
    def run(self) -> None:
        _place_component()
        # the shared statements of durable calls (durable/*.sql at the repository root)
        sql_src = HERE.parent.parent / "durable"
        if sql_src.is_dir():
            sql_dst = HERE / "src" / "levee" / "_sql"
            sql_dst.mkdir(parents=True, exist_ok=True)
            for f in sql_src.glob("*.sql"):
                shutil.copyfile(f, sql_dst / f.name)
        super().run()


class SdistWithComponent(sdist):
    def run(self) -> None:
        _place_component()
        super().run()


setup(cmdclass={"build_py": BuildPyWithComponent, "sdist": SdistWithComponent})

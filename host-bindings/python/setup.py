"""Build hook: copy the Levee component into the package so the wheel carries it.

The component comes from `$LEVEE_WASM_DIR/levee_policy.wasm` (default: `target/levee` at the
repository root, built by `cargo run -q --release -p levee-build -- target/levee`).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
WASM = "levee_policy.wasm"


def _wasm_dir() -> Path:
    env = os.environ.get("LEVEE_WASM_DIR")
    if env:
        return Path(env)
    try:
        top = subprocess.run(
            ["git", "rev-parse", "--show-toplevel"], cwd=HERE, capture_output=True, text=True, check=True
        ).stdout.strip()
        return Path(top) / "target" / "levee"
    except (OSError, subprocess.CalledProcessError):
        return HERE.parent.parent / "target" / "levee"


class BuildPyWithComponent(build_py):
    def run(self) -> None:
        src = _wasm_dir() / WASM
        dst_dir = HERE / "src" / "levee" / "_wasm"
        if not src.is_file():
            if (dst_dir / WASM).is_file() and not os.environ.get("LEVEE_WASM_DIR"):
                pass  # building from an sdist or a tree that already carries the component
            else:
                raise SystemExit(
                    f"levee: the policy component {src} is missing. Build it first with\n"
                    "  cd <repo> && cargo run -q --release -p levee-build -- target/levee\n"
                    "or point LEVEE_WASM_DIR at the directory holding levee_policy.wasm."
                )
        else:
            dst_dir.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, dst_dir / WASM)
        # the shared statements of durable calls (durable/*.sql at the repository root)
        sql_src = HERE.parent.parent / "durable"
        if sql_src.is_dir():
            sql_dst = HERE / "src" / "levee" / "_sql"
            sql_dst.mkdir(parents=True, exist_ok=True)
            for f in sql_src.glob("*.sql"):
                shutil.copyfile(f, sql_dst / f.name)
        super().run()


setup(cmdclass={"build_py": BuildPyWithComponent})

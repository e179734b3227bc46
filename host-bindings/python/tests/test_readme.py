"""The README's examples that a reader copies into a test suite run as written."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def _block_after(heading: str) -> str:
    """The first ```python block after the heading `heading`."""
    text = README.read_text(encoding="utf-8")
    start = text.index(f"\n{heading}\n")
    m = re.compile(r"^```python\n(.*?)^```", re.S | re.M).search(text, start)
    assert m is not None, f"no python block after {heading!r}"
    return m.group(1)


def test_the_virtual_time_example_runs_as_written(tmp_path: Path) -> None:
    """Issue 39: the example used an undefined `DOC`, and its `== 7.0` needs `jitter: none`."""
    (tmp_path / "test_virtual_time.py").write_text(_block_after("## Testing with virtual time"))
    (tmp_path / "pytest.ini").write_text(
        "[pytest]\nasyncio_mode = auto\nasyncio_default_fixture_loop_scope = function\n"
    )
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert "2 passed" in out.stdout, out.stdout


def test_the_grpc_example_runs_as_written(tmp_path: Path) -> None:
    """Issue 43: the README's gRPC example is a complete program."""
    (tmp_path / "grpc_example.py").write_text(_block_after("### gRPC"))
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    out = subprocess.run([sys.executable, str(tmp_path / "grpc_example.py")], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr

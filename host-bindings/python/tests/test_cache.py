"""The on-disk cache of the compiled component: used when sound, rebuilt when not."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import pytest

import levee
from levee import _cache
from levee.engine import component_path

DOC = "policies:\n  p:\n    attempts: 2\n"


def _engine_from_copy(tmp: Path, name: str) -> levee.Engine:
    """An engine from a copy of the component at a new path (so a new Runtime: a compile or a cache read)."""
    src = Path(component_path())
    dst = tmp / name
    shutil.copy(src, dst)
    return levee.Engine(DOC, seed=1, component=dst)


def _entries(cache: Path) -> list[Path]:
    return sorted((cache / "wasmtime-py").glob("*.cwasm"))


def test_cache_written_then_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = tmp_path / "cache"
    monkeypatch.setenv(_cache.CACHE_DIR_ENV, str(cache))
    e = _engine_from_copy(tmp_path, "a.wasm")
    assert e.policy("p")(lambda: 7)() == 7
    (entry,) = _entries(cache)
    stamp = entry.stat().st_mtime_ns
    e2 = _engine_from_copy(tmp_path, "b.wasm")
    assert e2.policy("p")(lambda: 8)() == 8
    assert entry.stat().st_mtime_ns == stamp  # read, not written again


@pytest.mark.parametrize(
    "damage",
    [
        lambda b: b[: len(b) // 3],  # truncated
        lambda b: b[:-1] + bytes([b[-1] ^ 0xFF]),  # one bit flipped in the compiled code
        lambda b: b"levee-cwasm-1\n" + b"\0" * 32 + b"junk",  # a wrong digest
        lambda b: b"garbage",
    ],
    ids=["truncated", "bit-flip", "bad-digest", "garbage"],
)
def test_corrupt_entry_is_compiled_again_and_rewritten(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, damage: Callable[[bytes], bytes]
) -> None:
    cache = tmp_path / "cache"
    monkeypatch.setenv(_cache.CACHE_DIR_ENV, str(cache))
    _engine_from_copy(tmp_path, "a.wasm")
    (entry,) = _entries(cache)
    good = entry.read_bytes()
    entry.write_bytes(damage(good))
    e = _engine_from_copy(tmp_path, "b.wasm")
    assert e.policy("p")(lambda: 9)() == 9
    assert _entries(cache) == [entry]
    again = entry.read_bytes()
    assert again[: len(_cache._MAGIC) + 32] == good[: len(_cache._MAGIC) + 32]  # the same sound entry


def test_cache_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(_cache.CACHE_DIR_ENV, "off")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    e = _engine_from_copy(tmp_path, "a.wasm")
    assert e.policy("p")(lambda: 1)() == 1
    assert _cache.cache_dir() is None
    assert not (tmp_path / "xdg").exists() and not (tmp_path / "home").exists()


def test_a_miss_prunes_entries_not_written_for_the_prune_age(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from levee._constants import CACHE_PRUNE_AFTER_SECS

    old, young = CACHE_PRUNE_AFTER_SECS + 60, CACHE_PRUNE_AFTER_SECS - 60
    cache = tmp_path / "cache"
    monkeypatch.setenv(_cache.CACHE_DIR_ENV, str(cache))
    d = cache / "wasmtime-py"
    d.mkdir(parents=True)
    now = time.time()
    files = {"old.cwasm": old, ".tmp-abandoned": old, "recent.cwasm": young}
    for name, age in files.items():
        (d / name).write_bytes(b"x")
        os.utime(d / name, (now - age, now - age))
    (d / "old-dir").mkdir()  # not a file: never removed
    os.utime(d / "old-dir", (now - 2 * CACHE_PRUNE_AFTER_SECS, now - 2 * CACHE_PRUNE_AFTER_SECS))

    e = _engine_from_copy(tmp_path, "a.wasm")  # a miss: compiles, writes, prunes
    assert e.policy("p")(lambda: 1)() == 1
    left = sorted(p.name for p in d.iterdir())
    (entry,) = [n for n in left if n not in ("recent.cwasm", "old-dir")]
    assert entry.endswith(".cwasm") and entry != "old.cwasm"
    assert "recent.cwasm" in left and "old-dir" in left

    # A hit prunes nothing: an entry made old stays until the next miss.
    (d / "old.cwasm").write_bytes(b"x")
    os.utime(d / "old.cwasm", (now - old, now - old))
    e2 = _engine_from_copy(tmp_path, "b.wasm")
    assert e2.policy("p")(lambda: 2)() == 2
    assert (d / "old.cwasm").exists()

    # The entry just written is kept whatever its age (a clock far ahead, say).
    _cache.prune(d, keep=d / entry, now=now + 10 * CACHE_PRUNE_AFTER_SECS)
    assert sorted(p.name for p in d.iterdir()) == sorted([entry, "old-dir"])

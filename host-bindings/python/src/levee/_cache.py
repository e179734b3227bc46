"""The on-disk cache of the compiled component (wasmtime's `Component.serialize`/`deserialize`).

Compiling the component takes 0.2-0.5 s; reading it back compiled takes milliseconds. An entry is
named after the SHA-256 of the component, the wasmtime-py version and the engine's settings, so a
new component or a new wasmtime never reads an old entry, and carries the SHA-256 of its own
payload, so a truncated or damaged file is never handed to wasmtime: it is compiled again and
rewritten. wasmtime itself refuses an artifact from another version or configuration.

`LEVEE_CACHE_DIR` moves the cache (default: `$XDG_CACHE_HOME/levee` or `~/.cache/levee`;
`%LOCALAPPDATA%\\levee` on Windows); `LEVEE_CACHE_DIR=off` disables it.

A miss (a compile) removes the files of `wasmtime-py/` last written more than
`CACHE_PRUNE_AFTER_SECS` ago (docs/hosts.md, "The compiled-component cache"): the entries of
components and wasmtimes no longer used, which are never read again.
"""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

import wasmtime
from wasmtime import _ffi
from wasmtime.component import Component

from levee._constants import CACHE_PRUNE_AFTER_SECS

CACHE_DIR_ENV = "LEVEE_CACHE_DIR"
_MAGIC = b"levee-cwasm-1\n"


def cache_dir() -> Path | None:
    """The cache directory, or None when the cache is off."""
    configured = os.environ.get(CACHE_DIR_ENV)
    if configured == "off":
        return None
    if configured:
        return Path(configured)
    if os.name == "nt" and os.environ.get("LOCALAPPDATA"):
        return Path(os.environ["LOCALAPPDATA"]) / "levee"
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "levee"


def entry_path(directory: Path, wasm: bytes, settings: str) -> Path:
    h = hashlib.sha256(wasm)
    # the native runtime's identity: its path, size and mtime (importlib.metadata's version
    # lookup cost ~30 ms of import time); wasmtime refuses another version's artifact anyway
    lib = str(_ffi.dll._name)
    st = os.stat(lib)
    h.update(f"\0{lib}\0{st.st_size}\0{st.st_mtime_ns}".encode())
    h.update(b"\0" + settings.encode())
    return directory / "wasmtime-py" / f"{h.hexdigest()}.cwasm"


def load_component(engine: wasmtime.Engine, wasm: bytes, settings: str) -> Component:
    """The compiled component: from the cache when a sound entry is there, else compiled (and cached)."""
    directory = cache_dir()
    if directory is None:
        return Component(engine, wasm)
    path = entry_path(directory, wasm, settings)
    try:
        data = path.read_bytes()
    except OSError:
        data = b""
    head = len(_MAGIC) + 32
    if data.startswith(_MAGIC) and len(data) > head:
        payload = data[head:]
        if hashlib.sha256(payload).digest() == data[len(_MAGIC) : head]:
            try:
                return Component.deserialize(engine, payload)
            except wasmtime.WasmtimeError:
                pass  # another wasmtime's or another configuration's artifact: compile again
    component = Component(engine, wasm)
    import tempfile  # only when writing: it costs import time every process pays otherwise

    try:
        compiled = bytes(component.serialize())
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(_MAGIC + hashlib.sha256(compiled).digest() + compiled)
            os.replace(tmp, path)  # atomic: a reader sees the old entry or the new one
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError:
        pass  # a read-only or full disk costs the next process a compile, nothing else
    prune(path.parent, keep=path)
    return component


def prune(directory: Path, keep: Path, now: float | None = None) -> None:
    """Remove the files of `directory` last written more than CACHE_PRUNE_AFTER_SECS before `now`
    (other components' and other wasmtimes' entries, a writer's leftover temporary file), `keep`
    aside. Best effort: what cannot be listed or removed stays."""
    cutoff = (time.time() if now is None else now) - CACHE_PRUNE_AFTER_SECS
    try:
        with os.scandir(directory) as it:
            for entry in it:
                try:
                    if entry.name == keep.name or not entry.is_file(follow_symlinks=False):
                        continue
                    if entry.stat().st_mtime < cutoff:
                        os.unlink(entry.path)
                except OSError:
                    pass  # gone already, or not ours to remove
    except OSError:
        pass

"""The component binding: every function of `levee:policy/engine-api@0.1.0`, written by hand.

wasmtime-py's `Func.__call__` asks wasmtime for the function's type over FFI on every call
and converts values through that reflected type: 35-55 us for one primitive method. This
module skips the reflection entirely. We know the WIT, so arguments are lowered straight
into `wasmtime_component_val_t` arrays, and results are lifted by reading the C values'
own kind tags.

The hot operations (`start`, `start-unkeyed`, `acquire`, `report`, `report-fallback`) keep
one argument array each for the life of the instance; a call only overwrites the integer
words that change (through a `c_uint64` overlay of the array) and makes the raw
`wasmtime_component_func_call`, then `wasmtime_component_func_post_return`. Arguments are
borrowed by wasmtime (`*const`, copied into `Val`s), so string arguments may point at
buffers we own.

A call with no key starts through `start-unkeyed`, which names the engine by its `id` (read
once per instance) instead of lending the `borrow<engine>` handle, and takes no string: the
C API lowers a string through a second guest call (`realloc`, even for "").

Anything else is lowered from a small tagged description (`_lower`: records, variants,
lists, options), as the durable executor's `exec-event` needs; its `exec-command`s are lifted
and checked into `levee.types`. An `executor` resource lives in the instance that made it: a
`Core` drops its executors with itself.

A `Core` is one component instance in one `wasmtime.Store`: it is NOT thread-safe; the
public `Engine` serialises access with a lock and replaces a `Core` that trapped.
"""

from __future__ import annotations

import ctypes
from ctypes import POINTER, addressof, c_size_t, c_ubyte, c_uint64, c_void_p
from typing import Any

import wasmtime
from wasmtime import _ffi as ffi
from wasmtime.component import Linker

from ._cache import load_component
from ._constants import (
    GUARD_GUEST_MEMORY_BYTES,
    GUARD_GUEST_WORK_UNITS,
    GUARD_GUEST_WORK_UNITS_PER_BYTE,
    GUARD_STATE_PAGE_BYTES,
)
from .types import (
    Analysis,
    BreakerState,
    CallInfo,
    DurableAction,
    DurableReason,
    DurableStep,
    Event,
    EventKind,
    ExecAbandon,
    ExecClaim,
    ExecClaimed,
    ExecClaimFailed,
    ExecCommand,
    ExecDueIn,
    ExecEvent,
    ExecIdle,
    ExecLog,
    ExecNextDue,
    ExecPoll,
    ExecQuarantine,
    ExecRenew,
    ExecRun,
    ExecSleep,
    ExecutorConfig,
    ExecWritten,
    LoadError,
    OutcomeKind,
    PolicyInfo,
    Reason,
    RowWrite,
    WriteFailed,
)

IFACE = "levee:policy/engine-api@0.1.0"

# The bounds on guest work (docs/architecture.md, "Bounds on the guest"), in work units: one
# unit is one unit of wasmtime fuel here (about one instruction), one nanosecond in the hosts
# that bound guest calls by time. A crossing whose work does not depend on the size of
# anything (start, acquire, report, queries, drain-events, analyze) may run `CALL_UNITS`;
# Python pools that budget over `HOT_BATCH` consecutive hot crossings (one FFI call fewer per
# crossing; each uses well under 10^5). A crossing that walks the document or the state
# (load, reload, export-state, import-state) may run `CALL_UNITS + UNITS_PER_BYTE * bytes`,
# where bytes is the document's size, plus, when it walks the state, the state's: the size of
# the last exported or imported state plus `KEY_BYTES` for every keyed `start` since (a new
# key adds at most one entry). A runaway guest traps when it runs out.
# The numbers are the guards of docs/hosts.md (section 7), generated into _constants.
CALL_UNITS = GUARD_GUEST_WORK_UNITS
UNITS_PER_BYTE = GUARD_GUEST_WORK_UNITS_PER_BYTE
KEY_BYTES = 1024
HOT_BATCH = 64
MEMORY_LIMIT = GUARD_GUEST_MEMORY_BYTES


def work_units(size_bytes: int) -> int:
    """The budget of a crossing that walks `size_bytes` of document or state (at most 2^62: the
    store's fuel is a u64, and the keyed starts counted since the last export or import, which
    the recovery snapshot no longer resets, grow for as long as the engine runs)."""
    return min(CALL_UNITS + UNITS_PER_BYTE * max(0, size_bytes), 1 << 62)


_V = ffi.wasmtime_component_val_t
_VAL_WORDS = 4  # sizeof(wasmtime_component_val_t) == 32

_K_BOOL = ffi.WASMTIME_COMPONENT_BOOL.value
_K_S8 = ffi.WASMTIME_COMPONENT_S8.value
_K_U8 = ffi.WASMTIME_COMPONENT_U8.value
_K_S16 = ffi.WASMTIME_COMPONENT_S16.value
_K_U16 = ffi.WASMTIME_COMPONENT_U16.value
_K_S32 = ffi.WASMTIME_COMPONENT_S32.value
_K_U32 = ffi.WASMTIME_COMPONENT_U32.value
_K_S64 = ffi.WASMTIME_COMPONENT_S64.value
_K_U64 = ffi.WASMTIME_COMPONENT_U64.value
_K_F32 = ffi.WASMTIME_COMPONENT_F32.value
_K_F64 = ffi.WASMTIME_COMPONENT_F64.value
_K_CHAR = ffi.WASMTIME_COMPONENT_CHAR.value
_K_STRING = ffi.WASMTIME_COMPONENT_STRING.value
_K_LIST = ffi.WASMTIME_COMPONENT_LIST.value
_K_RECORD = ffi.WASMTIME_COMPONENT_RECORD.value
_K_TUPLE = ffi.WASMTIME_COMPONENT_TUPLE.value
_K_VARIANT = ffi.WASMTIME_COMPONENT_VARIANT.value
_K_ENUM = ffi.WASMTIME_COMPONENT_ENUM.value
_K_OPTION = ffi.WASMTIME_COMPONENT_OPTION.value
_K_RESULT = ffi.WASMTIME_COMPONENT_RESULT.value
_K_FLAGS = ffi.WASMTIME_COMPONENT_FLAGS.value
_K_RESOURCE = ffi.WASMTIME_COMPONENT_RESOURCE.value

if ctypes.sizeof(_V) != 8 * _VAL_WORDS or _V.of.offset != 8:
    raise ImportError(
        "levee: this wasmtime build lays out wasmtime_component_val_t differently "
        f"(size {ctypes.sizeof(_V)}, payload offset {_V.of.offset}); levee needs wasmtime 50.x"
    )

# Our own function objects over the C API, with plain integer arguments: cheaper to call than
# wasmtime-py's wrappers, and changing their argtypes does not touch wasmtime-py's.
_CALL = ctypes.CFUNCTYPE(c_void_p, c_void_p, c_void_p, c_void_p, c_size_t, c_void_p, c_size_t)(
    ("wasmtime_component_func_call", ffi.dll)
)
_POST = ctypes.CFUNCTYPE(c_void_p, c_void_p, c_void_p)(("wasmtime_component_func_post_return", ffi.dll))
_VAL_DELETE = ctypes.CFUNCTYPE(None, c_void_p)(("wasmtime_component_val_delete", ffi.dll))


class ComponentFault(Exception):
    """The component trapped or failed a crossing: its instance must not be used again."""


def _fault(err: int, what: str) -> ComponentFault:
    e = wasmtime.WasmtimeError._from_ptr(ctypes.cast(err, POINTER(ffi.wasmtime_error_t)))
    return ComponentFault(f"{what}: {e}")


class Runtime:
    """A compiled component, shared by every `Core` made from it (compiling takes ~50 ms)."""

    def __init__(self, wasm: bytes) -> None:
        config = wasmtime.Config()
        config.consume_fuel = True
        self.engine = wasmtime.Engine(config)
        self.component = load_component(self.engine, wasm, "consume_fuel")
        self.linker = Linker(self.engine)
        imports = self.component.type.imports(self.engine)
        if imports:
            raise ValueError(f"the Levee component must have no imports; it has {sorted(imports)}")


def _lift(v: Any) -> Any:
    """Lift a C component value to Python by its own kind tag (no type reflection).

    Records become dicts keyed by kebab-case field names, enums their case name, lists of
    `u8` become bytes, options `None` or the value, results `("ok"|"err", value)`.
    Resources are taken out of the tree (their slot is turned into a `bool`) so that deleting
    the tree afterwards leaves them alive.
    """
    k = v.kind
    of = v.of
    if k == _K_U64:
        return of.u64
    if k == _K_U32:
        return of.u32
    if k == _K_S64:
        return of.s64
    if k == _K_S32:
        return of.s32
    if k == _K_STRING:
        return _str(of.string)
    if k == _K_ENUM:
        return _str(of.enumeration)
    if k == _K_BOOL:
        return bool(of.boolean)
    if k == _K_RECORD:
        rec = of.record
        out: dict[str, Any] = {}
        for i in range(rec.size):
            entry = rec.data[i]
            out[_str(entry.name)] = _lift(entry.val)
        return out
    if k == _K_LIST:
        lst = of.list
        n = lst.size
        if n == 0:
            return []
        if lst.data[0].kind == _K_U8:
            raw = ctypes.string_at(ctypes.cast(lst.data, c_void_p), n * 8 * _VAL_WORDS)
            return raw[8 :: 8 * _VAL_WORDS]
        return [_lift(lst.data[i]) for i in range(n)]
    if k == _K_OPTION:
        p = of.option
        return _lift(p.contents) if p else None
    if k == _K_RESULT:
        p = of.result.val
        return ("ok" if of.result.is_ok else "err", _lift(p.contents) if p else None)
    if k == _K_RESOURCE:
        ptr = ctypes.cast(of.resource, c_void_p).value
        of.resource = None
        v.kind = _K_BOOL
        of.boolean = False
        return ptr
    if k == _K_U8:
        return of.u8
    if k == _K_U16:
        return of.u16
    if k == _K_S8:
        return of.s8
    if k == _K_S16:
        return of.s16
    if k == _K_F64:
        return of.f64
    if k == _K_F32:
        return of.f32
    if k == _K_CHAR:
        return chr(of.character)
    if k == _K_TUPLE:
        t = of.tuple
        return tuple(_lift(t.data[i]) for i in range(t.size))
    if k == _K_VARIANT:
        p = of.variant.val
        return (_str(of.variant.discriminant), _lift(p.contents) if p else None)
    if k == _K_FLAGS:
        f = of.flags
        return {_str(f.data[i]) for i in range(f.size)}
    raise ComponentFault(f"unexpected component value kind {k}")


def _str(vec: Any) -> str:
    if not vec.size:
        return ""
    return ctypes.string_at(vec.data, vec.size).decode("utf-8", "replace")


class _Args:
    """A lowered argument array plus the buffers its strings point into."""

    __slots__ = ("arr", "keep", "n")

    def __init__(self, n: int) -> None:
        self.n = n
        self.arr = (_V * max(n, 1))()
        self.keep: list[Any] = []

    def u64(self, i: int, x: int) -> _Args:
        self.arr[i].kind = _K_U64
        self.arr[i].of.u64 = x
        return self

    def u32(self, i: int, x: int) -> _Args:
        self.arr[i].kind = _K_U32
        self.arr[i].of.u32 = x
        return self

    def s32(self, i: int, x: int) -> _Args:
        self.arr[i].kind = _K_S32
        self.arr[i].of.s32 = x
        return self

    def s64(self, i: int, x: int) -> _Args:
        self.arr[i].kind = _K_S64
        self.arr[i].of.s64 = x
        return self

    def val(self, i: int, v: Low) -> _Args:
        """Any value, described as `_lower` takes it (records, variants, lists, options)."""
        _lower(self.arr[i], v, self.keep)
        return self

    def boolean(self, i: int, x: bool) -> _Args:
        self.arr[i].kind = _K_BOOL
        self.arr[i].of.boolean = x
        return self

    def string(self, i: int, s: str) -> _Args:
        _lower(self.arr[i], ("string", s), self.keep)
        return self

    def enum(self, i: int, s: str) -> _Args:
        _lower(self.arr[i], ("enum", s), self.keep)
        return self

    def resource(self, i: int, ptr: int) -> _Args:
        self.arr[i].kind = _K_RESOURCE
        self.arr[i].of.resource = ctypes.cast(ptr, POINTER(ffi.wasmtime_component_resource_any_t))
        return self

    def bytes_list(self, i: int, data: bytes) -> _Args:
        _lower(self.arr[i], ("bytes", data), self.keep)
        return self


#: A value to lower, tagged by its WIT kind: `("u64" | "u32" | "s64" | "s32", int)`,
#: `("bool", bool)`, `("string" | "enum", str)`, `("bytes", bytes)` (a `list<u8>`),
#: `("list", [Low])`, `("record", [(field, Low)])` in the WIT's field order, `("variant", case,
#: Low | None)`, `("option", Low | None)`.
Low = tuple[Any, ...]

_ENTRY = ffi.wasmtime_component_valrecord_entry


def _name_into(vec: Any, s: str, keep: list[Any]) -> None:
    """Point a `wasm_name_t` at a buffer of ours holding `s` (kept alive by `keep`)."""
    b = s.encode("utf-8")
    buf = ctypes.create_string_buffer(b, max(len(b), 1))
    keep.append(buf)
    vec.size = len(b)
    vec.data = ctypes.cast(buf, POINTER(c_ubyte))


#: the buffers of field names, variant cases and enum values: a fixed set of the WIT's words,
#: each made once (a feed of the durable executor lowers about ten of them)
_WORDS: dict[str, tuple[int, Any, Any]] = {}


def _word_into(vec: Any, s: str) -> None:
    """`_name_into` for one of the WIT's own words, whose buffer lives for the process."""
    w = _WORDS.get(s)
    if w is None:
        b = s.encode("utf-8")
        buf = ctypes.create_string_buffer(b, max(len(b), 1))
        w = _WORDS[s] = (len(b), ctypes.cast(buf, POINTER(c_ubyte)), buf)
    vec.size = w[0]
    vec.data = w[1]


def _lower(dst: Any, v: Low, keep: list[Any]) -> None:
    """Write `v` into the C value `dst`; every buffer it points into is appended to `keep`
    (wasmtime borrows arguments: they must outlive the call)."""
    tag = v[0]
    of = dst.of
    if tag == "u64":
        dst.kind = _K_U64
        of.u64 = v[1]
    elif tag == "u32":
        dst.kind = _K_U32
        of.u32 = v[1]
    elif tag == "s64":
        dst.kind = _K_S64
        of.s64 = v[1]
    elif tag == "s32":
        dst.kind = _K_S32
        of.s32 = v[1]
    elif tag == "bool":
        dst.kind = _K_BOOL
        of.boolean = bool(v[1])
    elif tag == "string":
        dst.kind = _K_STRING
        _name_into(of.string, v[1], keep)
    elif tag == "enum":
        dst.kind = _K_ENUM
        _word_into(of.enumeration, v[1])
    elif tag == "bytes":
        data: bytes = v[1]
        n = len(data)
        raw = bytearray(max(n, 1) * 8 * _VAL_WORDS)
        raw[0 : n * 32 : 32] = bytes([_K_U8]) * n
        raw[8 : n * 32 : 32] = data
        items = (_V * max(n, 1)).from_buffer(raw)
        keep.append(raw)
        keep.append(items)
        dst.kind = _K_LIST
        of.list.size = n
        of.list.data = ctypes.cast(items, POINTER(_V))
    elif tag == "list":
        elems: list[Low] = v[1]
        arr = (_V * max(len(elems), 1))()
        keep.append(arr)
        for i, e in enumerate(elems):
            _lower(arr[i], e, keep)
        dst.kind = _K_LIST
        of.list.size = len(elems)
        of.list.data = ctypes.cast(arr, POINTER(_V))
    elif tag == "record":
        fields: list[tuple[str, Low]] = v[1]
        ents = (_ENTRY * max(len(fields), 1))()
        keep.append(ents)
        for i, (name, e) in enumerate(fields):
            _word_into(ents[i].name, name)
            _lower(ents[i].val, e, keep)
        dst.kind = _K_RECORD
        of.record.size = len(fields)
        of.record.data = ctypes.cast(ents, POINTER(_ENTRY))
    elif tag == "variant":
        dst.kind = _K_VARIANT
        _word_into(of.variant.discriminant, v[1])
        of.variant.val = _boxed(v[2], keep)
    elif tag == "option":
        dst.kind = _K_OPTION
        of.option = _boxed(v[1], keep)
    else:
        raise ValueError(f"cannot lower a value tagged {tag!r}")


def _boxed(v: Low | None, keep: list[Any]) -> Any:
    """A pointer to `v` lowered on its own (a variant's payload, an option's value), or NULL."""
    if v is None:
        return None
    box = _V()
    keep.append(box)
    _lower(box, v, keep)
    return ctypes.pointer(box)


def _hot_args(n: int) -> tuple[Any, Any, int]:
    arr = (_V * n)()
    words = (c_uint64 * (n * _VAL_WORDS)).from_buffer(arr)
    return arr, words, addressof(arr)


_EMPTY = ctypes.create_string_buffer(1)
_EMPTY_ADDR = addressof(_EMPTY)
_OUTCOME_NAMES = {k: ctypes.create_string_buffer(k.wit.encode(), len(k.wit)) for k in OutcomeKind}


class Core:
    """One instance of the component and the `engine` resource loaded in it."""

    def __init__(self, runtime: Runtime, document: str, seed: int) -> None:
        """Instantiate and `load`. Raises `PolicyDocumentError`-ready `LoadErrors` or `ComponentFault`."""
        self.runtime = runtime
        self.dead = False
        self.store = wasmtime.Store(runtime.engine)
        self.store.set_limits(memory_size=MEMORY_LIMIT)
        self.store.set_fuel(work_units(0))
        #: the size of the state this instance holds: the last state exported or imported,
        #: and the keyed `start`s since (each may add a key), for the bounds of `work_units`
        self.state_bytes = 0
        self.keyed_starts = 0
        try:
            self.instance = runtime.linker.instantiate(self.store, runtime.component)
        except wasmtime.WasmtimeError as e:
            raise ComponentFault(f"instantiate: {e}") from e
        self._ctx = ctypes.cast(self.store._context(), c_void_p).value
        iface = self.instance.get_export_index(self.store, IFACE)
        if iface is None:
            raise ComponentFault(f"the component does not export {IFACE}")
        self._funcs: dict[str, Any] = {}
        self._addr: dict[str, int] = {}
        for name in (
            "[static]engine.load",
            "[method]engine.reload",
            "[method]engine.policy-count",
            "[method]engine.policy-index",
            "[method]engine.policy-info",
            "[method]engine.policy-json",
            "[method]engine.analyze",
            "[method]engine.start",
            "[method]engine.id",
            "start-unkeyed",
            "[method]engine.acquire",
            "[method]engine.report",
            "[method]engine.report-fallback",
            "[method]engine.hedge-step",
            "[method]engine.report-attempt",
            "[method]engine.cancel",
            "[method]engine.take-wakes",
            "[method]engine.call-info",
            "[method]engine.drain-events",
            "[method]engine.breaker-state",
            "[method]engine.set-breaker-state",
            "[method]engine.export-state",
            "[method]engine.export-snapshot",
            "[method]engine.import-state",
            "[method]engine.export-state-page",
            "[method]engine.import-state-begin",
            "[method]engine.import-state-page",
            "[method]engine.import-state-end",
            "[method]engine.durable-begin",
            "[method]engine.durable-step",
            "[method]engine.durable-renew",
            "[method]engine.durable-outcome",
            "[method]engine.durable-cancel",
            "[method]engine.durable-revive",
            "[method]engine.durable-inspect",
            "[method]engine.fleet-plan",
            "[method]engine.fleet-merge",
            "[method]engine.fleet-apply",
            "[method]engine.fleet-inspect",
        ):
            idx = self.instance.get_export_index(self.store, name, iface)
            func = self.instance.get_func(self.store, idx) if idx is not None else None
            if func is None:
                raise ComponentFault(f"the component does not export {IFACE}#{name}")
            short = name.split(".", 1)[-1]
            self._funcs[short] = func
            self._addr[short] = addressof(func._func)
        for name, short in _EXECUTOR_FUNCS:
            idx = self.instance.get_export_index(self.store, name, iface)
            func = self.instance.get_func(self.store, idx) if idx is not None else None
            if func is None:
                raise ComponentFault(f"the component does not export {IFACE}#{name}")
            self._funcs[short] = func
            self._addr[short] = addressof(func._func)
        #: the `executor` resources made in this instance, dropped by `close`
        self._executors: set[int] = set()
        self._res = 0
        res = self._slow("load", _Args(2).string(0, document).u64(1, seed), work=len(document.encode("utf-8")))
        tag, val = res
        if tag != "ok":
            raise LoadErrors([LoadError(e["path"], e["message"]) for e in val])
        self._res = int(val)
        self._res_ptr = ctypes.cast(self._res, POINTER(ffi.wasmtime_component_resource_any_t))
        #: the engine's id in this instance, for `start-unkeyed`
        self.id = int(self._slow("id"))

        self._result = _V()
        self._result_addr = addressof(self._result)
        self._result_words = (c_uint64 * _VAL_WORDS).from_buffer(self._result)
        self._hot_left = HOT_BATCH
        self.store.set_fuel(CALL_UNITS)

        # start(self, call, policy, key, flags, now, settle-call, settle-at, settle-elapsed)
        self._start_arr, self._sw, self._start_addr = _hot_args(9)
        kinds = (_K_RESOURCE, _K_U64, _K_U32, _K_STRING, _K_U32, _K_U64, _K_U64, _K_U64, _K_U64)
        for i, k in enumerate(kinds):
            self._start_arr[i].kind = k
        self._sw[1] = self._res
        self._sw[13] = 0
        self._sw[14] = _EMPTY_ADDR
        self._key_bufs: dict[str, tuple[int, int, Any]] = {"": (0, _EMPTY_ADDR, _EMPTY)}
        # start-unkeyed(engine, call, policy, flags, now, settle-call, settle-at, settle-elapsed)
        self._unk_arr, self._uw, self._unk_addr = _hot_args(8)
        for i, k in enumerate((_K_U32, _K_U64, _K_U32, _K_U32, _K_U64, _K_U64, _K_U64, _K_U64)):
            self._unk_arr[i].kind = k
        self._uw[1] = self.id
        # acquire(self, call, now)
        self._acq_arr, self._aw, self._acq_addr = _hot_args(3)
        for i, k in enumerate((_K_RESOURCE, _K_U64, _K_U64)):
            self._acq_arr[i].kind = k
        self._aw[1] = self._res
        # report(self, call, now, elapsed, kind, code, text, wall-secs, flags)
        self._rep_arr, self._rw, self._rep_addr = _hot_args(9)
        for i, k in enumerate((_K_RESOURCE, _K_U64, _K_U64, _K_U64, _K_ENUM, _K_S32, _K_STRING, _K_U64, _K_U32)):
            self._rep_arr[i].kind = k
        self._rw[1] = self._res
        # report-fallback(self, call, now, ok)
        self._fb_arr, self._fw, self._fb_addr = _hot_args(4)
        for i, k in enumerate((_K_RESOURCE, _K_U64, _K_U64, _K_BOOL)):
            self._fb_arr[i].kind = k
        self._fw[1] = self._res
        # hedge-step(self, call, now)
        self._hs_arr, self._hsw, self._hs_addr = _hot_args(3)
        for i, k in enumerate((_K_RESOURCE, _K_U64, _K_U64)):
            self._hs_arr[i].kind = k
        self._hsw[1] = self._res
        # report-attempt(self, call, attempt, now, elapsed, kind, code, text, wall-secs, flags)
        self._ra_arr, self._raw, self._ra_addr = _hot_args(10)
        ra_kinds = (_K_RESOURCE, _K_U64, _K_U32, _K_U64, _K_U64, _K_ENUM, _K_S32, _K_STRING, _K_U64, _K_U32)
        for i, k in enumerate(ra_kinds):
            self._ra_arr[i].kind = k
        self._raw[1] = self._res
        self._answer = _V()
        self._answer_addr = addressof(self._answer)
        self._f_start = self._addr["start"]
        self._f_unkeyed = self._addr["start-unkeyed"]
        self._f_acquire = self._addr["acquire"]
        self._f_report = self._addr["report"]
        self._f_fallback = self._addr["report-fallback"]
        self.needs_post_return = self._probe_post_return()

    def _probe_post_return(self) -> bool:
        """Whether this wasmtime still needs `post_return` after a call before the instance can
        be entered again. wasmtime 42+ runs post-return inside `Func::call` and made
        `post_return` a no-op (bytecodealliance/wasmtime#12498); older ones refuse the second
        call. The hot path skips the no-op crossing when the probe shows it is not needed."""
        f = self._addr["policy-count"]
        arg = _Args(1).resource(0, self._res)
        result = _V()
        for _ in range(2):
            err = _CALL(f, self._ctx, addressof(arg.arr), 1, addressof(result), 1)
            if err:
                wasmtime.WasmtimeError._from_ptr(ctypes.cast(err, POINTER(ffi.wasmtime_error_t)))
                perr = _POST(f, self._ctx)
                if perr:
                    self.dead = True
                    raise _fault(perr, "post-return")
                return True
        err = _POST(f, self._ctx)
        if err:
            self.dead = True
            raise _fault(err, "post-return")
        return False

    # ------------------------------------------------------------------ plumbing

    def _refuel_hot(self) -> None:
        self._hot_left = HOT_BATCH
        self.store.set_fuel(CALL_UNITS)

    def state_work(self) -> int:
        """Bytes of state a crossing that walks the whole state may have to walk."""
        return self.state_bytes + KEY_BYTES * self.keyed_starts

    def _hot(self, f: int, args: int, n: int) -> int:
        """One crossing that returns a u64 verdict."""
        if self.dead:
            raise ComponentFault("the component instance is poisoned")
        self._hot_left -= 1
        if self._hot_left <= 0:
            self._refuel_hot()
        err = _CALL(f, self._ctx, args, n, self._result_addr, 1)
        if err:
            self.dead = True
            raise _fault(err, "component call")
        r: int = self._result_words[1]
        if self.needs_post_return:
            err = _POST(f, self._ctx)
            if err:
                self.dead = True
                raise _fault(err, "post-return")
        return r

    def _slow_fuel(self, work: int) -> int:
        """The fuel of a slow crossing (a seam for `levee.testing`'s fault injection)."""
        return work_units(work)

    def _slow(self, name: str, args: _Args | None = None, has_result: bool = True, work: int = 0, this: int = 0) -> Any:
        """A crossing with any arguments and result; the result is lifted then freed. `work` is
        the bytes of document or state it walks (its bound is `work_units(work)`). `this`: the
        resource a method is called on, when it is not the engine (an executor)."""
        if self.dead:
            raise ComponentFault("the component instance is poisoned")
        if args is None:
            args = _Args(0)
        if name not in _BARE:
            # every method takes its resource (the engine, unless `this`) as its first argument
            full = _Args(args.n + 1)
            ctypes.memmove(addressof(full.arr) + 32, addressof(args.arr), 32 * args.n)
            full.keep = [*args.keep, args.arr]
            full.resource(0, this or self._res)
            args = full
        f = self._addr[name]
        self.store.set_fuel(self._slow_fuel(work))
        result = _V()
        err = _CALL(
            f, self._ctx, addressof(args.arr), args.n, addressof(result) if has_result else None, 1 if has_result else 0
        )
        if err:
            self.dead = True
            raise _fault(err, f"component call {name}")
        try:
            out = _lift(result) if has_result else None
        finally:
            if has_result:
                _VAL_DELETE(addressof(result))
        err = _POST(f, self._ctx)
        if err:
            self.dead = True
            raise _fault(err, f"post-return of {name}")
        self._refuel_hot()
        return out

    def close(self) -> None:
        """Drop the executors and the engine resource; the instance is unusable afterwards."""
        for x in list(self._executors):
            self.executor_drop(x)
        if self._res and not self.dead:
            err = ffi.wasmtime_component_resource_any_drop(self.store._context(), self._res_ptr)
            if err:
                self.dead = True
        if self._res:
            ffi.wasmtime_component_resource_any_delete(self._res_ptr)
            self._res = 0
        self.dead = True

    # ------------------------------------------------------------------ hot path

    def key_ref(self, key: str) -> tuple[int, int, Any]:
        ref = self._key_bufs.get(key)
        if ref is None:
            b = key.encode("utf-8")
            buf = ctypes.create_string_buffer(b, len(b))
            ref = (len(b), addressof(buf), buf)
            if len(self._key_bufs) > 4096:
                self._key_bufs = {"": self._key_bufs[""]}
            self._key_bufs[key] = ref
        return ref

    def start(
        self,
        call: int,
        policy: int,
        key: str,
        flags: int,
        now: int,
        settle_call: int,
        settle_at: int,
        settle_elapsed: int,
    ) -> int:
        """`engine.start`; through `start-unkeyed` when `key` is "" (the same core function)."""
        if key:
            self.keyed_starts += 1
            w = self._sw
            w[5] = call
            w[9] = policy & 0xFFFFFFFF
            size, addr, _buf = self.key_ref(key)
            w[13] = size
            w[14] = addr  # `_buf` lives in `_key_bufs` for the crossing
            w[17] = flags & 0xFFFFFFFF
            w[21] = now
            w[25] = settle_call
            w[29] = settle_at
            w[33] = settle_elapsed
            f = self._f_start
            args, n = self._start_addr, 9
        else:
            w = self._uw
            w[5] = call
            w[9] = policy & 0xFFFFFFFF
            w[13] = flags & 0xFFFFFFFF
            w[17] = now
            w[21] = settle_call
            w[25] = settle_at
            w[29] = settle_elapsed
            f = self._f_unkeyed
            args, n = self._unk_addr, 8
        # `_hot`, inlined: this is the one crossing of a call that succeeds first time
        if self.dead:
            raise ComponentFault("the component instance is poisoned")
        self._hot_left -= 1
        if self._hot_left <= 0:
            self._refuel_hot()
        err = _CALL(f, self._ctx, args, n, self._result_addr, 1)
        if err:
            self.dead = True
            raise _fault(err, "component call")
        r: int = self._result_words[1]
        if self.needs_post_return:
            err = _POST(f, self._ctx)
            if err:
                self.dead = True
                raise _fault(err, "post-return")
        return r

    def acquire(self, call: int, now: int) -> int:
        w = self._aw
        w[5] = call
        w[9] = now
        return self._hot(self._f_acquire, self._acq_addr, 3)

    def report(
        self, call: int, now: int, elapsed: int, kind: OutcomeKind, code: int, text: str, wall_secs: int, flags: int
    ) -> int:
        w = self._rw
        w[5] = call
        w[9] = now
        w[13] = elapsed
        name = _OUTCOME_NAMES[kind]
        w[17] = len(kind.wit)
        w[18] = addressof(name)
        w[21] = code & 0xFFFFFFFF
        b = text.encode("utf-8")
        buf = ctypes.create_string_buffer(b, max(len(b), 1))
        w[25] = len(b)
        w[26] = addressof(buf)
        w[29] = wall_secs
        w[33] = flags & 0xFFFFFFFF
        return self._hot(self._f_report, self._rep_addr, 9)

    def report_fallback(self, call: int, now: int, ok: bool) -> int:
        w = self._fw
        w[5] = call
        w[9] = now
        w[13] = 1 if ok else 0
        return self._hot(self._f_fallback, self._fb_addr, 4)

    # ------------------------------------------------------------------ hedged calls

    def _hot_answer(self, f: int, args: int, n: int) -> tuple[list[Any], bool]:
        """A crossing of a hedged call (`hedge-step`, `report-attempt`): bounded work like the
        hot crossings (its fuel comes from the same pool), a `hedge-answer` result lifted
        and freed."""
        if self.dead:
            raise ComponentFault("the component instance is poisoned")
        self._hot_left -= 1
        if self._hot_left <= 0:
            self._refuel_hot()
        err = _CALL(f, self._ctx, args, n, self._answer_addr, 1)
        if err:
            self.dead = True
            raise _fault(err, "component call")
        try:
            out = _lift(self._answer)
        finally:
            _VAL_DELETE(self._answer_addr)
        if self.needs_post_return:
            err = _POST(f, self._ctx)
            if err:
                self.dead = True
                raise _fault(err, "post-return")
        return _hedge_answer(out)

    def hedge_step(self, call: int, now: int) -> tuple[list[Any], bool]:
        """`engine.hedge-step`: the commands (lifted, unchecked) and whether events are pending."""
        w = self._hsw
        w[5] = call
        w[9] = now
        return self._hot_answer(self._addr["hedge-step"], self._hs_addr, 3)

    def report_attempt(
        self,
        call: int,
        attempt: int,
        now: int,
        elapsed: int,
        kind: OutcomeKind,
        code: int,
        text: str,
        wall_secs: int,
        flags: int,
    ) -> tuple[list[Any], bool]:
        """`engine.report-attempt`: as `hedge_step`."""
        w = self._raw
        w[5] = call
        w[9] = attempt & 0xFFFFFFFF
        w[13] = now
        w[17] = elapsed
        name = _OUTCOME_NAMES[kind]
        w[21] = len(kind.wit)
        w[22] = addressof(name)
        w[25] = code & 0xFFFFFFFF
        b = text.encode("utf-8")
        buf = ctypes.create_string_buffer(b, max(len(b), 1))
        w[29] = len(b)
        w[30] = addressof(buf)
        w[33] = wall_secs
        w[37] = flags & 0xFFFFFFFF
        return self._hot_answer(self._addr["report-attempt"], self._ra_addr, 10)

    # ------------------------------------------------------------------ everything else

    def reload(self, document: str) -> list[LoadError] | None:
        work = len(document.encode("utf-8")) + self.state_work()
        tag, val = self._slow("reload", _Args(1).string(0, document), work=work)
        if tag == "ok":
            return None
        return [LoadError(e["path"], e["message"]) for e in val]

    def policy_count(self) -> int:
        return int(self._slow("policy-count"))

    def policy_index(self, name: str) -> int | None:
        r = self._slow("policy-index", _Args(1).string(0, name))
        return None if r is None else int(r)

    def policy_info(self, policy: int) -> PolicyInfo | None:
        r = self._slow("policy-info", _Args(1).u32(0, policy & 0xFFFFFFFF))
        if r is None:
            return None
        return PolicyInfo(
            name=r["name"],
            max_attempts=r["max-attempts"],
            attempt_timeout=r["attempt-timeout"],
            deadline=r["deadline"],
            fallbacks=tuple(r["fallbacks"]),
        )

    def policy_json(self, policy: int) -> str | None:
        r = self._slow("policy-json", _Args(1).u32(0, policy & 0xFFFFFFFF))
        return None if r is None else str(r)

    def analyze(self, policy: int, layers: int) -> Analysis | None:
        r = self._slow("analyze", _Args(2).u32(0, policy & 0xFFFFFFFF).u32(1, layers & 0xFFFFFFFF))
        if r is None:
            return None
        return Analysis(
            worst_attempts=r["worst-attempts"],
            worst_latency=r["worst-latency"],
            amplification=r["amplification"],
            amplification_with_budget=r["amplification-with-budget"],
        )

    def cancel(self, call: int, now: int) -> None:
        self._slow("cancel", _Args(2).u64(0, call).u64(1, now), has_result=False)

    def take_wakes(self) -> list[int]:
        """The calls granted a bulkhead slot since the last take, in grant order."""
        r = self._slow("take-wakes")
        return [int(x) for x in r] if isinstance(r, list) else []

    def call_info(self, call: int) -> CallInfo | None:
        r = self._slow("call-info", _Args(1).u64(0, call))
        if r is None:
            return None
        return CallInfo(
            policy=r["policy"],
            key=r["key"],
            attempts=r["attempts"],
            deadline=r["deadline"],
            last_reason=Reason.from_wit(r["last-reason"]),
            in_flight=r["in-flight"],
        )

    def drain_events(self) -> list[dict[str, Any]]:
        r: list[dict[str, Any]] = self._slow("drain-events")
        return r

    def breaker_state(self, policy: int, key: str, now: int) -> BreakerState | None:
        if key:
            self.keyed_starts += 1
        r = self._slow("breaker-state", _Args(3).u32(0, policy & 0xFFFFFFFF).string(1, key).u64(2, now))
        return None if r is None else BreakerState(r)

    def set_breaker_state(self, policy: int, key: str, state: BreakerState, now: int) -> str | None:
        if key:
            self.keyed_starts += 1
        args = _Args(4).u32(0, policy & 0xFFFFFFFF).string(1, key).enum(2, state.wit).u64(3, now)
        tag, val = self._slow("set-breaker-state", args)
        return None if tag == "ok" else str(val)

    def export_state(self) -> bytes:
        """`export-state`, page by page (`export-state-page`): each crossing copies at most
        `GUARD_STATE_PAGE_BYTES`, so a state of any size crosses (wasmtime-py faults lifting a
        few MB at once). The caller holds the engine's lock across the pages."""
        out = self._export_pages(False)
        self.state_bytes, self.keyed_starts = len(out), 0
        return out

    def export_snapshot(self) -> bytes:
        """`export-snapshot` (page by page, as `export_state`): the keys holding protection only,
        in the format of `export-state` (the recovery snapshot, docs/hosts.md section 7). Its
        work is bounded as an export's: it walks at most the whole state. The bytes say nothing
        of the keys at rest, so the size of the state (`state_bytes`) is left as it was."""
        return self._export_pages(True)

    def _export_pages(self, snapshot: bool) -> bytes:
        out = bytearray()
        cursor = 0
        while True:
            r = self._slow(
                "export-state-page", _Args(2).u64(0, cursor).boolean(1, snapshot), work=self.state_work() + len(out)
            )
            page, nxt = bytes(r["bytes"]), int(r["next"])
            # never trusted: a page within its bound, and a cursor that moves on by its bytes
            if len(page) > GUARD_STATE_PAGE_BYTES or (nxt != 0 and (not page or nxt != cursor + len(page))):
                self.dead = True
                raise ComponentFault(
                    f"export-state-page broke the contract: {len(page)} bytes from cursor {cursor}, next {nxt}"
                )
            out += page
            if nxt == 0:
                return bytes(out)
            cursor = nxt

    def import_state(self, state: bytes) -> LoadError | None:
        """`import-state`, page by page (`import-state-begin`, `-page`, `-end`): each crossing
        copies at most `GUARD_STATE_PAGE_BYTES`. On error nothing changes."""
        self._slow("import-state-begin", has_result=False)
        view = memoryview(state)
        for at in range(0, len(state), GUARD_STATE_PAGE_BYTES):
            page = bytes(view[at : at + GUARD_STATE_PAGE_BYTES])
            tag, val = self._slow("import-state-page", _Args(1).bytes_list(0, page), work=len(page))
            if tag != "ok":
                return LoadError(val["path"], val["message"])
        tag, val = self._slow("import-state-end", work=len(state) + self.state_work())
        if tag != "ok":
            return LoadError(val["path"], val["message"])
        self.state_bytes, self.keyed_starts = len(state), 0
        return None

    # Durable calls (docs/durable.md). Each returns the step or the core's error naming what
    # is wrong with the record; the caller (levee.durable) quarantines on an error.

    def durable_begin(
        self, policy: int, key: str, idempotency_key: str, flags: int, wall_now: int
    ) -> DurableStep | LoadError:
        args = (
            _Args(5)
            .u32(0, policy & 0xFFFFFFFF)
            .string(1, key)
            .string(2, idempotency_key)
            .u32(3, flags & 0xFFFFFFFF)
            .u64(4, wall_now)
        )
        return _durable(self._slow("durable-begin", args))

    def durable_step(self, record: bytes, owner: str, wall_now: int, elapsed: int) -> DurableStep | LoadError:
        args = _Args(4).bytes_list(0, record).string(1, owner).u64(2, wall_now).u64(3, elapsed)
        return _durable(self._slow("durable-step", args))

    def durable_renew(self, record: bytes, owner: str, wall_now: int, elapsed: int) -> DurableStep | LoadError:
        args = _Args(4).bytes_list(0, record).string(1, owner).u64(2, wall_now).u64(3, elapsed)
        return _durable(self._slow("durable-renew", args))

    def durable_outcome(
        self,
        record: bytes,
        owner: str,
        wall_now: int,
        elapsed: int,
        kind: OutcomeKind,
        code: int,
        text: str,
        message: str,
        flags: int,
    ) -> DurableStep | LoadError:
        args = (
            _Args(9)
            .bytes_list(0, record)
            .string(1, owner)
            .u64(2, wall_now)
            .u64(3, elapsed)
            .enum(4, kind.wit)
            .s32(5, code)
            .string(6, text)
            .string(7, message)
            .u32(8, flags & 0xFFFFFFFF)
        )
        return _durable(self._slow("durable-outcome", args))

    def durable_cancel(self, record: bytes, wall_now: int) -> DurableStep | LoadError:
        return _durable(self._slow("durable-cancel", _Args(2).bytes_list(0, record).u64(1, wall_now)))

    def durable_revive(self, record: bytes, wall_now: int) -> DurableStep | LoadError:
        return _durable(self._slow("durable-revive", _Args(2).bytes_list(0, record).u64(1, wall_now)))

    def durable_inspect(self, record: bytes) -> str | LoadError:
        tag, val = self._slow("durable-inspect", _Args(1).bytes_list(0, record))
        return str(val) if tag == "ok" else LoadError(val["path"], val["message"])

    # The durable executor's machine (`resource executor`, docs/durable.md "The executor"). An
    # executor is an `int`, its resource handle: it lives in this instance only.

    def executor_new(self, config: ExecutorConfig) -> int:
        """`[constructor]executor`: a new machine in this instance."""
        low = (
            "record",
            [
                ("owner", ("string", config.owner)),
                ("concurrency", ("u32", _clamp(config.concurrency, 0xFFFFFFFF))),
                ("poll", ("u64", _clamp(config.poll, _U64))),
                ("claim-hold", ("u64", _clamp(config.claim_hold, _U64))),
                ("until-idle", ("bool", config.until_idle)),
            ],
        )
        ptr = self._slow("executor.new", _Args(1).val(0, low))
        if not isinstance(ptr, int) or isinstance(ptr, bool) or not ptr:
            self.dead = True
            raise ComponentFault(f"the executor constructor answered {ptr!r}, not a resource")
        self._executors.add(ptr)
        return ptr

    def executor_register(self, x: int, name: str) -> None:
        """`executor.register`: calls of handler `name` may run in this process."""
        self._slow("executor.register", _Args(1).string(0, name), has_result=False, this=self._held(x))

    def executor_running(self, x: int) -> int:
        """`executor.running`: the calls the machine holds."""
        n = self._slow("executor.running", this=self._held(x))
        if not isinstance(n, int) or isinstance(n, bool):
            self.dead = True
            raise ComponentFault(f"executor.running answered {n!r}")
        return n

    def executor_feed(self, x: int, now: int, event: ExecEvent) -> list[ExecCommand]:
        """`executor.feed`: what happened at `now` (monotonic ns); the commands, in order. An
        answer that is not a list of commands breaks the contract (`ComponentFault`, the
        instance is not used again)."""
        low, work = _exec_event(event)
        args = _Args(3).resource(0, self._res).u64(1, _clamp(now, _U64)).val(2, low)
        raw = self._slow("executor.feed", args, work=work, this=self._held(x))
        try:
            return _exec_commands(raw)
        except (KeyError, TypeError, ValueError, IndexError) as e:
            self.dead = True
            raise ComponentFault(f"executor.feed broke the contract: {e}") from None

    def executor_forget(self, x: int, call_id: int) -> None:
        """`executor.forget`: drop call `call_id` (its handler was stopped at shutdown)."""
        self._slow("executor.forget", _Args(1).s64(0, _s64(call_id)), has_result=False, this=self._held(x))

    def executor_operator(self, call_id: int, record: bytes, revive: bool, wall_now: int) -> RowWrite | LoadError:
        """`executor.operator` (static): what an operator's cancel (`revive` False) or retry
        writes, compare-and-set against `record`; the core's error when it changes nothing."""
        args = _Args(4).s64(0, _s64(call_id)).bytes_list(1, record).boolean(2, revive).u64(3, _clamp(wall_now, _U64))
        tag, val = self._slow("executor.operator", args, work=len(record))
        if tag != "ok":
            return LoadError(str(val["path"]), str(val["message"]))
        try:
            return _row_write(val)
        except (KeyError, TypeError, ValueError) as e:
            self.dead = True
            raise ComponentFault(f"executor.operator broke the contract: {e}") from None

    def executor_drop(self, x: int) -> None:
        """Drop an executor resource (every one is dropped by `close`)."""
        if x not in self._executors:
            return
        self._executors.discard(x)
        p = ctypes.cast(x, POINTER(ffi.wasmtime_component_resource_any_t))
        if not self.dead:
            err = ffi.wasmtime_component_resource_any_drop(self.store._context(), p)
            if err:
                self.dead = True
        ffi.wasmtime_component_resource_any_delete(p)

    def _held(self, x: int) -> int:
        if x not in self._executors:
            raise ValueError("this executor does not belong to this component instance (or was dropped)")
        return x

    # Fleet-wide state (levee.fleet; docs/fleet.md).
    def fleet_plan(self, policy: int) -> str | None:
        r = self._slow("fleet-plan", _Args(1).u32(0, policy & 0xFFFFFFFF))
        return None if r is None else str(r)

    def _fleet_args(self, policy: int, key: str, node: str, now: int, wall_ms: int, shared: bytes) -> _Args:
        return (
            _Args(6)
            .u32(0, policy & 0xFFFFFFFF)
            .string(1, key)
            .string(2, node)
            .u64(3, now)
            .u64(4, wall_ms)
            .bytes_list(5, shared)
        )

    def fleet_merge(self, policy: int, key: str, node: str, now: int, wall_ms: int, shared: bytes) -> bytes | LoadError:
        tag, val = self._slow("fleet-merge", self._fleet_args(policy, key, node, now, wall_ms, shared))
        if tag != "ok":
            return LoadError(str(val["path"]), str(val["message"]))
        return bytes(val) if val else b""

    def fleet_apply(self, policy: int, key: str, node: str, now: int, wall_ms: int, shared: bytes) -> LoadError | None:
        tag, val = self._slow("fleet-apply", self._fleet_args(policy, key, node, now, wall_ms, shared))
        return None if tag == "ok" else LoadError(str(val["path"]), str(val["message"]))

    def fleet_inspect(self, shared: bytes) -> str | LoadError:
        tag, val = self._slow("fleet-inspect", _Args(1).bytes_list(0, shared))
        return str(val) if tag == "ok" else LoadError(str(val["path"]), str(val["message"]))


_U64 = (1 << 64) - 1
_BARE = frozenset({"load", "executor.new"})  # functions that take no resource first
_EXECUTOR_FUNCS = (
    ("[constructor]executor", "executor.new"),
    ("[method]executor.register", "executor.register"),
    ("[method]executor.running", "executor.running"),
    ("[method]executor.feed", "executor.feed"),
    ("[method]executor.forget", "executor.forget"),
    ("[static]executor.operator", "executor.operator"),
)


def _clamp(x: int, top: int) -> int:
    return min(max(0, int(x)), top)


def _s64(x: int) -> int:
    return min(max(-(1 << 63), int(x)), (1 << 63) - 1)


def _exec_event(ev: ExecEvent) -> tuple[Low, int]:
    """An `exec-event` to lower, and the bytes the core walks for it (records, texts)."""
    if isinstance(ev, ExecPoll):
        return ("variant", "poll", None), 0
    if isinstance(ev, ExecClaimed):
        rows: list[Low] = [
            (
                "record",
                [
                    ("id", ("s64", _s64(r.id))),
                    ("handler", ("string", r.handler)),
                    ("bytes", ("bytes", bytes(r.record))),
                    ("db-now", ("u64", _clamp(r.db_now, _U64))),
                ],
            )
            for r in ev.rows
        ]
        work = sum(len(r.record) + len(r.handler) for r in ev.rows)
        return ("variant", "claimed", ("list", rows)), work
    if isinstance(ev, ExecClaimFailed):
        return ("variant", "claim-failed", ("string", ev.error)), len(ev.error)
    if isinstance(ev, ExecDueIn):
        due = None if ev.due_in is None else ("u64", _clamp(ev.due_in, _U64))
        return ("variant", "next-due", ("option", due)), 0
    if isinstance(ev, ExecWritten):
        res = ev.result
        low: Low
        if isinstance(res, WriteFailed):
            low = ("variant", "failed", ("string", res.error))
        elif res == "lost":
            low = ("variant", "lost", None)
        else:
            low = ("variant", "applied", None)
        rec = ("record", [("id", ("s64", _s64(ev.id))), ("result", low)])
        return ("variant", "written", rec), len(res.error) if isinstance(res, WriteFailed) else 0
    if isinstance(ev, ExecRenew):
        return ("variant", "renew", ("s64", _s64(ev.id))), 0
    fields: list[tuple[str, Low]] = [
        ("id", ("s64", _s64(ev.id))),
        ("kind", ("enum", ev.kind.wit)),
        ("code", ("s32", min(max(-(1 << 31), int(ev.code)), (1 << 31) - 1))),
        ("text", ("string", ev.text)),
        ("message", ("string", ev.message)),
        ("flags", ("u32", _clamp(ev.flags, 0xFFFFFFFF))),
    ]
    return ("variant", "finished", ("record", fields)), len(ev.text) + len(ev.message)


def _int(v: Any) -> int:
    if not isinstance(v, int) or isinstance(v, bool):
        raise TypeError(f"{v!r} is not an integer")
    return v


def _text(v: Any) -> str:
    if not isinstance(v, str):
        raise TypeError(f"{v!r} is not a string")
    return v


def _row_write(v: Any) -> RowWrite:
    """A lifted `row-write`, checked."""
    error = v["error"]
    raw = v["bytes"]
    if not isinstance(raw, bytes | list) or not isinstance(v["lease"], bool) or not isinstance(v["keep-result"], bool):
        raise TypeError(f"a malformed row-write: {v!r}")
    return RowWrite(
        id=_int(v["id"]),
        status=_text(v["status"]),
        next_at=_int(v["next-at"]),
        attempts=_int(v["attempts"]),
        record=bytes(raw),
        lease=v["lease"],
        keep_result=v["keep-result"],
        error=None if error is None else _text(error),
    )


_NO_PAYLOAD: dict[str, ExecCommand] = {"next-due": ExecNextDue(), "idle": ExecIdle()}


def _exec_commands(raw: Any) -> list[ExecCommand]:
    """A lifted `list<exec-command>`, checked (never trusting the guest)."""
    if not isinstance(raw, list):
        raise TypeError(f"{raw!r} is not a list of commands")
    out: list[ExecCommand] = []
    for item in raw:
        case, val = item
        if case == "claim":
            out.append(ExecClaim(_int(val["limit"]), _int(val["hold"])))
        elif case == "write":
            out.append(_row_write(val))
        elif case == "run":
            out.append(ExecRun(_int(val["id"]), _int(val["attempt"]), _int(val["timeout"]), _int(val["renew-every"])))
        elif case == "abandon":
            out.append(ExecAbandon(_int(val)))
        elif case == "quarantine":
            out.append(ExecQuarantine(_int(val["id"]), _text(val["error"])))
        elif case == "sleep":
            out.append(ExecSleep(_int(val)))
        elif case == "log":
            level = _text(val["level"])
            if level not in ("warn", "error"):
                raise ValueError(f"log level {level!r}")
            out.append(ExecLog(level, _int(val["id"]), _text(val["text"])))
        elif case in _NO_PAYLOAD:
            out.append(_NO_PAYLOAD[case])
        else:
            raise ValueError(f"unknown command {case!r}")
    return out


def _hedge_answer(r: Any) -> tuple[list[Any], bool]:
    """A lifted `hedge-answer`: its commands as the guest gave them (`(case, payload)` pairs;
    the driver checks them) and its events bit. A malformed record becomes a `malformed`
    command, which the driver's check refuses (a contract fault)."""
    if not isinstance(r, dict) or not isinstance(r.get("commands"), list):
        return [("malformed", r)], False
    return r["commands"], r.get("events-pending") is True


def _durable(r: tuple[str, Any]) -> DurableStep | LoadError:
    """Lift a `result<durable-step, load-error>`, checking what the guest sent."""
    tag, val = r
    if tag != "ok":
        return LoadError(str(val["path"]), str(val["message"]))
    raw = val["bytes"]
    return DurableStep(
        action=DurableAction(val["action"]),
        attempt=int(val["attempt"]),
        wait=int(val["wait"]),
        timeout=int(val["timeout"]),
        next_at=int(val["next-at"]),
        lease_until=int(val["lease-until"]),
        reason=DurableReason(val["reason"]),
        policy_changed=bool(val["policy-changed"]),
        record=bytes(raw) if raw else b"",
    )


def event_from_raw(raw: dict[str, Any], policy_names: list[str]) -> Event:
    """Turn a lifted `event` record into an `Event` (never trusting the guest's indices)."""
    idx = int(raw["policy"])
    return Event(
        at=raw["at"],
        kind=EventKind(raw["kind"]),
        policy=policy_names[idx] if 0 <= idx < len(policy_names) else f"#{idx}",
        policy_index=idx,
        key=raw["key"],
        call=raw["call"],
        attempt=raw["attempt"],
        reason=Reason.from_wit(raw["reason"]),
        duration=raw["duration"],
        state_from=BreakerState(raw["state-from"]),
        state_to=BreakerState(raw["state-to"]),
        name=raw["name"],
        value=raw["value"],
    )


class LoadErrors(Exception):
    """Internal: `load` returned errors."""

    def __init__(self, errors: list[LoadError]) -> None:
        super().__init__("; ".join(str(e) for e in errors))
        self.errors = errors

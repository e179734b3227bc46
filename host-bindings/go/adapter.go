package levee

// A fused adapter for the hot path, in the manner of wasmtime's fused adapters.
//
// Lowering the `key` string of `start` takes a call of `cabi_realloc` before
// the call of `start`; under wazero's guest-call bound every call into the
// module costs a goroutine, so a keyed start would cost two. This tiny module,
// built here byte by byte, does the same lowering inside Wasm in one call:
//
//	(module
//	  (import "levee-core" "memory" (memory 0))
//	  (import "levee-core" "cabi_realloc" (func $realloc (param i32 i32 i32 i32) (result i32)))
//	  (import "levee-core" "levee:policy/engine-api@0.1.0#[method]engine.start"
//	    (func $start (param i32 i64 i32 i32 i32 i32 i64 i64 i64 i64) (result i64)))
//	  (func (export "start") (param $rep i32) (param $call i64) (param $policy i32)
//	        (param $src i32) (param $len i32) (param $flags i32) (param $now i64)
//	        (param $sc i64) (param $sa i64) (param $se i64) (result i64) (local $ptr i32)
//	    (if (local.get $len)
//	      (then (local.set $ptr (call $realloc (i32.const 0) (i32.const 0) (i32.const 1) (local.get $len)))
//	            (memory.copy (local.get $ptr) (local.get $src) (local.get $len)))
//	      (else (local.set $ptr (i32.const 1))))
//	    (call $start (local.get $rep) (local.get $call) (local.get $policy) (local.get $ptr)
//	      (local.get $len) (local.get $flags) (local.get $now) (local.get $sc) (local.get $sa) (local.get $se))))
//
// The host writes the key's bytes into a scratch buffer it allocated once in the
// guest with cabi_realloc (and never hands to the guest), then calls this
// function: realloc(0, 0, 1, len), the copy into the new allocation (bounds
// checked by memory.copy) and the call of `start` are exactly the Canonical
// ABI's lowering of a string, done in Wasm.

const coreModuleName = "levee-core"

func wasmName(s string) []byte { return append(uleb(uint32(len(s))), s...) }

func uleb(v uint32) []byte {
	var out []byte
	for {
		b := byte(v & 0x7f)
		v >>= 7
		if v != 0 {
			out = append(out, b|0x80)
			continue
		}
		return append(out, b)
	}
}

func wasmSection(id byte, body []byte) []byte {
	return append(append([]byte{id}, uleb(uint32(len(body)))...), body...)
}

// startAdapterWasm builds the adapter module above.
func startAdapterWasm() []byte {
	const i32, i64 = 0x7f, 0x7e
	startParams := []byte{i32, i64, i32, i32, i32, i32, i64, i64, i64, i64}
	types := []byte{2,
		0x60, 4, i32, i32, i32, i32, 1, i32, // 0: cabi_realloc
		0x60, byte(len(startParams))} // 1: start (and the adapter)
	types = append(append(types, startParams...), 1, i64)

	imports := []byte{3}
	imports = append(append(append(imports, wasmName(coreModuleName)...), wasmName(exportMemory)...), 0x02, 0x00, 0x00)
	imports = append(append(append(imports, wasmName(coreModuleName)...), wasmName(exportRealloc)...), 0x00, 0)
	imports = append(append(append(imports, wasmName(coreModuleName)...), wasmName(sigs[fnStart].export)...), 0x00, 1)

	funcs := []byte{1, 1}
	exports := append(append([]byte{1}, wasmName("start")...), 0x00, 2)

	code := []byte{
		1, 1, 0x7f, // one local entry: 1 x i32, $ptr (index 10)
		0x20, 4, 0x04, 0x40, // if (local.get $len)
		0x41, 0, 0x41, 0, 0x41, 1, 0x20, 4, 0x10, 0, 0x21, 10, // $ptr = realloc(0, 0, 1, len)
		0x20, 10, 0x20, 3, 0x20, 4, 0xfc, 10, 0, 0, // memory.copy $ptr $src $len
		0x05, 0x41, 1, 0x21, 10, // else $ptr = 1
		0x0b,
		0x20, 0, 0x20, 1, 0x20, 2, 0x20, 10, 0x20, 4, 0x20, 5, 0x20, 6, 0x20, 7, 0x20, 8, 0x20, 9,
		0x10, 1, // call $start
		0x0b,
	}
	body := append(uleb(uint32(len(code))), code...)
	codeSec := append([]byte{1}, body...)

	m := []byte{0x00, 0x61, 0x73, 0x6d, 0x01, 0x00, 0x00, 0x00}
	m = append(m, wasmSection(1, types)...)
	m = append(m, wasmSection(2, imports)...)
	m = append(m, wasmSection(3, funcs)...)
	m = append(m, wasmSection(7, exports)...)
	m = append(m, wasmSection(10, codeSec)...)
	return m
}

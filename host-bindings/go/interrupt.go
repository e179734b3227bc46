package levee

import (
	"errors"
	"fmt"
)

// The guest-call bound without a goroutine per call.
//
// wazero v1.12.0 can interrupt a guest only with WithCloseOnContextDone, and
// with it every call into the module starts a goroutine (callWithStack calls
// CloseModuleOnCanceledOrTimeout whatever the context, even one whose Done is
// nil) and every loop header exits to Go to check the module's closed flag.
// Both cost far more than the core's work on the hot path.
//
// Instead the host instruments the core module before compiling it: it adds
// two mutable i32 globals, $fuel and $interrupt (exported as interruptExport),
// and at the head of every loop of every function it inserts
//
//	global.get $fuel
//	i32.eqz
//	if                          ;; every interruptEvery iterations:
//	  i32.const interruptEvery
//	  global.set $fuel
//	  i32.const 0
//	  memory.grow 0             ;; an exit to Go, where the goroutine can be preempted
//	  drop
//	  global.get $interrupt
//	  if unreachable end        ;; the watchdog asked: trap
//	end
//	global.get $fuel
//	i32.const 1
//	i32.sub
//	global.set $fuel
//
// (a few instructions per iteration, in native code). The engine's watchdog
// goroutine sets $interrupt to 1 when a guest call has run longer than its
// bound; within interruptEvery iterations the call traps, and the trap recovery
// takes over. The exit to Go matters: native code cannot be preempted, so a loop
// that never left it would stall the Go runtime at its next stop-the-world
// (a GC), the watchdog included, forever. `memory.grow 0` is such an exit in
// wazero (it calls MemoryInstance.Grow, which returns the size for 0) with no
// effect on the guest. A guest cannot touch the new globals: its code was
// validated without them, and the instrumentation only adds its own uses. As with
// wazero's own check, only loops are checked (unbounded recursion ends in a stack
// overflow, which is a trap).

// interruptEvery is how many loop iterations run between two checks.
const interruptEvery = 10000

const interruptExport = "levee-host:interrupt"

const (
	secCustom = 0
	secImport = 2
	secGlobal = 6
	secExport = 7
	secCode   = 10
)

type wasmReader struct {
	b   []byte
	pos int
	err error
}

func (r *wasmReader) fail(format string, args ...any) {
	if r.err == nil {
		r.err = fmt.Errorf("levee: instrument core module at byte %d: %s", r.pos, fmt.Sprintf(format, args...))
	}
}

func (r *wasmReader) byte() byte {
	if r.err != nil {
		return 0
	}
	if r.pos >= len(r.b) {
		r.fail("unexpected end")
		return 0
	}
	c := r.b[r.pos]
	r.pos++
	return c
}

// u32 reads an unsigned LEB128 of at most 5 bytes.
func (r *wasmReader) u32() uint32 {
	var v uint32
	for shift := 0; shift < 35; shift += 7 {
		c := r.byte()
		v |= uint32(c&0x7f) << shift
		if c&0x80 == 0 {
			return v
		}
	}
	r.fail("LEB128 u32 too long")
	return 0
}

// skipLEB skips a (signed or unsigned) LEB128 of at most max bytes.
func (r *wasmReader) skipLEB(max int) {
	for i := 0; i < max; i++ {
		if r.byte()&0x80 == 0 {
			return
		}
	}
	r.fail("LEB128 too long")
}

func (r *wasmReader) skip(n int) {
	if r.err == nil && (n < 0 || r.pos+n > len(r.b)) {
		r.fail("unexpected end")
		return
	}
	r.pos += n
}

func (r *wasmReader) name() string {
	n := int(r.u32())
	start := r.pos
	r.skip(n)
	if r.err != nil {
		return ""
	}
	return string(r.b[start:r.pos])
}

func (r *wasmReader) blockType() {
	c := r.byte()
	switch c {
	case 0x40, 0x7f, 0x7e, 0x7d, 0x7c, 0x7b, 0x70, 0x6f:
	default:
		r.pos--
		r.skipLEB(5) // s33 type index
	}
}

func (r *wasmReader) memarg() {
	align := r.u32()
	if align&0x40 != 0 {
		r.u32() // memory index (multi-memory)
	}
	r.skipLEB(10) // offset
}

func appendU32(b []byte, v uint32) []byte {
	for {
		c := byte(v & 0x7f)
		v >>= 7
		if v != 0 {
			b = append(b, c|0x80)
		} else {
			return append(b, c)
		}
	}
}

// appendS32 appends a signed LEB128 (the immediate of i32.const).
func appendS32(b []byte, v int32) []byte {
	for {
		c := byte(v & 0x7f)
		v >>= 7
		if (v == 0 && c&0x40 == 0) || (v == -1 && c&0x40 != 0) {
			return append(b, c)
		}
		b = append(b, c|0x80)
	}
}

func appendSection(b []byte, id byte, body []byte) []byte {
	b = append(b, id)
	b = appendU32(b, uint32(len(body)))
	return append(b, body...)
}

// instrumentInterrupt returns the module with the interrupt global and a check of
// it at every loop head. It refuses (with an error) anything it cannot decode.
func instrumentInterrupt(wasm []byte) ([]byte, error) {
	if len(wasm) < 8 || string(wasm[:4]) != "\x00asm" || wasm[4] != 1 || wasm[5] != 0 || wasm[6] != 0 || wasm[7] != 0 {
		return nil, errors.New("levee: instrument core module: not a core Wasm module (version 1)")
	}
	type section struct {
		id   byte
		body []byte
	}
	var secs []section
	r := &wasmReader{b: wasm, pos: 8}
	for r.err == nil && r.pos < len(wasm) {
		id := r.byte()
		n := int(r.u32())
		start := r.pos
		r.skip(n)
		if r.err == nil {
			secs = append(secs, section{id, wasm[start:r.pos]})
		}
	}
	if r.err != nil {
		return nil, r.err
	}
	// Index of the new global: after the imported and the defined ones.
	var importedGlobals, definedGlobals uint32
	hasGlobal, hasExport, hasMemory := false, false, false
	for _, s := range secs {
		sr := &wasmReader{b: s.body}
		switch s.id {
		case secImport:
			for n := sr.u32(); n > 0 && sr.err == nil; n-- {
				sr.name()
				sr.name()
				switch kind := sr.byte(); kind {
				case 0: // func
					sr.u32()
				case 1: // table: reftype, limits
					sr.byte()
					if sr.byte()&1 != 0 {
						sr.u32()
					}
					sr.u32()
				case 2: // memory: limits
					hasMemory = true
					flags := sr.byte()
					sr.skipLEB(10)
					if flags&1 != 0 {
						sr.skipLEB(10)
					}
				case 3: // global
					sr.byte()
					sr.byte()
					importedGlobals++
				case 4: // tag
					sr.byte()
					sr.u32()
				default:
					sr.fail("import kind %d", kind)
				}
			}
		case 5:
			hasMemory = hasMemory || sr.u32() > 0
		case secGlobal:
			hasGlobal = true
			definedGlobals = sr.u32()
		case secExport:
			hasExport = true
			for n := sr.u32(); n > 0 && sr.err == nil; n-- {
				if sr.name() == interruptExport {
					return nil, fmt.Errorf("levee: instrument core module: it already exports %q", interruptExport)
				}
				sr.byte()
				sr.u32()
			}
		}
		if sr.err != nil {
			return nil, sr.err
		}
	}
	if !hasMemory {
		return nil, errors.New("levee: instrument core module: it has no memory")
	}
	fuel := importedGlobals + definedGlobals
	intr := fuel + 1
	check := appendU32([]byte{0x23}, fuel)
	check = append(check, 0x45, 0x04, 0x40, 0x41)
	check = appendS32(check, interruptEvery)
	check = appendU32(append(check, 0x24), fuel)
	check = append(check, 0x41, 0x00, 0x40, 0x00, 0x1a)
	check = appendU32(append(check, 0x23), intr)
	check = append(check, 0x04, 0x40, 0x00, 0x0b, 0x0b)
	check = appendU32(append(check, 0x23), fuel)
	check = append(check, 0x41, 0x01, 0x6b, 0x24)
	check = appendU32(check, fuel)
	// (mut i32) = interruptEvery, (mut i32) = 0
	newGlobal := appendS32([]byte{0x7f, 0x01, 0x41}, interruptEvery)
	newGlobal = append(newGlobal, 0x0b, 0x7f, 0x01, 0x41, 0x00, 0x0b)
	newExport := appendU32(nil, uint32(len(interruptExport)))
	newExport = append(newExport, interruptExport...)
	newExport = append(newExport, 0x03)
	newExport = appendU32(newExport, intr)

	out := append([]byte(nil), wasm[:8]...)
	// order of the known sections (custom sections go where they were)
	order := func(id byte) int {
		switch id {
		case 1, 2, 3, 4, 5:
			return int(id)
		case 13: // tag
			return 5
		case secGlobal:
			return 6
		case secExport:
			return 7
		case 8, 9:
			return int(id)
		case 12: // data count
			return 9
		case secCode:
			return 10
		case 11:
			return 11
		}
		return -1
	}
	for _, s := range secs {
		if s.id != secCustom {
			if !hasGlobal && order(s.id) > order(secGlobal) {
				out = appendSection(out, secGlobal, append([]byte{2}, newGlobal...))
				hasGlobal = true
			}
			if !hasExport && order(s.id) > order(secExport) {
				out = appendSection(out, secExport, append([]byte{1}, newExport...))
				hasExport = true
			}
		}
		switch s.id {
		case secGlobal:
			body := appendU32(nil, definedGlobals+2)
			sr := &wasmReader{b: s.body}
			sr.u32()
			body = append(body, s.body[sr.pos:]...)
			out = appendSection(out, secGlobal, append(body, newGlobal...))
		case secExport:
			sr := &wasmReader{b: s.body}
			n := sr.u32()
			body := appendU32(nil, n+1)
			body = append(body, s.body[sr.pos:]...)
			out = appendSection(out, secExport, append(body, newExport...))
		case secCode:
			body, err := instrumentCode(s.body, check)
			if err != nil {
				return nil, err
			}
			out = appendSection(out, secCode, body)
		default:
			out = appendSection(out, s.id, s.body)
		}
	}
	if !hasGlobal {
		out = appendSection(out, secGlobal, append([]byte{2}, newGlobal...))
	}
	if !hasExport {
		out = appendSection(out, secExport, append([]byte{1}, newExport...))
	}
	return out, nil
}

// instrumentCode inserts check after the block type of every loop.
func instrumentCode(code, check []byte) ([]byte, error) {
	r := &wasmReader{b: code}
	n := r.u32()
	out := appendU32(make([]byte, 0, len(code)+len(code)/8), n)
	var fb []byte
	for i := uint32(0); i < n && r.err == nil; i++ {
		size := int(r.u32())
		start := r.pos
		r.skip(size)
		if r.err != nil {
			break
		}
		f := &wasmReader{b: code[start:r.pos]}
		for locals := f.u32(); locals > 0 && f.err == nil; locals-- {
			f.u32()
			f.byte()
		}
		fb = append(fb[:0], f.b[:f.pos]...)
		last := f.pos
		for f.err == nil && f.pos < len(f.b) {
			if f.b[f.pos] == 0x03 { // loop
				f.pos++
				f.blockType()
				fb = append(fb, f.b[last:f.pos]...)
				fb = append(fb, check...)
				last = f.pos
				continue
			}
			f.instruction()
		}
		if f.err != nil {
			return nil, fmt.Errorf("function %d: %w", i, f.err)
		}
		fb = append(fb, f.b[last:]...)
		out = appendU32(out, uint32(len(fb)))
		out = append(out, fb...)
	}
	if r.err != nil {
		return nil, r.err
	}
	if r.pos != len(code) {
		return nil, errors.New("levee: instrument core module: trailing bytes in the code section")
	}
	return out, nil
}

// instruction skips one instruction (opcode and immediates).
func (r *wasmReader) instruction() {
	op := r.byte()
	switch {
	case op == 0x00 || op == 0x01 || op == 0x05 || op == 0x0a || op == 0x0b || op == 0x0f || op == 0x19 ||
		op == 0x1a || op == 0x1b || op == 0xd1 || (op >= 0x45 && op <= 0xc4):
		// no immediates
	case op == 0x02 || op == 0x03 || op == 0x04 || op == 0x06:
		r.blockType()
	case op == 0x07 || op == 0x08 || op == 0x09 || op == 0x0c || op == 0x0d || op == 0x10 || op == 0x12 ||
		op == 0x18 || (op >= 0x20 && op <= 0x26) || op == 0x3f || op == 0x40 || op == 0xd2:
		r.u32()
	case op == 0x0e: // br_table
		for n := r.u32(); n > 0 && r.err == nil; n-- {
			r.u32()
		}
		r.u32()
	case op == 0x11 || op == 0x13: // call_indirect, return_call_indirect
		r.u32()
		r.u32()
	case op == 0x1c: // select t*
		for n := r.u32(); n > 0 && r.err == nil; n-- {
			r.byte()
		}
	case op == 0x1f: // try_table
		r.blockType()
		for n := r.u32(); n > 0 && r.err == nil; n-- {
			if kind := r.byte(); kind <= 1 {
				r.u32()
			}
			r.u32()
		}
	case op >= 0x28 && op <= 0x3e:
		r.memarg()
	case op == 0x41:
		r.skipLEB(5)
	case op == 0x42:
		r.skipLEB(10)
	case op == 0x43:
		r.skip(4)
	case op == 0x44:
		r.skip(8)
	case op == 0xd0: // ref.null heaptype
		r.skipLEB(5)
	case op == 0xfc:
		switch sub := r.u32(); {
		case sub <= 7:
		case sub == 8, sub == 10, sub == 12, sub == 14: // memory.init, memory.copy, table.init, table.copy
			r.u32()
			r.u32()
		case sub == 9 || sub == 11 || sub == 13 || sub == 15 || sub == 16 || sub == 17:
			r.u32()
		default:
			r.fail("unknown 0xfc %d", sub)
		}
	case op == 0xfd:
		switch sub := r.u32(); {
		case sub <= 11 || sub == 92 || sub == 93:
			r.memarg()
		case sub == 12 || sub == 13:
			r.skip(16)
		case sub >= 21 && sub <= 34:
			r.byte()
		case sub >= 84 && sub <= 91:
			r.memarg()
			r.byte()
		}
	case op == 0xfe:
		if sub := r.u32(); sub == 3 {
			r.byte()
		} else {
			r.memarg()
		}
	default:
		r.fail("unknown opcode 0x%02x", op)
	}
}

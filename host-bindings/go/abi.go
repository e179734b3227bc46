package levee

// The Canonical ABI (component-model CanonicalABI.md), written once for the
// types that wit/levee.wit uses. wazero has no component model, so this file
// is the part of the component model the Go host needs: type layouts
// (alignment, size, field offsets, discriminant sizes), flattening of function
// signatures (MAX_FLAT_PARAMS = 16, MAX_FLAT_RESULTS = 1), and bounds-checked
// loads and stores on the guest's linear memory. bindings.go uses it to lift
// and lower every function of the `engine-api` interface; the layouts are
// computed here from the WIT's types, never written as bare numbers.

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"unicode/utf8"

	"github.com/tetratelabs/wazero/api"
)

// Limits of the Canonical ABI.
const (
	maxFlatParams  = 16
	maxFlatResults = 1
	// maxStringByteLength is MAX_STRING_BYTE_LENGTH = (1 << 31) - 1.
	maxStringByteLength = (1 << 31) - 1
)

// typeKind enumerates the WIT types that levee.wit uses.
type typeKind uint8

const (
	kBool typeKind = iota
	kU8
	kU32
	kS32
	kU64
	kS64
	kF64
	kString
	kList
	kRecord
	kVariant // enum, option and result are despecialized into variants
	kOwn     // own<resource>: an i32 handle
)

// flat core value types.
type flatType uint8

const (
	fI32 flatType = iota
	fI64
	fF32
	fF64
)

func (f flatType) String() string {
	switch f {
	case fI32:
		return "i32"
	case fI64:
		return "i64"
	case fF32:
		return "f32"
	default:
		return "f64"
	}
}

func (f flatType) valueType() api.ValueType {
	switch f {
	case fI32:
		return api.ValueTypeI32
	case fI64:
		return api.ValueTypeI64
	case fF32:
		return api.ValueTypeF32
	default:
		return api.ValueTypeF64
	}
}

// witType describes a WIT type with its Canonical ABI layout, computed once.
type witType struct {
	kind    typeKind
	name    string
	elem    *witType   // list
	fields  []*witType // record fields; variant case payloads (nil = no payload)
	names   []string   // record field names; variant case names
	offsets []int      // record field offsets
	payload int        // variant: offset of the payload
	discSz  int        // variant: discriminant size in bytes
	size    int
	align   int
	flat    []flatType
}

func alignTo(ptr, align int) int { return (ptr + align - 1) / align * align }

func prim(kind typeKind, name string, size int, flat flatType) *witType {
	return &witType{kind: kind, name: name, size: size, align: size, flat: []flatType{flat}}
}

var (
	tBool   = prim(kBool, "bool", 1, fI32)
	tU8     = prim(kU8, "u8", 1, fI32)
	tU32    = prim(kU32, "u32", 4, fI32)
	tS32    = prim(kS32, "s32", 4, fI32)
	tU64    = prim(kU64, "u64", 8, fI64)
	tS64    = prim(kS64, "s64", 8, fI64)
	tF64    = prim(kF64, "f64", 8, fF64)
	tString = &witType{kind: kString, name: "string", size: 8, align: 4, flat: []flatType{fI32, fI32}}
)

func ownOf(resource string) *witType {
	return &witType{kind: kOwn, name: "own<" + resource + ">", size: 4, align: 4, flat: []flatType{fI32}}
}

func listOf(elem *witType) *witType {
	return &witType{kind: kList, name: "list<" + elem.name + ">", elem: elem, size: 8, align: 4, flat: []flatType{fI32, fI32}}
}

// recordOf lays a record out: each field at the next offset aligned to it,
// the size rounded up to the record's alignment (the largest field alignment).
func recordOf(name string, kv ...any) *witType {
	t := &witType{kind: kRecord, name: name, align: 1}
	for i := 0; i < len(kv); i += 2 {
		t.names = append(t.names, kv[i].(string))
		t.fields = append(t.fields, kv[i+1].(*witType))
	}
	s := 0
	for _, f := range t.fields {
		s = alignTo(s, f.align)
		t.offsets = append(t.offsets, s)
		s += f.size
		t.align = max(t.align, f.align)
		t.flat = append(t.flat, f.flat...)
	}
	t.size = alignTo(s, t.align)
	return t
}

// discriminantSize is discriminant_type: u8 up to 256 cases, u16 up to 65536, else u32.
func discriminantSize(n int) int {
	switch {
	case n <= 1<<8:
		return 1
	case n <= 1<<16:
		return 2
	default:
		return 4
	}
}

func joinFlat(a, b flatType) flatType {
	if a == b {
		return a
	}
	if (a == fI32 && b == fF32) || (a == fF32 && b == fI32) {
		return fI32
	}
	return fI64
}

// variantOf lays a variant out: the discriminant, then the payload at the
// largest case alignment; flattening joins the cases' flat types position by position.
func variantOf(name string, names []string, payloads []*witType) *witType {
	t := &witType{kind: kVariant, name: name, names: names, fields: payloads}
	t.discSz = discriminantSize(len(names))
	maxCaseAlign, maxCaseSize := 1, 0
	var flat []flatType
	for _, p := range payloads {
		if p == nil {
			continue
		}
		maxCaseAlign = max(maxCaseAlign, p.align)
		maxCaseSize = max(maxCaseSize, p.size)
		for i, ft := range p.flat {
			if i < len(flat) {
				flat[i] = joinFlat(flat[i], ft)
			} else {
				flat = append(flat, ft)
			}
		}
	}
	t.align = max(t.discSz, maxCaseAlign)
	t.payload = alignTo(t.discSz, maxCaseAlign)
	t.size = alignTo(t.payload+maxCaseSize, t.align)
	t.flat = append([]flatType{fI32}, flat...)
	return t
}

func enumOf(name string, cases ...string) *witType {
	return variantOf(name, cases, make([]*witType, len(cases)))
}

func optionOf(t *witType) *witType {
	return variantOf("option<"+t.name+">", []string{"none", "some"}, []*witType{nil, t})
}

// resultOf builds result<ok, err>; a nil side is `_`.
func resultOf(ok, err *witType) *witType {
	n := func(t *witType) string {
		if t == nil {
			return "_"
		}
		return t.name
	}
	return variantOf("result<"+n(ok)+", "+n(err)+">", []string{"ok", "error"}, []*witType{ok, err})
}

// funcSig is a WIT function and its core signature when lifted (called by the host).
type funcSig struct {
	export  string // the core export name
	params  []*witType
	results []*witType
	// core signature after flattening for a lifted (exported) function
	flatParams  []flatType
	flatResults []flatType
	// retptr: the results do not fit MAX_FLAT_RESULTS; the core function returns a pointer
	retptr bool
	// paramsInMemory: the params do not fit MAX_FLAT_PARAMS (never true for levee.wit)
	paramsInMemory bool
}

func newFuncSig(export string, params []*witType, results []*witType) *funcSig {
	s := &funcSig{export: export, params: params, results: results}
	for _, p := range params {
		s.flatParams = append(s.flatParams, p.flat...)
	}
	if len(s.flatParams) > maxFlatParams {
		s.flatParams = []flatType{fI32}
		s.paramsInMemory = true
	}
	for _, r := range results {
		s.flatResults = append(s.flatResults, r.flat...)
	}
	if len(s.flatResults) > maxFlatResults {
		s.flatResults = []flatType{fI32}
		s.retptr = true
	}
	return s
}

// checkAgainst verifies that a core function has exactly the flattened signature.
func (s *funcSig) checkAgainst(def api.FunctionDefinition) error {
	eq := func(a []api.ValueType, b []flatType) bool {
		if len(a) != len(b) {
			return false
		}
		for i := range a {
			if a[i] != b[i].valueType() {
				return false
			}
		}
		return true
	}
	if !eq(def.ParamTypes(), s.flatParams) || !eq(def.ResultTypes(), s.flatResults) {
		return fmt.Errorf("levee: core export %q has signature %v -> %v, the WIT flattens to %v -> %v",
			s.export, def.ParamTypes(), def.ResultTypes(), s.flatParams, s.flatResults)
	}
	return nil
}

// errTrap is a violation of the Canonical ABI by the guest: the component
// model would trap, and so does this host (the engine is re-instantiated).
var errTrap = errors.New("canonical ABI trap")

func trapf(format string, args ...any) error {
	return fmt.Errorf("%w: %s", errTrap, fmt.Sprintf(format, args...))
}

// mem is a view of the guest's linear memory for one lift; every access is
// bounds-checked and alignment-checked as the Canonical ABI requires.
type mem struct {
	b []byte
}

func (m mem) check(ptr uint32, size, align int) error {
	if int(ptr)%align != 0 {
		return trapf("pointer %d not aligned to %d", ptr, align)
	}
	if uint64(ptr)+uint64(size) > uint64(len(m.b)) {
		return trapf("range [%d, %d) out of bounds of %d bytes", ptr, uint64(ptr)+uint64(size), len(m.b))
	}
	return nil
}

func (m mem) u8(ptr uint32) uint8   { return m.b[ptr] }
func (m mem) u32(ptr uint32) uint32 { return binary.LittleEndian.Uint32(m.b[ptr:]) }
func (m mem) u64(ptr uint32) uint64 { return binary.LittleEndian.Uint64(m.b[ptr:]) }

// load reads a value of type t at ptr (already checked for t's size and
// alignment by the caller or by loadChecked) into its generic Go form:
// bool, uint8, uint32, int32, uint64, int64, float64, string, []any (list),
// []any (record fields), variantVal, or uint32 (own handle).
func (m mem) loadChecked(ptr uint32, t *witType) (any, error) {
	if err := m.check(ptr, t.size, t.align); err != nil {
		return nil, err
	}
	return m.load(ptr, t)
}

type variantVal struct {
	disc    uint32
	payload any // nil when the case has no payload
}

func (m mem) load(ptr uint32, t *witType) (any, error) {
	switch t.kind {
	case kBool:
		return m.u8(ptr) != 0, nil
	case kU8:
		return m.u8(ptr), nil
	case kU32, kOwn:
		return m.u32(ptr), nil
	case kS32:
		return int32(m.u32(ptr)), nil
	case kU64:
		return m.u64(ptr), nil
	case kS64:
		return int64(m.u64(ptr)), nil
	case kF64:
		// canonicalize_nan64 is not required on lift; keep the bits.
		return math.Float64frombits(m.u64(ptr)), nil
	case kString:
		return m.loadString(m.u32(ptr), m.u32(ptr+4))
	case kList:
		return m.loadList(m.u32(ptr), m.u32(ptr+4), t.elem)
	case kRecord:
		vals := make([]any, len(t.fields))
		for i, f := range t.fields {
			v, err := m.load(ptr+uint32(t.offsets[i]), f)
			if err != nil {
				return nil, err
			}
			vals[i] = v
		}
		return vals, nil
	case kVariant:
		var disc uint32
		switch t.discSz {
		case 1:
			disc = uint32(m.u8(ptr))
		case 2:
			disc = uint32(binary.LittleEndian.Uint16(m.b[ptr:]))
		default:
			disc = m.u32(ptr)
		}
		if int(disc) >= len(t.names) {
			return nil, trapf("%s: discriminant %d out of range", t.name, disc)
		}
		v := variantVal{disc: disc}
		if p := t.fields[disc]; p != nil {
			pv, err := m.load(ptr+uint32(t.payload), p)
			if err != nil {
				return nil, err
			}
			v.payload = pv
		}
		return v, nil
	}
	return nil, trapf("unsupported type %s", t.name)
}

// loadString lifts a UTF-8 string (the encoding wit-bindgen's Rust guests use).
func (m mem) loadString(ptr, n uint32) (string, error) {
	if uint64(ptr)+uint64(n) > uint64(len(m.b)) {
		return "", trapf("string [%d, +%d) out of bounds", ptr, n)
	}
	b := m.b[ptr : ptr+n]
	if !utf8.Valid(b) {
		return "", trapf("string at %d is not valid UTF-8", ptr)
	}
	return string(b), nil
}

func (m mem) loadList(ptr, n uint32, elem *witType) (any, error) {
	if int(ptr)%elem.align != 0 {
		return nil, trapf("list pointer %d not aligned to %d", ptr, elem.align)
	}
	if uint64(ptr)+uint64(n)*uint64(elem.size) > uint64(len(m.b)) {
		return nil, trapf("list [%d, +%d x %d) out of bounds", ptr, n, elem.size)
	}
	if elem.kind == kU8 {
		out := make([]byte, n)
		copy(out, m.b[ptr:ptr+n])
		return out, nil
	}
	out := make([]any, n)
	for i := uint32(0); i < n; i++ {
		v, err := m.load(ptr+i*uint32(elem.size), elem)
		if err != nil {
			return nil, err
		}
		out[i] = v
	}
	return out, nil
}

// enumCase checks an enum value lifted from a flat i32 (discriminant) against its case count.
func enumCase(t *witType, v uint64) (uint32, error) {
	if v >= uint64(len(t.names)) {
		return 0, trapf("%s: case %d out of range", t.name, v)
	}
	return uint32(v), nil
}

package levee

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math"
	"net"
	"os"
	"reflect"
	"strings"
	"syscall"
	"testing"
)

// Layouts worked out by hand from CanonicalABI.md (alignment, elem_size,
// discriminant_type, flatten_functype) for the types of levee.wit.
func TestLayouts(t *testing.T) {
	cases := []struct {
		t           *witType
		size, align int
		offsets     []int
		flat        []flatType
	}{
		{tEvent, 72, 8, []int{0, 8, 12, 16, 24, 32, 36, 40, 48, 49, 52, 64},
			[]flatType{fI64, fI32, fI32, fI32, fI32, fI64, fI32, fI32, fI64, fI32, fI32, fI32, fI32, fI64}},
		{tLoadError, 16, 4, []int{0, 8}, []flatType{fI32, fI32, fI32, fI32}},
		{tPolicyInfo, 40, 8, []int{0, 8, 16, 24, 32}, []flatType{fI32, fI32, fI32, fI64, fI64, fI32, fI32}},
		{tCallInfo, 32, 8, []int{0, 4, 12, 16, 24, 25}, []flatType{fI32, fI32, fI32, fI32, fI64, fI32, fI32}},
		{tAnalysis, 40, 8, []int{0, 8, 24, 32}, []flatType{fI32, fI32, fI64, fF64, fF64}},
	}
	for _, c := range cases {
		if c.t.size != c.size || c.t.align != c.align || !reflect.DeepEqual(c.t.offsets, c.offsets) || !reflect.DeepEqual(c.t.flat, c.flat) {
			t.Errorf("%s: size %d align %d offsets %v flat %v; want %d %d %v %v",
				c.t.name, c.t.size, c.t.align, c.t.offsets, c.t.flat, c.size, c.align, c.offsets, c.flat)
		}
	}
	// variants
	vs := []struct {
		t                    *witType
		size, align, payload int
		flat                 []flatType
	}{
		{tReason, 1, 1, 1, []flatType{fI32}},
		{optionOf(tU32), 8, 4, 4, []flatType{fI32, fI32}},
		{optionOf(tU64), 16, 8, 8, []flatType{fI32, fI64}},
		{optionOf(tBreakerState), 2, 1, 1, []flatType{fI32, fI32}},
		{optionOf(tPolicyInfo), 48, 8, 8, []flatType{fI32, fI32, fI32, fI32, fI64, fI64, fI32, fI32}},
		{resultOf(tOwnEngine, listOf(tLoadError)), 12, 4, 4, []flatType{fI32, fI32, fI32}},
		{resultOf(nil, tString), 12, 4, 4, []flatType{fI32, fI32, fI32}},
		{resultOf(nil, tLoadError), 20, 4, 4, []flatType{fI32, fI32, fI32, fI32, fI32}},
		// joining: i64 with f64 gives i64, i32 with f32 gives i32
		{variantOf("v", []string{"a", "b"}, []*witType{tU64, tF64}), 16, 8, 8, []flatType{fI32, fI64}},
	}
	for _, c := range vs {
		if c.t.size != c.size || c.t.align != c.align || c.t.payload != c.payload || !reflect.DeepEqual(c.t.flat, c.flat) {
			t.Errorf("%s: size %d align %d payload %d flat %v; want %d %d %d %v",
				c.t.name, c.t.size, c.t.align, c.t.payload, c.t.flat, c.size, c.align, c.payload, c.flat)
		}
	}
	if discriminantSize(256) != 1 || discriminantSize(257) != 2 || discriminantSize(65537) != 4 {
		t.Error("discriminant sizes")
	}
}

func TestSignatures(t *testing.T) {
	want := map[int]struct {
		params  []flatType
		results []flatType
		retptr  bool
	}{
		fnLoad:         {[]flatType{fI32, fI32, fI64}, []flatType{fI32}, true},
		fnPolicyCount:  {[]flatType{fI32}, []flatType{fI32}, false},
		fnStart:        {[]flatType{fI32, fI64, fI32, fI32, fI32, fI32, fI64, fI64, fI64, fI64}, []flatType{fI64}, false},
		fnReport:       {[]flatType{fI32, fI64, fI64, fI64, fI32, fI32, fI32, fI32, fI64, fI32}, []flatType{fI64}, false},
		fnCancel:       {[]flatType{fI32, fI64, fI64}, nil, false},
		fnBreakerState: {[]flatType{fI32, fI32, fI32, fI32, fI64}, []flatType{fI32}, true},
		fnImportState:  {[]flatType{fI32, fI32, fI32}, []flatType{fI32}, true},
		// state-page {list<u8>, u64} is three flat values: returned through a pointer
		fnExportStatePage:  {[]flatType{fI32, fI64, fI32}, []flatType{fI32}, true},
		fnImportStateBegin: {[]flatType{fI32}, nil, false},
		fnImportStatePage:  {[]flatType{fI32, fI32, fI32}, []flatType{fI32}, true},
		fnImportStateEnd:   {[]flatType{fI32}, []flatType{fI32}, true},
		fnReportFallback:   {[]flatType{fI32, fI64, fI64, fI32}, []flatType{fI64}, false},
		fnID:               {[]flatType{fI32}, []flatType{fI32}, false},
		fnStartUnkeyed:     {[]flatType{fI32, fI64, fI32, fI32, fI64, fI64, fI64, fI64}, []flatType{fI64}, false},
	}
	for fn, w := range want {
		s := sigs[fn]
		if !reflect.DeepEqual(s.flatParams, w.params) || !reflect.DeepEqual(s.flatResults, w.results) || s.retptr != w.retptr {
			t.Errorf("%s: %v -> %v retptr %v; want %v -> %v %v", s.export, s.flatParams, s.flatResults, s.retptr, w.params, w.results, w.retptr)
		}
	}
}

func TestLiftTraps(t *testing.T) {
	b := make([]byte, 64)
	m := mem{b: b}
	// misaligned record
	if _, err := m.loadChecked(4, tEvent); !errors.Is(err, errTrap) {
		t.Errorf("misaligned event: %v", err)
	}
	// out of bounds
	if _, err := m.loadChecked(0, tEvent); !errors.Is(err, errTrap) {
		t.Errorf("out of bounds event: %v", err)
	}
	// bad enum discriminant
	b[0] = 13
	if _, err := m.loadChecked(0, tReason); !errors.Is(err, errTrap) {
		t.Errorf("bad reason: %v", err)
	}
	// string out of bounds and invalid UTF-8
	binary.LittleEndian.PutUint32(b[0:], 60)
	binary.LittleEndian.PutUint32(b[4:], 10)
	if _, err := m.loadChecked(0, tString); !errors.Is(err, errTrap) {
		t.Errorf("string oob: %v", err)
	}
	binary.LittleEndian.PutUint32(b[0:], 40)
	binary.LittleEndian.PutUint32(b[4:], 2)
	b[40], b[41] = 0xff, 0xfe
	if _, err := m.loadChecked(0, tString); !errors.Is(err, errTrap) {
		t.Errorf("string utf8: %v", err)
	}
	// list overflow of the address space
	binary.LittleEndian.PutUint32(b[0:], 8)
	binary.LittleEndian.PutUint32(b[4:], math.MaxUint32)
	if _, err := m.loadChecked(0, listOf(tLoadError)); !errors.Is(err, errTrap) {
		t.Errorf("list oob: %v", err)
	}
	// a good option<u64>
	for i := range b {
		b[i] = 0
	}
	b[0] = 1
	binary.LittleEndian.PutUint64(b[8:], 12345)
	v, err := m.loadChecked(0, optionOf(tU64))
	if err != nil || v.(variantVal).disc != 1 || v.(variantVal).payload.(uint64) != 12345 {
		t.Errorf("option<u64>: %v %v", v, err)
	}
}

func TestVerdictDecoding(t *testing.T) {
	v := Verdict(50331651)
	if v.Kind() != VerdictRetry || v.Detail() != 0 || v.Payload() != 768 || v.EventsPending() {
		t.Errorf("decode %d: %v", uint64(v), v)
	}
	if MethodFlag("POST") != 3<<8 || MethodFlag("BREW") != 15<<8 {
		t.Error("method flags")
	}
}

// The fused adapter (adapter.go) lowers a key exactly as the two-call path does.
func TestFusedStartMatchesTwoCallLowering(t *testing.T) {
	const doc = `
policies:
  p:
    attempts: 3
    backoff: { kind: exponential, base: 10ms, cap: 1s, jitter: full }
    breaker: { window: { kind: count, size: 4 }, minimum-calls: 2, failure-rate: 50, open-duration: 1s }
`
	run := func(fused bool) ([]Verdict, []Event) {
		e, err := Load(context.Background(), doc, WithSeed(9))
		if err != nil {
			t.Fatal(err)
		}
		defer e.Close(context.Background())
		if !fused {
			e.in.fusedStart = nil
		}
		var vs []Verdict
		// a key of MaxKeyBytes (the longest with state of its own), and one past the
		// scratch buffer (maxScratch), which the core decides against its overflow entry
		keys := []string{"a", "b.example.com", strings.Repeat("k", 100), strings.Repeat("z", MaxKeyBytes),
			strings.Repeat("y", maxScratch+1), "ü-ключ", "a"}
		now := uint64(1000)
		for i, k := range keys {
			for j := 0; j < 3; j++ {
				c := uint64(i*10 + j + 1)
				v, err := e.Start(c, 0, k, 0, now, 0, 0, 0)
				if err != nil {
					t.Fatal(err)
				}
				vs = append(vs, v)
				now += 1000
				v, err = e.Report(c, now, 500, OutcomeConnectionError, 0, "", 0, 0)
				if err != nil {
					t.Fatal(err)
				}
				vs = append(vs, v)
				_ = e.Cancel(c, now)
			}
		}
		evs, err := e.DrainEvents()
		if err != nil {
			t.Fatal(err)
		}
		return vs, evs
	}
	v1, e1 := run(true)
	v2, e2 := run(false)
	if !reflect.DeepEqual(v1, v2) || !reflect.DeepEqual(e1, e2) || len(e1) == 0 {
		t.Fatalf("fused and two-call lowering differ:\n%v\n%v", v1, v2)
	}
	keys := map[string]bool{}
	for _, ev := range e1 {
		keys[ev.Key] = true
		if ev.Kind == EventKeyOverflow {
			keys[ev.Key+" "+ev.Name] = true
		}
	}
	// the overflow event names the key's first MaxKeyBytes (docs/policy.md, Keys)
	if !keys["ü-ключ"] || !keys[strings.Repeat("z", MaxKeyBytes)] || !keys["levee:overflow "+strings.Repeat("y", MaxKeyBytes)] {
		t.Fatalf("keys lost: %v", keys)
	}
}

type timeoutErr struct{}

func (*timeoutErr) Error() string   { return "i/o timeout" }
func (*timeoutErr) Timeout() bool   { return true }
func (*timeoutErr) Temporary() bool { return true }

type classed struct{}

func (classed) Error() string      { return "throttled" }
func (classed) LeveeClass() string { return "Throttled" }

type genericErr[T any] struct{}

func (genericErr[T]) Error() string { return "generic" }

func TestClassify(t *testing.T) {
	cases := []struct {
		err  error
		want Outcome
	}{
		{nil, Outcome{Kind: OutcomeSuccess}},
		{context.DeadlineExceeded, Outcome{Kind: OutcomeTimeout}},
		{&net.OpError{Op: "dial", Err: syscall.ECONNREFUSED}, Outcome{Kind: OutcomeConnectionError}},
		{fmt.Errorf("read: %w", io.ErrUnexpectedEOF), Outcome{Kind: OutcomeConnectionError}},
		{HTTPStatusError(429, "1"), Outcome{Kind: OutcomeHTTPStatus, Code: 429, Text: "1"}},
		{GRPCStatusError(14, ""), Outcome{Kind: OutcomeGRPCStatus, Code: 14}},
		{ClassError("Throttled", errors.New("x")), Outcome{Kind: OutcomeErrorClass, Text: "Throttled"}},
		{fmt.Errorf("ctx: %w", os.ErrNotExist), Outcome{Kind: OutcomeErrorClass, Text: "errorString"}},
		{fmt.Errorf("wrapped: %w", &os.PathError{Op: "open", Err: os.ErrPermission}), Outcome{Kind: OutcomeErrorClass, Text: "PathError"}},
		// docs/hosts.md, section 6: a connect timeout is a connection error, a certificate its own class
		{&net.OpError{Op: "dial", Err: &timeoutErr{}}, Outcome{Kind: OutcomeConnectionError}},
		{&net.OpError{Op: "read", Err: &timeoutErr{}}, Outcome{Kind: OutcomeTimeout}},
		{&net.OpError{Op: "read", Err: syscall.ECONNRESET}, Outcome{Kind: OutcomeConnectionError}},
		{&tls.CertificateVerificationError{Err: x509.UnknownAuthorityError{}}, Outcome{Kind: OutcomeErrorClass, Text: "tls-certificate"}},
		{fmt.Errorf("x: %w", x509.HostnameError{}), Outcome{Kind: OutcomeErrorClass, Text: "tls-certificate"}},
		{tls.RecordHeaderError{Msg: "not TLS"}, Outcome{Kind: OutcomeConnectionError}},
		{classed{}, Outcome{Kind: OutcomeErrorClass, Text: "Throttled"}},
		{genericErr[int]{}, Outcome{Kind: OutcomeErrorClass, Text: "genericErr"}},
	}
	for _, c := range cases {
		if got := Classify(context.Background(), c.err); got != c.want {
			t.Errorf("Classify(%v) = %+v, want %+v", c.err, got, c.want)
		}
	}
}

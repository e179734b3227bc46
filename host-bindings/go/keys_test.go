package levee

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"testing"
)

// keysDoc: a per-key breaker that stays open for an hour, and room for a million keys.
const keysDoc = "policies:\n  p:\n    attempts: 1\n" +
	"    breaker: { window: { kind: count, size: 2 }, minimum-calls: 2, failure-rate: 50, open-duration: 1h }\n" +
	"    keys: { max: 1000000 }\n"

func fillKeys(t *testing.T, p *Policy, n int, pad string) {
	t.Helper()
	for i := 0; i < n; i++ {
		if err := p.Do(context.Background(), func(context.Context) error { return nil }, WithKey(fmt.Sprintf("k%d%s", i, pad))); err != nil {
			t.Fatal(err)
		}
	}
}

// The recovery snapshot (taken after a breaker transition) is export-snapshot: the keys
// that hold protection, not every key; a trap restores the open breaker from it.
func TestRecoverySnapshotKeepsOnlyProtection(t *testing.T) {
	rec := &recorder{}
	e := mustLoad(t, keysDoc, WithListener(rec.listen))
	p := mustPolicy(t, e, "p")
	fillKeys(t, p, 2000, "")
	trip(t, p, "open") // a breaker transition: a snapshot at once
	e.mu.Lock()
	snap := len(e.snap)
	ctx := e.enterWork(e.stateWork())
	full, err := e.in.exportState(ctx, e.rep)
	e.leave()
	e.mu.Unlock()
	if err != nil {
		t.Fatal(err)
	}
	if snap == 0 || snap*20 > len(full) {
		t.Fatalf("the recovery snapshot is %d bytes, the whole state %d: it holds more than the protected key", snap, len(full))
	}
	killGuest(e)
	if err := p.Do(context.Background(), func(context.Context) error { return nil }, WithKey("open")); !errors.Is(err, ErrBreakerOpen) {
		t.Fatalf("after the trap the breaker of key open is forgotten: %v", err)
	}
	if rec.count(EventEngineFault) != 1 {
		t.Fatalf("%d engine faults", rec.count(EventEngineFault))
	}
	// the whole state is still exported by ExportState (within its bound)
	if _, err := e.ExportState(); err != nil {
		t.Fatal(err)
	}
	if rec.count(EventEngineFault) != 1 {
		t.Fatalf("%d engine faults: %+v", rec.count(EventEngineFault), rec.evs)
	}
}

// What export-state gives, import-state takes back, at any size; and a trap after a
// large export restores the open breaker (docs/hosts.md, section 7).
func TestRestoreAtAnySize(t *testing.T) {
	if testing.Short() {
		t.Skip("20,000 keys of 1,000 bytes")
	}
	rec := &recorder{}
	e := mustLoad(t, keysDoc, WithListener(rec.listen))
	p := mustPolicy(t, e, "p")
	fillKeys(t, p, 20_000, strings.Repeat("x", 990))
	trip(t, p, "open")
	state, err := e.ExportState()
	if err != nil || len(state) < 20_000*990 {
		t.Fatalf("export of 20,000 keys: %d bytes, %v", len(state), err)
	}
	if err := e.ImportState(state); err != nil {
		t.Fatalf("import of %d bytes: %v", len(state), err)
	}
	if n := rec.count(EventEngineFault); n != 0 {
		t.Fatalf("%d engine faults: %+v", n, rec.evs)
	}
	killGuest(e)
	if err := p.Do(context.Background(), func(context.Context) error { return nil }, WithKey("open")); !errors.Is(err, ErrBreakerOpen) {
		t.Fatalf("after the trap the breaker of key open is forgotten: %v", err)
	}
	if ev, _ := rec.find(EventEngineFault); rec.count(EventEngineFault) != 1 || strings.Contains(ev.Err.Error(), "not restored") {
		t.Fatalf("recovery: %+v", rec.evs)
	}
}

// A key longer than MaxKeyBytes is refused at every entry that takes a key, before the core.
func TestKeyLongerThanTheBound(t *testing.T) {
	e := mustLoad(t, keysDoc)
	p := mustPolicy(t, e, "p")
	long := strings.Repeat("é", MaxKeyBytes/2) + "x" // MaxKeyBytes+1 bytes
	want := fmt.Sprintf("key: %d bytes, longer than the %d a key may be (docs/policy.md, Keys)", MaxKeyBytes+1, MaxKeyBytes)
	check := func(what string, err error) {
		t.Helper()
		if !errors.Is(err, ErrKeyTooLong) || !strings.Contains(err.Error(), want) {
			t.Errorf("%s: %v", what, err)
		}
	}
	ran := false
	check("Do", p.Do(context.Background(), func(context.Context) error { ran = true; return nil }, WithKey(long)))
	if ran {
		t.Error("Do ran the call of a key too long")
	}
	_, _, err := e.BreakerState(0, long, e.Now())
	check("BreakerState", err)
	_, _, err = e.SetBreakerState(0, long, BreakerForcedOpen, e.Now())
	check("SetBreakerState", err)
	check("CheckKey", CheckKey(long))
	// a key of exactly the bound is a key like any other
	if err := p.Do(context.Background(), func(context.Context) error { return nil }, WithKey(long[:MaxKeyBytes])); err != nil {
		t.Fatal(err)
	}
	if _, ok, err := e.BreakerState(0, long[:MaxKeyBytes], e.Now()); err != nil || !ok {
		t.Fatalf("breaker of a key of %d bytes: %v %v", MaxKeyBytes, ok, err)
	}
}

type countingSink struct {
	mu     sync.Mutex
	counts map[string]int64
	events []string
}

func (s *countingSink) Event(_ context.Context, name string, attrs []slog.Attr) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.events = append(s.events, name+fmt.Sprint(attrs))
}

func (s *countingSink) Add(_ context.Context, counter string, v int64, attrs []slog.Attr) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.counts[counter+fmt.Sprint(attrs)] += v
}
func (s *countingSink) Record(context.Context, string, float64, []slog.Attr) {}
func (s *countingSink) Gauge(context.Context, string, int64, []slog.Attr)    {}

// key-evicted and key-overflow are events, and counted (levee.keys.evicted,
// levee.keys.overflow by levee.policy, as the other counters).
func TestKeyEvictionAndOverflowAreCounted(t *testing.T) {
	sink := &countingSink{counts: map[string]int64{}}
	rec := &recorder{}
	doc := "policies:\n  p:\n    attempts: 1\n" +
		"    breaker: { window: { kind: count, size: 2 }, minimum-calls: 2, failure-rate: 50, open-duration: 1h }\n" +
		"    keys: { max: 2 }\n"
	e := mustLoad(t, doc, WithTelemetry(sink), WithListener(rec.listen))
	p := mustPolicy(t, e, "p")
	fillKeys(t, p, 3, "") // k2 evicts k0 (at rest)
	trip(t, p, "a")       // evicts k1
	trip(t, p, "b")       // evicts k2
	// both keys hold an open breaker: c gets no state of its own
	if err := p.Do(context.Background(), func(context.Context) error { return nil }, WithKey("c")); err != nil {
		t.Fatal(err)
	}
	ev, ok := rec.find(EventKeyOverflow)
	if !ok || ev.Key != "levee:overflow" || ev.Name != "c" || ev.Kind.String() != "key-overflow" {
		t.Fatalf("no key-overflow event for c: %+v", rec.evs)
	}
	if k, ok := ParseEventKind("key-overflow"); !ok || k != EventKeyOverflow {
		t.Fatalf("ParseEventKind(key-overflow) = %v %v", k, ok)
	}
	sink.mu.Lock()
	defer sink.mu.Unlock()
	pol := fmt.Sprint([]slog.Attr{slog.String(cAttrPolicy, "p")})
	if got := sink.counts[cMetricKeysEvicted+pol]; got != 3 || rec.count(EventKeyEvicted) != 3 {
		t.Errorf("%s = %d (%d key-evicted events): %v", cMetricKeysEvicted, got, rec.count(EventKeyEvicted), sink.counts)
	}
	if got := sink.counts[cMetricKeysOverflow+pol]; got < 1 || int(got) != rec.count(EventKeyOverflow) {
		t.Errorf("%s = %d (%d key-overflow events): %v", cMetricKeysOverflow, got, rec.count(EventKeyOverflow), sink.counts)
	}
}

// State larger than import-state takes in one crossing (64 MiB) goes out and back in by
// pages (docs/hosts.md, "State of any size"): 70,000 keys of about 1,000 bytes.
func TestStateAboveOneCrossingGoesByPages(t *testing.T) {
	if testing.Short() {
		t.Skip("70,000 keys of 1,000 bytes")
	}
	rec := &recorder{}
	e := mustLoad(t, keysDoc, WithListener(rec.listen))
	p := mustPolicy(t, e, "p")
	fillKeys(t, p, 70_000, strings.Repeat("x", 990))
	trip(t, p, "open")
	state, err := e.ExportState()
	if ev, ok := rec.find(EventEngineFault); ok {
		t.Fatalf("engine fault: %+v", ev)
	}
	if err != nil || len(state) <= 64<<20 {
		t.Fatalf("export of 70,000 keys: %d bytes, %v", len(state), err)
	}
	other := mustLoad(t, keysDoc)
	if err := other.ImportState(state); err != nil {
		t.Fatalf("import of %d bytes: %v", len(state), err)
	}
	if s, ok, err := other.BreakerState(0, "open", other.Now()); err != nil || !ok || s != BreakerOpen {
		t.Fatalf("the imported breaker of key open: %v %v %v", s, ok, err)
	}
	// an import that stops early changes nothing
	var le *LoadError
	if err := other.ImportState(state[:3<<20]); !errors.As(err, &le) || !strings.Contains(le.Message, "ends early") {
		t.Fatalf("a truncated import: %v", err)
	}
	if s, _, _ := other.BreakerState(0, "open", other.Now()); s != BreakerOpen {
		t.Fatalf("after a failed import the breaker of key open is %v", s)
	}
}

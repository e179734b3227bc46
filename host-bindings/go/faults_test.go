package levee

// Regression tests of issue 14 ("Faults and bad input"): bounds that fit valid
// work, recovery that never forgets a trip, invalid UTF-8, a nil policy.

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

const breakerBody = "    attempts: 1\n" +
	"    breaker: { window: { kind: count, size: 2 }, minimum-calls: 2, failure-rate: 50, open-duration: 60s }\n"

func manyPolicies(n int) string {
	var b strings.Builder
	b.WriteString("policies:\n")
	for i := 0; i < n; i++ {
		fmt.Fprintf(&b, "  p%d:\n%s", i, breakerBody)
	}
	return b.String()
}

func TestBoundsFitTheLargestValidWork(t *testing.T) {
	rec := &recorder{}
	// 4,096 policies: the most a document may hold.
	e := mustLoad(t, manyPolicies(4096), WithListener(rec.listen), WithSnapshotInterval(0))
	if err := e.Reload(manyPolicies(4000)); err != nil {
		t.Fatalf("reload to 4,000 policies: %v", err)
	}
	if err := e.Reload("policies:\n  p:\n" + breakerBody + "    keys: { max: 1000000 }\n"); err != nil {
		t.Fatal(err)
	}
	p := mustPolicy(t, e, "p")
	for i := 0; i < 10_000; i++ {
		if err := p.Do(context.Background(), func(context.Context) error { return nil }, WithKey(fmt.Sprintf("host-%d", i))); err != nil {
			t.Fatal(err)
		}
	}
	state, err := e.ExportState()
	if err != nil || len(state) < 1<<20 {
		t.Fatalf("export of 10,000 keys: %d bytes, %v", len(state), err)
	}
	if err := e.ImportState(state); err != nil {
		t.Fatalf("import of 10,000 keys: %v", err)
	}
	if n := rec.count(EventEngineFault); n != 0 {
		t.Fatalf("%d engine faults: %+v", n, rec.evs)
	}
}

// trip opens the breaker of p (for key) with failing calls.
func trip(t *testing.T, p *Policy, key string) {
	t.Helper()
	for i := 0; i < 2; i++ {
		_ = p.Do(context.Background(), func(context.Context) error { return connErr }, WithKey(key))
	}
	if err := p.Do(context.Background(), func(context.Context) error { return nil }, WithKey(key)); !errors.Is(err, ErrBreakerOpen) {
		t.Fatalf("breaker of key %q not open: %v", key, err)
	}
}

// killGuest makes the next guest call fail as after a trap.
func killGuest(e *Engine) {
	e.mu.Lock()
	_ = e.in.mod.Close(context.Background())
	e.mu.Unlock()
}

func TestATrapNeverForgetsATrip(t *testing.T) {
	rec := &recorder{}
	// No periodic snapshot, no explicit export: only the snapshot the transition
	// takes can bring the open breakers back.
	e := mustLoad(t, "policies:\n  b:\n"+breakerBody, WithListener(rec.listen), WithSnapshotInterval(0))
	p := mustPolicy(t, e, "b")
	trip(t, p, "")
	trip(t, p, "db-1")
	if _, ok, err := e.SetBreakerState(0, "db-2", BreakerForcedOpen, e.Now()); !ok || err != nil {
		t.Fatalf("force open: %v", err)
	}
	killGuest(e)
	ran := 0
	if err := p.Do(context.Background(), func(context.Context) error { ran++; return nil }); err != nil || ran != 1 {
		t.Fatalf("the faulted call did not run once: %v (ran %d)", err, ran)
	}
	if rec.count(EventEngineFault) != 1 {
		t.Fatalf("no engine fault: %+v", rec.evs)
	}
	for _, key := range []string{"", "db-1", "db-2"} {
		ran := 0
		err := p.Do(context.Background(), func(context.Context) error { ran++; return nil }, WithKey(key))
		if !errors.Is(err, ErrBreakerOpen) || ran != 0 {
			t.Fatalf("breaker of key %q forgotten after the trap: %v (ran %d)", key, err, ran)
		}
	}
}

func TestInvalidUTF8IsRefusedAtTheBoundary(t *testing.T) {
	if _, err := Load(context.Background(), "policies:\n  p\xff:\n    attempts: 2\n"); err == nil {
		t.Fatal("a document with invalid UTF-8 loaded")
	} else if le := (LoadErrors)(nil); !errors.As(err, &le) || !strings.Contains(err.Error(), "line 2") {
		t.Fatalf("not a LoadErrors naming the line: %v", err)
	}
	rec := &recorder{}
	e := mustLoad(t, "policies:\n  b:\n"+breakerBody, WithListener(rec.listen), WithSnapshotInterval(0))
	if err := e.Reload("policies:\n  \xfe: {}\n"); err == nil || errors.Is(err, ErrEngineFault) {
		t.Fatalf("reload with invalid UTF-8: %v", err)
	}
	p := mustPolicy(t, e, "b")
	trip(t, p, "db")
	ran := 0
	err := p.Do(context.Background(), func(context.Context) error { ran++; return nil }, WithKey("\xff\xfe"))
	if !errors.Is(err, ErrInvalidUTF8) || ran != 0 {
		t.Fatalf("invalid key: %v (ran %d)", err, ran)
	}
	if _, _, err := e.BreakerState(0, "\xff", e.Now()); !errors.Is(err, ErrInvalidUTF8) {
		t.Fatalf("BreakerState with an invalid key: %v", err)
	}
	// A URL whose host is invalid UTF-8 (http://%ff%fe/) is the key of its request.
	c := &http.Client{Transport: &Transport{Policy: p}}
	if _, err := c.Get("http://%ff%fe/"); !errors.Is(err, ErrInvalidUTF8) {
		t.Fatalf("GET http://%%ff%%fe/: %v", err)
	}
	if n := rec.count(EventEngineFault); n != 0 {
		t.Fatalf("%d engine faults: %+v", n, rec.evs)
	}
	if err := p.Do(context.Background(), func(context.Context) error { return nil }, WithKey("db")); !errors.Is(err, ErrBreakerOpen) {
		t.Fatalf("the breaker was reset: %v", err)
	}
}

func TestTransportWithoutAPolicyIsAnError(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {}))
	defer srv.Close()
	c := &http.Client{Transport: &Transport{}}
	if _, err := c.Get(srv.URL); !errors.Is(err, ErrNoPolicy) {
		t.Fatalf("nil Policy: %v", err)
	}
	var p *Policy
	if err := p.Do(context.Background(), func(context.Context) error { return nil }); err == nil {
		t.Fatal("Do on a nil policy succeeded")
	}
}

// Issue 39: a nil input of the public API is an error naming it, never a panic.
func TestNilInputsAreErrorsNotPanics(t *testing.T) {
	e := mustLoad(t, doDoc)
	p := mustPolicy(t, e, "fast")
	bg := context.Background()
	var nilCtx context.Context
	ok := func(context.Context) error { return nil }
	check := func(what string, err error, mention string) {
		t.Helper()
		if !errors.Is(err, ErrNilArgument) || !strings.Contains(err.Error(), mention) {
			t.Errorf("%s: %v, want ErrNilArgument naming %q", what, err, mention)
		}
	}
	try := func(what string, f func() error, mention string) {
		t.Helper()
		var err error
		func() {
			defer func() {
				if r := recover(); r != nil {
					err = fmt.Errorf("panicked: %v", r)
				}
			}()
			err = f()
		}()
		check(what, err, mention)
	}
	try("Do(ctx, p, nil)", func() error { return Do(bg, p, nil) }, "fn")
	try("p.Do(ctx, nil)", func() error { return p.Do(bg, nil) }, "fn")
	try("DoValue(ctx, p, nil)", func() error { _, err := DoValue[int](bg, p, nil); return err }, "fn")
	try("Do(nil, p, fn)", func() error { return Do(nilCtx, p, ok) }, "ctx")
	try("DoValue(nil, p, fn)", func() error {
		_, err := DoValue(nilCtx, p, func(context.Context) (int, error) { return 1, nil })
		return err
	}, "ctx")
	try("WithCallFallback(name, nil)", func() error { return Do(bg, p, ok, WithCallFallback("cached", nil)) }, "cached")
	try("Load(nil, ...)", func() error { _, err := Load(nilCtx, doDoc); return err }, "ctx")
	try("WithListener(nil)", func() error { _, err := Load(bg, doDoc, WithListener(nil)); return err }, "WithListener")
	try("WithFallback(name, nil)", func() error { _, err := Load(bg, doDoc, WithFallback("cached", nil)); return err }, "cached")
	try("Engine(nil).Policy", func() error { var ne *Engine; _, err := ne.Policy("fast"); return err }, "engine")
	tr := &Transport{Policy: p}
	try("RoundTrip(nil)", func() error { _, err := tr.RoundTrip(nil); return err }, "request")
	try("RoundTrip(no URL)", func() error { _, err := tr.RoundTrip(&http.Request{Method: "GET"}); return err }, "URL")
	// and the helpers that read a context or a URL answer for nil
	func() {
		defer func() {
			if r := recover(); r != nil {
				t.Errorf("a helper panicked on nil: %v", r)
			}
		}()
		if _, ok := FallbackContext(nilCtx); ok || Degraded(nilCtx) || HTTPKey(nil) != "" {
			t.Error("nil context or URL")
		}
		var np *Policy
		if np.Name() != "" || np.Info().Name != "" || np.Engine() != nil {
			t.Error("nil policy")
		}
	}()
}

func TestAnUnknownPolicyListsTheKnownOnes(t *testing.T) {
	e := mustLoad(t, doDoc)
	_, err := e.Policy("fsat")
	var upe *UnknownPolicyError
	if !errors.As(err, &upe) || !errors.Is(err, ErrUnknownPolicy) {
		t.Fatalf("not an UnknownPolicyError: %v", err)
	}
	want := "levee: no policy named 'fsat' (did you mean 'fast'?); the document's policies: 'fast', 'slow-backoff', 'classes', 'with-fallback'"
	if err.Error() != want {
		t.Fatalf("got  %s\nwant %s", err, want)
	}
}

func TestAnUnregisteredFallbackIsNamedInTheError(t *testing.T) {
	e := mustLoad(t, doDoc)
	p := mustPolicy(t, e, "with-fallback")
	err := p.Do(context.Background(), func(context.Context) error { return connErr })
	var le *Error
	if !errors.As(err, &le) || !errors.Is(err, ErrFallbacksFailed) {
		t.Fatalf("not fallbacks-failed: %v", err)
	}
	if len(le.Unregistered) != 1 || le.Unregistered[0] != "cached" ||
		!strings.Contains(err.Error(), "fallback 'cached' is named by the policy but not registered") {
		t.Fatalf("the missing registration is not said: %v (%+v)", err, le)
	}
	if !errors.Is(err, connErr) {
		t.Fatalf("the attempt's error is lost: %v", err)
	}
}

// What an HTTP attempt covers (docs/http.md).
const bodyDoc = `
policies:
  deadline:
    attempts: 3
    deadline: 2s
    backoff: { kind: constant, base: 10ms, jitter: none }
  retry:
    attempts: 3
    backoff: { kind: constant, base: 10ms, jitter: none }
`

func TestHTTPTheDeadlineCoversTheBody(t *testing.T) {
	trickle := func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Length", "50")
		w.WriteHeader(200)
		for i := 0; i < 50; i++ { // 10 s of body
			if _, err := w.Write([]byte("x")); err != nil {
				return
			}
			w.(http.Flusher).Flush()
			select {
			case <-r.Context().Done():
				return
			case <-time.After(200 * time.Millisecond):
			}
		}
	}
	srv := httptest.NewServer(http.HandlerFunc(trickle))
	defer srv.Close()
	e := mustLoad(t, bodyDoc)
	c := &http.Client{Transport: &Transport{Policy: mustPolicy(t, e, "deadline")}}
	t0 := time.Now()
	resp, err := c.Get(srv.URL)
	if err == nil {
		b, rerr := io.ReadAll(resp.Body)
		_ = resp.Body.Close()
		t.Fatalf("a %d with %d bytes (%v) after %v under a 2 s deadline", resp.StatusCode, len(b), rerr, time.Since(t0))
	}
	if d := time.Since(t0); d > 3*time.Second {
		t.Fatalf("failed after %v under a 2 s deadline: %v", d, err)
	}
}

func TestHTTPAConnectionClosedMidBodyIsRetried(t *testing.T) {
	var hits atomic.Int64
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if hits.Add(1) == 1 {
			w.Header().Set("Content-Length", "1000")
			w.WriteHeader(200)
			_, _ = w.Write([]byte(strings.Repeat("y", 500)))
			w.(http.Flusher).Flush()
			conn, _, _ := w.(http.Hijacker).Hijack()
			_ = conn.Close()
			return
		}
		_, _ = io.WriteString(w, "whole")
	}))
	defer srv.Close()
	e := mustLoad(t, bodyDoc)
	c := &http.Client{Transport: &Transport{Policy: mustPolicy(t, e, "retry")}}
	resp, err := c.Get(srv.URL)
	if err != nil {
		t.Fatal(err)
	}
	b, rerr := io.ReadAll(resp.Body)
	_ = resp.Body.Close()
	if rerr != nil || string(b) != "whole" || hits.Load() != 2 {
		t.Fatalf("body %q (%v) after %d hits", b, rerr, hits.Load())
	}
}

func TestAFaultInAnalyzeNeverReopensATrippedBreaker(t *testing.T) {
	// The scenario of the report: Analyze of 10^8 attempts ran over the guest-call bound
	// and the recovery brought the open breaker back closed.
	e := mustLoad(t, "policies:\n  b:\n"+breakerBody+"  huge:\n    attempts: 100000000\n",
		WithSnapshotInterval(0), WithGuestCallLimit(50*time.Millisecond))
	p := mustPolicy(t, e, "b")
	trip(t, p, "")
	_, _, _ = e.Analyze(1, 3) // a fault here is recovered; the breaker must survive it
	if err := p.Do(context.Background(), func(context.Context) error { return nil }); !errors.Is(err, ErrBreakerOpen) {
		t.Fatalf("the breaker came back closed: %v", err)
	}
}

// panickySink is a telemetry sink whose Event panics.
type panickySink struct{}

func (panickySink) Event(context.Context, string, []slog.Attr)           { panic("sink event") }
func (panickySink) Add(context.Context, string, int64, []slog.Attr)      { panic("sink add") }
func (panickySink) Record(context.Context, string, float64, []slog.Attr) {}
func (panickySink) Gauge(context.Context, string, int64, []slog.Attr)    {}

// panickyTracer is a sink that records spans, whose spans panic when they end (and whose
// StartSpan panics for the attempts).
type panickyTracer struct{ panickySink }

type panickySpan struct{}

func (panickySpan) SetAttributes(...slog.Attr) {}
func (panickySpan) End(error)                  { panic("span end") }

func (panickyTracer) StartSpan(ctx context.Context, name string, _ []slog.Attr) (context.Context, Span) {
	if name == "levee.attempt" {
		panic("start span")
	}
	return ctx, panickySpan{}
}

// Observer code never reaches the call (docs/hosts.md): a listener, or a telemetry sink (its
// events, counters, spans), that panics is logged and ignored, and the listeners after it
// still get the event.
func TestAPanickingListenerNeverReachesTheCall(t *testing.T) {
	for _, sink := range []Telemetry{panickySink{}, panickyTracer{}} {
		t.Run(fmt.Sprintf("%T", sink), func(t *testing.T) { testPanickingObservers(t, sink) })
	}
}

func testPanickingObservers(t *testing.T, sink Telemetry) {
	var logged strings.Builder
	var seen atomic.Int64
	e := mustLoad(t, doDoc,
		WithLogger(slog.New(slog.NewTextHandler(&lockedWriter{w: &logged}, nil))),
		WithListener(func(Event) { panic("listener") }),
		WithListener(func(Event) { seen.Add(1) }),
		WithTelemetry(sink))
	n := 0
	var err error
	func() {
		defer func() {
			if r := recover(); r != nil {
				err = fmt.Errorf("the call panicked: %v", r)
			}
		}()
		err = Do(context.Background(), mustPolicy(t, e, "fast"), func(context.Context) error {
			n++
			if n == 1 {
				return connErr // a retry: a retry-scheduled event
			}
			return nil
		})
	}()
	if err != nil || n != 2 {
		t.Fatalf("err %v (n=%d)", err, n)
	}
	if seen.Load() == 0 {
		t.Fatal("the listener after the panicking one got no event")
	}
	if !strings.Contains(logged.String(), "panicked (ignored)") {
		t.Fatalf("not logged: %s", logged.String())
	}
}

// lockedWriter is a writer safe for the goroutines of an engine's calls.
type lockedWriter struct {
	mu sync.Mutex
	w  io.Writer
}

func (l *lockedWriter) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.w.Write(p)
}

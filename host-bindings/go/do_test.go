package levee

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

const doDoc = `
policies:
  fast:
    attempts: 3
    attempt-timeout: 50ms
    backoff: { kind: exponential, base: 1ms, multiplier: 2, cap: 4ms, jitter: full }
  slow-backoff:
    attempts: 3
    backoff: { kind: constant, base: 10s, cap: 10s, jitter: none }
  classes:
    attempts: 4
    backoff: { kind: constant, base: 1ms, cap: 1ms, jitter: none }
    retry-on: ["error:flaky"]
  with-fallback:
    attempts: 2
    backoff: { kind: constant, base: 1ms, cap: 1ms, jitter: none }
    fallbacks: [cached]
`

type recorder struct {
	mu  sync.Mutex
	evs []Event
}

func (r *recorder) listen(ev Event) { r.mu.Lock(); r.evs = append(r.evs, ev); r.mu.Unlock() }

func (r *recorder) count(k EventKind) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	n := 0
	for _, ev := range r.evs {
		if ev.Kind == k {
			n++
		}
	}
	return n
}

func (r *recorder) find(k EventKind) (Event, bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, ev := range r.evs {
		if ev.Kind == k {
			return ev, true
		}
	}
	return Event{}, false
}

func mustLoad(t testing.TB, doc string, opts ...Option) *Engine {
	t.Helper()
	e, err := Load(context.Background(), doc, opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = e.Close(context.Background()) })
	return e
}

func mustPolicy(t testing.TB, e *Engine, name string) *Policy {
	t.Helper()
	p, err := e.Policy(name)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

type flaky struct{}

func (flaky) Error() string      { return "flaky" }
func (flaky) LeveeClass() string { return "flaky" }

var connErr = &net.OpError{Op: "dial", Net: "tcp", Err: errors.New("connection refused")}

func TestLoadErrorsNamePaths(t *testing.T) {
	_, err := Load(context.Background(), "policies:\n  p:\n    attempts: 0\n")
	var lerrs LoadErrors
	if !errors.As(err, &lerrs) || len(lerrs) == 0 || lerrs[0].Path != "policies.p.attempts" {
		t.Fatalf("got %v", err)
	}
	e := mustLoad(t, doDoc)
	if _, err := e.Policy("nope"); err == nil {
		t.Fatal("unknown policy accepted")
	}
	info := mustPolicy(t, e, "fast").Info()
	if info.MaxAttempts != 3 || info.AttemptTimeout != uint64(50*time.Millisecond) {
		t.Fatalf("info %+v", info)
	}
}

func TestDoSuccessAndRetry(t *testing.T) {
	rec := &recorder{}
	e := mustLoad(t, doDoc, WithSeed(7), WithListener(rec.listen))
	p := mustPolicy(t, e, "fast")
	if err := Do(context.Background(), p, func(context.Context) error { return nil }); err != nil {
		t.Fatal(err)
	}
	n := 0
	err := p.Do(context.Background(), func(context.Context) error {
		n++
		if n < 3 {
			return connErr
		}
		return nil
	})
	if err != nil || n != 3 {
		t.Fatalf("err %v after %d attempts", err, n)
	}
	if got := rec.count(EventRetryScheduled); got != 2 {
		t.Fatalf("%d retry-scheduled events, want 2: %+v", got, rec.evs)
	}
}

func TestDoErrors(t *testing.T) {
	e := mustLoad(t, doDoc)
	p := mustPolicy(t, e, "fast")
	mine := errors.New("bad input")
	n := 0
	err := Do(context.Background(), p, func(context.Context) error { n++; return mine })
	var le *Error
	if !errors.Is(err, ErrNonRetryable) || !errors.Is(err, mine) || !errors.As(err, &le) || n != 1 {
		t.Fatalf("err %v (n=%d)", err, n)
	}
	if le.Reason != ReasonNonRetryable || le.Attempts != 1 || le.Last != mine {
		t.Fatalf("%+v", le)
	}
	n = 0
	err = Do(context.Background(), p, func(context.Context) error { n++; return connErr })
	if !errors.Is(err, ErrRetriesExhausted) || n != 3 {
		t.Fatalf("err %v (n=%d)", err, n)
	}
	var ne *net.OpError
	if !errors.As(err, &ne) {
		t.Fatalf("last error lost: %v", err)
	}
	// error classes named by LeveeClass()
	n = 0
	err = Do(context.Background(), mustPolicy(t, e, "classes"), func(context.Context) error {
		n++
		if n < 3 {
			return fmt.Errorf("wrapped: %w", flaky{})
		}
		return nil
	})
	if err != nil || n != 3 {
		t.Fatalf("classes: %v (n=%d)", err, n)
	}
}

func TestDoPerAttemptTimeout(t *testing.T) {
	e := mustLoad(t, doDoc)
	n := 0
	err := Do(context.Background(), mustPolicy(t, e, "fast"), func(ctx context.Context) error {
		n++
		if n == 1 {
			<-ctx.Done() // the attempt's deadline
			return ctx.Err()
		}
		if _, ok := ctx.Deadline(); !ok {
			return errors.New("attempt without a deadline")
		}
		return nil
	})
	if err != nil || n != 2 {
		t.Fatalf("err %v (n=%d)", err, n)
	}
}

func TestDoSleepStopsOnCancel(t *testing.T) {
	e := mustLoad(t, doDoc)
	ctx, cancel := context.WithCancel(context.Background())
	go func() { time.Sleep(30 * time.Millisecond); cancel() }()
	start := time.Now()
	err := Do(ctx, mustPolicy(t, e, "slow-backoff"), func(context.Context) error { return connErr })
	if !errors.Is(err, ErrCancelled) || !errors.Is(err, context.Canceled) {
		t.Fatalf("err %v", err)
	}
	if time.Since(start) > 5*time.Second {
		t.Fatalf("the 10 s sleep did not stop on cancel")
	}
}

func TestDoValueAndFallbacks(t *testing.T) {
	rec := &recorder{}
	e := mustLoad(t, doDoc, WithListener(rec.listen))
	v, err := DoValue(context.Background(), mustPolicy(t, e, "fast"), func(context.Context) (int, error) { return 42, nil })
	if err != nil || v != 42 {
		t.Fatalf("%v %v", v, err)
	}
	fb := mustPolicy(t, e, "with-fallback")
	// no fallback registered: the chain fails
	_, err = DoValue(context.Background(), fb, func(context.Context) (string, error) { return "", connErr })
	if !errors.Is(err, ErrFallbacksFailed) {
		t.Fatalf("err %v", err)
	}
	// a per-call fallback
	s, err := DoValue(context.Background(), fb, func(context.Context) (string, error) { return "", connErr },
		WithCallFallback("cached", func(_ context.Context, cause error) (any, error) {
			if !errors.Is(cause, connErr) {
				return nil, errors.New("cause lost")
			}
			return "from cache", nil
		}))
	if err != nil || s != "from cache" {
		t.Fatalf("%q %v", s, err)
	}
	ev, ok := rec.find(EventFallbackChosen)
	if !ok || ev.Name != "cached" {
		t.Fatalf("fallback-chosen not reported: %+v", rec.evs)
	}
	// an engine-wide fallback
	e.RegisterFallback("cached", func(context.Context, error) (any, error) { return "engine", nil })
	s, err = DoValue(context.Background(), fb, func(context.Context) (string, error) { return "", connErr })
	if err != nil || s != "engine" {
		t.Fatalf("%q %v", s, err)
	}
}

func TestConcurrentCallsShareOneEngine(t *testing.T) {
	e := mustLoad(t, doDoc)
	p := mustPolicy(t, e, "classes")
	var wg sync.WaitGroup
	var ok, failed atomic.Int64
	for g := 0; g < 8; g++ {
		wg.Add(1)
		go func(g int) {
			defer wg.Done()
			for i := 0; i < 150; i++ {
				n := 0
				err := Do(context.Background(), p, func(context.Context) error {
					n++
					switch {
					case (g+i)%3 == 0 && n < 2:
						return flaky{}
					case (g+i)%7 == 0:
						return errors.New("hard")
					}
					return nil
				}, WithKey(fmt.Sprintf("k%d", g%3)))
				if err == nil {
					ok.Add(1)
				} else if errors.Is(err, ErrNonRetryable) {
					failed.Add(1)
				} else {
					t.Errorf("unexpected %v", err)
				}
			}
		}(g)
	}
	wg.Wait()
	if ok.Load()+failed.Load() != 8*150 || failed.Load() == 0 {
		t.Fatalf("ok %d failed %d", ok.Load(), failed.Load())
	}
	if err := e.Flush(); err != nil {
		t.Fatal(err)
	}
}

func TestTrapRecovery(t *testing.T) {
	rec := &recorder{}
	const doc = `
policies:
  b:
    attempts: 1
    breaker: { window: { kind: count, size: 2 }, minimum-calls: 2, failure-rate: 50, open-duration: 60s }
`
	e := mustLoad(t, doc, WithListener(rec.listen), WithSnapshotInterval(0))
	p := mustPolicy(t, e, "b")
	for i := 0; i < 2; i++ {
		_ = Do(context.Background(), p, func(context.Context) error { return connErr })
	}
	if err := Do(context.Background(), p, func(context.Context) error { return nil }); !errors.Is(err, ErrBreakerOpen) {
		t.Fatalf("breaker not open: %v", err)
	}
	if _, err := e.ExportState(); err != nil { // the snapshot restored after the trap
		t.Fatal(err)
	}
	// The guest dies under the engine (as after a trap).
	e.mu.Lock()
	_ = e.in.mod.Close(context.Background())
	e.mu.Unlock()
	ran := 0
	err := Do(context.Background(), p, func(context.Context) error { ran++; return nil })
	if err != nil || ran != 1 {
		t.Fatalf("the call did not proceed as a single attempt: %v (ran %d)", err, ran)
	}
	if ev, ok := rec.find(EventEngineFault); !ok || !errors.Is(ev.Err, ErrEngineFault) {
		t.Fatalf("no engine-fault event: %+v", rec.evs)
	}
	// the state came back: the breaker is still open
	if err := Do(context.Background(), p, func(context.Context) error { return nil }); !errors.Is(err, ErrBreakerOpen) {
		t.Fatalf("breaker state lost: %v", err)
	}
}

func TestGuestCallBound(t *testing.T) {
	// A guest call over its bound (parsing a document of 4000 policies, some
	// hundreds of ms, under a 30 ms bound that does not grow with the document's
	// size) is interrupted by the watchdog: the
	// engine is re-instantiated with the document it had, the fault is reported,
	// and calls go on.
	rec := &recorder{}
	e := mustLoad(t, doDoc, WithListener(rec.listen), WithGuestCallLimit(30*time.Millisecond),
		func(o *options) { o.perByte = 0 })
	p := mustPolicy(t, e, "fast")
	var big strings.Builder
	big.WriteString("policies:\n")
	for i := 0; i < 4000; i++ {
		fmt.Fprintf(&big, "  p%d:\n    attempts: 3\n    backoff: { kind: exponential, base: 10ms, cap: 1s }\n", i)
	}
	t0 := time.Now()
	err := e.Reload(big.String())
	if !errors.Is(err, ErrEngineFault) || !strings.Contains(err.Error(), "time bound") {
		t.Fatalf("reload under a 30 ms bound: %v", err)
	}
	if d := time.Since(t0); d > 5*time.Second {
		t.Fatalf("the interrupted reload took %v", d)
	}
	if _, ok := rec.find(EventEngineFault); !ok {
		t.Fatalf("no engine-fault event: %+v", rec.evs)
	}
	// (re-instantiation may have failed too on a loaded machine: the engine
	// tries again at most every 100 ms)
	time.Sleep(120 * time.Millisecond)
	if n, err := e.PolicyCount(); err != nil || n != 4 {
		t.Fatalf("the engine lost its document: %d %v", n, err)
	}
	if err := Do(context.Background(), p, func(context.Context) error { return nil }); err != nil {
		t.Fatal(err)
	}
}

func TestEngineStateAndReload(t *testing.T) {
	const doc = `
policies:
  b:
    attempts: 1
    breaker: { window: { kind: count, size: 2 }, minimum-calls: 2, failure-rate: 50, open-duration: 60s }
`
	e := mustLoad(t, doc, WithSeed(3))
	p := mustPolicy(t, e, "b")
	if msg, ok, err := e.SetBreakerState(0, "", BreakerForcedOpen, e.Now()); err != nil || !ok {
		t.Fatalf("set-breaker-state: %q %v", msg, err)
	}
	err := Do(context.Background(), p, func(context.Context) error { return nil })
	if !errors.Is(err, ErrBreakerOpen) {
		t.Fatalf("forced open: %v", err)
	}
	if st, ok, err := e.BreakerState(0, "", e.Now()); err != nil || !ok || st != BreakerForcedOpen {
		t.Fatalf("breaker-state %v %v %v", st, ok, err)
	}
	state, err := e.ExportState()
	if err != nil || len(state) == 0 {
		t.Fatalf("export: %v", err)
	}
	// Another engine takes the state over.
	e2 := mustLoad(t, doc, WithSeed(3))
	if err := e2.ImportState(state); err != nil {
		t.Fatal(err)
	}
	if st, ok, _ := e2.BreakerState(0, "", e2.Now()); !ok || st != BreakerForcedOpen {
		t.Fatalf("imported state: %v", st)
	}
	var le *LoadError
	if err := e2.ImportState([]byte("not a state")); !errors.As(err, &le) {
		t.Fatalf("bad state accepted: %v", err)
	}
	// Reload: a bad document changes nothing; a good one keeps the policy handle working.
	if err := e.Reload("policies:\n  b:\n    attempts: -1\n"); !errors.As(err, new(LoadErrors)) {
		t.Fatalf("bad reload: %v", err)
	}
	if err := e.Reload("policies:\n  a:\n    attempts: 2\n  b:\n    attempts: 2\n"); err != nil {
		t.Fatal(err)
	}
	if p.Info().MaxAttempts != 2 {
		t.Fatalf("policy not re-resolved: %+v", p.Info())
	}
	js, ok, err := e.PolicyJSON(1)
	if err != nil || !ok || js == "" {
		t.Fatalf("policy-json %q %v %v", js, ok, err)
	}
	if a, ok, err := e.Analyze(1, 3); err != nil || !ok || a.Amplification != 8 {
		t.Fatalf("analyze %+v %v %v", a, ok, err)
	}
	if _, err := e.Policy("a"); err != nil {
		t.Fatal(err)
	}
	_ = e.Close(context.Background())
	if err := Do(context.Background(), p, func(context.Context) error { return nil }); !errors.Is(err, ErrClosed) {
		t.Fatalf("closed engine: %v", err)
	}
}

func TestDoValueFallbackOfTheWrongType(t *testing.T) {
	e := mustLoad(t, doDoc)
	_, err := DoValue(context.Background(), mustPolicy(t, e, "with-fallback"),
		func(context.Context) (string, error) { return "", connErr },
		WithCallFallback("cached", func(context.Context, error) (any, error) { return 42, nil }))
	if !errors.Is(err, ErrFallbacksFailed) || !strings.Contains(err.Error(), "not a string") {
		t.Fatalf("err %v", err)
	}
}

func TestPanicCancelsTheCall(t *testing.T) {
	const doc = "policies:\n  one:\n    attempts: 2\n    bulkhead: { max-concurrent: 1 }\n"
	e := mustLoad(t, doc)
	p := mustPolicy(t, e, "one")
	func() {
		defer func() {
			if r := recover(); r != "boom" {
				t.Fatalf("recovered %v", r)
			}
		}()
		_ = Do(context.Background(), p, func(context.Context) error { panic("boom") })
	}()
	// The bulkhead slot came back: the next call runs.
	if err := Do(context.Background(), p, func(context.Context) error { return nil }); err != nil {
		t.Fatalf("after a panic: %v", err)
	}
}

// Successes held back by calls that finished together must all reach the core
// before the next start: a bulkhead sized for one wave of calls admits every
// following wave only if no finished call still holds its slot.
func TestDoHeldSuccessesFreeTheirSlots(t *testing.T) {
	const width = 8
	doc := "policies:\n  p:\n    attempts: 1\n    bulkhead: { max-concurrent: 8 }\n"
	e, err := Load(context.Background(), doc, WithSeed(1))
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close(context.Background())
	p, err := e.Policy("p")
	if err != nil {
		t.Fatal(err)
	}
	for wave := 0; wave < 50; wave++ {
		var started, finished sync.WaitGroup
		started.Add(width)
		finished.Add(width)
		errs := make(chan error, width)
		for i := 0; i < width; i++ {
			go func() {
				defer finished.Done()
				ran := false
				err := Do(context.Background(), p, func(context.Context) error {
					ran = true
					started.Done()
					started.Wait() // all width calls in flight at once
					return nil
				})
				if !ran {
					started.Done() // rejected: do not keep the others waiting
				}
				errs <- err
			}()
		}
		finished.Wait()
		close(errs)
		for err := range errs {
			if err != nil {
				t.Fatalf("wave %d: %v", wave, err)
			}
		}
	}
	if err := e.Flush(); err != nil {
		t.Fatal(err)
	}
}

// A fallback is told the trigger's reason, the attempts made and the last error.
func TestFallbackContext(t *testing.T) {
	e := mustLoad(t, doDoc, WithSeed(1))
	p := mustPolicy(t, e, "with-fallback")
	boom := &net.OpError{Op: "dial", Err: errors.New("refused")}
	var got FallbackInfo
	v, err := DoValue(context.Background(), p, func(context.Context) (string, error) { return "", boom },
		WithCallFallback("cached", func(ctx context.Context, cause error) (any, error) {
			got, _ = FallbackContext(ctx)
			return "from cache", nil
		}))
	if err != nil || v != "from cache" {
		t.Fatalf("DoValue = %q, %v", v, err)
	}
	if got.Policy != "with-fallback" || got.Name != "cached" || got.Reason != ReasonRetriesExhausted || got.Attempts != 2 || got.Err != boom {
		t.Fatalf("FallbackInfo = %+v", got)
	}
}

type quote struct{ price int }

// Issue 39: typed fallbacks. Of[T] checks a call's fallbacks against its result type at
// compile time (failsafe-go's Fallback[R]); the engine keeps one fallback per name and
// result type, so the same name serves an HTTP call and a DoValue call each with its own.
func TestTypedFallbacks(t *testing.T) {
	ctx := context.Background()
	e := mustLoad(t, doDoc, WithTypedFallback("cached", func(context.Context, error) (string, error) { return "at load", nil }))
	fb := mustPolicy(t, e, "with-fallback")
	failQuote := func(context.Context) (quote, error) { return quote{}, connErr }
	// a call's own, typed: a fallback returning anything but a quote would not compile
	q, err := Of[quote](fb).Fallback("cached", func(_ context.Context, cause error) (quote, error) {
		if !errors.Is(cause, connErr) {
			return quote{}, errors.New("cause lost")
		}
		return quote{7}, nil
	}).Do(ctx, failQuote)
	if err != nil || q.price != 7 {
		t.Fatalf("Of[quote].Fallback: %v %v", q, err)
	}
	// the engine's, one per (name, result type): the second registration keeps the first
	if err := RegisterTypedFallback(e, "cached", func(context.Context, error) (quote, error) { return quote{1}, nil }); err != nil {
		t.Fatal(err)
	}
	if q, err = DoValue(ctx, fb, failQuote); err != nil || q.price != 1 {
		t.Fatalf("typed quote fallback: %v %v", q, err)
	}
	s, err := DoValue(ctx, fb, func(context.Context) (string, error) { return "", connErr })
	if err != nil || s != "at load" {
		t.Fatalf("typed string fallback: %q %v", s, err)
	}
	// a call whose result no registration fits: the error says what is registered
	_, err = DoValue(ctx, fb, func(context.Context) (int, error) { return 0, connErr })
	want := "fallback 'cached' is registered for levee.quote, string, not for int"
	if !errors.Is(err, ErrFallbacksFailed) || !strings.Contains(err.Error(), want) || strings.Contains(err.Error(), "not registered") {
		t.Fatalf("err %v, want it to say %q", err, want)
	}
	err = Do(ctx, fb, func(context.Context) error { return connErr })
	if !errors.Is(err, ErrFallbacksFailed) || !strings.Contains(err.Error(), "not for a call without a result (Do)") {
		t.Fatalf("Do: %v", err)
	}
	// an untyped fallback serves every call no typed one fits; a typed one wins
	e.RegisterFallback("cached", func(context.Context, error) (any, error) { return 99, nil })
	if n, err := DoValue(ctx, fb, func(context.Context) (int, error) { return 0, connErr }); err != nil || n != 99 {
		t.Fatalf("untyped: %v %v", n, err)
	}
	if q, err = DoValue(ctx, fb, failQuote); err != nil || q.price != 1 {
		t.Fatalf("typed over untyped: %v %v", q, err)
	}
	if err := Do(ctx, fb, func(context.Context) error { return connErr }); err != nil {
		t.Fatalf("Do with an untyped fallback: %v", err)
	}
	// a call's own untyped fallback still wins over the engine's typed one
	q, err = DoValue(ctx, fb, failQuote, WithCallFallback("cached", func(context.Context, error) (any, error) { return quote{3}, nil }))
	if err != nil || q.price != 3 {
		t.Fatalf("call over engine: %v %v", q, err)
	}
	if err := RegisterTypedFallback[quote](e, "cached", nil); err != nil { // nil removes it
		t.Fatal(err)
	}
	if _, err = DoValue(ctx, fb, failQuote); !strings.Contains(err.Error(), "not a levee.quote") {
		t.Fatalf("after removing the typed one, the untyped one's int is refused: %v", err)
	}
}

package levee_test

// Hedged calls through the public API (Do, DoValue, the Transport) on a virtual clock:
// the A6 example, the caller's cancel, a cancelled attempt that holds its bulkhead slot
// until it has closed, a fallback after every hedge failed, a hedged HTTP call against a
// loopback server (each attempt its own request, the loser cancelled), a stream body
// never hedged, and the contract checks of hedge-answers (the recovery path).

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	levee "github.com/levee-dev/levee/host-bindings/go"
	"github.com/levee-dev/levee/host-bindings/go/leveetest"
)

const ms = time.Millisecond

// hedgeLog records what each attempt did, by its number (x-levee-attempt, or its order).
type hedgeLog struct {
	mu     sync.Mutex
	clk    *leveetest.VirtualClock
	start  time.Time
	starts map[int]time.Duration
	ends   map[int]time.Duration
	errs   map[int]error
}

func newHedgeLog(clk *leveetest.VirtualClock) *hedgeLog {
	return &hedgeLog{clk: clk, start: clk.Now(), starts: map[int]time.Duration{}, ends: map[int]time.Duration{}, errs: map[int]error{}}
}

func (l *hedgeLog) begin(n int) {
	l.mu.Lock()
	l.starts[n] = l.clk.Since(l.start)
	l.mu.Unlock()
}

func (l *hedgeLog) end(n int, err error) {
	l.mu.Lock()
	l.ends[n] = l.clk.Since(l.start)
	l.errs[n] = err
	l.mu.Unlock()
}

func (l *hedgeLog) String() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	var b strings.Builder
	for n := 1; n <= 11; n++ {
		if s, ok := l.starts[n]; ok {
			e, ended := l.ends[n]
			if ended {
				fmt.Fprintf(&b, "#%d %v-%v %v; ", n, s, e, l.errs[n])
			} else {
				fmt.Fprintf(&b, "#%d %v-open; ", n, s)
			}
		}
	}
	return b.String()
}

// waitPending blocks until exactly want timers wait on clk (the call's goroutines have
// settled), failing after 10 s of real time.
func waitPending(t *testing.T, clk *leveetest.VirtualClock, want int) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for clk.Pending() != want {
		if time.Now().After(deadline) {
			t.Fatalf("%d timers pending, want %d", clk.Pending(), want)
		}
		time.Sleep(200 * time.Microsecond)
	}
	time.Sleep(2 * ms) // nothing else moves: the goroutines are blocked on the clock
	if n := clk.Pending(); n != want {
		t.Fatalf("%d timers pending, want %d", n, want)
	}
}

type listener struct {
	mu  sync.Mutex
	evs []levee.Event
}

func (l *listener) listen(ev levee.Event) { l.mu.Lock(); l.evs = append(l.evs, ev); l.mu.Unlock() }
func (l *listener) kinds() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []string
	for _, ev := range l.evs {
		s := ev.Kind.String()
		if ev.Kind == levee.EventHedgeStarted {
			s += "#" + strconv.Itoa(int(ev.Attempt))
		}
		if ev.Kind == levee.EventEngineFault {
			s += ":" + ev.Fault
		}
		out = append(out, s)
	}
	return out
}

// The A6 example through DoValue: #1 at 0, #2 at 500 ms, #1 fails UNAVAILABLE at 700 so #3
// starts at once, #2's OK at 900 wins and cancels #3, #4 never starts.
func TestHedgeA6ThroughDoValue(t *testing.T) {
	ctx := context.Background()
	clk := leveetest.NewVirtualClock()
	rec := leveetest.NewRecorder()
	ls := &listener{}
	e, err := levee.Load(ctx, "policies:\n  p:\n    hedge: { attempts: 4, delay: 500ms, non-fatal: [\"grpc:unavailable\"] }\n",
		levee.WithClock(clk), levee.WithSeed(1), levee.WithTelemetry(rec), levee.WithListener(ls.listen))
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close(ctx)
	p, _ := e.Policy("p")
	log := newHedgeLog(clk)
	var order atomic.Int32
	plays := map[int]func(ctx context.Context) (string, error){
		1: func(ctx context.Context) (string, error) {
			if err := clk.Sleep(ctx, 700*ms); err != nil {
				return "", err
			}
			return "", levee.GRPCStatusError(14, "")
		},
		2: func(ctx context.Context) (string, error) {
			if err := clk.Sleep(ctx, 400*ms); err != nil {
				return "", err
			}
			return "two", nil
		},
		3: func(ctx context.Context) (string, error) {
			if err := clk.Sleep(ctx, time.Second); err != nil {
				return "", err
			}
			return "three", nil
		},
	}
	type res struct {
		v   string
		err error
	}
	done := make(chan res, 1)
	go func() {
		v, err := levee.DoValue(ctx, p, func(ctx context.Context) (string, error) {
			n := int(order.Add(1))
			log.begin(n)
			v, err := plays[n](ctx)
			log.end(n, err)
			return v, err
		})
		done <- res{v, err}
	}()
	waitPending(t, clk, 2) // #1's 700 ms, the wait of 500 ms
	clk.Advance(500 * ms)
	waitPending(t, clk, 3) // #1, #2, the next wait (1000 ms)
	clk.Advance(200 * ms)
	waitPending(t, clk, 3) // #2, #3, the wait of 500 ms from 700
	clk.Advance(200 * ms)
	r := <-done
	if r.err != nil || r.v != "two" {
		t.Fatalf("DoValue = %q, %v; want two (%s)", r.v, r.err, log)
	}
	waitPending(t, clk, 0)
	log.mu.Lock()
	got := fmt.Sprint(log.starts, log.ends)
	canceled := errors.Is(log.errs[3], context.Canceled)
	log.mu.Unlock()
	if want := "map[1:0s 2:500ms 3:700ms] map[1:700ms 2:900ms 3:900ms]"; got != want || !canceled {
		t.Fatalf("attempts %s (#3 cancelled: %v), want %s", got, canceled, want)
	}
	if err := e.Flush(); err != nil {
		t.Fatal(err)
	}
	if got, want := strings.Join(ls.kinds(), ","), "hedge-started#2,hedge-started#3"; got != want {
		t.Fatalf("events %s, want %s", got, want)
	}
	var hedges, attempts float64
	for _, en := range rec.Entries() {
		if en.Kind == "add" && en.Name == "levee.hedges" {
			hedges += en.Value
		}
		if en.Kind == "add" && en.Name == "levee.attempts" {
			attempts += en.Value
		}
	}
	if hedges != 2 || attempts != 2 { // the cancelled #3 is not counted
		t.Fatalf("levee.hedges %v, levee.attempts %v; want 2 and 2", hedges, attempts)
	}
}

// A hedged HTTP call against a loopback server: each attempt is its own request (its own
// x-levee-attempt, its own copy of the body), the slow first one is cancelled when the
// hedge's response wins (the server sees its request's context end), and the response
// returned is the winner's.
func TestHedgedHTTPOnLoopback(t *testing.T) {
	var mu sync.Mutex
	seen := map[string]string{} // attempt -> body received
	firstGone := make(chan struct{})
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		n := r.Header.Get(levee.HeaderAttempt)
		mu.Lock()
		seen[n] = string(b)
		mu.Unlock()
		if n == "1" {
			select {
			case <-r.Context().Done(): // the hedge won: this request is cancelled
				close(firstGone)
			case <-time.After(5 * time.Second):
			}
			return
		}
		fmt.Fprintf(w, "from attempt %s", n)
	}))
	defer srv.Close()
	ctx := context.Background()
	e, err := levee.Load(ctx, "policies:\n  p:\n    hedge: { attempts: 2, delay: 30ms }\n", levee.WithSeed(1))
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close(ctx)
	p, _ := e.Policy("p")
	client := &http.Client{Transport: &levee.Transport{Policy: p}}
	req, _ := http.NewRequest(http.MethodPut, srv.URL+"/x", strings.NewReader("payload")) // GetBody: replayable
	resp, err := client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	_ = resp.Body.Close()
	if resp.StatusCode != 200 || string(body) != "from attempt 2" {
		t.Fatalf("response %d %q, want 200 from attempt 2", resp.StatusCode, body)
	}
	select {
	case <-firstGone:
	case <-time.After(5 * time.Second):
		t.Fatal("the losing request was not cancelled")
	}
	mu.Lock()
	defer mu.Unlock()
	if seen["1"] != "payload" || seen["2"] != "payload" || len(seen) != 2 {
		t.Fatalf("the server saw %v, want the body on attempts 1 and 2", seen)
	}
}

// A body that cannot be sent twice is never hedged: one request, however slow.
func TestHedgedHTTPStreamBodyIsSentOnce(t *testing.T) {
	var n atomic.Int32
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		n.Add(1)
		_, _ = io.Copy(io.Discard, r.Body)
		time.Sleep(60 * ms)
		w.WriteHeader(201)
	}))
	defer srv.Close()
	ctx := context.Background()
	e, err := levee.Load(ctx, "policies:\n  p:\n    hedge: { attempts: 2, delay: 10ms }\n", levee.WithSeed(1))
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close(ctx)
	p, _ := e.Policy("p")
	client := &http.Client{Transport: &levee.Transport{Policy: p}}
	req, _ := http.NewRequest(http.MethodPost, srv.URL, io.NopCloser(strings.NewReader("stream"))) // no GetBody
	req.Header.Set("Idempotency-Key", "k")                                                         // whatever the headers say
	resp, err := client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	_ = resp.Body.Close()
	if resp.StatusCode != 201 || n.Load() != 1 {
		t.Fatalf("status %d after %d requests, want 201 after 1", resp.StatusCode, n.Load())
	}
}

// hedgeCall runs a DoValue of p in a goroutine; the attempts play fns in the order they start.
func hedgeCall(ctx context.Context, p *levee.Policy, fns ...func(ctx context.Context) (string, error)) chan struct {
	v   string
	err error
} {
	var order atomic.Int32
	done := make(chan struct {
		v   string
		err error
	}, 1)
	go func() {
		v, err := levee.DoValue(ctx, p, func(ctx context.Context) (string, error) {
			k := int(order.Add(1)) - 1
			if k >= len(fns) {
				return "", errors.New("no such attempt")
			}
			return fns[k](ctx)
		})
		done <- struct {
			v   string
			err error
		}{v, err}
	}()
	return done
}

func after(clk *leveetest.VirtualClock, d time.Duration, v string, err error) func(ctx context.Context) (string, error) {
	return func(ctx context.Context) (string, error) {
		if cerr := clk.Sleep(ctx, d); cerr != nil {
			return "", cerr
		}
		return v, err
	}
}

// Every attempt fails: the call fails with retries-exhausted and the last failure (A6),
// a *levee.Error like a retried call's.
func TestHedgeAllFailIsATypedError(t *testing.T) {
	ctx := context.Background()
	clk := leveetest.NewVirtualClock()
	e, err := levee.Load(ctx, "policies:\n  p:\n    hedge: { attempts: 2, delay: 100ms }\n", levee.WithClock(clk), levee.WithSeed(1))
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close(ctx)
	p, _ := e.Policy("p")
	first, second := levee.HTTPStatusError(503, ""), levee.HTTPStatusError(502, "")
	done := hedgeCall(ctx, p, after(clk, 30*ms, "", first), after(clk, 20*ms, "", second))
	waitPending(t, clk, 2)
	clk.Advance(30 * ms) // #1's 503 sends #2 at once
	waitPending(t, clk, 1)
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(time.Millisecond) { // #2 sleeps, not the wait
		if ci, ok, _ := e.CallInfo(1); ok && ci.Attempts == 2 && clk.Pending() == 1 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("attempt 2 did not start")
		}
	}
	clk.Advance(20 * ms)
	r := <-done
	var le *levee.Error
	if !errors.As(r.err, &le) || !errors.Is(r.err, levee.ErrRetriesExhausted) || le.Attempts != 2 || !errors.Is(r.err, second) {
		t.Fatalf("error %v (%#v), want retries-exhausted after 2 attempts with the 502", r.err, le)
	}
}

// The caller's cancel aborts every attempt and ends the call with an error wrapping
// context.Canceled, without waiting for an attempt that ignores it.
func TestHedgeCallerCancel(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	clk := leveetest.NewVirtualClock()
	e, err := levee.Load(ctx, "policies:\n  p:\n    bulkhead: { max-concurrent: 2 }\n    hedge: { attempts: 2, delay: 0 }\n",
		levee.WithClock(clk), levee.WithSeed(1))
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close(context.Background())
	p, _ := e.Policy("p")
	aborted := make(chan error, 2)
	hang := func(ctx context.Context) (string, error) {
		<-ctx.Done()
		aborted <- ctx.Err()
		return "", ctx.Err()
	}
	done := hedgeCall(ctx, p, hang, hang)
	deadline := time.Now().Add(5 * time.Second)
	for {
		ci, ok, _ := e.CallInfo(1)
		if ok && ci.Attempts == 2 || time.Now().After(deadline) {
			break
		}
		time.Sleep(time.Millisecond)
	}
	cancel()
	r := <-done
	if !errors.Is(r.err, context.Canceled) || !errors.Is(r.err, levee.ErrCancelled) {
		t.Fatalf("error %v, want the call cancelled", r.err)
	}
	for i := 0; i < 2; i++ {
		if err := <-aborted; !errors.Is(err, context.Canceled) {
			t.Fatalf("attempt aborted with %v", err)
		}
	}
	if _, ok, _ := e.CallInfo(1); ok {
		t.Fatal("the core still knows the cancelled call")
	}
	// both bulkhead slots are free again
	if v, err := levee.DoValue(context.Background(), p, func(context.Context) (string, error) { return "ok", nil }); err != nil || v != "ok" {
		t.Fatalf("a call after the cancel: %q, %v", v, err)
	}
}

// A panic in an attempt reaches the caller, as in a call that is not hedged; the call is
// cancelled in the core first.
func TestHedgeAttemptPanicReachesTheCaller(t *testing.T) {
	ctx := context.Background()
	e, err := levee.Load(ctx, "policies:\n  p:\n    hedge: { attempts: 2, delay: 1s }\n", levee.WithSeed(1))
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close(ctx)
	p, _ := e.Policy("p")
	defer func() {
		if r := recover(); r != "boom" {
			t.Fatalf("recovered %v, want the attempt's panic", r)
		}
		if _, ok, _ := e.CallInfo(1); ok {
			t.Fatal("the core still knows the call")
		}
	}()
	_ = p.Do(ctx, func(context.Context) error { panic("boom") })
	t.Fatal("Do returned")
}

// A hedge-answer that breaks the contract is the one recovery path: the engine is
// re-instantiated, an engine-fault (contract) is reported, and the call degrades to the
// attempt in flight, whose own result it returns.
func TestHedgeContractBreachDegrades(t *testing.T) {
	for _, tc := range []struct {
		name string
		bad  levee.HedgeCommand
	}{
		{"start twice", levee.HedgeCommand{Kind: levee.HedgeStart, Attempt: 1}},
		{"start past 11", levee.HedgeCommand{Kind: levee.HedgeStart, Attempt: 12}},
		{"cancel never started", levee.HedgeCommand{Kind: levee.HedgeCancel, Attempt: 3}},
		{"end never started", levee.HedgeCommand{Kind: levee.HedgeEnd, Attempt: 4, Verdict: levee.Verdict(levee.VerdictDone)}},
		{"end with a wait verdict", levee.HedgeCommand{Kind: levee.HedgeEnd, Attempt: 1, Verdict: levee.Verdict(levee.VerdictWait)}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ctx := context.Background()
			clk := leveetest.NewVirtualClock()
			ls := &listener{}
			e, err := levee.Load(ctx, "policies:\n  p:\n    hedge: { attempts: 3, delay: 100ms }\n", levee.WithClock(clk),
				levee.WithSeed(1), levee.WithListener(ls.listen))
			if err != nil {
				t.Fatal(err)
			}
			defer e.Close(ctx)
			levee.SetHedgeInjector(e, func(_ context.Context, _ uint64, op string, a levee.HedgeAnswer) levee.HedgeAnswer {
				if op == "hedge-step" && len(a.Commands) > 0 && a.Commands[0].Kind == levee.HedgeStart {
					a.Commands = append([]levee.HedgeCommand{a.Commands[0], tc.bad}, a.Commands[1:]...)
				}
				return a
			})
			p, _ := e.Policy("p")
			done := hedgeCall(ctx, p, after(clk, 300*ms, "first", nil), after(clk, 10*ms, "second", nil))
			waitPending(t, clk, 2) // #1, the wait
			clk.Advance(100 * ms)  // the hedge-step that starts #2 breaks the contract: nothing of it is done
			waitPending(t, clk, 1) // #1 alone
			clk.Advance(200 * ms)
			r := <-done
			if r.err != nil || r.v != "first" {
				t.Fatalf("DoValue = %q, %v; want attempt 1's own result", r.v, r.err)
			}
			if got := strings.Join(ls.kinds(), ","); got != "engine-fault:contract" {
				t.Fatalf("events %s, want one engine-fault (contract)", got)
			}
		})
	}
}

// A trap in report-attempt ends the call with that attempt's own result (here its error,
// as the user's own); the other attempt is cancelled.
func TestHedgeTrapInReportKeepsItsAttempt(t *testing.T) {
	ctx := context.Background()
	clk := leveetest.NewVirtualClock()
	ls := &listener{}
	e, err := levee.Load(ctx, "policies:\n  p:\n    hedge: { attempts: 2, delay: 0 }\n", levee.WithClock(clk),
		levee.WithSeed(1), levee.WithListener(ls.listen))
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close(ctx)
	levee.SetFaultInjector(e, func(_ context.Context, _ uint64, op string) (bool, uint64, bool) {
		return op == "report-attempt", 0, false
	})
	p, _ := e.Policy("p")
	mine := errors.New("mine")
	cancelled := make(chan error, 1)
	done := hedgeCall(ctx, p, after(clk, 10*ms, "", mine), func(ctx context.Context) (string, error) {
		<-ctx.Done()
		cancelled <- ctx.Err()
		return "", ctx.Err()
	})
	waitPending(t, clk, 1)
	clk.Advance(10 * ms)
	r := <-done
	if r.err != mine {
		t.Fatalf("error %v, want the attempt's own error", r.err)
	}
	if err := <-cancelled; !errors.Is(err, context.Canceled) {
		t.Fatalf("the other attempt ended with %v", err)
	}
	if got := strings.Join(ls.kinds(), ","); got != "hedge-started#2,engine-fault:trap" {
		t.Fatalf("events %s", got)
	}
}

// HedgeAttempt names the attempt of a hedged call its function runs as, and nothing under a
// call that is not hedged (nor outside any call).
func TestHedgeAttemptNumber(t *testing.T) {
	ctx := context.Background()
	e, err := levee.Load(ctx, "policies:\n  h:\n    hedge: { attempts: 2, delay: 1ms }\n  r:\n    attempts: 2\n    backoff: { kind: constant, base: 1ms, cap: 1ms, jitter: none }\n")
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close(ctx)
	h, _ := e.Policy("h")
	r, _ := e.Policy("r")
	if _, ok := levee.HedgeAttempt(ctx); ok {
		t.Fatal("HedgeAttempt outside a call")
	}
	var mu sync.Mutex
	var seen []int
	second := make(chan struct{})
	v, err := levee.DoValue(ctx, h, func(ctx context.Context) (int, error) {
		n, ok := levee.HedgeAttempt(ctx)
		if !ok {
			return 0, errors.New("not a hedged attempt")
		}
		mu.Lock()
		seen = append(seen, n)
		mu.Unlock()
		if n == 1 {
			<-second // #1 waits for the hedge, then loses to it
			<-ctx.Done()
			return 0, ctx.Err()
		}
		close(second)
		return n, nil
	})
	mu.Lock()
	got := fmt.Sprint(seen)
	mu.Unlock()
	if err != nil || v != 2 || got != "[1 2]" {
		t.Fatalf("DoValue = %d, %v; attempts %s: want 2 from the hedge, attempts [1 2]", v, err, got)
	}
	calls := 0
	err = levee.Do(ctx, r, func(ctx context.Context) error {
		calls++
		if n, ok := levee.HedgeAttempt(ctx); ok {
			return fmt.Errorf("attempt %d of a call that is not hedged is named a hedge", n)
		}
		if calls == 1 {
			return levee.GRPCStatusError(14, "")
		}
		return nil
	})
	if err != nil || calls != 2 {
		t.Fatalf("Do = %v after %d attempts", err, calls)
	}
}

package leveetest_test

import (
	"context"
	"errors"
	"net/http"
	"net/http/httptest"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	levee "github.com/levee-dev/levee/host-bindings/go"
	"github.com/levee-dev/levee/host-bindings/go/leveetest"
)

const doc = `
policies:
  slow:
    attempts: 3
    backoff: { kind: constant, base: 10s, cap: 10s, jitter: none }
    retry-on: ["error:flaky"]
  timed:
    attempts: 2
    attempt-timeout: 5s
    backoff: { kind: constant, base: 1s, cap: 1s, jitter: none }
`

func load(t *testing.T, opts ...levee.Option) *levee.Engine {
	t.Helper()
	e, err := levee.Load(context.Background(), doc, opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = e.Close(context.Background()) })
	return e
}

func policy(t *testing.T, e *levee.Engine, name string) *levee.Policy {
	t.Helper()
	p, err := e.Policy(name)
	if err != nil {
		t.Fatal(err)
	}
	return p
}

// NoWaits: two 10 s backoffs pass on the virtual clock, none in real time.
func TestNoWaitsRunsBackoffInstantly(t *testing.T) {
	clk := leveetest.NewAutoClock()
	e := load(t, levee.WithClock(clk))
	var starts []time.Duration
	t0, real0 := clk.Now(), time.Now()
	err := levee.Do(context.Background(), policy(t, e, "slow"), func(ctx context.Context) error {
		starts = append(starts, clk.Since(t0))
		return levee.ClassError("flaky", errors.New("down"))
	})
	if !errors.Is(err, levee.ErrRetriesExhausted) {
		t.Fatalf("err = %v", err)
	}
	want := []time.Duration{0, 10 * time.Second, 20 * time.Second}
	if len(starts) != 3 || starts[0] != want[0] || starts[1] != want[1] || starts[2] != want[2] {
		t.Fatalf("attempts started at %v, want %v", starts, want)
	}
	if el := time.Since(real0); el > 5*time.Second {
		t.Fatalf("the virtual backoff took %v of real time", el)
	}
	if got := e.Now(); got != uint64(20*time.Second) {
		t.Fatalf("engine now = %v, want 20s", time.Duration(got))
	}
}

// A virtual attempt timeout cancels the attempt's context when the test moves the clock past it.
func TestVirtualAttemptTimeoutCancelsTheAttempt(t *testing.T) {
	clk := leveetest.NewVirtualClock()
	e := load(t, levee.WithClock(clk))
	var attempts atomic.Int32
	deadlines := make(chan time.Duration, 2)
	done := make(chan error, 1)
	t0 := clk.Now()
	go func() {
		done <- levee.Do(context.Background(), policy(t, e, "timed"), func(ctx context.Context) error {
			attempts.Add(1)
			dl, ok := levee.ClockDeadline(ctx)
			if !ok {
				deadlines <- -1
			} else {
				deadlines <- dl.Sub(clk.Now())
			}
			<-ctx.Done()
			return ctx.Err()
		})
	}()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := clk.BlockUntil(ctx, 1); err != nil { // the first attempt's timeout timer
		t.Fatal(err)
	}
	if d := <-deadlines; d != 5*time.Second {
		t.Fatalf("the first attempt's deadline is %v away, want 5s", d)
	}
	clk.Advance(4 * time.Second)
	select {
	case err := <-done:
		t.Fatalf("the call ended before its timeout: %v", err)
	case <-time.After(20 * time.Millisecond):
	}
	clk.Advance(time.Second) // the timeout: the 1 s backoff sleep starts
	if err := clk.BlockUntil(ctx, 1); err != nil {
		t.Fatal(err)
	}
	clk.Advance(time.Second) // the second attempt
	if d := <-deadlines; d != 5*time.Second {
		t.Fatalf("the second attempt's deadline is %v away, want 5s", d)
	}
	if err := clk.BlockUntil(ctx, 1); err != nil {
		t.Fatal(err)
	}
	clk.Advance(5 * time.Second)
	var err error
	select {
	case err = <-done:
	case <-ctx.Done():
		t.Fatal("the call did not end")
	}
	var le *levee.Error
	if !errors.As(err, &le) || le.Reason != levee.ReasonRetriesExhausted || le.Attempts != 2 ||
		!errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("err = %v", err)
	}
	if got := clk.Since(t0); got != 11*time.Second {
		t.Fatalf("the call took %v on the virtual clock, want 11s", got)
	}
}

// In auto-advance mode a dependency that sleeps past the attempt timeout is cut at the timeout.
func TestAutoClockStopsAtTheAttemptTimeout(t *testing.T) {
	clk := leveetest.NewAutoClock()
	e := load(t, levee.WithClock(clk))
	t0 := clk.Now()
	var ends []time.Duration
	err := levee.Do(context.Background(), policy(t, e, "timed"), func(ctx context.Context) error {
		err := clk.Sleep(ctx, time.Hour)
		ends = append(ends, clk.Since(t0))
		return err
	})
	if !errors.Is(err, levee.ErrRetriesExhausted) || !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("err = %v", err)
	}
	if len(ends) != 2 || ends[0] != 5*time.Second || ends[1] != 11*time.Second {
		t.Fatalf("attempts ended at %v, want [5s 11s]", ends)
	}
}

// Cancelling the caller's context during a virtual sleep ends the call as cancelled.
func TestCancelDuringVirtualSleep(t *testing.T) {
	clk := leveetest.NewVirtualClock()
	e := load(t, levee.WithClock(clk))
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		done <- levee.Do(ctx, policy(t, e, "slow"), func(context.Context) error { return levee.ClassError("flaky", errors.New("down")) })
	}()
	wctx, wcancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer wcancel()
	if err := clk.BlockUntil(wctx, 1); err != nil {
		t.Fatal(err)
	}
	cancel()
	err := <-done
	if !errors.Is(err, levee.ErrCancelled) || !errors.Is(err, context.Canceled) {
		t.Fatalf("err = %v", err)
	}
	if clk.Pending() != 0 {
		t.Fatalf("%d timers left on the clock", clk.Pending())
	}
}

func TestClockTimersFireInOrder(t *testing.T) {
	clk := leveetest.NewVirtualClock()
	var got []int
	clk.AfterFunc(3*time.Second, func() { got = append(got, 3) })
	clk.AfterFunc(time.Second, func() { got = append(got, 1) })
	stopped := clk.AfterFunc(2*time.Second, func() { got = append(got, 2) })
	clk.AfterFunc(time.Second, func() { got = append(got, 10) })
	if !stopped.Stop() || stopped.Stop() {
		t.Fatal("Stop should report true once")
	}
	clk.Advance(2 * time.Second)
	if len(got) != 2 || got[0] != 1 || got[1] != 10 {
		t.Fatalf("fired %v", got)
	}
	if !clk.AdvanceToNext() || len(got) != 3 || got[2] != 3 || clk.Since(leveetest.Epoch) != 3*time.Second {
		t.Fatalf("fired %v at %v", got, clk.Since(leveetest.Epoch))
	}
	if clk.AdvanceToNext() {
		t.Fatal("no timer should be left")
	}
}

// A success that arrives after its attempt's timeout (a function that ignores its
// context) is reported, not held back: the core judges it a timeout and retries.
func TestLateSuccessIsTheCoresToJudge(t *testing.T) {
	clk := leveetest.NewAutoClock()
	var retries atomic.Int32
	e := load(t, levee.WithClock(clk), levee.WithListener(func(ev levee.Event) {
		if ev.Kind == levee.EventRetryScheduled {
			retries.Add(1)
		}
	}))
	n := 0
	err := levee.Do(context.Background(), policy(t, e, "timed"), func(ctx context.Context) error {
		n++
		if n == 1 {
			_ = clk.Sleep(context.Background(), 6*time.Second) // deaf to ctx
		}
		return nil
	})
	if err != nil || n != 2 || retries.Load() != 1 {
		t.Fatalf("err = %v after %d attempts, %d retries scheduled", err, n, retries.Load())
	}
}

// Under a virtual clock the attempt's ctx.Deadline() is in real time (now plus what
// is left on the virtual clock), so real I/O under it (a dial on 127.0.0.1) works,
// and levee.ClockDeadline gives the virtual one.
func TestVirtualDeadlineIsRealForIO(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(204) }))
	defer srv.Close()
	clk := leveetest.NewAutoClock()
	e := load(t, levee.WithClock(clk))
	var real, virtual time.Duration
	base := rtFunc(func(r *http.Request) (*http.Response, error) {
		dl, _ := r.Context().Deadline()
		real = time.Until(dl)
		vdl, _ := levee.ClockDeadline(r.Context())
		virtual = vdl.Sub(clk.Now())
		return http.DefaultTransport.RoundTrip(r)
	})
	client := &http.Client{Transport: &levee.Transport{Base: base, Policy: policy(t, e, "timed")}}
	resp, err := client.Get(srv.URL)
	if err != nil {
		t.Fatal(err)
	}
	_ = resp.Body.Close()
	if resp.StatusCode != 204 || virtual != 5*time.Second || real <= 4*time.Second || real > 5*time.Second {
		t.Fatalf("status %d, deadline %v away in real time, %v on the clock", resp.StatusCode, real, virtual)
	}
}

type rtFunc func(*http.Request) (*http.Response, error)

func (f rtFunc) RoundTrip(r *http.Request) (*http.Response, error) { return f(r) }

// A retry predicate in code (docs/hosts.md, section 9): a result it calls a failure is
// retried; its "no" stops an error the policy would retry.
func TestRetryIf(t *testing.T) {
	e := load(t, leveetest.NoWaits(), levee.WithPolicyRetryIf("slow", func(result any, err error) levee.RetryAnswer {
		if result == "bad" {
			return levee.Retry
		}
		return levee.Unset
	}))
	n := 0
	v, err := levee.DoValue(context.Background(), policy(t, e, "slow"), func(context.Context) (any, error) {
		n++
		if n < 3 {
			return "bad", nil
		}
		return "good", nil
	})
	if err != nil || v != "good" || n != 3 {
		t.Fatalf("DoValue = %v, %v after %d attempts", v, err, n)
	}
	n = 0
	err = levee.Do(context.Background(), policy(t, e, "slow"), func(context.Context) error {
		n++
		return levee.ClassError("flaky", errors.New("down")) // retry-on: error:flaky
	}, levee.RetryIf(func(any, error) levee.RetryAnswer { return levee.NoRetry }))
	if !errors.Is(err, levee.ErrNonRetryable) || n != 1 {
		t.Fatalf("Do = %v after %d attempts", err, n)
	}
	n = 0
	_, err = levee.DoValue(context.Background(), policy(t, e, "slow"), func(context.Context) (any, error) { n++; return "bad", nil },
		levee.RetryIf(func(any, error) levee.RetryAnswer { panic("predicate bug") }))
	if err != nil || n != 1 {
		t.Fatalf("a panicking predicate must count as unset: %v after %d attempts", err, n)
	}
}

// The Transport's predicate sees the response: a 200 it calls a failure is retried.
func TestTransportRetryIf(t *testing.T) {
	e := load(t, leveetest.NoWaits())
	n := 0
	base := rtFunc(func(r *http.Request) (*http.Response, error) {
		n++
		return &http.Response{StatusCode: 200, Header: http.Header{"X-Stale": {strconv.FormatBool(n < 2)}}, Body: http.NoBody, Request: r}, nil
	})
	tr := &levee.Transport{Base: base, Policy: policy(t, e, "timed"), RetryIf: func(result any, err error) levee.RetryAnswer {
		if r, ok := result.(*http.Response); ok && r.Header.Get("X-Stale") == "true" {
			return levee.Retry
		}
		return levee.Unset
	}}
	resp, err := (&http.Client{Transport: tr}).Get("http://svc.test/")
	if err != nil || resp.StatusCode != 200 || n != 2 || resp.Header.Get("X-Stale") != "false" {
		t.Fatalf("%v %v after %d attempts", resp, err, n)
	}
}

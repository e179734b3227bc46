package levee

import (
	"context"
	"errors"
	"testing"
	"time"
)

const parkDoc = `
policies:
  q:
    attempts: 1
    bulkhead: { max-concurrent: 1, queue: 2, queue-timeout: 10s }
`

// On the real clock, a call queued behind a running one starts when that one
// reports, not when its 10 s queue timeout elapses; nothing stays parked.
func TestBulkheadQueueWakesOnReport(t *testing.T) {
	e := mustLoad(t, parkDoc)
	p := mustPolicy(t, e, "q")
	release, first := holdSlot(p)
	second := make(chan error, 1)
	start := time.Now()
	go func() { second <- p.Do(context.Background(), func(context.Context) error { return nil }) }()
	waitParked(t, e, 1)
	release()
	if err := <-first; err != nil {
		t.Fatal(err)
	}
	// no flush: with a call parked, the held-back success is applied at once
	if err := <-second; err != nil {
		t.Fatalf("the queued call: %v", err)
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Fatalf("the queued call waited %v: not woken", d)
	}
	waitParked(t, e, 0)
}

// A parked call whose context is cancelled ends at once, cancelled, and leaves the queue.
func TestBulkheadQueueParkStopsOnCancel(t *testing.T) {
	e := mustLoad(t, parkDoc)
	p := mustPolicy(t, e, "q")
	release, done := holdSlot(p)
	ctx, cancel := context.WithCancel(context.Background())
	queued := make(chan error, 1)
	go func() { queued <- p.Do(ctx, func(context.Context) error { return errors.New("never runs") }) }()
	waitParked(t, e, 1)
	start := time.Now()
	cancel()
	err := <-queued
	if !errors.Is(err, ErrCancelled) || !errors.Is(err, context.Canceled) {
		t.Fatalf("err %v", err)
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Fatalf("the park did not stop on cancel (%v)", d)
	}
	waitParked(t, e, 0)
	release()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
}

// holdSlot runs a Do call of p that holds its slot until release is called;
// done answers its result.
func holdSlot(p *Policy) (release func(), done <-chan error) {
	hold := make(chan struct{})
	running := make(chan struct{})
	result := make(chan error, 1)
	go func() {
		result <- p.Do(context.Background(), func(context.Context) error { close(running); <-hold; return nil })
	}()
	<-running
	return func() { close(hold) }, result
}

func waitParked(t *testing.T, e *Engine, n int) {
	t.Helper()
	for i := 0; i < 500; i++ {
		if e.nParked.Load() == int64(n) {
			return
		}
		time.Sleep(10 * time.Millisecond)
	}
	t.Fatalf("%d call(s) parked, want %d", e.nParked.Load(), n)
}

// A slot freed through the raw API goes to a call Do parked in the queue, and
// that call is woken at once, not when its 10 s queue timeout elapses.
func TestRawReportWakesACallDoParked(t *testing.T) {
	e := mustLoad(t, parkDoc)
	p := mustPolicy(t, e, "q")
	pi, ok, err := e.PolicyIndex("q")
	if err != nil || !ok {
		t.Fatalf("policy index: %v %v", ok, err)
	}
	raw := e.NewCallID()
	if v, err := e.Start(raw, pi, "", 0, e.Now(), 0, 0, 0); err != nil || v.Kind() != VerdictAttempt {
		t.Fatalf("raw start: %v %v", v, err)
	}
	queued := make(chan error, 1)
	start := time.Now()
	go func() { queued <- p.Do(context.Background(), func(context.Context) error { return nil }) }()
	waitParked(t, e, 1)
	if _, err := e.Report(raw, e.Now(), 1, OutcomeSuccess, 0, "", 0, 0); err != nil {
		t.Fatal(err)
	}
	if err := <-queued; err != nil {
		t.Fatalf("the queued call: %v", err)
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Fatalf("the queued call waited %v: the raw report did not wake it", d)
	}
	waitParked(t, e, 0)
}

// A slot a Do call frees may be granted to a call of the raw API: Do wakes only
// its own parked calls and keeps the grant for TakeWakes, where the raw caller
// finds it (before, Do took the core's list and dropped the ids it did not know).
func TestDoKeepsTheRawAPIsWakesForTakeWakes(t *testing.T) {
	e := mustLoad(t, parkDoc)
	p := mustPolicy(t, e, "q")
	pi, _, _ := e.PolicyIndex("q")
	release, first := holdSlot(p)
	raw := e.NewCallID()
	v, err := e.Start(raw, pi, "", 0, e.Now(), 0, 0, 0)
	if err != nil || v.Kind() != VerdictWait || v.Reason() != ReasonBulkheadFull {
		t.Fatalf("raw start behind the Do call: %v %v", v, err)
	}
	// a Do call parked too, so that Do takes the core's wakes when the slot frees
	second := make(chan error, 1)
	go func() { second <- p.Do(context.Background(), func(context.Context) error { return nil }) }()
	waitParked(t, e, 1)
	release()
	if err := <-first; err != nil {
		t.Fatal(err)
	}
	var got []uint64
	for i := 0; i < 500 && len(got) == 0; i++ {
		if got, err = e.TakeWakes(); err != nil {
			t.Fatal(err)
		}
		if len(got) == 0 {
			time.Sleep(2 * time.Millisecond)
		}
	}
	if len(got) != 1 || got[0] != raw {
		t.Fatalf("TakeWakes = %v, want [%d] (the raw call, granted the freed slot first)", got, raw)
	}
	if v, err := e.Acquire(raw, e.Now()); err != nil || v.Kind() != VerdictAttempt {
		t.Fatalf("the raw call's acquire after its wake: %v %v", v, err)
	}
	if _, err := e.Report(raw, e.Now(), 1, OutcomeSuccess, 0, "", 0, 0); err != nil {
		t.Fatal(err)
	}
	if err := <-second; err != nil {
		t.Fatalf("the parked Do call: %v", err)
	}
	waitParked(t, e, 0)
}

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
	release := make(chan struct{})
	running := make(chan struct{})
	first := make(chan error, 1)
	go func() {
		first <- p.Do(context.Background(), func(context.Context) error { close(running); <-release; return nil })
	}()
	<-running
	second := make(chan error, 1)
	start := time.Now()
	go func() { second <- p.Do(context.Background(), func(context.Context) error { return nil }) }()
	waitParked(t, e, 1)
	close(release)
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
	release := make(chan struct{})
	running := make(chan struct{})
	done := make(chan error, 1)
	go func() {
		done <- p.Do(context.Background(), func(context.Context) error { close(running); <-release; return nil })
	}()
	<-running
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
	close(release)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
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

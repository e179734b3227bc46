// Package leveetest is test support for code that runs under Levee: a virtual
// clock for levee.WithClock, whose timers fire when the test advances it, and
// NoWaits, the switch that turns the waits of an engine off.
//
//	clk := leveetest.NewVirtualClock()
//	e, _ := levee.Load(ctx, doc, levee.WithClock(clk))
//	go func() { done <- levee.Do(ctx, p, fn) }()
//	clk.BlockUntil(ctx, 1) // the call sleeps before its retry
//	clk.Advance(200 * time.Millisecond)
//
// Under a virtual clock every `now` the engine passes to the core, every sleep
// between attempts and every attempt timeout (the attempt's context deadline)
// is on the virtual clock: a schedule of minutes runs in microseconds, and the
// delays are exactly the core's.
package leveetest

import (
	"container/heap"
	"context"
	"sync"
	"time"

	levee "github.com/levee-dev/levee/host-bindings/go"
)

// Epoch is where a NewVirtualClock starts: 2026-01-01T00:00:00Z (wall seconds matter
// only for a Retry-After given as an HTTP date).
var Epoch = time.Date(2026, time.January, 1, 0, 0, 0, 0, time.UTC)

// VirtualClock is a virtual levee.Clock. Time moves only when the test calls Advance
// or Set, or, in auto-advance mode (NewAutoClock, NoWaits), when a goroutine
// sleeps on it. Timers fire in the order of their times (then of their
// creation); their functions run synchronously in the goroutine that moves
// the clock, with the clock set to their time, so they must not block. It is
// safe for use by many goroutines.
type VirtualClock struct {
	mu      sync.Mutex
	now     time.Time
	timers  timerHeap
	seq     uint64
	auto    bool
	changed chan struct{} // closed and replaced when the set of timers changes
}

// NewVirtualClock is a virtual clock at Epoch that moves only when the test advances it.
func NewVirtualClock() *VirtualClock { return NewVirtualClockAt(Epoch) }

// NewVirtualClockAt is a virtual clock at t that moves only when the test advances it.
func NewVirtualClockAt(t time.Time) *VirtualClock {
	return &VirtualClock{now: t, changed: make(chan struct{})}
}

// NewAutoClock is a virtual clock at Epoch in auto-advance mode: a Sleep moves
// the clock to its end at once, firing the timers due on the way (when one of
// them ends the sleeper's context, as an attempt timeout does, the clock stops
// there and Sleep returns the context's error). A single goroutine's calls are
// then deterministic and never wait.
func NewAutoClock() *VirtualClock {
	c := NewVirtualClock()
	c.auto = true
	return c
}

// NoWaits is the switch that turns waits off in tests: the engine runs on a
// fresh auto-advance virtual clock (NewAutoClock), so retries, backoff and
// rate-limit waits take no real time while the core sees them pass.
//
//	e, err := levee.Load(ctx, doc, leveetest.NoWaits())
func NoWaits() levee.Option { return levee.WithClock(NewAutoClock()) }

// Now is the virtual time.
func (c *VirtualClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

// Since is the virtual time elapsed since t.
func (c *VirtualClock) Since(t time.Time) time.Duration { return c.Now().Sub(t) }

// AfterFunc calls f once the clock has passed d from now (d <= 0: at the next
// move of the clock, or at once in auto-advance mode).
func (c *VirtualClock) AfterFunc(d time.Duration, f func()) levee.Timer {
	c.mu.Lock()
	t := c.addLocked(d, f)
	c.mu.Unlock()
	return t
}

// Sleep waits until the clock has passed d from now, or until ctx is done. In
// auto-advance mode it moves the clock itself.
func (c *VirtualClock) Sleep(ctx context.Context, d time.Duration) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	if d <= 0 {
		return nil
	}
	if c.auto {
		return c.autoSleep(ctx, d)
	}
	ch := make(chan struct{})
	c.mu.Lock()
	t := c.addLocked(d, func() { close(ch) })
	c.mu.Unlock()
	select {
	case <-ch:
		return nil
	case <-ctx.Done():
		t.Stop()
		return ctx.Err()
	}
}

func (c *VirtualClock) autoSleep(ctx context.Context, d time.Duration) error {
	c.mu.Lock()
	target := c.now.Add(d)
	c.mu.Unlock()
	for {
		c.mu.Lock()
		if len(c.timers) == 0 || c.timers[0].when.After(target) {
			if target.After(c.now) {
				c.now = target
			}
			c.mu.Unlock()
			return nil
		}
		t := c.popLocked()
		c.mu.Unlock()
		t.f()
		if err := ctx.Err(); err != nil {
			return err
		}
	}
}

// Advance moves the clock d forward, firing the timers due on the way in order.
func (c *VirtualClock) Advance(d time.Duration) {
	c.mu.Lock()
	target := c.now.Add(d)
	c.mu.Unlock()
	c.Set(target)
}

// Set moves the clock to t (never backwards), firing the timers due on the way in order.
func (c *VirtualClock) Set(target time.Time) {
	for {
		c.mu.Lock()
		if len(c.timers) == 0 || c.timers[0].when.After(target) {
			if target.After(c.now) {
				c.now = target
			}
			c.mu.Unlock()
			return
		}
		t := c.popLocked()
		c.mu.Unlock()
		t.f()
	}
}

// AdvanceToNext moves the clock to the earliest pending timer and fires it (and
// any others due at the same time); false when no timer is pending.
func (c *VirtualClock) AdvanceToNext() bool {
	c.mu.Lock()
	if len(c.timers) == 0 {
		c.mu.Unlock()
		return false
	}
	when := c.timers[0].when
	c.mu.Unlock()
	c.Set(when)
	return true
}

// Pending is the number of timers and sleepers waiting on the clock.
func (c *VirtualClock) Pending() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return len(c.timers)
}

// BlockUntil waits (in real time) until at least n timers or sleepers wait on
// the clock, or ctx is done: a test starts a call in a goroutine, then
// BlockUntil before it advances the clock past the call's sleep.
func (c *VirtualClock) BlockUntil(ctx context.Context, n int) error {
	for {
		c.mu.Lock()
		if len(c.timers) >= n {
			c.mu.Unlock()
			return nil
		}
		ch := c.changed
		c.mu.Unlock()
		select {
		case <-ch:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
}

func (c *VirtualClock) addLocked(d time.Duration, f func()) *timer {
	c.seq++
	t := &timer{c: c, when: c.now.Add(max(d, 0)), seq: c.seq, f: f, index: -1}
	heap.Push(&c.timers, t)
	c.notifyLocked()
	if c.auto && d <= 0 {
		// nothing will move the clock for it: due now, it fires now
		heap.Remove(&c.timers, t.index)
		go f()
	}
	return t
}

func (c *VirtualClock) popLocked() *timer {
	t := heap.Pop(&c.timers).(*timer)
	if t.when.After(c.now) {
		c.now = t.when
	}
	c.notifyLocked()
	return t
}

func (c *VirtualClock) notifyLocked() {
	close(c.changed)
	c.changed = make(chan struct{})
}

type timer struct {
	c     *VirtualClock
	when  time.Time
	seq   uint64
	f     func()
	index int // in the heap; -1 once fired or stopped
}

// Stop prevents the timer from firing; it reports whether it did.
func (t *timer) Stop() bool {
	c := t.c
	c.mu.Lock()
	defer c.mu.Unlock()
	if t.index < 0 {
		return false
	}
	heap.Remove(&c.timers, t.index)
	c.notifyLocked()
	return true
}

type timerHeap []*timer

func (h timerHeap) Len() int { return len(h) }
func (h timerHeap) Less(i, j int) bool {
	if !h[i].when.Equal(h[j].when) {
		return h[i].when.Before(h[j].when)
	}
	return h[i].seq < h[j].seq
}
func (h timerHeap) Swap(i, j int) {
	h[i], h[j] = h[j], h[i]
	h[i].index = i
	h[j].index = j
}
func (h *timerHeap) Push(x any) {
	t := x.(*timer)
	t.index = len(*h)
	*h = append(*h, t)
}
func (h *timerHeap) Pop() any {
	old := *h
	t := old[len(old)-1]
	old[len(old)-1] = nil
	t.index = -1
	*h = old[:len(old)-1]
	return t
}

var _ levee.Clock = (*VirtualClock)(nil)

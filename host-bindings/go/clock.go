package levee

import (
	"context"
	"sync"
	"time"
)

// Clock is the time an engine runs on: the `now` it passes to the core, the
// sleeps between attempts and the per-attempt timeouts all come from it. The
// default is the machine's monotonic clock; tests pass a virtual clock
// (package leveetest) with WithClock, so that a retry schedule of minutes runs
// in microseconds and every sleep and timeout is exactly as the core chose.
//
// Only the guest-call bound (WithGuestCallLimit) stays on real time: it bounds
// the CPU time of the guest, which a virtual clock does not measure.
//
// A Clock must be safe for use by many goroutines.
type Clock interface {
	// Now is the current time. Only differences between readings matter to the
	// engine (it runs on Now minus its reading at Load), and wall-clock seconds
	// for a Retry-After given as an HTTP date.
	Now() time.Time
	// Sleep waits d, or until ctx is done; it returns ctx.Err() in that case
	// and nil otherwise. A d <= 0 returns at once (ctx.Err()).
	Sleep(ctx context.Context, d time.Duration) error
	// AfterFunc calls f in its own goroutine once d has passed (the attempt
	// timeouts); the Timer stops it.
	AfterFunc(d time.Duration, f func()) Timer
}

// Timer is a pending call of Clock.AfterFunc.
type Timer interface {
	// Stop prevents the call if it has not run yet; it reports whether it did.
	Stop() bool
}

// SystemClock is the machine's clock (time.Now, time.Timer). An engine without
// WithClock runs on it, with a faster path than through the interface.
type SystemClock struct{}

// Now is time.Now().
func (SystemClock) Now() time.Time { return time.Now() }

// Sleep waits d on a time.Timer or until ctx is done.
func (SystemClock) Sleep(ctx context.Context, d time.Duration) error { return sleepReal(ctx, d) }

// AfterFunc is time.AfterFunc.
func (SystemClock) AfterFunc(d time.Duration, f func()) Timer { return time.AfterFunc(d, f) }

// WithClock runs the engine on clk instead of the machine's clock: the `now` of
// every crossing, the sleeps between attempts and the attempt timeouts (the
// context deadline of an attempt is clk's: its Done closes when clk passes it,
// and its Err is then context.DeadlineExceeded). nil keeps the machine's clock.
func WithClock(clk Clock) Option {
	return func(o *options) {
		if _, sys := clk.(SystemClock); sys {
			clk = nil
		}
		o.clock = clk
	}
}

func sleepReal(ctx context.Context, d time.Duration) error {
	if d <= 0 {
		return ctx.Err()
	}
	t := time.NewTimer(d)
	select {
	case <-t.C:
		return nil
	case <-ctx.Done():
		t.Stop()
		return ctx.Err()
	}
}

// sleep waits d on the engine's clock, or until ctx is done.
func (e *Engine) sleep(ctx context.Context, d time.Duration) error {
	if e.o.clock == nil {
		return sleepReal(ctx, d)
	}
	if d <= 0 {
		return ctx.Err()
	}
	return e.o.clock.Sleep(ctx, d)
}

// withTimeout is context.WithTimeout on the engine's clock.
func (e *Engine) withTimeout(ctx context.Context, d time.Duration) (context.Context, context.CancelFunc) {
	if e.o.clock == nil {
		return context.WithTimeout(ctx, d)
	}
	return withClockTimeout(ctx, e.o.clock, d)
}

// clockCtx is a context whose deadline is on a Clock: Done closes when the
// clock's timer fires (Err: context.DeadlineExceeded), when the parent is done
// (the parent's Err) or when it is cancelled (context.Canceled).
type clockCtx struct {
	context.Context // the parent, for Value
	deadline        time.Time
	done            chan struct{}
	mu              sync.Mutex
	err             error
	timer           Timer
	stopParent      func() bool
}

func withClockTimeout(parent context.Context, clk Clock, d time.Duration) (context.Context, context.CancelFunc) {
	c := &clockCtx{Context: parent, deadline: clk.Now().Add(d), done: make(chan struct{})}
	if err := parent.Err(); err != nil {
		c.finish(err)
		return c, func() {}
	}
	if d <= 0 {
		c.finish(context.DeadlineExceeded)
		return c, func() {}
	}
	c.mu.Lock()
	c.stopParent = context.AfterFunc(parent, func() { c.finish(parent.Err()) })
	c.timer = clk.AfterFunc(d, func() { c.finish(context.DeadlineExceeded) })
	c.mu.Unlock()
	return c, func() { c.finish(context.Canceled) }
}

func (c *clockCtx) finish(err error) {
	c.mu.Lock()
	if c.err != nil {
		c.mu.Unlock()
		return
	}
	c.err = err
	close(c.done)
	t, sp := c.timer, c.stopParent
	c.mu.Unlock()
	if t != nil {
		t.Stop()
	}
	if sp != nil {
		sp()
	}
}

func (c *clockCtx) Deadline() (time.Time, bool) { return c.deadline, true }
func (c *clockCtx) Done() <-chan struct{}       { return c.done }
func (c *clockCtx) Err() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.err
}
func (c *clockCtx) String() string { return "levee.clockTimeout(" + c.deadline.String() + ")" }

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
// every crossing, the sleeps between attempts and the attempt timeouts (an
// attempt's context times out on clk: its Done closes when clk passes the
// deadline, and its Err is then context.DeadlineExceeded; its Deadline() is in
// real time, for I/O that reads it, and ClockDeadline gives it on clk). nil
// keeps the machine's clock.
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
	clk             Clock
	deadline        time.Time // on clk
	done            chan struct{}
	mu              sync.Mutex
	err             error
	timer           Timer
	stopParent      func() bool
}

func withClockTimeout(parent context.Context, clk Clock, d time.Duration) (context.Context, context.CancelFunc) {
	c := &clockCtx{Context: parent, clk: clk, deadline: clk.Now().Add(d), done: make(chan struct{})}
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

// Deadline is in real time, as every consumer of a context (a net.Dialer, say)
// compares it with time.Now(): now plus what is left on the clock, or the
// parent's deadline if that is earlier. ClockDeadline gives it on the clock.
func (c *clockCtx) Deadline() (time.Time, bool) {
	dl := time.Now().Add(max(c.deadline.Sub(c.clk.Now()), 0))
	if pd, ok := c.Context.Deadline(); ok && pd.Before(dl) {
		return pd, true
	}
	return dl, true
}

func (c *clockCtx) Value(key any) any {
	if key == (clockCtxKey{}) {
		return c
	}
	return c.Context.Value(key)
}

type clockCtxKey struct{}

// ClockDeadline is the deadline of an attempt's context on the engine's clock:
// under WithClock, the virtual time its timeout fires at (ctx.Deadline() is that
// deadline in real time); otherwise ctx.Deadline().
func ClockDeadline(ctx context.Context) (time.Time, bool) {
	if c, ok := ctx.Value(clockCtxKey{}).(*clockCtx); ok {
		return c.deadline, true
	}
	return ctx.Deadline()
}
func (c *clockCtx) Done() <-chan struct{} { return c.done }

// Err is the context's error. A parent done is seen at once (its Done reaches this
// context through context.AfterFunc, on another goroutine): as for the standard library's
// contexts, Err is not nil from the moment the parent's is.
func (c *clockCtx) Err() error {
	c.mu.Lock()
	err := c.err
	c.mu.Unlock()
	if err == nil {
		if perr := c.Context.Err(); perr != nil {
			c.finish(perr)
			c.mu.Lock()
			err = c.err
			c.mu.Unlock()
		}
	}
	return err
}
func (c *clockCtx) String() string { return "levee.clockTimeout(" + c.deadline.String() + ")" }

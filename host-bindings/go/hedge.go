package levee

// Hedged calls (docs/policy.md, "Hedging"): on a `hedge` verdict the call runs attempt 1
// in a goroutine of its own and carries out the commands of hedge-step and report-attempt,
// in order. Each attempt runs under a child context of the call's (so the caller's cancel
// reaches it), cancelled when the core says `cancel` or when the call is over; the goroutine
// hands its outcome to the call's goroutine, which reports it (report-attempt) and carries
// out the answer. After the call is over, an attempt that closes later reports itself
// (freeing what it holds in the core, a bulkhead slot say), and the caller does not wait
// for it. The checks of every answer are the driver's (driver.go, plan); nothing here
// decides what to start, cancel or return. A call that is not hedged never comes here.

import (
	"context"
	"fmt"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"time"
)

// hedgeCross is a crossing of a hedged call (hedge-step or report-attempt) asked at now.
// The driver checks the answer under the lock of the crossing, as decideLocked checks a
// verdict: an answer that breaks the contract re-instantiates the engine before any other
// goroutine crosses (its events are lost); an `end` with `invalid` queues the fault; the
// events of any other answer are drained under the same lock.
func (e *Engine) hedgeCross(cctx context.Context, ref callRef, op crossing, d *driver, h *hedgeDriver, now uint64,
	f func(ctx context.Context, in *instance) (HedgeAnswer, error)) (p hedgePlan, a HedgeAnswer, err error) {
	e.mu.Lock()
	defer e.unlockEmitCtx(cctx)
	if err := e.readyLocked(false); err != nil {
		return p, a, err
	}
	a, err = e.crossHedgeLocked(cctx, ref, op, f)
	if err != nil {
		return p, a, err
	}
	p = d.plan(h, a, now)
	switch {
	case p.breach != nil:
		_ = e.faultKindLocked(fmt.Errorf("call %d, %v: a hedge-answer broke the contract: %w", ref.call, op, p.breach), faultContract)
		e.tagFaultLocked(ref)
	case p.end && p.act.kind == actRecover: // end with invalid
		if a.EventsPending && e.in != nil {
			gctx := e.enter()
			_, derr := e.in.drainEvents(gctx, e.rep) // the refused crossing's events are lost
			e.leave()
			if derr != nil {
				_ = e.faultLocked(derr)
			}
		}
		e.queued = append(e.queued, Event{At: e.Now(), Kind: EventEngineFault, Fault: faultInvalid.String(),
			Call: ref.call, Policy: ref.policy, Key: ref.key,
			Err: fmt.Errorf("%w: call %d, %v: %w", ErrEngineFault, ref.call, op, p.act.breach)})
	case a.EventsPending:
		e.drainLocked()
	}
	return p, a, nil
}

// crossHedgeLocked runs the crossing (through the test seam when one is set); a failure
// of the guest re-instantiates the engine. A report frees what the attempt held: the
// call the core grants its bulkhead slot to is woken.
func (e *Engine) crossHedgeLocked(cctx context.Context, ref callRef, op crossing,
	f func(ctx context.Context, in *instance) (HedgeAnswer, error)) (a HedgeAnswer, err error) {
	ctx := e.enter()
	in := e.in
	if e.inject != nil || e.injectHedge != nil {
		if e.inject != nil {
			if trap, _, _ := e.inject(cctx, ref.call, op.String()); trap {
				err = trapf("injected trap on %v of call %d", op, ref.call)
			}
		}
		if err == nil {
			if a, err = f(ctx, in); err == nil && e.injectHedge != nil {
				a = e.injectHedge(cctx, ref.call, op.String(), a)
			}
		}
	} else {
		a, err = f(ctx, in)
	}
	e.leave()
	if err != nil {
		err = e.faultLocked(err)
		e.tagFaultLocked(ref)
		return a, err
	}
	if op == opReportAttempt {
		e.wakesIfParkedLocked() // the answer has no wakes bit
	}
	return a, nil
}

// reportClosed reports an attempt that closed after its call was over (the core cancelled
// it, or the call ended while it ran): the answer has nothing for a call that is over, and
// is not looked at; its events are delivered.
func (e *Engine) reportClosed(cctx context.Context, ref callRef, n uint32, now, elapsed uint64, o Outcome, text string, wall uint64) {
	e.mu.Lock()
	defer e.unlockEmitCtx(cctx)
	if e.readyLocked(false) != nil {
		return
	}
	a, err := e.crossHedgeLocked(cctx, ref, opReportAttempt, func(ctx context.Context, in *instance) (HedgeAnswer, error) {
		return in.reportAttempt(ctx, e.rep, ref.call, n, now, elapsed, o.Kind, o.Code, text, wall, 0)
	})
	if err == nil && a.EventsPending {
		e.drainLocked()
	}
}

// hedgedAttempter is an attempter that runs attempts of a hedged call, several at once:
// each keeps its own result, and the call adopts the one the core names.
type hedgedAttempter interface {
	// hedged runs attempt n under timeout (0: none) on e's clock; res is its result (a
	// value, a response) when it has one.
	hedged(e *Engine, ctx context.Context, timeout time.Duration, n int) (o Outcome, err error, res any)
	// adopt makes attempt res the call's result (as if it had been the only attempt).
	adopt(res any)
	// drop frees a result the call does not return (an HTTP response's body).
	drop(res any)
}

func (f funcAttempt) hedged(e *Engine, ctx context.Context, timeout time.Duration, _ int) (Outcome, error, any) {
	o, err := f.attempt(e, ctx, timeout)
	return o, err, nil
}
func (funcAttempt) adopt(any) {}
func (funcAttempt) drop(any)  {}

// valueResult is the value of an attempt of DoValue that returned no error.
type valueResult[T any] struct{ v T }

func (r valueResult[T]) value() any { return r.v }

func (a *valueAttempt[T]) hedged(e *Engine, ctx context.Context, timeout time.Duration, _ int) (Outcome, error, any) {
	var res any
	o, err := funcAttempt(func(ctx context.Context) error {
		v, err := a.fn(ctx)
		if err == nil {
			res = valueResult[T]{v}
		}
		return err
	}).attempt(e, ctx, timeout)
	return o, err, res
}

func (a *valueAttempt[T]) adopt(res any) {
	if r, ok := res.(valueResult[T]); ok {
		a.val, a.ok = r.v, true
	}
}
func (a *valueAttempt[T]) drop(any) {}

// hedgeAttempt is an attempt of a hedged call in flight.
type hedgeAttempt struct {
	cancel  context.CancelFunc
	t0      uint64 // engine ns it started at
	timeout time.Duration
}

// hedgeEnded is what an attempt's goroutine hands over once the attempt has closed.
type hedgeEnded struct {
	n        int
	o        Outcome
	err      error
	res      any
	t1       uint64 // engine ns it closed at
	panicked bool
	pv       any // the panic's value
}

// hedgeRun is a hedged call in progress. It holds what its attempts' goroutines need of
// the call, never the callRun itself: a pointer to it in a goroutine would move every
// call's callRun to the heap, hedged or not.
type hedgeRun struct {
	e     *Engine
	a     attempter
	tel   *callTel
	ref   callRef
	name  string          // the policy's
	cctx  context.Context // the call's, for the events of late reports
	ctx   context.Context // the call's
	h     hedgeDriver
	att   [maxHedgeAttempts + 1]hedgeAttempt
	got   [maxHedgeAttempts + 1]*hedgeEnded // the outcomes reported, by attempt
	ended chan hedgeEnded                   // buffered for every attempt: a goroutine never blocks on it
	// notify is signalled (never blocking) when an attempt closes; cut ends the wait's sleep
	notify chan struct{}
	mu     sync.Mutex
	cut    context.CancelFunc
	// over: the call is over. An attempt closing after it reports itself when report is
	// set (the call ended), and only closes when not (the caller gave up, the recovery path).
	over, report bool
}

// hedgeAttemptKey marks the context of a hedged attempt with its number.
type hedgeAttemptKey struct{}

// HedgeAttempt is the number of the attempt of a hedged call that runs under ctx (1 for the
// first); ok is false under the context of any other attempt. A call that is not hedged runs
// its attempts one after another, so an attempt may last as long as its work (a stream read
// to its end); a hedged call's attempts run concurrently and the core starts the next hedge
// while one is in flight, so a function whose work goes on after its answer returns at that
// answer when hedged.
func HedgeAttempt(ctx context.Context) (n int, ok bool) {
	if ctx == nil {
		return 0, false
	}
	n, ok = ctx.Value(hedgeAttemptKey{}).(int)
	return n, ok
}

// start runs attempt n in its own goroutine from now, under timeout.
func (r *hedgeRun) start(n int, timeout time.Duration, now uint64) {
	e := r.e
	actx, cancel := context.WithCancel(context.WithValue(r.ctx, hedgeAttemptKey{}, n))
	r.att[n] = hedgeAttempt{cancel: cancel, t0: now, timeout: timeout}
	if s := e.hedgeSeam; s != nil {
		s.spawn(r.ctx, n)
	}
	if hs, ok := r.a.(interface{ hedgeStarted(n int) }); ok {
		hs.hedgeStarted(n)
	}
	ha, tel := r.a, r.tel
	go func() {
		res := hedgeEnded{n: n}
		func() {
			defer func() {
				if p := recover(); p != nil {
					res.panicked, res.pv = true, p
					res.o, res.err = Outcome{Kind: OutcomeErrorClass, Text: cHttpUnnamedErrorClass}, fmt.Errorf("levee: attempt %d panicked: %v", n, p)
				}
			}()
			sctx, span := tel.attemptSpan(actx, n, false)
			res.o, res.err, res.res = ha.hedged(e, sctx, timeout, n)
			tel.endAttemptSpan(span, res.o, res.err)
		}()
		res.t1 = e.Now()
		r.closed(res)
	}()
}

// closed hands attempt res.n's outcome to the call's goroutine or, once the call is over,
// reports it itself (or only drops its result when the call was abandoned).
func (r *hedgeRun) closed(res hedgeEnded) {
	e := r.e
	r.mu.Lock()
	if !r.over {
		r.ended <- res
		if r.cut != nil {
			r.cut() // the wait is cut short
		}
		if s := e.hedgeSeam; s != nil {
			s.exit(r.ctx, res.n) // the call's goroutine is runnable from here
		}
		select {
		case r.notify <- struct{}{}:
		default:
		}
		r.mu.Unlock()
		return
	}
	report := r.report
	r.mu.Unlock()
	r.closeLate(res, report)
	if s := e.hedgeSeam; s != nil {
		s.exit(r.ctx, res.n)
	}
}

// closeLate is the end of an attempt that closed after its call was decided: its result is
// not needed; it is reported when report is set (the call ended: the core frees what the
// attempt held), and not when the call was abandoned. A panic has nobody left to reach: it
// is logged.
func (r *hedgeRun) closeLate(res hedgeEnded, report bool) {
	e := r.e
	r.a.drop(res.res)
	if report {
		r.reportLate(res)
	}
	if res.panicked {
		if lg := e.o.logger; lg != nil {
			lg.Error("levee: an attempt of a hedged call panicked after the call was decided",
				slog.String("policy", r.name), slog.Int("attempt", res.n), slog.String("panic", fmt.Sprint(res.pv)))
		}
	}
}

// elapsed is attempt res.n's duration: a timeout that fired lasted its timeout.
func (r *hedgeRun) elapsed(res *hedgeEnded) uint64 {
	a := &r.att[res.n]
	el := res.t1 - min(a.t0, res.t1)
	if res.o.Kind == OutcomeTimeout && a.timeout > 0 && time.Duration(el) > a.timeout {
		el = uint64(a.timeout)
	}
	return el
}

func (r *hedgeRun) reportLate(res hedgeEnded) {
	e := r.e
	el := r.elapsed(&res)
	text, wall := reportText(e, res.o)
	now := max(e.Now(), res.t1)
	e.reportClosed(r.cctx, r.ref, uint32(res.n), now, el, res.o, text, wall)
	// not counted in levee.attempts: the core cancelled it (or the call ended while it ran)
	if tr := e.o.trace; tr != nil {
		tr(Step{Op: "report-attempt", Call: r.ref.call, Now: now, Outcome: res.o, Attempt: res.n})
	}
}

// reportText is the text and wall time an outcome is reported with.
func reportText(e *Engine, o Outcome) (string, uint64) {
	var wall uint64
	if o.Kind == OutcomeHTTPStatus && o.Text != "" {
		wall = e.wallSecs()
	}
	return strings.ToValidUTF8(o.Text, "\uFFFD"), wall // a raw header: the core says what it means
}

// finish ends the call's part in its attempts: every attempt still open is cancelled;
// report says whether they report themselves as they close (the call ended) or only close
// (it was abandoned). The outcomes already handed over are reported (or dropped) now.
func (r *hedgeRun) finish(report bool) {
	r.mu.Lock()
	r.over, r.report = true, report
	r.mu.Unlock()
	for n := 1; n <= r.h.last; n++ {
		if a := &r.att[n]; a.cancel != nil {
			a.cancel()
		}
	}
	for {
		select {
		case res := <-r.ended:
			r.closeLate(res, report)
		default:
			return
		}
	}
}

// dropResults frees the results handed over that the call does not return.
func (r *hedgeRun) dropResults(keep int) {
	ha := r.a
	for n, g := range r.got {
		if g != nil && n != keep {
			ha.drop(g.res)
			g.res = nil
		}
	}
}

// hedge carries out a hedged call from its `hedge` verdict (act) asked at now. It returns
// the action the call goes on with (done, fail or fallback, the end's verdict, with the
// attempt it names adopted as the call's), or ends the call itself (final): on the
// caller's cancel and on the recovery path.
func (c *callRun) hedge(ctx context.Context, act action, now uint64) (next action, final bool, val any, used bool, err error) {
	e, call := c.p.e, c.call
	d := &c.d
	r := &hedgeRun{e: e, a: c.a, tel: c.tel, ref: c.ref(), name: c.p.name, cctx: c.ctx, ctx: ctx,
		ended: make(chan hedgeEnded, maxHedgeAttempts), notify: make(chan struct{}, 1)}
	r.h.newHedge(1)
	r.start(1, act.d, now)
	tr := e.o.trace
	plan, ans, ferr := e.hedgeCross(ctx, c.ref(), opHedgeStep, d, &r.h, now, func(ctx context.Context, in *instance) (HedgeAnswer, error) {
		return in.hedgeStep(ctx, e.rep, call, now)
	})
	if tr != nil && ferr == nil {
		tr(Step{Op: "hedge-step", Call: call, Now: now, Commands: ans.Commands})
	}
	var reported *hedgeEnded // the outcome the crossing in hand reported (nil for hedge-step)
	var pending []hedgeEnded // attempts closed and not yet reported, lowest number first
	for {
		if ferr != nil || plan.breach != nil || (plan.end && plan.act.kind == actRecover) {
			for _, res := range pending {
				r.closeLate(res, false)
			}
			return c.hedgeRecover(r, reported, now)
		}
		for _, cmd := range plan.cmds {
			n := int(cmd.Attempt)
			switch cmd.Kind {
			case HedgeStart:
				r.start(n, time.Duration(cmd.Timeout), now)
			case HedgeCancel:
				if a := &r.att[n]; a.cancel != nil {
					a.cancel()
				}
			}
		}
		if plan.end {
			g := r.got[plan.attempt]
			c.lastErr = g.err
			c.a.adopt(g.res)
			r.dropResults(plan.attempt)
			for _, res := range pending {
				r.closeLate(res, true)
			}
			r.finish(true)
			return plan.act, false, nil, false, nil
		}
		if len(pending) == 0 {
			pending = r.take(pending) // an attempt that closed already ends any wait at once
		}
		if len(pending) == 0 {
			// wait for an attempt to close, the wait's time, or the caller's cancel
			if cerr := r.await(plan); cerr != nil {
				r.dropResults(0)
				r.finish(false)
				val, used, err = c.cancelled(cerr)
				return next, true, val, used, err
			}
			pending = r.take(pending)
		}
		now = max(e.Now(), now)
		at := now
		if len(pending) == 0 { // the wait's time has come
			reported = nil
			plan, ans, ferr = e.hedgeCross(ctx, c.ref(), opHedgeStep, d, &r.h, at, func(ctx context.Context, in *instance) (HedgeAnswer, error) {
				return in.hedgeStep(ctx, e.rep, call, at)
			})
			if tr != nil && ferr == nil {
				tr(Step{Op: "hedge-step", Call: call, Now: at, Commands: ans.Commands})
			}
			continue
		}
		res := pending[0]
		pending = pending[1:]
		if res.panicked {
			for _, p := range pending {
				r.closeLate(p, false)
			}
			r.dropResults(0)
			r.finish(false)
			c.cancelCall(c.ctx)
			panic(res.pv) // run's deferred cancel ends the call's telemetry
		}
		n := res.n
		el := r.elapsed(&res)
		live := r.h.cancelled&(1<<n) == 0
		var flags uint32
		if live {
			if c.co.retryIf != nil || e.o.retryIf != nil {
				flags = c.askPredicateFor(res.res, res.err)
			}
			if res.o.Overloaded {
				flags |= cReportOverloaded
			}
			r.got[n] = &res
			reported = &res
		} else {
			c.a.drop(res.res)
			reported = nil
		}
		text, wall := reportText(e, res.o)
		r.h.closed(n)
		plan, ans, ferr = e.hedgeCross(ctx, c.ref(), opReportAttempt, d, &r.h, at, func(ctx context.Context, in *instance) (HedgeAnswer, error) {
			return in.reportAttempt(ctx, e.rep, call, uint32(n), at, el, res.o.Kind, res.o.Code, text, wall, flags)
		})
		if ferr == nil && live {
			c.tel.reported(res.o.Kind, el) // an attempt the core cancelled is not counted
		}
		if tr != nil && ferr == nil {
			tr(Step{Op: "report-attempt", Call: call, Now: at, Outcome: res.o, Attempt: n, Commands: ans.Commands})
		}
	}
}

// await blocks until an attempt has closed, the plan's wait has passed on the engine's
// clock (the wait is a sleep of the call, cut short by an attempt's close), or the caller
// gives up (its error). With no wait, only an attempt's close or the caller end it; an
// answer that left nothing to wait for broke the contract (plan).
func (r *hedgeRun) await(plan hedgePlan) error {
	e := r.e
	seam := e.hedgeSeam
	if plan.wait {
		wctx, cancel := context.WithCancel(r.ctx)
		r.mu.Lock()
		if len(r.ended) > 0 {
			cancel() // an attempt closed already: the sleep is cut short at once
		} else {
			r.cut = cancel
		}
		r.mu.Unlock()
		_ = e.sleep(wctx, plan.d)
		r.mu.Lock()
		r.cut = nil
		r.mu.Unlock()
		cancel()
		return r.ctx.Err()
	}
	for {
		r.mu.Lock()
		if len(r.ended) > 0 {
			r.mu.Unlock()
			return nil
		}
		if seam != nil {
			seam.park(r.ctx) // under mu: an attempt's exit after this wakes it
		}
		r.mu.Unlock()
		select {
		case <-r.notify: // perhaps for an attempt already taken: look again
		case <-r.ctx.Done():
			return r.ctx.Err()
		}
	}
}

// take appends the attempts closed so far to pending, lowest number first. Under the host
// scenarios it first lets every attempt that closes at this instant close (settle).
func (r *hedgeRun) take(pending []hedgeEnded) []hedgeEnded {
	if s := r.e.hedgeSeam; s != nil {
		s.settle(r.ctx)
	}
	r.mu.Lock()
	for len(r.ended) > 0 {
		pending = append(pending, <-r.ended)
	}
	r.mu.Unlock()
	slices.SortFunc(pending, func(a, b hedgeEnded) int { return a.n - b.n })
	return pending
}

// hedgeRecover is the one recovery path (docs/hosts.md, section 3) of a hedged call, after
// a crossing failed (the glue has re-instantiated the engine and reported the fault) or its
// answer broke the contract or ended with invalid. The call degrades to a single attempt,
// without the core: the attempt whose outcome the failed crossing reported, when it
// reported one; else the first attempt still in flight that the core did not cancel (the
// others are cancelled); else one degraded attempt, as after a failed start. The other
// attempts close without being reported: the core no longer knows the call, or (invalid)
// is told to forget it (cancel).
func (c *callRun) hedgeRecover(r *hedgeRun, reported *hedgeEnded, now uint64) (action, bool, any, bool, error) {
	e, d := c.p.e, &c.d
	ha := c.a
	keep := 0
	if reported == nil {
		for n := 1; n <= r.h.last; n++ {
			if r.h.live()&(1<<n) != 0 {
				keep = n
				break
			}
		}
	}
	// everything but the attempt kept is cancelled and closes unreported
	r.mu.Lock()
	for n := 1; n <= r.h.last; n++ {
		if a := &r.att[n]; a.cancel != nil && n != keep {
			a.cancel()
		}
	}
	r.mu.Unlock()
	_ = e.cancelIn(c.ctx, c.call) // a no-op for a call the core lost
	if reported != nil {
		r.dropResults(reported.n)
		r.finish(false)
		c.lastErr = reported.err
		ha.adopt(reported.res)
		val, used, err := c.recover(c.ctx, action{kind: actRecover, ending: recoverAttemptResult})
		return action{}, true, val, used, err
	}
	r.dropResults(0)
	if keep == 0 {
		r.finish(false)
		d.op = opAcquire // no attempt in hand: one degraded attempt, or the deadline
		val, used, err := c.recover(c.ctx, d.recover(faultTrap, nil, max(e.Now(), now)))
		return action{}, true, val, used, err
	}
	// wait for attempt keep alone; any other closes unreported
	for {
		if cerr := r.await(hedgePlan{}); cerr != nil {
			r.finish(false)
			c.lastErr = nil
			c.tel.end(cResults[3], d.attempts > 1, ReasonCancelled, cerr)
			return action{}, true, nil, false, c.fail(ReasonCancelled, 0, cerr)
		}
		var kept *hedgeEnded
		for _, res := range r.take(nil) {
			if res.n == keep {
				kept = &res
			} else {
				r.closeLate(res, false)
			}
		}
		if kept != nil {
			res := *kept
			r.finish(false)
			if res.panicked {
				panic(res.pv)
			}
			err := res.err
			if res.o.Kind == OutcomeSuccess {
				err = nil // as for a degraded attempt: a late success is still a success
			}
			c.lastErr = err
			ha.adopt(res.res)
			c.tel.end(c.ownResult(err), d.attempts > 1, ReasonNone, err)
			return action{}, true, nil, false, err
		}
	}
}

// hedgeSeam is the test seam of the host scenarios (export_test.go): it is told when a
// hedged call's goroutines start, block and wake, so that a virtual clock is advanced only
// when all of them wait on it. nil in use.
type hedgeSeam struct {
	spawn  func(ctx context.Context, n int) // attempt n's goroutine is about to start
	exit   func(ctx context.Context, n int) // attempt n is done with the call (the call's goroutine may run)
	park   func(ctx context.Context)        // the call's goroutine waits for an attempt to close
	settle func(ctx context.Context)        // let every attempt that closes at this instant close
}

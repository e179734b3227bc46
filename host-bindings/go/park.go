package levee

import (
	"context"
	"slices"
	"time"
)

// The bulkhead queue's host half (docs/policy.md, "The queue"): a call the core
// queues (a wait with reason bulkhead-full) is parked until its payload
// elapses or the core names it in take-wakes (it granted the call a freed
// slot), whichever comes first, and then acquires again. Only the named calls
// are woken, each found by its call id: a release costs one wake whatever the
// number of parked calls. The park is registered under the engine's lock in
// the crossing that queued it, and the wakes a crossing's verdict announces
// are taken under that lock at the end of the same locked section (after its
// own park, since the verdict that queues a call may name it), so no wake-up
// is lost between the two. A success Do holds back frees its slot only when
// it is applied, so while calls are parked it is applied at once
// (holdSuccess). While nothing is parked, a crossing and a held-back success
// pay one atomic load.

// parker is one parked call: its sleep runs under ctx, which a wake cancels.
type parker struct {
	call   uint64
	ctx    context.Context
	cancel context.CancelFunc
}

// parkLocked registers the call of ref as parked.
func (e *Engine) parkLocked(cctx context.Context, ref callRef) *parker {
	p := &parker{call: ref.call}
	p.ctx, p.cancel = context.WithCancel(cctx)
	if e.parked == nil {
		e.parked = map[uint64]*parker{}
	}
	if old := e.parked[p.call]; old != nil {
		old.cancel() // a call parks once at a time; an earlier park of it is over
	} else {
		e.nParked.Add(1)
	}
	e.parked[p.call] = p
	return p
}

// wakesLocked takes the calls the core granted a slot (take-wakes) and wakes
// the ones parked here, and only them (routeWakesLocked).
func (e *Engine) wakesLocked() {
	if e.in == nil {
		return
	}
	ctx := e.enter()
	calls, err := e.in.takeWakes(ctx, e.rep)
	e.leave()
	if err != nil {
		_ = e.faultLocked(err)
		return
	}
	e.routeWakesLocked(calls)
}

// maxUnclaimedWakes bounds the wakes kept for TakeWakes: the core's bound on
// live calls, so an engine whose raw API never takes its wakes (or names a Do
// call that acquired between its park and the grant) cannot grow without end;
// the oldest are dropped first.
const maxUnclaimedWakes = 1 << 17

// routeWakesLocked wakes the parked calls among calls (the core's take-wakes,
// in grant order) and keeps the others, calls of the raw API or calls that
// acquired already, for TakeWakes.
func (e *Engine) routeWakesLocked(calls []uint64) {
	for _, c := range calls {
		if p := e.parked[c]; p != nil {
			delete(e.parked, c)
			e.nParked.Add(-1)
			p.cancel()
			continue
		}
		e.unclaimed = append(e.unclaimed, c)
	}
	if over := len(e.unclaimed) - maxUnclaimedWakes; over > 0 {
		e.unclaimed = slices.Delete(e.unclaimed, 0, over) // the oldest go first
	}
}

// rawWakesLocked wakes Do's parked calls after a raw operation whose verdict
// announces wakes (a slot it freed may be granted to one of them).
func (e *Engine) rawWakesLocked(v Verdict, err error) {
	if err == nil && v.WakesPending() {
		e.wakesIfParkedLocked()
	}
}

// wakesIfParkedLocked is wakesLocked after a crossing that answers no verdict
// bit (cancel, report-attempt) but may have freed a slot, while calls are parked.
func (e *Engine) wakesIfParkedLocked() {
	if e.nParked.Load() > 0 {
		e.wakesLocked()
	}
}

// parkSleep sleeps a parked call for d, or until it is woken (nil either way),
// or until ctx is done (its error). The park is over when it returns.
func (e *Engine) parkSleep(ctx context.Context, p *parker, d time.Duration) error {
	_ = e.sleep(p.ctx, d)
	e.mu.Lock()
	if e.parked[p.call] == p {
		delete(e.parked, p.call)
		e.nParked.Add(-1)
	}
	e.mu.Unlock()
	p.cancel()
	return ctx.Err()
}

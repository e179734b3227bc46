package levee

import "context"

// SetFaultInjector installs the test seam of the host scenarios
// (conformance/hosts/README.md, "A fault"): f is asked before every crossing
// Do and the Transport make for a call (op: start, acquire, report,
// report-fallback) and may make it trap, or replace its verdict.
func SetFaultInjector(e *Engine, f func(ctx context.Context, call uint64, op string) (trap bool, verdict uint64, replace bool)) {
	e.mu.Lock()
	e.inject = f
	e.mu.Unlock()
}

// SetHedgeInjector lets f replace the answer of every hedge-step and report-attempt of a
// call (op: "hedge-step", "report-attempt"), after the guest gave it: a test of the
// contract checks of hedged calls.
func SetHedgeInjector(e *Engine, f func(ctx context.Context, call uint64, op string, a HedgeAnswer) HedgeAnswer) {
	e.mu.Lock()
	e.injectHedge = f
	e.mu.Unlock()
}

// SetHedgeSeam follows the goroutines of hedged calls (hedge.go, hedgeSeam): spawn before
// attempt n's goroutine starts, exit when it is done with the call, park when the call's
// goroutine waits for an attempt (with no wait command), settle before it takes the
// attempts that have closed (it returns once every attempt that closes at this instant has).
func SetHedgeSeam(e *Engine, spawn, exit func(ctx context.Context, n int), park, settle func(ctx context.Context)) {
	e.mu.Lock()
	e.hedgeSeam = &hedgeSeam{spawn: spawn, exit: exit, park: park, settle: settle}
	e.mu.Unlock()
}

// HedgeAttemptOf is the number of the hedged attempt running under ctx (0 outside one).
func HedgeAttemptOf(ctx context.Context) int {
	n, _ := ctx.Value(hedgeAttemptKey{}).(int)
	return n
}

// ExportSnapshot is export-snapshot (the recovery snapshot's bytes: the keys that hold
// protection), for the conformance runner's snapshot_import.
func (e *Engine) ExportSnapshot() (b []byte, err error) {
	err = e.op(false, func(ctx context.Context, in *instance) error {
		e.leave()
		ctx = e.enterWork(e.stateWork())
		b, err = in.exportSnapshot(ctx, e.rep)
		return err
	})
	return b, err
}

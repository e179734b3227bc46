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

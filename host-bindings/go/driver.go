package levee

import (
	"fmt"
	"time"
)

// The driver of one call: a sans-I/O state machine from the core's verdicts to
// the actions the host performs (run an attempt under a timeout, sleep, run a
// fallback, finish, recover). It reads no clock, sleeps on nothing and calls
// into no guest: the runtime glue (engine.go, abi.go, bindings.go) crosses into
// the core, and the public API (Do, DoValue, Transport in do.go and
// transport.go) performs the actions and feeds the verdicts back, each with the
// `now` it was asked at. Every host has this loop (Python's `_protocol` is the
// model); what it may do with a verdict is written in docs/hosts.md.

// actionKind is what the driver asks the host to do next.
type actionKind uint8

const (
	// actAttempt: run attempt number n under timeout (0: none), report its outcome.
	actAttempt actionKind = iota
	// actSleep: sleep d (retry: prepare the operation for another attempt first), then acquire.
	actSleep
	// actFallback: run the named fallback, report whether it succeeded.
	actFallback
	// actDone: the call is over; the last attempt's (or fallback's) result stands.
	actDone
	// actFail: the call is over with the core's reason (and retry-after hint).
	actFail
	// actRecover: the engine failed the call (a fault on a crossing, or a verdict
	// that breaks the contract, named by fault): the host recovers, and the call ends
	// as one degraded attempt, or with the result of the attempt that ran.
	actRecover
)

// action is one step the driver asks for.
type action struct {
	kind    actionKind
	n       int           // actAttempt: the attempt number (1 on the first)
	limit   time.Duration // actAttempt: the timeout the verdict gave (a success this late is the core's to judge)
	d       time.Duration // actAttempt: the attempt's timeout; actSleep: the delay; actFail: retry-after
	retry   bool          // actSleep: a retry (false: a wait for a permit)
	reason  Reason        // actFail, actFallback: the core's reason
	name    string        // actFallback: the fallback to run
	fault   error         // actRecover: the guest output refused (nil: the crossing itself failed)
	timeout time.Duration // actRecover: the degraded attempt's timeout (0: none)
	ran     bool          // actRecover: an attempt has run (its result stands; no degraded attempt)
}

// driver holds what the protocol must remember of one call.
type driver struct {
	info     *PolicyInfo
	deadline uint64 // engine ns, 0 = none
	attempts int
}

// newDriver starts the driver of a call started at start (engine ns).
func newDriver(info *PolicyInfo, start uint64) driver {
	d := driver{info: info}
	if info.Deadline > 0 {
		d.deadline = start + info.Deadline
	}
	return d
}

// left is the time to the deadline at now (0 when past it); ok false without a deadline.
func (d *driver) left(now uint64) (left uint64, ok bool) {
	if d.deadline == 0 {
		return 0, false
	}
	if d.deadline > now {
		return d.deadline - now, true
	}
	return 0, true
}

// holdable says whether a success that took elapsed may be held back to settle
// on the next start: only one below the timeout its verdict gave (a late one is
// a timeout whose answer the host must hear; the WIT's engine-api).
func (a *action) holdable(elapsed uint64) bool {
	return a.limit == 0 || time.Duration(elapsed) < a.limit
}

// next is the action for verdict v, asked at now.
func (d *driver) next(v Verdict, now uint64) action {
	switch v.Kind() {
	case VerdictAttempt:
		d.attempts++
		if d.info.MaxAttempts > 0 && d.attempts > int(d.info.MaxAttempts) {
			d.attempts--
			return d.recover(now, fmt.Errorf("attempt %d granted past max-attempts %d", d.attempts+1, d.info.MaxAttempts))
		}
		given := v.Payload()
		timeout := given
		if left, ok := d.left(now); ok && (timeout == 0 || timeout > left) {
			timeout = max(left, 1)
		}
		return action{kind: actAttempt, n: d.attempts, d: time.Duration(timeout), limit: time.Duration(given)}
	case VerdictWait, VerdictRetry:
		delay := v.Payload()
		if left, ok := d.left(now); ok && delay > left {
			delay = left
		}
		return action{kind: actSleep, d: time.Duration(delay), retry: v.Kind() == VerdictRetry}
	case VerdictFallback:
		idx := v.Payload()
		if idx >= uint64(len(d.info.Fallbacks)) {
			return d.recover(now, fmt.Errorf("fallback index %d out of the chain of %d", idx, len(d.info.Fallbacks)))
		}
		return action{kind: actFallback, name: d.info.Fallbacks[idx], reason: v.Reason()}
	case VerdictDone:
		return action{kind: actDone}
	case VerdictFail:
		return action{kind: actFail, reason: v.Reason(), d: time.Duration(v.Payload())}
	default:
		// invalid: the engine does not know the call (it was re-instantiated
		// meanwhile, or evicted it), or a kind no contract knows
		return d.recover(now, fmt.Errorf("verdict %v", v))
	}
}

// crossingFailed is the action after a crossing of the call faulted at now (the
// glue has re-instantiated the engine).
func (d *driver) crossingFailed(now uint64) action { return d.recover(now, nil) }

// recover is the one recovery path: the call ends as one degraded attempt
// under the policy's attempt timeout (clamped to the deadline), or with the
// result of the attempt that already ran.
func (d *driver) recover(now uint64, fault error) action {
	timeout := d.info.AttemptTimeout
	if left, ok := d.left(now); ok && (timeout == 0 || timeout > left) {
		timeout = max(left, 1)
	}
	return action{kind: actRecover, fault: fault, ran: d.attempts > 0, n: d.attempts + 1, timeout: time.Duration(timeout)}
}

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
// `now` it was asked at. Every host has this loop; what it may do with a
// verdict is written once in docs/hosts.md (sections 2-4), which this file
// follows line by line.

// actionKind is what the driver asks the host to do next.
type actionKind uint8

const (
	// actAttempt: run attempt number n under timeout d (0: none), report its outcome.
	actAttempt actionKind = iota
	// actSleep: sleep d (retry: prepare the operation for another attempt first), then acquire.
	actSleep
	// actFallback: run the named fallback, report whether it succeeded.
	actFallback
	// actDone: the call is over; the last attempt's (or fallback's) result stands.
	actDone
	// actFail: the call is over with the core's reason (and retry-after hint d).
	actFail
	// actRecover: the one recovery path (docs/hosts.md, section 3); see recovery.
	actRecover
	// actHedge: run attempt 1 of a hedged call under timeout d, then carry out the
	// commands of hedge-step and report-attempt (hedgeDriver).
	actHedge
)

// crossing is the operation a verdict answers.
type crossing uint8

const (
	opStart crossing = iota
	opAcquire
	opReport
	opReportFallback
	opHedgeStep
	opReportAttempt
)

var crossingNames = [...]string{"start", "acquire", "report", "report-fallback", "hedge-step", "report-attempt"}

func (c crossing) String() string { return crossingNames[c] }

// fault is why a call took the recovery path: the `levee.fault` of docs/telemetry.md.
type fault uint8

const (
	faultTrap     fault = iota // the guest trapped or overran its bound (already re-instantiated)
	faultContract              // a verdict broke the contract: re-instantiate
	faultInvalid               // the core answered invalid for a call this host started
)

func (f fault) String() string { return cFaults[f] }

// recovery is how a call on the recovery path ends.
type recovery uint8

const (
	// recoverAttemptResult: the failed crossing reported an attempt; its own result stands.
	recoverAttemptResult recovery = iota
	// recoverFallbackResult: the failed crossing reported a fallback; its own result stands.
	recoverFallbackResult
	// recoverDegraded: no attempt in hand: run exactly one degraded attempt under timeout d.
	recoverDegraded
	// recoverDeadline: no attempt in hand and the deadline has passed: fail with `deadline`.
	recoverDeadline
)

// action is one step the driver asks for.
type action struct {
	kind   actionKind
	n      int           // actAttempt: the attempt number (1 on the first)
	d      time.Duration // actAttempt: timeout; actSleep: delay; actFail: retry-after; recoverDegraded: timeout
	retry  bool          // actSleep: a retry (false: a wait for a permit)
	park   *parker       // actSleep: the call's park in a bulkhead queue (set by decideLocked)
	reason Reason        // actFail, actFallback, actSleep: the core's reason
	name   string        // actFallback: the fallback to run
	// actRecover
	fault  fault
	breach error // faultContract, faultInvalid: what the verdict broke
	ending recovery
}

// driver holds what the protocol must remember of one call.
type driver struct {
	info     *PolicyInfo
	start    uint64 // engine ns the call started at
	deadline uint64 // engine ns, 0 = none
	span     uint64 // the policy's deadline, ns after the start (0 = none)
	attempts int
	op       crossing // the crossing whose verdict (or failure) comes next
}

// newDriver starts the driver of a call started at start (engine ns).
func newDriver(info *PolicyInfo, start uint64) driver {
	d := driver{info: info, op: opStart, span: info.Deadline}
	d.begin(start)
	return d
}

// begin sets the call's start (engine ns); the rest of the driver was made
// before (the engine calls it under its lock, so it reads nothing of info).
func (d *driver) begin(start uint64) {
	d.start = start
	if d.span > 0 {
		d.deadline = start + d.span
	}
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

func validReason(r Reason) bool { return int(r) < len(cReasons) }

// next is the action for verdict v of the pending crossing, asked at now.
func (d *driver) next(v Verdict, now uint64) action {
	if v&cVerdictReservedMask != 0 {
		return d.breach(faultContract, now, "reserved bits set in %v", v)
	}
	info := d.info
	switch v.Kind() {
	case VerdictAttempt:
		n := d.attempts + 1
		timeout := v.Payload()
		switch {
		case int(v.Detail()) != n&0xff:
			return d.breach(faultContract, now, "attempt %d granted as attempt %d", n, v.Detail())
		case info.MaxAttempts > 0 && n > int(info.MaxAttempts):
			return d.breach(faultContract, now, "attempt %d granted past max-attempts %d", n, info.MaxAttempts)
		case info.AttemptTimeout > 0 && timeout > info.AttemptTimeout:
			return d.breach(faultContract, now, "attempt timeout %v above the policy's %v", time.Duration(timeout), time.Duration(info.AttemptTimeout))
		case timeout == 0 && (info.AttemptTimeout > 0 || d.deadline > 0):
			return d.breach(faultContract, now, "attempt without a timeout under a policy with one")
		}
		if left, ok := d.left(now); ok && timeout > left {
			return d.breach(faultContract, now, "attempt timeout %v past the deadline (%v left)", time.Duration(timeout), time.Duration(left))
		}
		d.attempts = n
		d.op = opReport
		return action{kind: actAttempt, n: n, d: time.Duration(timeout)}
	case VerdictWait, VerdictRetry:
		delay := v.Payload()
		if !validReason(v.Reason()) {
			return d.breach(faultContract, now, "%v with an unknown reason", v)
		}
		if left, ok := d.left(now); ok && delay > left {
			return d.breach(faultContract, now, "a delay of %v past the deadline (%v left)", time.Duration(delay), time.Duration(left))
		}
		d.op = opAcquire
		return action{kind: actSleep, d: time.Duration(delay), retry: v.Kind() == VerdictRetry, reason: v.Reason()}
	case VerdictFallback:
		idx := v.Payload()
		if idx >= uint64(len(info.Fallbacks)) {
			return d.breach(faultContract, now, "fallback index %d out of the chain of %d", idx, len(info.Fallbacks))
		}
		d.op = opReportFallback
		return action{kind: actFallback, name: info.Fallbacks[idx], reason: v.Reason()}
	case VerdictDone:
		if d.op == opAcquire || d.op == opStart {
			return d.breach(faultContract, now, "done answered to %v (it only admits)", d.op)
		}
		return action{kind: actDone}
	case VerdictFail:
		if r := v.Reason(); r == ReasonNone || !validReason(r) {
			return d.breach(faultContract, now, "fail with reason %d", r)
		}
		return action{kind: actFail, reason: v.Reason(), d: time.Duration(v.Payload())}
	case VerdictHedge:
		// attempt 1 of a hedged call (docs/policy.md, "Hedging"): a hedged policy's one
		// call-level attempt, so the first; its timeout as a hedged attempt's (hedgeTimeout)
		if d.attempts != 0 || v.Detail() != 1 {
			return d.breach(faultContract, now, "hedge verdict for attempt %d after %d attempts", v.Detail(), d.attempts)
		}
		if err := d.hedgeTimeout(1, v.Payload(), now); err != nil {
			return d.recover(faultContract, err, now)
		}
		d.attempts = 1
		d.op = opHedgeStep
		return action{kind: actHedge, n: 1, d: time.Duration(v.Payload())}
	case VerdictInvalid:
		// the core does not know the call (evicted at MAX_LIVE_CALLS, or an instance replaced)
		return d.breach(faultInvalid, now, "invalid (code %d) for call of policy %q", v.Detail(), info.Name)
	default:
		return d.breach(faultContract, now, "verdict kind %d", v.Kind())
	}
}

// crossingFailed is the action after the pending crossing trapped at now (the
// glue has re-instantiated the engine).
func (d *driver) crossingFailed(now uint64) action { return d.recover(faultTrap, nil, now) }

func (d *driver) breach(f fault, now uint64, format string, args ...any) action {
	return d.recover(f, fmt.Errorf(format, args...), now)
}

// recover is the one recovery path (docs/hosts.md, section 3): the call ends
// with the result of what the failed crossing reported, or, with no attempt
// in hand, with one degraded attempt under min(attempt-timeout, time left)
// (none when the policy has neither), or `deadline` when none is left.
func (d *driver) recover(f fault, breach error, now uint64) action {
	a := action{kind: actRecover, fault: f, breach: breach}
	switch d.op {
	case opReport:
		a.ending = recoverAttemptResult
	case opReportFallback:
		a.ending = recoverFallbackResult
	default:
		timeout := d.info.AttemptTimeout
		if left, ok := d.left(now); ok {
			if left == 0 {
				a.ending = recoverDeadline
				return a
			}
			if timeout == 0 || timeout > left {
				timeout = left
			}
		}
		a.ending, a.n, a.d = recoverDegraded, d.attempts+1, time.Duration(timeout)
	}
	return a
}

// maxHedgeAttempts is the most attempts a hedged call can have, counting the original
// (the Polly preset's 1 + 10 hedges; docs/policy.md, "Hedging"; hedge.MAX_ATTEMPTS of the
// contract).
const maxHedgeAttempts = cHedgeMaxAttempts

// hedgeTimeout checks the timeout of a hedged attempt: the core caps it at the deadline
// (and gives none past it), but not always at the policy's attempt-timeout (the envoy
// preset races attempts past it), so only the deadline bounds it here.
func (d *driver) hedgeTimeout(n int, timeout, now uint64) error {
	left, ok := d.left(now)
	switch {
	case !ok:
		return nil
	case timeout == 0:
		return fmt.Errorf("hedged attempt %d without a timeout under a deadline", n)
	case timeout > left:
		return fmt.Errorf("hedged attempt %d with a timeout of %v past the deadline (%v left)", n, time.Duration(timeout), time.Duration(left))
	}
	return nil
}

// hedgeDriver is what the driver knows of a hedged call's attempts, sans I/O: the
// commands of each hedge-answer are checked against it before the host carries out any
// of them (docs/hosts.md, section 2, for hedging). Bit n of each set is attempt n.
type hedgeDriver struct {
	started   uint16 // attempts started (attempt 1 by the hedge verdict)
	open      uint16 // started and not yet reported (report-attempt)
	cancelled uint16 // the core cancelled them
	last      int    // the highest attempt started
	over      bool   // an end was carried out
}

// hedgePlan is a checked hedge-answer: what to start and cancel, in order, the wait, and
// the end of the call, if it ends.
type hedgePlan struct {
	cmds []HedgeCommand // starts and cancels, in order
	wait bool
	d    time.Duration // wait: the delay
	end  bool
	// end: the attempt whose result or failure the call returns, and the driver's action
	// for the end's verdict (actDone, actFail, actFallback, or actRecover for invalid)
	attempt int
	act     action
	// breach: the answer broke the contract (faultContract: nothing of it is carried out)
	breach error
}

func (h *hedgeDriver) newHedge(attempt int) {
	h.started |= 1 << attempt
	h.open |= 1 << attempt
	h.last = attempt
}

// closed records that attempt n was reported to the core.
func (h *hedgeDriver) closed(n int) { h.open &^= 1 << n }

// live is the set of attempts in flight that the core did not cancel.
func (h *hedgeDriver) live() uint16 { return h.open &^ h.cancelled }

// plan checks answer a of a crossing asked at now and, when it keeps the contract,
// applies it to h. A command breaks it when it starts an attempt out of order, already
// started or past maxHedgeAttempts, or with a timeout past the deadline; cancels or ends
// with an attempt never started; ends with an attempt whose outcome the host has not
// reported (it has no result to return) or with a verdict that cannot end a call; waits
// until past the deadline; or follows an end. An answer that neither
// ends the call nor leaves anything to wait for (no attempt live, no wait) breaks it too.
func (d *driver) plan(h *hedgeDriver, a HedgeAnswer, now uint64) (p hedgePlan) {
	n := *h // checked on a copy: a breach changes nothing
	breach := func(format string, args ...any) hedgePlan {
		return hedgePlan{breach: fmt.Errorf(format, args...)}
	}
	for i, c := range a.Commands {
		if p.end {
			return breach("%v after the end of the call", c)
		}
		at := int(c.Attempt)
		switch c.Kind {
		case HedgeStart:
			switch {
			case at < 2 || at > maxHedgeAttempts:
				return breach("start of attempt %d (a hedge is attempt 2 to %d)", at, maxHedgeAttempts)
			case n.started&(1<<at) != 0:
				return breach("start of attempt %d, already started", at)
			case at != n.last+1:
				return breach("start of attempt %d after attempt %d", at, n.last)
			}
			if err := d.hedgeTimeout(at, c.Timeout, now); err != nil {
				return hedgePlan{breach: err}
			}
			n.newHedge(at)
			p.cmds = append(p.cmds, c)
		case HedgeCancel:
			if at < 1 || at > maxHedgeAttempts || n.started&(1<<at) == 0 {
				return breach("cancel of attempt %d, never started", at)
			}
			n.cancelled |= 1 << at
			p.cmds = append(p.cmds, c)
		case HedgeWait:
			p.wait, p.d = true, time.Duration(c.Delay)
			if i != len(a.Commands)-1 {
				// a wait is the last command, or an end follows; nothing else may
				if nx := a.Commands[i+1]; nx.Kind != HedgeEnd {
					return breach("%v after a wait", nx)
				}
			}
		case HedgeEnd:
			p.end, p.attempt = true, at
			v := c.Verdict
			switch k := v.Kind(); {
			case v&cVerdictReservedMask != 0:
				return breach("end with reserved bits set in %v", v)
			case k == VerdictInvalid:
				p.act = d.breach(faultInvalid, now, "end with invalid (code %d) for call of policy %q", v.Detail(), d.info.Name)
			case k != VerdictDone && k != VerdictFail && k != VerdictFallback:
				return breach("end with a %v verdict", k)
			case at < 1 || at > maxHedgeAttempts || n.started&(1<<at) == 0:
				return breach("end with attempt %d, never started", at)
			case n.open&(1<<at) != 0:
				return breach("end with attempt %d, still in flight", at)
			case n.cancelled&(1<<at) != 0:
				return breach("end with attempt %d, which it cancelled", at)
			default:
				saved := d.op
				d.op = opReport // the end's verdict is handled as report's answer
				p.act = d.next(v, now)
				if p.act.kind == actRecover {
					d.op = saved
					return hedgePlan{breach: p.act.breach}
				}
			}
		default:
			return breach("hedge command of kind %d", c.Kind)
		}
	}
	if p.wait && !p.end {
		if left, ok := d.left(now); ok && uint64(p.d) > left {
			return breach("a wait of %v past the deadline (%v left)", p.d, time.Duration(left))
		}
	}
	if !p.end && !p.wait && n.live() == 0 && n.open == 0 && !n.over {
		return breach("no attempt in flight, no wait and no end")
	}
	if p.end {
		n.over = true
	}
	*h = n
	d.attempts = max(d.attempts, h.last)
	return p
}

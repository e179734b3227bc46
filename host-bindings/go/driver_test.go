package levee

import (
	"strings"
	"testing"
	"time"
)

func mkVerdict(k VerdictKind, detail uint8, payload uint64) Verdict {
	return Verdict(uint64(k) | uint64(detail)<<8 | payload<<16)
}

// The driver alone, verdict by verdict: no engine, no clock, no I/O (docs/hosts.md, sections 2-3).
func TestDriverActions(t *testing.T) {
	ms := uint64(time.Millisecond)
	info := &PolicyInfo{Name: "p", MaxAttempts: 2, AttemptTimeout: 50 * ms, Deadline: 100 * ms, Fallbacks: []string{"cached"}}
	d := newDriver(info, 1000*ms)

	a := d.next(mkVerdict(VerdictAttempt, 1, 50*ms), 1000*ms)
	if a.kind != actAttempt || a.n != 1 || a.d != 50*time.Millisecond || d.op != opReport {
		t.Fatalf("first attempt: %+v", a)
	}
	a = d.next(mkVerdict(VerdictRetry, uint8(ReasonNone), 40*ms), 1060*ms)
	if a.kind != actSleep || !a.retry || a.d != 40*time.Millisecond || d.op != opAcquire {
		t.Fatalf("retry: %+v", a)
	}
	a = d.next(mkVerdict(VerdictAttempt, 2, 10*ms), 1090*ms)
	if a.kind != actAttempt || a.n != 2 || a.d != 10*time.Millisecond {
		t.Fatalf("second attempt: %+v", a)
	}
	if a = d.next(mkVerdict(VerdictFallback, uint8(ReasonRetriesExhausted), 0), 1101*ms); a.kind != actFallback || a.name != "cached" ||
		a.reason != ReasonRetriesExhausted || d.op != opReportFallback {
		t.Fatalf("fallback: %+v", a)
	}
	if a = d.next(mkVerdict(VerdictFail, uint8(ReasonBreakerOpen), 7*ms), 1101*ms); a.kind != actFail ||
		a.reason != ReasonBreakerOpen || a.d != 7*time.Millisecond {
		t.Fatalf("fail: %+v", a)
	}
	if a = d.next(mkVerdict(VerdictDone, 0, 0), 1101*ms); a.kind != actDone {
		t.Fatalf("done: %+v", a)
	}
}

// Every breach of section 2 takes the recovery path, ended by the crossing that failed.
func TestDriverContract(t *testing.T) {
	ms := uint64(time.Millisecond)
	info := &PolicyInfo{Name: "p", MaxAttempts: 2, AttemptTimeout: 50 * ms, Deadline: 100 * ms, Fallbacks: []string{"cached"}}
	fresh := func() driver { return newDriver(info, 0) }
	afterAttempt := func() driver {
		d := fresh()
		d.next(mkVerdict(VerdictAttempt, 1, 50*ms), 0)
		return d
	}
	afterRetry := func() driver {
		d := afterAttempt()
		d.next(mkVerdict(VerdictRetry, 0, 10*ms), 50*ms)
		return d
	}
	cases := []struct {
		name   string
		d      driver
		v      Verdict
		now    uint64
		fault  fault
		ending recovery
	}{
		{"reserved bits", fresh(), mkVerdict(VerdictAttempt, 1, 50*ms) | 0x40, 0, faultContract, recoverDegraded},
		{"unknown kind", fresh(), mkVerdict(9, 0, 0), 0, faultContract, recoverDegraded},
		{"wrong attempt number", fresh(), mkVerdict(VerdictAttempt, 2, 50*ms), 0, faultContract, recoverDegraded},
		{"timeout above the policy's", fresh(), mkVerdict(VerdictAttempt, 1, 60*ms), 0, faultContract, recoverDegraded},
		{"no timeout", fresh(), mkVerdict(VerdictAttempt, 1, 0), 0, faultContract, recoverDegraded},
		{"timeout past the deadline", fresh(), mkVerdict(VerdictAttempt, 1, 50*ms), 60 * ms, faultContract, recoverDegraded},
		{"delay past the deadline", afterAttempt(), mkVerdict(VerdictRetry, 0, 60*ms), 50 * ms, faultContract, recoverAttemptResult},
		{"unknown reason", afterAttempt(), mkVerdict(VerdictRetry, 200, 1), 50 * ms, faultContract, recoverAttemptResult},
		{"fallback out of range", afterAttempt(), mkVerdict(VerdictFallback, 0, 1), 50 * ms, faultContract, recoverAttemptResult},
		{"fail without a reason", afterAttempt(), mkVerdict(VerdictFail, 0, 0), 50 * ms, faultContract, recoverAttemptResult},
		{"done to acquire", afterRetry(), mkVerdict(VerdictDone, 0, 0), 60 * ms, faultContract, recoverDegraded},
		{"done to start", fresh(), mkVerdict(VerdictDone, 0, 0), 0, faultContract, recoverDegraded},
		{"invalid", afterRetry(), mkVerdict(VerdictInvalid, InvalidUnknownCall, 0), 60 * ms, faultInvalid, recoverDegraded},
		{"deadline passed", afterRetry(), mkVerdict(VerdictInvalid, InvalidUnknownCall, 0), 100 * ms, faultInvalid, recoverDeadline},
	}
	for _, c := range cases {
		a := c.d.next(c.v, c.now)
		if a.kind != actRecover || a.fault != c.fault || a.ending != c.ending || a.breach == nil {
			t.Errorf("%s: %+v", c.name, a)
		}
	}
	d := afterRetry()
	d.next(mkVerdict(VerdictAttempt, 2, 40*ms), 60*ms)
	if a := d.next(mkVerdict(VerdictAttempt, 3, 10*ms), 90*ms); a.kind != actRecover || a.ending != recoverAttemptResult {
		t.Errorf("attempt past max-attempts: %+v", a)
	}
}

// A trap with no attempt in hand: one degraded attempt under min(attempt-timeout, time left).
func TestDriverDegradedAttempt(t *testing.T) {
	ms := uint64(time.Millisecond)
	info := &PolicyInfo{AttemptTimeout: 50 * ms, Deadline: 100 * ms}
	d := newDriver(info, 0)
	if a := d.crossingFailed(70 * ms); a.kind != actRecover || a.fault != faultTrap || a.ending != recoverDegraded ||
		a.d != 30*time.Millisecond || a.n != 1 {
		t.Fatalf("trap at start: %+v", a)
	}
	if a := d.crossingFailed(10 * ms); a.d != 50*time.Millisecond {
		t.Fatalf("trap early: %+v", a)
	}
	if a := d.crossingFailed(100 * ms); a.ending != recoverDeadline {
		t.Fatalf("trap past the deadline: %+v", a)
	}
	d = newDriver(&PolicyInfo{}, 0)
	if a := d.crossingFailed(70 * ms); a.d != 0 || a.ending != recoverDegraded {
		t.Fatalf("trap under a policy without timeouts: %+v", a)
	}
}

// The checks of hedge-answers (driver.go, plan), command by command: no engine, no I/O.
func TestHedgePlanContract(t *testing.T) {
	ms := uint64(time.Millisecond)
	info := &PolicyInfo{Name: "p", MaxAttempts: 1, Deadline: 1000 * ms}
	start := func(n uint32, timeout uint64) HedgeCommand {
		return HedgeCommand{Kind: HedgeStart, Attempt: n, Timeout: timeout}
	}
	wait := func(d uint64) HedgeCommand { return HedgeCommand{Kind: HedgeWait, Delay: d} }
	cancel := func(n uint32) HedgeCommand { return HedgeCommand{Kind: HedgeCancel, Attempt: n} }
	end := func(n uint32, v Verdict) HedgeCommand { return HedgeCommand{Kind: HedgeEnd, Attempt: n, Verdict: v} }
	done := mkVerdict(VerdictDone, 0, 0)
	// fresh: attempt 1 runs (the hedge verdict at 0); reported1: and was reported at 100 ms
	fresh := func() (driver, hedgeDriver) {
		d := newDriver(info, 0)
		if a := d.next(mkVerdict(VerdictHedge, 1, 1000*ms), 0); a.kind != actHedge || a.n != 1 {
			t.Fatalf("hedge verdict: %+v", a)
		}
		var h hedgeDriver
		h.newHedge(1)
		return d, h
	}
	cases := []struct {
		name     string
		reported bool // attempt 1 closed (reported) before the answer
		cmds     []HedgeCommand
		now      uint64
		breach   string // "" when the answer keeps the contract
	}{
		{"a wait", false, []HedgeCommand{wait(500 * ms)}, 0, ""},
		{"a hedge and a wait", false, []HedgeCommand{start(2, 500*ms), wait(400 * ms)}, 500 * ms, ""},
		{"a wait to the deadline", false, []HedgeCommand{wait(1000 * ms)}, 0, ""},
		{"a wait past the deadline", false, []HedgeCommand{wait(2000 * ms)}, 0, "past the deadline"},
		{"nothing left to wait for", true, nil, 100 * ms, "no attempt in flight"},
		{"start of attempt 1", false, []HedgeCommand{start(1, 100*ms)}, 0, "start of attempt 1"},
		{"start out of order", false, []HedgeCommand{start(3, 100*ms)}, 0, "after attempt 1"},
		{"start twice", false, []HedgeCommand{start(2, 100*ms), start(2, 100*ms)}, 0, "already started"},
		{"start past 11", false, []HedgeCommand{start(12, 100*ms)}, 0, "attempt 2 to 11"},
		{"start without a timeout under a deadline", false, []HedgeCommand{start(2, 0)}, 0, "without a timeout"},
		{"start past the deadline", false, []HedgeCommand{start(2, 600*ms)}, 500 * ms, "past the deadline"},
		{"cancel of one never started", false, []HedgeCommand{cancel(2), end(1, done)}, 0, "never started"},
		{"end of one never started", false, []HedgeCommand{end(2, done)}, 0, "never started"},
		{"end of one in flight", false, []HedgeCommand{end(1, done)}, 0, "still in flight"},
		{"end done", true, []HedgeCommand{end(1, done)}, 100 * ms, ""},
		{"end with an attempt verdict", true, []HedgeCommand{end(1, mkVerdict(VerdictAttempt, 2, 0))}, 100 * ms, "end with a attempt verdict"},
		{"end with a retry", true, []HedgeCommand{end(1, mkVerdict(VerdictRetry, 0, 0))}, 100 * ms, "end with a retry verdict"},
		{"end with kind 9", true, []HedgeCommand{end(1, Verdict(9))}, 100 * ms, "verdict"},
		{"end with reserved bits", true, []HedgeCommand{end(1, done|1<<6)}, 100 * ms, "reserved bits"},
		{"end failing for reason none", true, []HedgeCommand{end(1, mkVerdict(VerdictFail, 0, 0))}, 100 * ms, "reason 0"},
		{"end with a fallback out of the chain", true, []HedgeCommand{end(1, mkVerdict(VerdictFallback, 2, 0))}, 100 * ms, "out of the chain"},
		{"a command after the end", true, []HedgeCommand{end(1, done), wait(1)}, 100 * ms, "after the end"},
		{"a start after a wait", false, []HedgeCommand{wait(1), start(2, 100*ms)}, 0, "after a wait"},
		{"an unknown command", false, []HedgeCommand{{Kind: 7}}, 0, "kind 7"},
	}
	for _, tc := range cases {
		d, h := fresh()
		if tc.reported {
			h.closed(1)
		}
		before := h
		p := d.plan(&h, HedgeAnswer{Commands: tc.cmds}, tc.now)
		switch {
		case tc.breach == "" && p.breach != nil:
			t.Errorf("%s: breach %v", tc.name, p.breach)
		case tc.breach != "" && (p.breach == nil || !strings.Contains(p.breach.Error(), tc.breach)):
			t.Errorf("%s: breach %v, want one saying %q", tc.name, p.breach, tc.breach)
		case tc.breach != "" && h != before:
			t.Errorf("%s: a breach changed the state: %+v -> %+v", tc.name, before, h)
		}
	}
	// an end with invalid is the recovery path (faultInvalid), not a breach
	d, h := fresh()
	p := d.plan(&h, HedgeAnswer{Commands: []HedgeCommand{end(0, mkVerdict(VerdictInvalid, InvalidUnknownCall, 0))}}, 0)
	if p.breach != nil || !p.end || p.act.kind != actRecover || p.act.fault != faultInvalid {
		t.Fatalf("end invalid: %+v", p)
	}
	// the hedge verdict itself: attempt 1 only, its timeout within the deadline
	d = newDriver(info, 0)
	if a := d.next(mkVerdict(VerdictHedge, 2, 100*ms), 0); a.kind != actRecover || a.fault != faultContract {
		t.Fatalf("hedge verdict for attempt 2: %+v", a)
	}
	d = newDriver(info, 0)
	if a := d.next(mkVerdict(VerdictHedge, 1, 0), 0); a.kind != actRecover || a.fault != faultContract {
		t.Fatalf("hedge verdict without a timeout under a deadline: %+v", a)
	}
}

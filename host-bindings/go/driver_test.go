package levee

import (
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
		{"reserved bits", fresh(), mkVerdict(VerdictAttempt, 1, 50*ms) | 0x20, 0, faultContract, recoverDegraded},
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

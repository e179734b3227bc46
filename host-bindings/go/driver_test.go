package levee

import (
	"testing"
	"time"
)

func mkVerdict(k VerdictKind, detail uint8, payload uint64) Verdict {
	return Verdict(uint64(k) | uint64(detail)<<8 | payload<<16)
}

// The driver alone, verdict by verdict: no engine, no clock, no I/O.
func TestDriverActions(t *testing.T) {
	ms := uint64(time.Millisecond)
	info := &PolicyInfo{Name: "p", MaxAttempts: 2, AttemptTimeout: 50 * ms, Deadline: 100 * ms, Fallbacks: []string{"cached"}}
	d := newDriver(info, 1000*ms)

	a := d.next(mkVerdict(VerdictAttempt, 1, 50*ms), 1000*ms)
	if a.kind != actAttempt || a.n != 1 || a.d != 50*time.Millisecond {
		t.Fatalf("first attempt: %+v", a)
	}
	// a delay that would end past the deadline is cut to it
	a = d.next(mkVerdict(VerdictRetry, uint8(ReasonNone), 80*ms), 1060*ms)
	if a.kind != actSleep || !a.retry || a.d != 40*time.Millisecond {
		t.Fatalf("retry: %+v", a)
	}
	// an attempt timeout is clamped to what is left of the deadline (at least 1 ns)
	a = d.next(mkVerdict(VerdictAttempt, 2, 50*ms), 1090*ms)
	if a.kind != actAttempt || a.n != 2 || a.d != 10*time.Millisecond {
		t.Fatalf("second attempt: %+v", a)
	}
	// an attempt past max-attempts breaks the contract: the recovery path, the last result stands
	a = d.next(mkVerdict(VerdictAttempt, 3, 50*ms), 1101*ms)
	if a.kind != actRecover || a.fault == nil || !a.ran || d.attempts != 2 {
		t.Fatalf("attempt past the maximum: %+v", a)
	}
	if a = d.next(mkVerdict(VerdictFallback, uint8(ReasonRetriesExhausted), 0), 1101*ms); a.kind != actFallback || a.name != "cached" ||
		a.reason != ReasonRetriesExhausted {
		t.Fatalf("fallback: %+v", a)
	}
	if a = d.next(mkVerdict(VerdictFallback, 0, 1), 1101*ms); a.kind != actRecover || a.fault == nil {
		t.Fatalf("fallback index out of range: %+v", a)
	}
	if a = d.next(mkVerdict(VerdictFail, uint8(ReasonBreakerOpen), 7*ms), 1101*ms); a.kind != actFail ||
		a.reason != ReasonBreakerOpen || a.d != 7*time.Millisecond {
		t.Fatalf("fail: %+v", a)
	}
	if a = d.next(mkVerdict(VerdictDone, 0, 0), 1101*ms); a.kind != actDone {
		t.Fatalf("done: %+v", a)
	}
	if a = d.next(mkVerdict(VerdictInvalid, InvalidUnknownCall, 0), 1101*ms); a.kind != actRecover || a.fault == nil {
		t.Fatalf("invalid: %+v", a)
	}

	// a fault before any attempt: one degraded attempt, its timeout clamped to the deadline
	d = newDriver(info, 0)
	if a = d.crossingFailed(70 * ms); a.kind != actRecover || a.ran || a.fault != nil || a.timeout != 30*time.Millisecond {
		t.Fatalf("fault at start: %+v", a)
	}
	if a = d.crossingFailed(200 * ms); a.timeout != 1 {
		t.Fatalf("fault past the deadline: %+v", a)
	}
	// without a deadline the degraded attempt has the policy's attempt timeout
	d = newDriver(&PolicyInfo{AttemptTimeout: 5 * ms}, 0)
	if a = d.crossingFailed(70 * ms); a.timeout != 5*time.Millisecond {
		t.Fatalf("fault without a deadline: %+v", a)
	}
}

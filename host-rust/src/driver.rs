//! The driver: the step protocol as a small sans-I/O state machine, from the core's verdicts
//! to the host's actions (run an attempt under a timeout, sleep, run a fallback, finish,
//! recover). It reads no clock, sleeps nowhere and holds no value of the call: the caller
//! ([`crate::Call`]) passes the `now` of each step and does the I/O the action names. It
//! decides nothing the core decides; it only holds the core to its contract (no attempt past
//! the policy's maximum, no timeout or sleep past the deadline) and names the way out when
//! the engine trapped or lost the call.

use levee_core::{PolicyInfo, Reason, Verdict, VerdictKind};

use crate::constants::VERDICT_RESERVED_MASK;
use crate::telemetry::Fault;

/// What a running call needs of its policy (copied at `start`: no allocation, no shared count).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct PolicyLimits {
    pub(crate) max_attempts: u32,
    pub(crate) attempt_timeout: u64,
    pub(crate) deadline: u64,
    pub(crate) fallbacks: u32,
}

impl PolicyLimits {
    pub(crate) fn of(p: &PolicyInfo) -> Self {
        PolicyLimits {
            max_attempts: p.max_attempts,
            attempt_timeout: p.attempt_timeout,
            deadline: p.deadline,
            fallbacks: p.fallbacks.len() as u32,
        }
    }
}

/// How a call on the recovery path ends (docs/hosts.md, section 3).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Recovery {
    /// With the result of the attempt whose report failed.
    Attempt,
    /// With the result of the fallback whose report failed.
    Fallback,
    /// After one degraded attempt, number `number`, under `timeout` ns (`None`: none).
    Degraded { number: u32, timeout: Option<u64> },
    /// With the result of the hedged attempt that stood ([`crate::hedge`]), which has already
    /// reported the fault (before it waited for that attempt).
    Hedged,
    /// The deadline has passed: no attempt runs; the call fails with `deadline`.
    DeadlinePassed,
}

/// What the host does next.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Action {
    /// Run attempt `number`, begun at `begin`, under `timeout` ns (`None`: none); report it.
    Attempt { number: u32, begin: u64, timeout: Option<u64> },
    /// A hedged call ([`crate::hedge`]): run attempt 1, begun at `begin`, under `timeout` ns
    /// (`None`: none), then carry out the core's hedge commands.
    Hedge { begin: u64, timeout: Option<u64> },
    /// Sleep until `until` holding nothing, then `acquire`. After a `retry` the value the last
    /// attempt returned is dropped (the retry replaces it). With `park` the call waits in a
    /// bulkhead queue (a `wait` with reason `bulkhead-full`): the sleep also ends as soon as the
    /// core grants the call a slot and names it (docs/policy.md, "The queue").
    Sleep { until: u64, delay: u64, retry: bool, park: bool },
    /// Run the fallback at `index` of the policy's chain (why: `reason`); report whether it
    /// succeeded.
    Fallback { index: u32, reason: Reason },
    /// The call is over with the last value (an attempt's the policy accepted, or a fallback's).
    Done,
    /// The policy stopped the call: `reason`, and a retry-after hint (ns, 0 for none).
    Fail { reason: Reason, hint: u64 },
    /// The one recovery path: report `fault` (re-instantiating first for a contract breach),
    /// then end as `then` says, with no retry and no fallback.
    Recover { fault: Fault, then: Recovery },
}

/// The crossing that produced a verdict (or trapped).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Crossing {
    Start,
    Report,
    Acquire,
    ReportFallback,
}

/// Whether `v` queues the call in its bulkhead queue: a `wait` whose reason is `bulkhead-full`
/// (then the host parks it, registered in the crossing that gave `v`, see [`crate::park`]).
#[inline]
pub(crate) fn parks(v: Verdict) -> bool {
    v.kind() == Some(VerdictKind::Wait) && u32::from(v.detail()) == Reason::BulkheadFull as u32
}

/// The state of one call's protocol.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Driver {
    limits: PolicyLimits,
    deadline: Option<u64>,
    attempts: u32,
}

impl Driver {
    /// A call of a policy with `limits`, started at `started`.
    #[inline]
    pub(crate) fn new(limits: PolicyLimits, started: u64) -> Self {
        Driver { limits, deadline: (limits.deadline > 0).then(|| started.saturating_add(limits.deadline)), attempts: 0 }
    }

    /// Attempts started so far.
    #[inline]
    pub(crate) fn attempts(&self) -> u32 {
        self.attempts
    }

    /// The call's deadline (`None`: none).
    pub(crate) fn deadline(&self) -> Option<u64> {
        self.deadline
    }

    /// A hedged call has started `started` attempts in all.
    pub(crate) fn hedged(&mut self, started: u32) {
        self.attempts = self.attempts.max(started);
    }

    /// The action for the verdict `v` that `crossing` answered at `now`: what the verdict says,
    /// or the recovery path when it breaks the contract (docs/hosts.md, section 2) or is
    /// `invalid`.
    #[inline(always)]
    pub(crate) fn next(&mut self, v: Verdict, now: u64, crossing: Crossing) -> Action {
        if v.0 & u64::from(VERDICT_RESERVED_MASK) != 0 {
            return self.recover(Fault::Contract, crossing, now);
        }
        let Some(kind) = v.kind() else { return self.recover(Fault::Contract, crossing, now) };
        match kind {
            VerdictKind::Attempt => {
                let number = self.attempts.saturating_add(1);
                let t = v.payload();
                let l = &self.limits;
                let left = self.deadline.map(|d| d.saturating_sub(now));
                let breach = u32::from(v.detail()) != number.min(255)
                    || number > l.max_attempts
                    || (l.attempt_timeout > 0 && t > l.attempt_timeout)
                    || left.is_some_and(|left| t > left)
                    || (t == 0 && (l.attempt_timeout > 0 || left.is_some()));
                if breach {
                    return self.recover(Fault::Contract, crossing, now);
                }
                self.attempts = number;
                Action::Attempt { number, begin: now, timeout: (t > 0).then_some(t) }
            }
            // Attempt 1 of a hedged call, admitted by `start` (or `acquire` after a wait). Its
            // timeout is bounded by the deadline only: under the `envoy` preset it is not the
            // policy's `attempt-timeout` (the attempt keeps racing past it).
            VerdictKind::Hedge => {
                let t = v.payload();
                let left = self.deadline.map(|d| d.saturating_sub(now));
                let breach = self.attempts != 0
                    || v.detail() != 1
                    || !matches!(crossing, Crossing::Start | Crossing::Acquire)
                    || left.is_some_and(|left| t > left || t == 0);
                if breach {
                    return self.recover(Fault::Contract, crossing, now);
                }
                self.attempts = 1;
                Action::Hedge { begin: now, timeout: (t > 0).then_some(t) }
            }
            VerdictKind::Wait | VerdictKind::Retry => {
                let until = now.saturating_add(v.payload());
                if Reason::from_index(u32::from(v.detail())).is_none() || self.deadline.is_some_and(|d| until > d) {
                    return self.recover(Fault::Contract, crossing, now);
                }
                Action::Sleep { until, delay: v.payload(), retry: kind == VerdictKind::Retry, park: parks(v) }
            }
            VerdictKind::Fallback => {
                let index = v.payload();
                match Reason::from_index(u32::from(v.detail())) {
                    Some(reason) if index < u64::from(self.limits.fallbacks) => Action::Fallback { index: index as u32, reason },
                    _ => self.recover(Fault::Contract, crossing, now),
                }
            }
            VerdictKind::Done => match crossing {
                // `start` and `acquire` only admit: they never end a call.
                Crossing::Start | Crossing::Acquire => self.recover(Fault::Contract, crossing, now),
                Crossing::Report | Crossing::ReportFallback => Action::Done,
            },
            VerdictKind::Fail => match Reason::from_index(u32::from(v.detail())) {
                Some(reason) if reason != Reason::None => Action::Fail { reason, hint: v.payload() },
                _ => self.recover(Fault::Contract, crossing, now),
            },
            VerdictKind::Invalid => self.recover(Fault::Invalid, crossing, now),
        }
    }

    /// The recovery path for `fault` at `now` with no attempt in hand: one degraded attempt
    /// (or none past the deadline), as after a failed `acquire`.
    pub(crate) fn degraded(&mut self, fault: Fault, now: u64) -> Action {
        self.recover(fault, Crossing::Acquire, now)
    }

    /// The action after `crossing` trapped at `now` (the engine has re-instantiated itself).
    pub(crate) fn trapped(&mut self, crossing: Crossing, now: u64) -> Action {
        self.recover(Fault::Trap, crossing, now)
    }

    /// The recovery path from `crossing` at `now`.
    fn recover(&mut self, fault: Fault, crossing: Crossing, now: u64) -> Action {
        let then = match crossing {
            Crossing::Report => Recovery::Attempt,
            Crossing::ReportFallback => Recovery::Fallback,
            Crossing::Start | Crossing::Acquire => match self.deadline {
                Some(d) if now >= d => Recovery::DeadlinePassed,
                deadline => {
                    let left = deadline.map(|d| d - now);
                    let timeout = match (self.limits.attempt_timeout, left) {
                        (0, left) => left,
                        (t, Some(left)) => Some(t.min(left)),
                        (t, None) => Some(t),
                    };
                    Recovery::Degraded { number: self.attempts.saturating_add(1), timeout }
                }
            },
        };
        Action::Recover { fault, then }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: PolicyLimits = PolicyLimits { max_attempts: 2, attempt_timeout: 50, deadline: 100, fallbacks: 1 };

    fn v(kind: VerdictKind, detail: u8, payload: u64) -> Verdict {
        Verdict::new(kind, detail, payload)
    }

    fn contract(then: Recovery) -> Action {
        Action::Recover { fault: Fault::Contract, then }
    }

    #[test]
    fn attempts_follow_the_verdict_within_the_contract() {
        let mut d = Driver::new(LIMITS, 1);
        assert_eq!(d.next(Verdict::attempt(1, 50), 1, Crossing::Start), Action::Attempt { number: 1, begin: 1, timeout: Some(50) });
        assert_eq!(d.next(Verdict::attempt(2, 31), 70, Crossing::Acquire), Action::Attempt { number: 2, begin: 70, timeout: Some(31) });
        // A third attempt is past the maximum.
        assert_eq!(d.next(Verdict::attempt(3, 10), 80, Crossing::Acquire), contract(Recovery::Degraded { number: 3, timeout: Some(21) }));
        assert_eq!(d.attempts(), 2);
    }

    #[test]
    fn verdicts_that_break_the_contract_take_the_recovery_path() {
        let degraded = contract(Recovery::Degraded { number: 1, timeout: Some(50) });
        let cases = [
            (Verdict::attempt(2, 50), Crossing::Start),             // wrong number
            (Verdict::attempt(1, 60), Crossing::Start),             // above the attempt timeout
            (Verdict::attempt(1, 0), Crossing::Start),              // no timeout under one
            (v(VerdictKind::Done, 0, 0), Crossing::Start),          // done to start
            (v(VerdictKind::Fail, 0, 0), Crossing::Start),          // fail without a reason
            (v(VerdictKind::Fail, 200, 0), Crossing::Start),        // an unknown reason
            (v(VerdictKind::Fallback, 1, 1), Crossing::Start),      // index out of range
            (v(VerdictKind::Retry, 0, 200), Crossing::Acquire),     // past the deadline
            (Verdict(8), Crossing::Start),                          // an unknown kind
            (Verdict(0x40 | 0x0100 | (50 << 16)), Crossing::Start), // reserved bits
        ];
        for (verdict, crossing) in cases {
            assert_eq!(Driver::new(LIMITS, 1).next(verdict, 1, crossing), degraded, "{verdict:?}");
        }
        let mut d = Driver::new(LIMITS, 1);
        assert_eq!(
            d.next(v(VerdictKind::Retry, 0, 20), 30, Crossing::Report),
            Action::Sleep { until: 50, delay: 20, retry: true, park: false }
        );
        assert_eq!(d.next(v(VerdictKind::Retry, 0, 72), 30, Crossing::Report), contract(Recovery::Attempt));
        assert_eq!(d.next(v(VerdictKind::Done, 0, 0), 30, Crossing::ReportFallback), Action::Done);
    }

    #[test]
    fn a_hedge_verdict_starts_attempt_one_within_the_deadline() {
        let hedge = |timeout: u64| v(VerdictKind::Hedge, 1, timeout);
        let mut d = Driver::new(LIMITS, 1);
        assert_eq!(d.next(hedge(99), 2, Crossing::Start), Action::Hedge { begin: 2, timeout: Some(99) });
        assert_eq!(d.attempts(), 1);
        // The `envoy` preset's attempt 1 runs past the policy's attempt timeout, to the deadline.
        let mut d = Driver::new(LIMITS, 1);
        assert_eq!(d.next(hedge(60), 30, Crossing::Acquire), Action::Hedge { begin: 30, timeout: Some(60) });
        let none = PolicyLimits { max_attempts: 1, attempt_timeout: 0, deadline: 0, fallbacks: 0 };
        assert_eq!(Driver::new(none, 1).next(hedge(0), 1, Crossing::Start), Action::Hedge { begin: 1, timeout: None });
        let degraded = contract(Recovery::Degraded { number: 1, timeout: Some(50) });
        for verdict in [
            hedge(101),                                     // past the deadline
            hedge(0),                                       // no timeout under a deadline
            v(VerdictKind::Hedge, 2, 50),                   // not attempt 1
            Verdict(v(VerdictKind::Hedge, 1, 50).0 | 0x40), // reserved bits
        ] {
            assert_eq!(Driver::new(LIMITS, 1).next(verdict, 1, Crossing::Start), degraded, "{verdict:?}");
        }
        // A hedge verdict answers only `start` and `acquire`, and only before any attempt.
        assert_eq!(Driver::new(LIMITS, 1).next(hedge(50), 1, Crossing::Report), contract(Recovery::Attempt));
        let mut d = Driver::new(LIMITS, 1);
        assert!(matches!(d.next(Verdict::attempt(1, 50), 1, Crossing::Start), Action::Attempt { .. }));
        assert_eq!(d.next(hedge(50), 2, Crossing::Acquire), contract(Recovery::Degraded { number: 2, timeout: Some(50) }));
    }

    #[test]
    fn a_bulkhead_wait_parks_and_nothing_else_does() {
        let full = Reason::BulkheadFull as u8;
        let mut d = Driver::new(LIMITS, 1);
        assert_eq!(
            d.next(v(VerdictKind::Wait, full, 30), 10, Crossing::Start),
            Action::Sleep { until: 40, delay: 30, retry: false, park: true }
        );
        assert_eq!(
            d.next(v(VerdictKind::Wait, Reason::RateLimited as u8, 30), 10, Crossing::Acquire),
            Action::Sleep { until: 40, delay: 30, retry: false, park: false }
        );
        assert!(parks(v(VerdictKind::Wait, full, 30).with_events(true)));
        assert!(!parks(v(VerdictKind::Retry, full, 30)) && !parks(v(VerdictKind::Fail, full, 0)));
        // A queue wait past the deadline breaks the contract: no park, the recovery path.
        assert_eq!(
            d.next(v(VerdictKind::Wait, full, 200), 10, Crossing::Acquire),
            contract(Recovery::Degraded { number: 1, timeout: Some(50) })
        );
    }

    #[test]
    fn the_recovery_path_ends_by_the_crossing_that_failed() {
        let mut d = Driver::new(LIMITS, 1);
        let invalid = Verdict::invalid(levee_core::InvalidCode::UnknownCall);
        assert_eq!(
            d.next(invalid, 10, Crossing::Start),
            Action::Recover { fault: Fault::Invalid, then: Recovery::Degraded { number: 1, timeout: Some(50) } }
        );
        assert_eq!(
            d.trapped(Crossing::Acquire, 90),
            Action::Recover { fault: Fault::Trap, then: Recovery::Degraded { number: 1, timeout: Some(11) } }
        );
        assert_eq!(d.trapped(Crossing::Acquire, 101), Action::Recover { fault: Fault::Trap, then: Recovery::DeadlinePassed });
        assert_eq!(d.trapped(Crossing::Report, 90), Action::Recover { fault: Fault::Trap, then: Recovery::Attempt });
        assert_eq!(d.trapped(Crossing::ReportFallback, 90), Action::Recover { fault: Fault::Trap, then: Recovery::Fallback });
        let mut none = Driver::new(PolicyLimits { max_attempts: 1, attempt_timeout: 0, deadline: 0, fallbacks: 0 }, 1);
        assert_eq!(
            none.trapped(Crossing::Start, 5),
            Action::Recover { fault: Fault::Trap, then: Recovery::Degraded { number: 1, timeout: None } }
        );
    }
}

//! The driver: the step protocol as a small sans-I/O state machine, from the core's verdicts
//! to the host's actions (run an attempt under a timeout, sleep, run a fallback, finish,
//! recover). It reads no clock, sleeps nowhere and holds no value of the call: the caller
//! ([`crate::Call`]) passes the `now` of each step and does the I/O the action names. It
//! decides nothing the core decides; it only holds the core to its contract (no attempt past
//! the policy's maximum, no timeout or sleep past the deadline) and names the way out when
//! the engine trapped or lost the call.

use levee_core::{InvalidCode, PolicyInfo, Reason, Verdict, VerdictKind};

use crate::raw::is_trapped;

/// What a running call needs of its policy (copied at `start`: no allocation, no shared count).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct PolicyLimits {
    pub(crate) max_attempts: u32,
    pub(crate) attempt_timeout: u64,
    pub(crate) deadline: u64,
}

impl PolicyLimits {
    pub(crate) fn of(p: &PolicyInfo) -> Self {
        PolicyLimits { max_attempts: p.max_attempts, attempt_timeout: p.attempt_timeout, deadline: p.deadline }
    }
}

/// What the host does next.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Action {
    /// Run attempt `number`, begun at `begin`, under `timeout` ns (`None`: none); report it.
    Attempt { number: u32, begin: u64, timeout: Option<u64> },
    /// Sleep until `until` holding nothing, then `acquire`. After a `retry` the value the last
    /// attempt returned is dropped (the retry replaces it).
    Sleep { until: u64, retry: bool },
    /// Run the fallback at `index` of the policy's chain (why: `reason`); report whether it
    /// succeeded.
    Fallback { index: u32, reason: Reason },
    /// The call is over with the value a fallback gave.
    Done,
    /// The policy stopped the call: `reason`, and a retry-after hint (ns, 0 for none).
    Fail { reason: Reason, hint: u64 },
    /// The guest broke its contract: cancel the call in the engine and fail with `reason`.
    Abort { reason: Reason },
    /// The engine could not decide (it trapped, or lost the call): run one attempt, number
    /// `number`, under `timeout`, without retries, and end with its result.
    Degraded { number: u32, timeout: Option<u64> },
    /// The engine lost the call after an attempt ran: end with what the attempt gave.
    Lost,
    /// A protocol error between host and core.
    Invalid(InvalidCode),
}

/// The crossing that trapped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Crossing {
    Start,
    Report,
    Acquire,
    ReportFallback,
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

    /// Attempts run so far (or begun: counted when the action is given).
    #[inline]
    pub(crate) fn attempts(&self) -> u32 {
        self.attempts
    }

    /// The action for the verdict `v` of a step taken at `now`; `has_last` says whether an
    /// attempt left a value or an error to end with.
    #[inline(always)]
    pub(crate) fn next(&mut self, mut v: Verdict, now: u64, has_last: bool) -> Action {
        if is_trapped(v) {
            // Only the plain methods answer TRAPPED; the try_ ones the handle uses do not.
            v = Verdict::invalid(InvalidCode::UnknownCall);
        }
        match v.kind().unwrap_or(VerdictKind::Invalid) {
            VerdictKind::Attempt => {
                if self.attempts >= self.limits.max_attempts {
                    // The guest asked for more attempts than the policy allows: stop.
                    return Action::Abort { reason: Reason::RetriesExhausted };
                }
                self.attempts += 1;
                Action::Attempt { number: self.attempts, begin: now, timeout: clamp_timeout(v.payload(), self.deadline, now) }
            }
            kind @ (VerdictKind::Wait | VerdictKind::Retry) => match clamp_delay(v.payload(), self.deadline, now) {
                // A delay that would end past the deadline: the guest was wrong; stop.
                None => Action::Abort { reason: Reason::Deadline },
                Some(delay) => Action::Sleep { until: now.saturating_add(delay), retry: kind == VerdictKind::Retry },
            },
            VerdictKind::Fallback => Action::Fallback { index: v.payload() as u32, reason: v.reason() },
            VerdictKind::Done => Action::Done,
            VerdictKind::Fail => Action::Fail { reason: v.reason(), hint: v.payload() },
            VerdictKind::Invalid => {
                let code = InvalidCode::from_index(u32::from(v.detail())).unwrap_or(InvalidCode::UnknownCall);
                if code != InvalidCode::UnknownCall {
                    return Action::Invalid(code);
                }
                // Another task's trap recovery dropped this call from the engine: it proceeds
                // as a single attempt (or ends with what it has).
                if self.attempts == 0 || !has_last {
                    self.degraded(now)
                } else {
                    Action::Lost
                }
            }
        }
    }

    /// The action after `crossing` trapped at `now` (the engine has recovered and forgotten
    /// the call).
    pub(crate) fn trapped(&mut self, crossing: Crossing, now: u64) -> Action {
        match crossing {
            Crossing::Start | Crossing::Acquire => self.degraded(now),
            Crossing::Report | Crossing::ReportFallback => Action::Lost,
        }
    }

    /// One attempt under the policy's own timeout and deadline.
    fn degraded(&mut self, now: u64) -> Action {
        Action::Degraded {
            number: self.attempts.saturating_add(1),
            timeout: clamp_timeout(self.limits.attempt_timeout, self.deadline, now),
        }
    }
}

/// The attempt timeout to enforce: the core's, never past the deadline.
#[inline]
fn clamp_timeout(payload: u64, deadline: Option<u64>, now: u64) -> Option<u64> {
    let remaining = deadline.map(|d| d.saturating_sub(now).max(1));
    match (payload, remaining) {
        (0, r) => r,
        (t, Some(r)) => Some(t.min(r)),
        (t, None) => Some(t),
    }
}

/// The delay to sleep: the core's, `None` when it would end at or past the deadline.
fn clamp_delay(payload: u64, deadline: Option<u64>, now: u64) -> Option<u64> {
    match deadline {
        Some(d) if now.saturating_add(payload) >= d => None,
        _ => Some(payload),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: PolicyLimits = PolicyLimits { max_attempts: 2, attempt_timeout: 50, deadline: 100 };

    fn attempt(timeout: u64) -> Verdict {
        Verdict::attempt(1, timeout)
    }

    fn retry(delay: u64) -> Verdict {
        Verdict::new(VerdictKind::Retry, Reason::None as u8, delay)
    }

    #[test]
    fn delays_and_timeouts_never_pass_the_deadline() {
        assert_eq!(clamp_delay(10, Some(100), 50), Some(10));
        assert_eq!(clamp_delay(50, Some(100), 50), None);
        assert_eq!(clamp_delay(u64::MAX, None, 50), Some(u64::MAX));
        assert_eq!(clamp_timeout(0, None, 5), None);
        assert_eq!(clamp_timeout(0, Some(100), 40), Some(60));
        assert_eq!(clamp_timeout(500, Some(100), 40), Some(60));
        assert_eq!(clamp_timeout(30, Some(100), 40), Some(30));
        assert_eq!(clamp_timeout(30, Some(100), 200), Some(1));
    }

    #[test]
    fn attempts_never_pass_the_policy_maximum() {
        let mut d = Driver::new(LIMITS, 1);
        assert_eq!(d.next(attempt(50), 1, false), Action::Attempt { number: 1, begin: 1, timeout: Some(50) });
        assert_eq!(d.next(attempt(50), 70, true), Action::Attempt { number: 2, begin: 70, timeout: Some(31) });
        assert_eq!(d.next(attempt(50), 80, true), Action::Abort { reason: Reason::RetriesExhausted });
        assert_eq!(d.attempts(), 2);
    }

    #[test]
    fn a_retry_sleeps_from_the_step_and_a_late_one_stops() {
        let mut d = Driver::new(LIMITS, 1);
        assert_eq!(d.next(retry(20), 30, true), Action::Sleep { until: 50, retry: true });
        assert_eq!(d.next(retry(80), 30, true), Action::Abort { reason: Reason::Deadline });
    }

    #[test]
    fn a_lost_call_runs_one_attempt_or_ends_with_what_it_has() {
        let mut d = Driver::new(LIMITS, 1);
        let unknown = Verdict::invalid(InvalidCode::UnknownCall);
        assert_eq!(d.next(unknown, 10, false), Action::Degraded { number: 1, timeout: Some(50) });
        let _ = d.next(attempt(50), 10, false);
        assert_eq!(d.next(unknown, 20, true), Action::Lost);
        assert_eq!(d.trapped(Crossing::Acquire, 90), Action::Degraded { number: 2, timeout: Some(11) });
        assert_eq!(d.trapped(Crossing::Report, 90), Action::Lost);
        assert_eq!(d.next(Verdict::invalid(InvalidCode::WrongStep), 20, true), Action::Invalid(InvalidCode::WrongStep));
    }
}

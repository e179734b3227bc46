//! Deadlines: one total deadline spans every attempt of a call (Envoy's route timeout,
//! gRPC's call deadline), and a per-attempt timeout sits innermost. Neither has a default.
//!
//! * The deadline starts when the call starts: `at = start + deadline` (saturating).
//! * No attempt starts at or after it; no retry is scheduled whose start would fall at or
//!   after it (the retry ladder, `crate::retry::decide`).
//! * An attempt's timeout is the smaller of `attempt-timeout` and the time left before the
//!   deadline; 0 means none.

use crate::doc::Fields;
use crate::error::LoadError;
use crate::read::opt_duration;

/// Parse `attempt-timeout` and `deadline` (both optional, above 0 when given).
pub(crate) fn parse(f: &mut Fields<'_>, errors: &mut Vec<LoadError>) -> (Option<u64>, Option<u64>) {
    let attempt_timeout = opt_duration(f, "attempt-timeout", errors, true);
    let deadline = opt_duration(f, "deadline", errors, true);
    (attempt_timeout, deadline)
}

/// The absolute deadline of a call started at `now`.
#[inline]
pub fn starting_at(deadline: Option<u64>, now: u64) -> Option<u64> {
    deadline.map(|d| now.saturating_add(d))
}

/// Whether the deadline has passed at `now` (no attempt may start).
#[inline]
pub fn passed(at: Option<u64>, now: u64) -> bool {
    at.is_some_and(|dl| now >= dl)
}

/// The timeout of an attempt starting at `now`: the smaller of the per-attempt timeout and
/// the time left before the deadline, 0 when neither applies.
#[inline]
pub fn attempt_timeout(per_attempt: Option<u64>, at: Option<u64>, now: u64) -> u64 {
    let remaining = at.map(|dl| dl.saturating_sub(now));
    match (per_attempt, remaining) {
        (Some(t), Some(r)) => t.min(r),
        (Some(t), None) => t,
        (None, Some(r)) => r,
        (None, None) => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timeouts_and_the_deadline() {
        assert_eq!(starting_at(Some(10), u64::MAX - 1), Some(u64::MAX));
        assert_eq!(starting_at(None, 5), None);
        assert!(passed(Some(10), 10) && !passed(Some(10), 9) && !passed(None, u64::MAX));
        assert_eq!(attempt_timeout(Some(5), Some(100), 97), 3);
        assert_eq!(attempt_timeout(Some(5), Some(100), 10), 5);
        assert_eq!(attempt_timeout(Some(5), None, 10), 5);
        assert_eq!(attempt_timeout(None, Some(100), 40), 60);
        assert_eq!(attempt_timeout(None, None, 40), 0);
        assert_eq!(attempt_timeout(None, Some(100), 200), 0);
    }
}

//! Retry: how many attempts, how long between them ([`backoff`]), what the server may ask
//! for ([`retry_after`]), and the decision ladder that turns a failed attempt into a retry
//! or a reason to stop ([`decide`]).

pub mod backoff;
pub mod retry_after;

use crate::doc::{obj, Fields, Value};
use crate::error::LoadError;
use crate::read::{choose, describe, int, opt_duration};
use crate::time::{format_duration, SECOND};
use crate::types::Reason;

/// Attempts, counting the first call, when a policy says nothing (resilience4j's `maxAttempts`).
pub const DEFAULT_ATTEMPTS: u32 = 3;
/// Step Functions' and Celery's default of 3 retries, as attempts.
pub const DEFAULT_RETRIES_PRESET_ATTEMPTS: u32 = 4;
/// Sidekiq's default of 25 retries, as attempts.
pub const DEFAULT_SIDEKIQ_ATTEMPTS: u32 = 26;
/// Longest server-directed delay accepted by default (Envoy's `max_interval`).
pub const DEFAULT_RETRY_AFTER_CAP: u64 = 300 * SECOND;
/// The fields of `retry-after`.
pub const RETRY_AFTER_FIELDS: &[&str] = &["honor", "cap", "over-cap"];

/// How a policy's `attempts` is counted: the anchors disagree, and a policy moved from one of
/// them keeps its meaning under the preset of the same name.
///
/// | preset | `attempts: n` means | `attempts: 0` |
/// |---|---|---|
/// | `levee` (default), `durable-task` | n attempts, counting the first call | an error |
/// | `temporal` | n attempts, counting the first call (`maximumAttempts`) | unlimited |
/// | `step-functions` (`MaxAttempts`), `celery` (`max_retries`), `sidekiq` (`retry`) | n retries after the first call | no retry |
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttemptsPreset {
    /// Count the first call; 0 is an error.
    Levee,
    /// Temporal's `maximumAttempts`: counts the first call; 0 is unlimited.
    Temporal,
    /// Azure Durable Task's `maxNumberOfAttempts`: counts the first call.
    DurableTask,
    /// Step Functions' `MaxAttempts`: counts retries; 0 never retries.
    StepFunctions,
    /// Celery's `max_retries`: counts retries.
    Celery,
    /// Sidekiq's `retry`: counts retries.
    Sidekiq,
}

impl AttemptsPreset {
    /// Every preset with its document name.
    pub const ALL: [(&'static str, AttemptsPreset); 6] = [
        ("levee", AttemptsPreset::Levee),
        ("temporal", AttemptsPreset::Temporal),
        ("durable-task", AttemptsPreset::DurableTask),
        ("step-functions", AttemptsPreset::StepFunctions),
        ("celery", AttemptsPreset::Celery),
        ("sidekiq", AttemptsPreset::Sidekiq),
    ];

    /// Name in documents.
    pub fn name(self) -> &'static str {
        Self::ALL.iter().find(|(_, p)| *p == self).map(|(n, _)| *n).unwrap_or("levee")
    }

    /// Whether `attempts` counts retries (not the first call).
    pub fn counts_retries(self) -> bool {
        matches!(self, AttemptsPreset::StepFunctions | AttemptsPreset::Celery | AttemptsPreset::Sidekiq)
    }

    /// The document's number for a normalised total of attempts (the inverse of parsing).
    pub fn written(self, total: u32) -> u32 {
        match self {
            AttemptsPreset::Temporal if total == u32::MAX => 0,
            p if p.counts_retries() => total.saturating_sub(1),
            _ => total,
        }
    }

    /// Attempts, counting the first call, when the policy gives no `attempts`: the anchors'
    /// own defaults (Step Functions 3 retries, Celery 3, Sidekiq 25).
    pub fn default_attempts(self) -> u32 {
        match self {
            AttemptsPreset::Sidekiq => DEFAULT_SIDEKIQ_ATTEMPTS,
            p if p.counts_retries() => DEFAULT_RETRIES_PRESET_ATTEMPTS,
            _ => DEFAULT_ATTEMPTS,
        }
    }
}

/// Parse `attempts-preset` and `attempts`: the preset, and attempts counting the first call.
pub(crate) fn parse_attempts(f: &mut Fields<'_>, errors: &mut Vec<LoadError>) -> (AttemptsPreset, u32) {
    let preset = match f.take("attempts-preset") {
        None => AttemptsPreset::Levee,
        Some(v) => choose(&f.path_of("attempts-preset"), v, &AttemptsPreset::ALL, errors).unwrap_or(AttemptsPreset::Levee),
    };
    let attempts = match f.take("attempts") {
        None => preset.default_attempts(),
        Some(v) => match int(v) {
            Some(0) if preset == AttemptsPreset::Temporal => u32::MAX,
            Some(n) if preset.counts_retries() && (0..i64::from(u32::MAX)).contains(&n) => n as u32 + 1,
            Some(0) => {
                errors.push(LoadError::new(&f.path_of("attempts"), "must be at least 1 (attempts count the first call; 1 means no retry)"));
                1
            }
            Some(n) if !preset.counts_retries() && (1..=i64::from(u32::MAX)).contains(&n) => n as u32,
            _ => {
                let lo = u32::from(!preset.counts_retries() && preset != AttemptsPreset::Temporal);
                let hi = if preset.counts_retries() { u32::MAX - 1 } else { u32::MAX };
                errors.push(LoadError::new(
                    &f.path_of("attempts"),
                    format!("must be a whole number from {lo} to {hi}, found {}", describe(v)),
                ));
                1
            }
        },
    };
    (preset, attempts)
}

/// What happens when a server asks for a wait above `retry-after.cap`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OverCap {
    /// Give up (reason `retry-after-too-long`).
    Fail,
    /// Wait `cap` instead.
    Clamp,
}

impl OverCap {
    /// Every choice with its document name.
    pub const ALL: [(&'static str, OverCap); 2] = [("fail", OverCap::Fail), ("clamp", OverCap::Clamp)];

    /// Name in documents.
    pub fn name(self) -> &'static str {
        match self {
            OverCap::Fail => "fail",
            OverCap::Clamp => "clamp",
        }
    }
}

/// Retry-After and gRPC pushback handling.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RetryAfterCfg {
    /// Honour server-directed delays (default true).
    pub honor: bool,
    /// Longest server-directed delay accepted (default [`DEFAULT_RETRY_AFTER_CAP`]).
    pub cap: u64,
    /// What to do above the cap (default `fail`).
    pub over_cap: OverCap,
}

impl Default for RetryAfterCfg {
    fn default() -> Self {
        RetryAfterCfg { honor: true, cap: DEFAULT_RETRY_AFTER_CAP, over_cap: OverCap::Fail }
    }
}

impl RetryAfterCfg {
    /// Parse `retry-after` (absent: every default).
    pub(crate) fn parse(f: &mut Fields<'_>, errors: &mut Vec<LoadError>) -> RetryAfterCfg {
        let mut out = RetryAfterCfg::default();
        let Some(v) = f.take("retry-after") else {
            return out;
        };
        let path = f.path_of("retry-after");
        let Some(mut r) = Fields::new(&path, v, errors) else {
            return out;
        };
        if let Some(h) = r.take("honor") {
            match h {
                Value::Bool(b) => out.honor = *b,
                other => errors.push(LoadError::new(&r.path_of("honor"), format!("must be true or false, found {}", describe(other)))),
            }
        }
        if let Some(cap) = opt_duration(&mut r, "cap", errors, false) {
            out.cap = cap;
        }
        if let Some(o) = r.take("over-cap") {
            if let Some(x) = choose(&r.path_of("over-cap"), o, &OverCap::ALL, errors) {
                out.over_cap = x;
            }
        }
        r.finish(RETRY_AFTER_FIELDS, errors);
        out
    }

    /// As the policy's JSON shows it.
    pub(crate) fn to_json(&self) -> Value {
        obj([("honor", self.honor.into()), ("cap", format_duration(self.cap).into()), ("over-cap", self.over_cap.name().into())])
    }
}

/// What the decision ladder knows of a failed attempt.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Failure {
    /// The server said not to retry (a negative or unparseable gRPC pushback).
    pub stop: bool,
    /// The outcome is retryable under the policy's rules (and not marked overloaded).
    pub retryable: bool,
    /// The operation may be repeated (idempotent, or it carries an idempotency key).
    pub idempotent: bool,
    /// Attempts started so far, the failed one included.
    pub attempts: u32,
    /// The delay the server asked for (Retry-After, pushback), if it asked.
    pub server: Option<u64>,
    /// When the failure was reported.
    pub now: u64,
    /// The call's absolute deadline, if it has one.
    pub deadline: Option<u64>,
    /// The breaker the next attempt needs rejects every attempt before this time, if it is
    /// open now (`u64::MAX`: forced open, until an operator says otherwise).
    pub open_until: Option<u64>,
}

/// Where a call's backoff stands between its retries.
///
/// A server-directed delay (a Retry-After or a gRPC pushback that the ladder used) restarts
/// the backoff: the next retry that the backoff times is its first again, as gRPC A6 says of
/// pushback ("for subsequent retries, the delay period will be reset to the `initialBackoff`
/// setting"; grpc-go's `numRetriesSincePushback`), and the decorrelated recurrence starts
/// again from `base`. The server's wait did the backing off; the backoff's exponent does not
/// grow on top of it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BackoffState {
    /// The previous backoff delay of this call (decorrelated), 0 before the first and after
    /// a server-directed delay.
    pub prev: u64,
    /// Attempts started when the last server-directed delay was used (0: none yet).
    pub from: u32,
}

impl BackoffState {
    /// The backoff's delay after `attempts` attempts (the n-th retry counted since the last
    /// server-directed delay), drawing jitter from `rng`.
    #[inline]
    pub fn delay(&self, b: &backoff::Backoff, attempts: u32, rng: &mut crate::rng::Rng) -> u64 {
        b.delay(attempts.saturating_sub(self.from), self.prev, rng)
    }

    /// Record the retry the ladder scheduled after `f`: a server-directed delay restarts the
    /// backoff, a backoff delay is the next one's `prev`.
    #[inline]
    pub fn retried(&mut self, f: &Failure, delay: u64) {
        if f.server.is_some() {
            *self = BackoffState { prev: 0, from: f.attempts };
        } else {
            self.prev = delay;
        }
    }
}

/// The ladder's answer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decision {
    /// Retry after this delay (jitter, Retry-After and its cap applied; it fits the deadline).
    Retry(u64),
    /// Stop for this reason; `hint` is the server's delay for `retry-after-too-long`, else 0.
    Stop {
        /// Why.
        reason: Reason,
        /// Retry-after hint.
        hint: u64,
    },
    /// The retry budget refused the retry; its level afterwards (see the `budget-refused` event).
    Refused(i64),
}

/// The retry decision ladder, one rung after another; the first that stops decides:
///
/// 1. pushback said stop: `pushback`;
/// 2. not retryable: `non-retryable`;
/// 3. not idempotent: `non-idempotent`;
/// 4. no attempt left: `retries-exhausted`;
/// 5. the delay: the server's when it asked (above `retry-after.cap` either `retry-after-too-long`
///    or the cap, as `over-cap` says), else the backoff's (`backoff` is drawn only here, so
///    the jitter stream moves only when a backoff delay is used);
/// 6. the retry would start at or after the deadline: `deadline`;
/// 7. the breaker the next attempt needs is open and still will be when the retry starts (its
///    open duration ends after the delay, or an operator forced it open): `breaker-open`, with
///    the time it stays open as the hint (0 when forced), decided now rather than after a sleep
///    that can only end in that rejection;
/// 8. the budget refuses (`budget` is asked only here, last, so that it pays only for retries
///    that would otherwise happen): `budget`.
#[inline]
pub fn decide(
    max_attempts: u32,
    retry_after: &RetryAfterCfg,
    f: Failure,
    backoff: impl FnOnce() -> u64,
    budget: impl FnOnce() -> Result<(), i64>,
) -> Decision {
    let stop = |reason| Decision::Stop { reason, hint: 0 };
    if f.stop {
        return stop(Reason::Pushback);
    }
    if !f.retryable {
        return stop(Reason::NonRetryable);
    }
    if !f.idempotent {
        return stop(Reason::NonIdempotent);
    }
    if f.attempts >= max_attempts {
        return stop(Reason::RetriesExhausted);
    }
    let delay = match f.server {
        Some(d) if d > retry_after.cap => match retry_after.over_cap {
            OverCap::Fail => return Decision::Stop { reason: Reason::RetryAfterTooLong, hint: d },
            OverCap::Clamp => retry_after.cap,
        },
        Some(d) => d,
        None => backoff(),
    };
    if let Some(dl) = f.deadline {
        if f.now.saturating_add(delay) >= dl {
            return stop(Reason::Deadline);
        }
    }
    if let Some(until) = f.open_until {
        if f.now.saturating_add(delay) < until {
            let hint = if until == u64::MAX { 0 } else { until - f.now };
            return Decision::Stop { reason: Reason::BreakerOpen, hint };
        }
    }
    match budget() {
        Ok(()) => Decision::Retry(delay),
        Err(level) => Decision::Refused(level),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BASE: Failure =
        Failure { stop: false, retryable: true, idempotent: true, attempts: 1, server: None, now: 1_000, deadline: None, open_until: None };

    #[test]
    fn the_ladder_table() {
        let dflt = RetryAfterCfg::default();
        let clamp = RetryAfterCfg { over_cap: OverCap::Clamp, ..RetryAfterCfg::default() };
        let cap = DEFAULT_RETRY_AFTER_CAP;
        let stop = |reason| Decision::Stop { reason, hint: 0 };
        // (failure, retry-after, budget allows, expected, backoff drawn, budget asked)
        #[rustfmt::skip]
        let table: Vec<(Failure, &RetryAfterCfg, bool, Decision, bool, bool)> = vec![
            (BASE, &dflt, true, Decision::Retry(50), true, true),
            // Every rung wins over the ones below it.
            (Failure { stop: true, retryable: false, idempotent: false, attempts: 3, ..BASE }, &dflt, false, stop(Reason::Pushback), false, false),
            (Failure { retryable: false, idempotent: false, attempts: 3, ..BASE }, &dflt, false, stop(Reason::NonRetryable), false, false),
            (Failure { idempotent: false, attempts: 3, ..BASE }, &dflt, false, stop(Reason::NonIdempotent), false, false),
            (Failure { attempts: 3, deadline: Some(0), ..BASE }, &dflt, false, stop(Reason::RetriesExhausted), false, false),
            (Failure { attempts: 7, ..BASE }, &dflt, true, stop(Reason::RetriesExhausted), false, false),
            // The server's delay replaces the backoff; above the cap it fails or is clamped.
            (Failure { server: Some(7), ..BASE }, &dflt, true, Decision::Retry(7), false, true),
            (Failure { server: Some(cap), ..BASE }, &dflt, true, Decision::Retry(cap), false, true),
            (Failure { server: Some(cap + 1), deadline: Some(0), ..BASE }, &dflt, false, Decision::Stop { reason: Reason::RetryAfterTooLong, hint: cap + 1 }, false, false),
            (Failure { server: Some(cap + 1), ..BASE }, &clamp, true, Decision::Retry(cap), false, true),
            // A retry that would start at or after the deadline is not scheduled.
            (Failure { deadline: Some(1_050), ..BASE }, &dflt, true, stop(Reason::Deadline), true, false),
            (Failure { deadline: Some(1_051), ..BASE }, &dflt, true, Decision::Retry(50), true, true),
            (Failure { server: Some(cap + 1), deadline: Some(1_000 + cap), ..BASE }, &clamp, true, stop(Reason::Deadline), false, false),
            (Failure { now: u64::MAX, deadline: Some(u64::MAX), ..BASE }, &dflt, true, stop(Reason::Deadline), true, false),
            // A breaker open past the retry's start ends the call now; one that is half-open
            // by then does not (its trials decide); the deadline is checked first.
            (Failure { open_until: Some(1_051), ..BASE }, &dflt, true, Decision::Stop { reason: Reason::BreakerOpen, hint: 51 }, true, false),
            (Failure { open_until: Some(1_050), ..BASE }, &dflt, true, Decision::Retry(50), true, true),
            (Failure { open_until: Some(u64::MAX), ..BASE }, &dflt, true, Decision::Stop { reason: Reason::BreakerOpen, hint: 0 }, true, false),
            (Failure { open_until: Some(u64::MAX), deadline: Some(1_050), ..BASE }, &dflt, true, stop(Reason::Deadline), true, false),
            (Failure { server: Some(7), open_until: Some(1_008), ..BASE }, &dflt, true, Decision::Stop { reason: Reason::BreakerOpen, hint: 8 }, false, false),
            // The budget is asked last.
            (BASE, &dflt, false, Decision::Refused(-1), true, true),
        ];
        for (i, (f, ra, allows, want, drawn, asked)) in table.into_iter().enumerate() {
            let (mut d, mut a) = (false, false);
            let got = decide(
                3,
                ra,
                f,
                || {
                    d = true;
                    50
                },
                || {
                    a = true;
                    if allows {
                        Ok(())
                    } else {
                        Err(-1)
                    }
                },
            );
            assert_eq!((got, d, a), (want, drawn, asked), "row {i}");
        }
    }
}

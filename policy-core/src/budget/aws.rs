//! AWS SDKs' adaptive retry mode: a client-side rate limiter whose rate follows CUBIC
//! (botocore `retries/adaptive.py`, `cubic.py`, `bucket.py`), as a budget kind:
//!
//! ```yaml
//! budget: { kind: aws-adaptive, max-wait: 10s }
//! ```
//!
//! * **Measured rate.** Every reported outcome counts one response; responses are counted in
//!   half-second buckets, and when a response falls in a later bucket than the last,
//!   `measured = 0.8 * count / (buckets elapsed) + 0.2 * measured` (botocore's `RateClocker`).
//! * **CUBIC.** `C = 0.4`, `beta = 0.7`, `K = cbrt(Wmax * (1 - beta) / C)` (seconds). After a
//!   response that is not a throttle, `rate = C * (t - t_fail - K)^3 + Wmax`; after a throttle,
//!   `Wmax = min(measured, bucket rate)` (the measured rate before the first throttle),
//!   `t_fail = t`, `rate = Wmax * beta`, and the limiter is enabled. The bucket's rate is then
//!   `min(rate, 2 * measured)`. `Wmax` starts at 0.5/s and `t_fail` at the first response.
//! * **Bucket.** Fill rate `max(rate, 0.5/s)`, capacity `max(rate, 1)`, starting empty.
//!   Until the first throttle every attempt passes; after it each attempt (the first of a call
//!   too) takes a token. With none left the token is reserved and the call told to *wait*
//!   (reason `rate-limited`) until it has refilled; a wait above `max-wait` or past the
//!   deadline is a rejection (`rate-limited`, with the wait as a hint). A retry is never
//!   refused by this budget: it is slowed down.
//!
//! Arithmetic: rates are kept in milli-requests per second and tokens in micro-tokens
//! (integers); each step converts them to IEEE-754 binary64, computes with `+ - * /` only
//! (the cube root by 64 Newton steps from a fixed start), and rounds down back to integers,
//! so every host gets the same rate.

use crate::classify::{self, Observed, Rules};
use crate::doc::{obj, Fields, Value};
use crate::error::LoadError;
use crate::read::{opt_duration, u64_at};
use crate::time::{format_duration, SECOND};

/// CUBIC's scale constant `C`.
pub const CUBIC_C: f64 = 0.4;
/// CUBIC's multiplicative decrease `beta`.
pub const CUBIC_BETA: f64 = 0.7;
/// Lowest fill rate, requests per second.
pub const MIN_FILL_RATE: f64 = 0.5;
/// Lowest bucket capacity, tokens.
pub const MIN_CAPACITY: f64 = 1.0;
/// A new rate is at most this multiple of the measured rate.
pub const MAX_RATE_ADJUST: f64 = 2.0;
/// The starting `Wmax`, requests per second.
pub const STARTING_MAX_RATE: f64 = 0.5;
/// Smoothing of the measured rate.
pub const MEASURE_SMOOTHING: f64 = 0.8;
/// Width of the measured rate's buckets.
pub const MEASURE_BUCKET: u64 = SECOND / 2;
/// Default longest wait for a token.
pub const DEFAULT_MAX_WAIT: u64 = 20 * SECOND;
/// Highest rate kept, requests per second (the cube grows without bound between throttles).
pub const MAX_RATE: f64 = 1.0e9;
/// Outcomes that are throttles by default: HTTP 429 and botocore's throttling error codes.
pub const DEFAULT_THROTTLE_ON: &[&str] = &[
    "http:429",
    "error:Throttling",
    "error:ThrottlingException",
    "error:ThrottledException",
    "error:RequestThrottledException",
    "error:TooManyRequestsException",
    "error:ProvisionedThroughputExceededException",
    "error:TransactionInProgressException",
    "error:RequestLimitExceeded",
    "error:BandwidthLimitExceeded",
    "error:LimitExceededException",
    "error:RequestThrottled",
    "error:SlowDown",
    "error:PriorRequestNotComplete",
    "error:EC2ThrottledException",
];
/// The fields of an `aws-adaptive` budget.
pub const FIELDS: &[&str] = &["kind", "max-wait", "throttle-on"];

/// Configuration.
#[derive(Clone, Debug, PartialEq)]
pub struct AwsCfg {
    /// Longest wait for a token.
    pub max_wait: u64,
    /// Outcomes that are throttles.
    pub throttle_on: Rules,
}

/// State.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct AwsState {
    /// A response has been seen (the clocks below have started).
    pub started: bool,
    /// A throttle has been seen: attempts take tokens.
    pub enabled: bool,
    /// `Wmax`, milli-requests per second.
    pub w_max: u64,
    /// Time of the last throttle (ns).
    pub last_fail: u64,
    /// Measured rate, milli-requests per second.
    pub measured: u64,
    /// Current half-second bucket of the measured rate.
    pub last_bucket: u64,
    /// Responses counted since `last_bucket` began.
    pub count: u64,
    /// The bucket's rate (before the 0.5/s floor), milli-requests per second.
    pub rate: u64,
    /// Tokens, micro-tokens (negative: reserved by waiting calls).
    pub tokens: i64,
    /// When the bucket was last refilled (ns).
    pub last_refill: u64,
}

fn to_milli(x: f64) -> u64 {
    if x.is_nan() || x <= 0.0 {
        0
    } else {
        (x.min(MAX_RATE) * 1000.0) as u64
    }
}

fn from_milli(x: u64) -> f64 {
    x as f64 / 1000.0
}

/// The cube root by Newton's method with `+ - * /` only: 64 steps from `max(x, 1)`.
pub fn cbrt(x: f64) -> f64 {
    if x.is_nan() || x <= 0.0 {
        return 0.0;
    }
    let mut y = if x > 1.0 { x } else { 1.0 };
    for _ in 0..64 {
        y = (2.0 * y + x / (y * y)) / 3.0;
    }
    y
}

/// Parse an `aws-adaptive` budget (after its `kind`).
pub(crate) fn parse(b: &mut Fields<'_>, errors: &mut Vec<LoadError>) -> AwsCfg {
    let max_wait = opt_duration(b, "max-wait", errors, false).unwrap_or(DEFAULT_MAX_WAIT);
    let throttle_on = classify::parse_rules(b, "throttle-on", DEFAULT_THROTTLE_ON, errors);
    AwsCfg { max_wait, throttle_on }
}

impl AwsCfg {
    /// As the policy's JSON shows it.
    pub(crate) fn to_json(&self) -> Value {
        obj([
            ("kind", "aws-adaptive".into()),
            ("max-wait", format_duration(self.max_wait).into()),
            ("throttle-on", self.throttle_on.texts().into()),
        ])
    }
}

impl AwsState {
    fn fill_rate(&self) -> f64 {
        from_milli(self.rate).max(MIN_FILL_RATE)
    }

    fn capacity_micro(&self) -> i64 {
        (from_milli(self.rate).max(MIN_CAPACITY) * 1.0e6) as i64
    }

    fn refill(&mut self, now: u64) {
        let now = now.max(self.last_refill);
        let dt = (now - self.last_refill) as f64 / 1.0e9;
        let add = (dt * self.fill_rate() * 1.0e6) as i64;
        self.tokens = self.tokens.saturating_add(add).min(self.capacity_micro());
        self.last_refill = now;
    }

    /// Take a token for an attempt at `now`; with none left, reserve one and say how long
    /// until it has refilled (the caller waits that long, then proceeds without asking again).
    pub fn try_acquire(&mut self, now: u64) -> Result<(), u64> {
        if !self.enabled {
            return Ok(());
        }
        self.refill(now);
        self.tokens = self.tokens.saturating_sub(1_000_000);
        if self.tokens >= 0 {
            return Ok(());
        }
        let wait = (-self.tokens) as f64 / 1.0e6 / self.fill_rate() * 1.0e9;
        Err((wait as u64).max(1))
    }

    /// Give back a token reserved by [`try_acquire`](Self::try_acquire) that will not be used
    /// (the wait did not fit).
    pub fn give_back(&mut self) {
        self.tokens = self.tokens.saturating_add(1_000_000).min(self.capacity_micro());
    }

    /// A response (any outcome) was reported at `now`.
    pub fn on_response(&mut self, cfg: &AwsCfg, observed: &Observed<'_>, now: u64) {
        let bucket = now / MEASURE_BUCKET;
        if !self.started {
            self.started = true;
            self.w_max = to_milli(STARTING_MAX_RATE);
            self.last_fail = now;
            self.last_bucket = bucket;
            self.last_refill = now;
        }
        let now = now.max(self.last_fail);
        // Measured rate.
        self.count = self.count.saturating_add(1);
        if bucket > self.last_bucket {
            let current = self.count as f64 / ((bucket - self.last_bucket) as f64 * (MEASURE_BUCKET as f64 / 1.0e9));
            self.measured = to_milli(current * MEASURE_SMOOTHING + from_milli(self.measured) * (1.0 - MEASURE_SMOOTHING));
            self.count = 0;
            self.last_bucket = bucket;
        }
        let measured = from_milli(self.measured);
        let new_rate = if cfg.throttle_on.matches(observed) {
            let rate = if self.enabled { measured.min(from_milli(self.rate)) } else { measured };
            self.w_max = to_milli(rate);
            self.last_fail = now;
            self.enabled = true;
            rate * CUBIC_BETA
        } else {
            let w_max = from_milli(self.w_max);
            let k = cbrt(w_max * (1.0 - CUBIC_BETA) / CUBIC_C);
            let t = (now - self.last_fail) as f64 / 1.0e9 - k;
            CUBIC_C * t * t * t + w_max
        };
        self.refill(now);
        self.rate = to_milli(new_rate.min(MAX_RATE_ADJUST * measured));
        self.tokens = self.tokens.min(self.capacity_micro());
    }

    /// As exported state.
    pub(crate) fn to_json(&self) -> Value {
        obj([(
            "aws",
            obj([
                ("started", self.started.into()),
                ("enabled", self.enabled.into()),
                ("w_max", self.w_max.into()),
                ("last_fail", self.last_fail.into()),
                ("measured", self.measured.into()),
                ("last_bucket", self.last_bucket.into()),
                ("count", self.count.into()),
                ("rate", self.rate.into()),
                ("tokens", self.tokens.into()),
                ("last_refill", self.last_refill.into()),
            ]),
        )])
    }

    /// Read exported state (the value of `"aws"`).
    pub(crate) fn from_json(v: &Value, path: &str) -> Result<AwsState, LoadError> {
        let flag = |f: &str| matches!(v.get(f), Some(Value::Bool(true)));
        let mut s = AwsState {
            started: flag("started"),
            enabled: flag("enabled"),
            w_max: u64_at(v, "w_max", path)?.min(to_milli(MAX_RATE)),
            last_fail: u64_at(v, "last_fail", path)?,
            measured: u64_at(v, "measured", path)?.min(to_milli(MAX_RATE)),
            last_bucket: u64_at(v, "last_bucket", path)?,
            count: u64_at(v, "count", path)?,
            rate: u64_at(v, "rate", path)?.min(to_milli(MAX_RATE)),
            tokens: v
                .get("tokens")
                .and_then(Value::as_i64)
                .ok_or_else(|| LoadError::new(&format!("{path}.tokens"), "must be an integer"))?,
            last_refill: u64_at(v, "last_refill", path)?,
        };
        s.tokens = s.tokens.clamp(-s.capacity_micro().saturating_mul(1000), s.capacity_micro());
        Ok(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::OutcomeKind;

    fn cfg() -> AwsCfg {
        AwsCfg { max_wait: DEFAULT_MAX_WAIT, throttle_on: Rules::parse_all(DEFAULT_THROTTLE_ON).unwrap_or_default() }
    }

    fn http(code: i32) -> Observed<'static> {
        Observed { kind: OutcomeKind::HttpStatus, code, class: "", has_pushback: false }
    }

    #[test]
    fn cube_root_is_exact_enough() {
        for (x, want) in [(0.375, 0.721_124_785_153_704), (27.0, 3.0), (1.0, 1.0), (1.0e9, 1000.0), (0.0, 0.0)] {
            assert!((cbrt(x) - want).abs() < 1e-9, "{x}: {}", cbrt(x));
        }
    }

    #[test]
    fn cubic_after_a_throttle() {
        let c = cfg();
        let mut s = AwsState::default();
        // 10 responses per half second for 2 s: measured -> 0.8 * 20 + 0.2 * prev.
        let mut t = 0;
        for _ in 0..40 {
            s.on_response(&c, &http(200), t);
            t += MEASURE_BUCKET / 10;
        }
        assert!(!s.enabled);
        assert!(s.try_acquire(t).is_ok(), "not enabled before a throttle");
        let measured = from_milli(s.measured);
        assert!((measured - 20.0).abs() < 0.1, "{measured}");
        s.on_response(&c, &http(429), t);
        assert!(s.enabled);
        // Wmax = measured (this response counted); rate = 0.7 * Wmax.
        assert_eq!(s.w_max, s.measured);
        assert_eq!(s.rate, to_milli(from_milli(s.w_max) * CUBIC_BETA));
        // K seconds after the throttle, CUBIC is back at Wmax (capped at 2x measured).
        let k = cbrt(from_milli(s.w_max) * 0.3 / 0.4);
        let at_k = t + (k * 1e9) as u64;
        // Responses keep coming at 20/s, so the measured rate (and its 2x cap) stays.
        let mut u = t + MEASURE_BUCKET / 10;
        while u < at_k {
            s.on_response(&c, &http(200), u);
            u += MEASURE_BUCKET / 10;
        }
        s.on_response(&c, &http(200), at_k);
        assert!((from_milli(s.rate) - from_milli(s.w_max)).abs() < 0.01, "{} vs {}", s.rate, s.w_max);
    }

    #[test]
    fn the_bucket_makes_callers_wait() {
        let c = cfg();
        let mut s = AwsState::default();
        s.on_response(&c, &http(429), 0);
        // Nothing measured yet: rate 0, fill 0.5/s, capacity 1, empty.
        assert_eq!(s.rate, 0);
        assert_eq!(s.try_acquire(0), Err(2 * SECOND));
        assert_eq!(s.try_acquire(0), Err(4 * SECOND), "the next waiter queues behind");
        s.give_back();
        assert_eq!(s.try_acquire(4 * SECOND), Ok(()));
    }
}

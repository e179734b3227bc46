//! Rate limiter (GCRA, the token bucket as a theoretical arrival time).
//!
//! GCRA with emission interval `T = per / rate` and burst `b`: a request at `t` is admitted
//! when `max(TAT, t) - T * (b - 1) <= t`, and then `TAT = max(TAT, t) + T`. The tokens it
//! implies, `(T * b - (max(TAT, t) - t)) / T`, stay in `[0, b]`. A `now` earlier than the
//! latest seen counts as no time passed (tikv/pd #10744).
//!
//! When no token is free, the limiter says how long until one is: the engine answers *wait*
//! if that fits the policy's `max-wait` and the deadline, reserving the token for this call
//! (so waiters are served in order and never starve), else *reject* with that time as a hint.

use crate::doc::{obj, Fields, Value};
use crate::error::LoadError;
use crate::read::{describe, int, opt_duration, u64_at, uint};
use crate::time::{format_duration, SECOND};

/// Default period of `rate` (`per`).
pub const DEFAULT_PER: u64 = SECOND;
/// Default longest wait for a token (`max-wait`): none, reject at once.
pub const DEFAULT_MAX_WAIT: u64 = 0;
/// Largest `rate` and `burst`.
pub const MAX_RATE: u32 = 1_000_000_000;
/// The fields of `rate-limit`.
pub const FIELDS: &[&str] = &["rate", "per", "burst", "max-wait"];

/// Parse `rate-limit`.
pub(crate) fn parse(path: &str, v: &Value, errors: &mut Vec<LoadError>) -> Option<RateCfg> {
    let mut r = Fields::new(path, v, errors)?;
    let rate = match r.take("rate") {
        None => {
            errors.push(LoadError::new(&r.path_of("rate"), "is required: requests allowed per `per` (default per: 1s)"));
            1
        }
        Some(x) => match int(x) {
            Some(n) if (1..=i64::from(MAX_RATE)).contains(&n) => n as u32,
            _ => {
                errors.push(LoadError::new(
                    &r.path_of("rate"),
                    format!("must be a whole number from 1 to 1000000000, found {}", describe(x)),
                ));
                1
            }
        },
    };
    let per = opt_duration(&mut r, "per", errors, false).unwrap_or(DEFAULT_PER);
    if per == 0 {
        errors.push(LoadError::new(&r.path_of("per"), "must be above 0"));
    }
    let burst = uint(&mut r, "burst", rate, 1, MAX_RATE, errors);
    let max_wait = opt_duration(&mut r, "max-wait", errors, false).unwrap_or(DEFAULT_MAX_WAIT);
    r.finish(FIELDS, errors);
    Some(RateCfg { rate, per, burst, max_wait })
}

/// Rate limit configuration.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RateCfg {
    /// Requests per `per` (default: required).
    pub rate: u32,
    /// The period (default 1s).
    pub per: u64,
    /// Largest burst (default: `rate`).
    pub burst: u32,
    /// Longest wait the limiter may ask for (default 0: reject at once).
    pub max_wait: u64,
}

impl RateCfg {
    /// Emission interval in ns (at least 1).
    pub fn interval(&self) -> u64 {
        (self.per / u64::from(self.rate.max(1))).max(1)
    }
    /// A fresh, full bucket.
    pub fn fresh(&self) -> Gcra {
        Gcra { tat: 0, last_now: 0 }
    }

    /// As the policy's JSON shows it.
    pub(crate) fn to_json(&self) -> Value {
        obj([
            ("rate", self.rate.into()),
            ("per", format_duration(self.per).into()),
            ("burst", self.burst.into()),
            ("max-wait", format_duration(self.max_wait).into()),
        ])
    }

    /// Import a limiter's exported state: its arrival time is clamped to one full burst
    /// ahead of the latest `now` it saw.
    pub(crate) fn import(&self, g: &Value, path: &str) -> Result<Gcra, LoadError> {
        let last_now = u64_at(g, "last_now", path)?;
        let ahead = self.interval().saturating_mul(u64::from(self.burst));
        let tat = u64_at(g, "tat", path)?.min(last_now.saturating_add(ahead));
        Ok(Gcra { tat, last_now })
    }
}

/// GCRA state.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Gcra {
    /// Theoretical arrival time.
    pub tat: u64,
    /// Latest `now` seen.
    pub last_now: u64,
}

impl Gcra {
    /// As exported state.
    pub(crate) fn to_json(&self) -> Value {
        obj([("tat", self.tat.into()), ("last_now", self.last_now.into())])
    }

    fn now(&mut self, now: u64) -> u64 {
        self.last_now = self.last_now.max(now);
        self.last_now
    }

    /// Take a token now, or say how long until one is free (taking nothing).
    pub fn try_take(&mut self, cfg: &RateCfg, now: u64) -> Result<(), u64> {
        let now = self.now(now);
        let t = cfg.interval();
        let tau = t.saturating_mul(u64::from(cfg.burst.max(1)) - 1);
        let tat = self.tat.max(now);
        let allow_at = tat.saturating_sub(tau);
        if allow_at <= now {
            self.tat = tat.saturating_add(t);
            Ok(())
        } else {
            Err(allow_at - now)
        }
    }

    /// Reserve the next token for a caller who will wait for it.
    pub fn reserve(&mut self, cfg: &RateCfg, now: u64) {
        let now = self.now(now);
        self.tat = self.tat.max(now).saturating_add(cfg.interval());
    }

    /// Tokens available at `now`, in `[0, burst]` (for invariants and metrics).
    pub fn tokens(&self, cfg: &RateCfg, now: u64) -> u64 {
        let now = now.max(self.last_now);
        let t = cfg.interval();
        let full = t.saturating_mul(u64::from(cfg.burst.max(1)));
        let debt = self.tat.max(now) - now;
        full.saturating_sub(debt) / t
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn burst_then_rate() {
        let cfg = RateCfg { rate: 10, per: 1_000, burst: 3, max_wait: 0 };
        let mut g = cfg.fresh();
        assert_eq!(g.tokens(&cfg, 0), 3);
        assert!(g.try_take(&cfg, 0).is_ok());
        assert!(g.try_take(&cfg, 0).is_ok());
        assert!(g.try_take(&cfg, 0).is_ok());
        assert_eq!(g.try_take(&cfg, 0), Err(100));
        assert_eq!(g.tokens(&cfg, 0), 0);
        assert!(g.try_take(&cfg, 100).is_ok());
        assert_eq!(g.try_take(&cfg, 50), Err(100), "an earlier now counts as no time passed");
        assert_eq!(g.tokens(&cfg, 10_000), 3);
    }
}

//! Backoff and jitter.
//!
//! For the n-th retry (n = 1 after the first failure):
//!
//! | kind | raw delay |
//! |---|---|
//! | `constant` | `base` |
//! | `linear` | `base * n` |
//! | `exponential` | `base * multiplier^(n-1)` |
//! | `decorrelated` | Brooker: `sleep = min(cap, U(base, 3 * sleep))`, starting at `sleep = base` |
//!
//! The raw delay is capped at `cap` **before** jitter (AWS, Brooker), so every delay lies in
//! `[0, cap]`. Jitter: `none` (the raw delay), `full` (`U(0, d)`), `equal` (`d/2 + U(0, d/2)`),
//! `proportional` (Polly's `d ± ratio * d`, ratio 0.25 by default, then capped);
//! `decorrelated` is the jitter of the `decorrelated` kind and only goes with it.
//!
//! Computation never overflows: `multiplier^(n-1)` is an exponentiation by squaring in IEEE
//! `f64` (each step one correctly rounded multiplication, so the same on every platform) that
//! stops as soon as it exceeds `cap / base`; any `n` up to `u32::MAX` is fine.

use crate::doc::{obj, Fields, Value};
use crate::error::LoadError;
use crate::read::{choose, describe, number, opt_duration};
use crate::rng::Rng;
use crate::time::{format_duration, MILLISECOND, SECOND};

/// Default backoff kind.
pub const DEFAULT_KIND: Kind = Kind::Exponential;
/// Default first delay (`base`).
pub const DEFAULT_BASE: u64 = 100 * MILLISECOND;
/// Default growth per retry of the exponential kind.
pub const DEFAULT_MULTIPLIER: f64 = 2.0;
/// Default largest delay before jitter (`cap`).
pub const DEFAULT_CAP: u64 = 20 * SECOND;
/// Default jitter.
pub const DEFAULT_JITTER: Jitter = Jitter::Full;
/// Default spread of proportional jitter (Polly's ±25%).
pub const DEFAULT_JITTER_RATIO: f64 = 0.25;
/// Largest multiplier accepted.
pub const MAX_MULTIPLIER: f64 = 1000.0;
/// The fields of `backoff`.
pub const FIELDS: &[&str] = &["kind", "base", "multiplier", "cap", "jitter", "jitter-ratio"];

/// Backoff kinds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// `base` every time.
    Constant,
    /// `base * n`.
    Linear,
    /// `base * multiplier^(n-1)`.
    Exponential,
    /// Brooker's decorrelated jitter.
    Decorrelated,
}

/// Jitter kinds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Jitter {
    /// No jitter.
    None,
    /// `U(0, d)`.
    Full,
    /// `d/2 + U(0, d/2)`.
    Equal,
    /// Brooker's recurrence (the `decorrelated` kind).
    Decorrelated,
    /// Polly's constant-backoff jitter: `U(d - r*d, d + r*d)`, capped.
    Proportional,
}

impl Kind {
    /// Name in documents.
    pub fn name(self) -> &'static str {
        match self {
            Kind::Constant => "constant",
            Kind::Linear => "linear",
            Kind::Exponential => "exponential",
            Kind::Decorrelated => "decorrelated",
        }
    }
    /// Every kind.
    pub const ALL: [Kind; 4] = [Kind::Constant, Kind::Linear, Kind::Exponential, Kind::Decorrelated];
}

impl Jitter {
    /// Name in documents.
    pub fn name(self) -> &'static str {
        match self {
            Jitter::None => "none",
            Jitter::Full => "full",
            Jitter::Equal => "equal",
            Jitter::Decorrelated => "decorrelated",
            Jitter::Proportional => "proportional",
        }
    }
    /// Every jitter.
    pub const ALL: [Jitter; 5] = [Jitter::None, Jitter::Full, Jitter::Equal, Jitter::Decorrelated, Jitter::Proportional];
}

/// A validated backoff.
#[derive(Clone, Debug, PartialEq)]
pub struct Backoff {
    /// Kind (default `exponential`).
    pub kind: Kind,
    /// First delay (default 100ms).
    pub base: u64,
    /// Growth of `exponential` (default 2.0; at least 1).
    pub multiplier: f64,
    /// Largest delay (default 20s).
    pub cap: u64,
    /// Jitter (default `full`; `decorrelated` for the `decorrelated` kind).
    pub jitter: Jitter,
    /// Spread of `proportional` jitter, in (0, 1] (default 0.25, Polly's).
    pub jitter_ratio: f64,
}

impl Default for Backoff {
    fn default() -> Self {
        Backoff {
            kind: DEFAULT_KIND,
            base: DEFAULT_BASE,
            multiplier: DEFAULT_MULTIPLIER,
            cap: DEFAULT_CAP,
            jitter: DEFAULT_JITTER,
            jitter_ratio: DEFAULT_JITTER_RATIO,
        }
    }
}

impl Backoff {
    /// The raw (un-jittered) delay of the n-th retry, capped. For `decorrelated`, the upper
    /// bound `min(cap, 3 * prev)` of the next draw.
    pub fn raw(&self, n: u32, prev: u64) -> u64 {
        let n = n.max(1);
        match self.kind {
            Kind::Constant => self.base.min(self.cap),
            Kind::Linear => self.base.saturating_mul(u64::from(n)).min(self.cap),
            Kind::Exponential => exponential(self.base, self.multiplier, n - 1, self.cap),
            Kind::Decorrelated => prev.max(self.base).saturating_mul(3).min(self.cap),
        }
    }

    /// The delay of the n-th retry; `prev` is the previous delay of this call (0 before the first).
    pub fn delay(&self, n: u32, prev: u64, rng: &mut Rng) -> u64 {
        let d = self.raw(n, prev);
        match self.jitter {
            Jitter::None => d,
            Jitter::Full => rng.between(0, d),
            Jitter::Equal => {
                let half = d / 2;
                half.saturating_add(rng.between(0, d - half))
            }
            Jitter::Decorrelated => rng.between(self.base.min(self.cap), d),
            Jitter::Proportional => {
                let spread = (d as f64 * self.jitter_ratio) as u64;
                rng.between(d.saturating_sub(spread), d.saturating_add(spread)).min(self.cap)
            }
        }
    }
}

/// `min(cap, base * m^e)` without overflow.
pub(crate) fn exponential(base: u64, m: f64, e: u32, cap: u64) -> u64 {
    if base == 0 {
        return 0;
    }
    if base >= cap {
        return cap;
    }
    let limit = cap as f64 / base as f64;
    let mut result = 1.0f64;
    let mut square = m;
    let mut e = e;
    while e > 0 {
        if e & 1 == 1 {
            result *= square;
            if result >= limit {
                return cap;
            }
        }
        e >>= 1;
        if e > 0 {
            square *= square;
            if !square.is_finite() || square >= limit {
                // Any further set bit multiplies by at least this much (m >= 1).
                return cap;
            }
        }
    }
    let v = base as f64 * result;
    if v >= cap as f64 {
        cap
    } else {
        v as u64
    }
}

/// Parse `backoff` (absent: every default).
pub(crate) fn parse(f: &mut Fields<'_>, errors: &mut Vec<LoadError>) -> Backoff {
    let mut out = Backoff::default();
    let Some(v) = f.take("backoff") else {
        return out;
    };
    let path = f.path_of("backoff");
    let Some(mut b) = Fields::new(&path, v, errors) else {
        return out;
    };
    if let Some(k) = b.take("kind") {
        if let Some(kind) = choose(&b.path_of("kind"), k, &Kind::ALL.map(|k| (k.name(), k)), errors) {
            out.kind = kind;
        }
    }
    if out.kind == Kind::Decorrelated {
        out.jitter = Jitter::Decorrelated;
    }
    if let Some(base) = opt_duration(&mut b, "base", errors, false) {
        out.base = base;
    }
    if let Some(m) = b.take("multiplier") {
        match number(m) {
            Some(x) if x.is_finite() && (1.0..=MAX_MULTIPLIER).contains(&x) => out.multiplier = x,
            _ => errors.push(LoadError::new(&b.path_of("multiplier"), format!("must be a number from 1 to 1000, found {}", describe(m)))),
        }
    }
    // Written (a cap that is not a duration is an error of its own, and written too).
    let before = errors.len();
    let cap_written = match opt_duration(&mut b, "cap", errors, false) {
        Some(cap) => {
            out.cap = cap;
            true
        }
        None => errors.len() > before,
    };
    if let Some(j) = b.take("jitter") {
        let jp = b.path_of("jitter");
        if let Some(jitter) = choose(&jp, j, &Jitter::ALL.map(|j| (j.name(), j)), errors) {
            if jitter == Jitter::Decorrelated && out.kind != Kind::Decorrelated {
                errors.push(LoadError::new(
                    &jp,
                    "decorrelated jitter is the `decorrelated` backoff kind's own and goes only with it (use kind: decorrelated)",
                ));
            } else if jitter != Jitter::Decorrelated && out.kind == Kind::Decorrelated {
                errors.push(LoadError::new(
                    &jp,
                    format!(
                        "the `decorrelated` kind has its own jitter (each delay is drawn from base to 3 times the previous one), so `{}` cannot apply; leave `jitter` out (or write jitter: decorrelated), or choose another kind for {} jitter",
                        jitter.name(),
                        jitter.name()
                    ),
                ));
            } else {
                out.jitter = jitter;
            }
        }
    }
    if let Some(r) = b.take("jitter-ratio") {
        match number(r) {
            Some(x) if x > 0.0 && x <= 1.0 => out.jitter_ratio = x,
            _ => errors
                .push(LoadError::new(&b.path_of("jitter-ratio"), format!("must be a number above 0 and at most 1, found {}", describe(r)))),
        }
    }
    if !cap_written && out.kind == Kind::Constant {
        // The default cap follows a constant base: it only bounds the jitter there.
        out.cap = out.cap.max(out.base);
    }
    if out.cap < out.base {
        let message = if cap_written {
            format!("({}) must not be below base ({})", format_duration(out.cap), format_duration(out.base))
        } else {
            format!(
                "is not written and its default ({}) is below base ({}): the {} kind grows from base up to cap, so write a cap of at least {}",
                format_duration(out.cap),
                format_duration(out.base),
                out.kind.name(),
                format_duration(out.base)
            )
        };
        errors.push(LoadError::new(&b.path_of("cap"), message));
    }
    b.finish(FIELDS, errors);
    out
}

impl Backoff {
    /// As the policy's JSON shows it (fields that do not apply are null).
    pub(crate) fn to_json(&self) -> Value {
        obj([
            ("kind", self.kind.name().into()),
            ("base", format_duration(self.base).into()),
            ("multiplier", if self.kind == Kind::Exponential { self.multiplier.into() } else { Value::Null }),
            ("cap", format_duration(self.cap).into()),
            ("jitter", self.jitter.name().into()),
            ("jitter-ratio", if self.jitter == Jitter::Proportional { self.jitter_ratio.into() } else { Value::Null }),
        ])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn expo(base: u64, m: f64, cap: u64) -> Backoff {
        Backoff { kind: Kind::Exponential, base, multiplier: m, cap, jitter: Jitter::None, jitter_ratio: 0.25 }
    }

    #[test]
    fn exponential_values_and_cap() {
        let b = expo(100 * MILLISECOND, 2.0, 10 * SECOND);
        let mut rng = Rng::new(1);
        let got: Vec<u64> = (1..=9).map(|n| b.delay(n, 0, &mut rng) / MILLISECOND).collect();
        assert_eq!(got, vec![100, 200, 400, 800, 1600, 3200, 6400, 10000, 10000]);
        for n in [22, 40, 63, 64, 65, 1000, u32::MAX] {
            assert_eq!(b.delay(n, 0, &mut rng), 10 * SECOND, "n={n}");
        }
        let slow = expo(MILLISECOND, 1.0001, 10 * SECOND);
        assert_eq!(slow.raw(u32::MAX, 0), 10 * SECOND);
        assert_eq!(expo(MILLISECOND, 1.0, SECOND).raw(u32::MAX, 0), MILLISECOND);
    }

    #[test]
    fn linear_constant_and_jitter_bounds() {
        let mut rng = Rng::new(9);
        let lin = Backoff { kind: Kind::Linear, base: SECOND, multiplier: 2.0, cap: 5 * SECOND, jitter: Jitter::None, jitter_ratio: 0.25 };
        assert_eq!(lin.delay(3, 0, &mut rng), 3 * SECOND);
        assert_eq!(lin.delay(u32::MAX, 0, &mut rng), 5 * SECOND);
        for jitter in [Jitter::Full, Jitter::Equal] {
            let b = Backoff { jitter, ..expo(100, 2.0, 1_000_000) };
            for n in 1..200 {
                let d = b.delay(n, 0, &mut rng);
                let raw = b.raw(n, 0);
                assert!(d <= raw);
                if jitter == Jitter::Equal {
                    assert!(d >= raw / 2);
                }
            }
        }
        let dec =
            Backoff { kind: Kind::Decorrelated, base: 10, multiplier: 2.0, cap: 1000, jitter: Jitter::Decorrelated, jitter_ratio: 0.25 };
        let polly =
            Backoff { kind: Kind::Constant, base: 1000, multiplier: 2.0, cap: 1200, jitter: Jitter::Proportional, jitter_ratio: 0.25 };
        for n in 1..500 {
            let d = polly.delay(n, 0, &mut rng);
            assert!((750..=1200).contains(&d), "{d}");
        }
        let mut prev = 0;
        for n in 1..500 {
            let d = dec.delay(n, prev, &mut rng);
            assert!((10..=1000).contains(&d) && d <= prev.max(10) * 3, "{d} after {prev}");
            prev = d;
        }
    }
}

//! Retry budgets.
//!
//! * **Token throttling** (gRPC A6): tokens start at `max-tokens` and stay in
//!   `[0, max-tokens]`; each failed attempt that is retryable (or that carried a stop pushback)
//!   costs 1, each success adds `token-ratio`; a retry is allowed only while
//!   `tokens > max-tokens / 2`. Kept in milli-tokens, exactly as grpc's
//!   `retry_throttle.cc`.
//! * **Ratio budget** (Finagle / tower `TpsBudget`): each call deposits 1; a retry withdraws
//!   `100 / percent`; deposits expire after `ttl` (kept in 10 slots of `ttl / 10`); a reserve
//!   of `min-per-second * ttl` retries is always there. Kept in milli-units.

pub mod aws;

use crate::classify::Observed;
use crate::doc::{obj, Fields, Value};
use crate::error::LoadError;
use crate::read::{choose, fraction, opt_duration, pairs, rows, uint};
use crate::time::{format_duration, SECOND};
pub use aws::{AwsCfg, AwsState};

/// Default `max-tokens` of token throttling.
pub const DEFAULT_MAX_TOKENS: f64 = 10.0;
/// Default `token-ratio` of token throttling.
pub const DEFAULT_TOKEN_RATIO: f64 = 0.1;
/// Default `percent` of the ratio budget (Finagle, tower).
pub const DEFAULT_PERCENT: f64 = 20.0;
/// Default `min-per-second` of the ratio budget.
pub const DEFAULT_MIN_PER_SECOND: u32 = 10;
/// Default `ttl` of the ratio budget's deposits.
pub const DEFAULT_TTL: u64 = 10 * SECOND;
/// Shortest and longest `ttl` (tower's bounds).
pub const TTL_RANGE: core::ops::RangeInclusive<u64> = SECOND..=60 * SECOND;

/// Budget configuration.
#[derive(Clone, Debug, PartialEq)]
pub enum BudgetCfg {
    /// gRPC A6 throttling.
    Token {
        /// Maximum tokens in milli-tokens (`max-tokens` * 1000; default 10 tokens).
        max_milli: i64,
        /// Tokens a success adds, in milli-tokens (`token-ratio` * 1000; default 0.1).
        ratio_milli: i64,
    },
    /// Finagle/tower ratio budget.
    Ratio {
        /// Retries allowed per 100 calls (default 20).
        percent: f64,
        /// Retries always allowed per second (default 10).
        min_per_second: u32,
        /// How long a deposit counts (default 10s).
        ttl: u64,
    },
    /// The AWS SDKs' adaptive mode: a CUBIC client rate limiter (see [`aws`]).
    AwsAdaptive(AwsCfg),
}

/// Parse `budget`.
pub(crate) fn parse(path: &str, v: &Value, errors: &mut Vec<LoadError>) -> Option<BudgetCfg> {
    let mut b = Fields::new(path, v, errors)?;
    let kind = match b.take("kind") {
        None => {
            errors.push(LoadError::new(
                &b.path_of("kind"),
                "is required: `token` (gRPC retry throttling), `ratio` (Finagle/tower retry budget) or `aws-adaptive` (the AWS SDKs' CUBIC client rate)",
            ));
            None
        }
        Some(k) => choose(&b.path_of("kind"), k, &[("token", 0u8), ("ratio", 1u8), ("aws-adaptive", 2u8)], errors),
    };
    match kind {
        Some(0) => {
            let max = fraction(&mut b, "max-tokens", DEFAULT_MAX_TOKENS, 0.001, 1000.0, errors);
            let ratio = fraction(&mut b, "token-ratio", DEFAULT_TOKEN_RATIO, 0.001, 1000.0, errors);
            b.finish(&["kind", "max-tokens", "token-ratio"], errors);
            Some(BudgetCfg::Token { max_milli: (max * 1000.0).round() as i64, ratio_milli: (ratio * 1000.0).round() as i64 })
        }
        Some(2) => {
            let cfg = aws::parse(&mut b, errors);
            b.finish(aws::FIELDS, errors);
            Some(BudgetCfg::AwsAdaptive(cfg))
        }
        Some(_) => {
            let percent = fraction(&mut b, "percent", DEFAULT_PERCENT, 0.001, 1000.0, errors);
            let min_per_second = uint(&mut b, "min-per-second", DEFAULT_MIN_PER_SECOND, 0, 1_000_000, errors);
            let ttl = opt_duration(&mut b, "ttl", errors, false).unwrap_or(DEFAULT_TTL);
            if !TTL_RANGE.contains(&ttl) {
                errors.push(LoadError::new(&b.path_of("ttl"), "must be from 1s to 60s (tower's bounds)"));
            }
            b.finish(&["kind", "percent", "min-per-second", "ttl"], errors);
            Some(BudgetCfg::Ratio { percent, min_per_second, ttl })
        }
        None => None,
    }
}

impl BudgetCfg {
    /// As the policy's JSON shows it.
    pub(crate) fn to_json(&self) -> Value {
        match self {
            BudgetCfg::Token { max_milli, ratio_milli } => obj([
                ("kind", "token".into()),
                ("max-tokens", (*max_milli as f64 / 1000.0).into()),
                ("token-ratio", (*ratio_milli as f64 / 1000.0).into()),
            ]),
            BudgetCfg::Ratio { percent, min_per_second, ttl } => obj([
                ("kind", "ratio".into()),
                ("percent", (*percent).into()),
                ("min-per-second", (*min_per_second).into()),
                ("ttl", format_duration(*ttl).into()),
            ]),
            BudgetCfg::AwsAdaptive(a) => a.to_json(),
        }
    }

    /// Import a budget's exported state (see [`BudgetState::to_json`]): kept when it is of
    /// this budget's kind (clamped to its bounds), else a fresh state.
    pub(crate) fn import(&self, b: &Value, path: &str) -> Result<BudgetState, LoadError> {
        let state = if let Some(t) = b.get("token") {
            BudgetState::Token { tokens: t.as_i64().ok_or_else(|| LoadError::new(path, "token must be an integer"))? }
        } else if let Some(r) = b.get("ratio") {
            BudgetState::Ratio {
                slots: pairs(Some(r), path, 2)?
                    .iter()
                    .map(|r| (r.first().copied().unwrap_or(0).max(0) as u64, r.get(1).copied().unwrap_or(0)))
                    .collect(),
            }
        } else if let Some(a) = b.get("aws") {
            BudgetState::Aws(Box::new(AwsState::from_json(a, &format!("{path}.aws"))?))
        } else {
            return Err(LoadError::new(path, "must be {\"token\": n}, {\"ratio\": [...]} or {\"aws\": {...}}"));
        };
        let same = matches!(
            (self, &state),
            (BudgetCfg::Token { .. }, BudgetState::Token { .. })
                | (BudgetCfg::Ratio { .. }, BudgetState::Ratio { .. })
                | (BudgetCfg::AwsAdaptive(_), BudgetState::Aws(_))
        );
        Ok(if same { self.clamp(state) } else { self.fresh() })
    }
}

/// Number of slots a ratio budget keeps over its TTL.
pub const RATIO_SLOTS: u64 = 10;

/// Live budget state.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BudgetState {
    /// Token throttling: current milli-tokens.
    Token {
        /// Milli-tokens.
        tokens: i64,
    },
    /// Ratio budget: `(slot number, balance in milli-units)` for the live slots.
    Ratio {
        /// Slots.
        slots: Vec<(u64, i64)>,
    },
    /// AWS adaptive mode (boxed: it would double the size of every key's budget).
    Aws(Box<AwsState>),
}

impl BudgetCfg {
    /// A fresh state.
    pub fn fresh(&self) -> BudgetState {
        match self {
            BudgetCfg::Token { max_milli, .. } => BudgetState::Token { tokens: *max_milli },
            BudgetCfg::Ratio { .. } => BudgetState::Ratio { slots: Vec::new() },
            BudgetCfg::AwsAdaptive(_) => BudgetState::Aws(Box::default()),
        }
    }

    fn withdraw_milli(percent: f64) -> i64 {
        (100_000.0 / percent).round() as i64
    }

    pub(crate) fn slot_len(ttl: u64) -> u64 {
        (ttl / RATIO_SLOTS).max(1)
    }

    /// Whether a state made under `other` can be kept under `self` (same kind).
    pub fn same_kind(&self, other: &BudgetCfg) -> bool {
        matches!(
            (self, other),
            (BudgetCfg::Token { .. }, BudgetCfg::Token { .. })
                | (BudgetCfg::Ratio { .. }, BudgetCfg::Ratio { .. })
                | (BudgetCfg::AwsAdaptive(_), BudgetCfg::AwsAdaptive(_))
        )
    }

    /// Bring an imported state within this configuration's bounds.
    pub fn clamp(&self, state: BudgetState) -> BudgetState {
        match (self, state) {
            (BudgetCfg::Token { max_milli, .. }, BudgetState::Token { tokens }) => {
                BudgetState::Token { tokens: tokens.clamp(0, *max_milli) }
            }
            (BudgetCfg::Ratio { .. }, s @ BudgetState::Ratio { .. }) => s,
            (BudgetCfg::AwsAdaptive(_), s @ BudgetState::Aws(_)) => s,
            (cfg, _) => cfg.fresh(),
        }
    }
}

impl BudgetState {
    /// A call begins (ratio budgets deposit).
    pub fn on_call(&mut self, cfg: &BudgetCfg, now: u64) {
        if let (BudgetCfg::Ratio { ttl, .. }, BudgetState::Ratio { slots }) = (cfg, self) {
            let slot = current_slot(slots, now, *ttl);
            expire(slots, slot);
            match slots.iter_mut().find(|(s, _)| *s == slot) {
                Some((_, balance)) => *balance = balance.saturating_add(1000),
                None => slots.push((slot, 1000)),
            }
        }
    }

    /// Any outcome was reported (the AWS client rate measures and adjusts).
    #[inline]
    pub fn on_outcome(&mut self, cfg: &BudgetCfg, observed: &Observed<'_>, now: u64) {
        if let (BudgetCfg::AwsAdaptive(c), BudgetState::Aws(s)) = (cfg, self) {
            s.on_response(c, observed, now);
        }
    }

    /// Take the AWS client rate's token for an attempt, or say how long to wait for it.
    #[inline]
    pub fn try_acquire(&mut self, cfg: &BudgetCfg, now: u64) -> Result<(), u64> {
        match (cfg, self) {
            (BudgetCfg::AwsAdaptive(_), BudgetState::Aws(s)) => s.try_acquire(now),
            _ => Ok(()),
        }
    }

    /// Give back a token [`try_acquire`](Self::try_acquire) reserved for a wait that did not fit.
    pub fn give_back(&mut self) {
        if let BudgetState::Aws(s) = self {
            s.give_back();
        }
    }

    /// A success was reported (token throttling refills).
    pub fn on_success(&mut self, cfg: &BudgetCfg) {
        if let (BudgetCfg::Token { max_milli, ratio_milli }, BudgetState::Token { tokens }) = (cfg, self) {
            *tokens = tokens.saturating_add(*ratio_milli).min(*max_milli);
        }
    }

    /// A retryable failure (or a stop pushback) was reported (token throttling drains).
    pub fn on_failure(&mut self, cfg: &BudgetCfg) {
        if let (BudgetCfg::Token { .. }, BudgetState::Token { tokens }) = (cfg, self) {
            *tokens = tokens.saturating_sub(1000).max(0);
        }
    }

    /// Ask for a retry; withdraws from a ratio budget when allowed. Returns whether the retry
    /// is allowed and the budget's level afterwards (milli-tokens, or retries now allowed).
    pub fn try_retry(&mut self, cfg: &BudgetCfg, now: u64) -> (bool, i64) {
        match (cfg, self) {
            (BudgetCfg::Token { max_milli, .. }, BudgetState::Token { tokens }) => (tokens.saturating_mul(2) > *max_milli, *tokens),
            (BudgetCfg::Ratio { percent, min_per_second, ttl }, BudgetState::Ratio { slots }) => {
                let slot = current_slot(slots, now, *ttl);
                expire(slots, slot);
                let withdraw = BudgetCfg::withdraw_milli(*percent);
                let ttl_secs = *ttl as f64 / 1e9;
                let reserve = (f64::from(*min_per_second) * ttl_secs * withdraw as f64) as i64;
                let balance: i64 = slots.iter().fold(reserve, |acc, (_, b)| acc.saturating_add(*b));
                if balance >= withdraw {
                    match slots.iter_mut().find(|(s, _)| *s == slot) {
                        Some((_, b)) => *b = b.saturating_sub(withdraw),
                        None => slots.push((slot, -withdraw)),
                    }
                    (true, (balance - withdraw) / withdraw.max(1))
                } else {
                    (false, balance / withdraw.max(1))
                }
            }
            (_, _) => (true, 0),
        }
    }

    /// Whether a fresh state would decide no stricter at `now` (see `engine::holds_protection`):
    /// token throttling at its maximum, a ratio budget whose live slots withdrew no more than
    /// they deposited (withdrawals expire with their slots), the AWS client rate never throttled.
    pub fn at_rest(&self, cfg: &BudgetCfg, now: u64) -> bool {
        match (cfg, self) {
            (BudgetCfg::Token { max_milli, .. }, BudgetState::Token { tokens }) => *tokens >= *max_milli,
            (BudgetCfg::Ratio { ttl, .. }, BudgetState::Ratio { slots }) => {
                let current = current_slot(slots, now, *ttl);
                let live = slots.iter().filter(|(s, _)| s.saturating_add(RATIO_SLOTS) > current && *s <= current);
                live.fold(0i64, |acc, (_, b)| acc.saturating_add(*b)) >= 0
            }
            (BudgetCfg::AwsAdaptive(_), BudgetState::Aws(s)) => !s.enabled,
            _ => true,
        }
    }

    /// As exported state: `{"token": n}` or `{"ratio": [[slot, balance], ...]}`.
    pub(crate) fn to_json(&self) -> Value {
        match self {
            BudgetState::Token { tokens } => obj([("token", (*tokens).into())]),
            BudgetState::Ratio { slots } => obj([("ratio", rows(slots.iter().map(|(s, v)| [Value::from(*s), Value::from(*v)])))]),
            BudgetState::Aws(a) => a.to_json(),
        }
    }

    /// Token level in milli-tokens (token throttling), for invariants and metrics.
    pub fn tokens(&self) -> Option<i64> {
        match self {
            BudgetState::Token { tokens } => Some(*tokens),
            BudgetState::Ratio { .. } | BudgetState::Aws(_) => None,
        }
    }
}

/// The slot `now` falls in, never one before the latest slot with deposits: a `now` earlier
/// than one already seen counts as no time passed (it must not expire newer deposits).
pub(crate) fn current_slot(slots: &[(u64, i64)], now: u64, ttl: u64) -> u64 {
    let latest = slots.iter().map(|(s, _)| *s).max().unwrap_or(0);
    (now / BudgetCfg::slot_len(ttl)).max(latest)
}

pub(crate) fn expire(slots: &mut Vec<(u64, i64)>, current: u64) {
    slots.retain(|(s, _)| s.saturating_add(RATIO_SLOTS) > current && *s <= current);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// grpc `retry_throttle_test.cc`: max 4000 milli, ratio 1600 milli.
    #[test]
    fn grpc_a6_sequence_exactly() {
        let cfg = BudgetCfg::Token { max_milli: 4000, ratio_milli: 1600 };
        let mut s = cfg.fresh();
        // (outcome, tokens after, retry allowed after a failure)
        let steps: [(bool, i64, bool); 16] = [
            (false, 3000, true),
            (true, 4000, true),
            (false, 3000, true),
            (false, 2000, false),
            (false, 1000, false),
            (false, 0, false),
            (false, 0, false),
            (true, 1600, false),
            (true, 3200, false),
            (false, 2200, true),
            (false, 1200, false),
            (true, 2800, false),
            (false, 1800, false),
            (true, 3400, false),
            (false, 2400, true),
            (true, 4000, true),
        ];
        for (i, (success, tokens, allowed)) in steps.iter().enumerate() {
            if *success {
                s.on_success(&cfg);
            } else {
                s.on_failure(&cfg);
                assert_eq!(s.try_retry(&cfg, 0).0, *allowed, "step {i}");
            }
            assert_eq!(s.tokens(), Some(*tokens), "step {i}");
        }
    }

    #[test]
    fn ratio_budget_reserve_deposits_and_expiry() {
        let cfg = BudgetCfg::Ratio { percent: 20.0, min_per_second: 0, ttl: 10_000 };
        let mut s = cfg.fresh();
        assert!(!s.try_retry(&cfg, 0).0, "no deposits, no reserve");
        for _ in 0..10 {
            s.on_call(&cfg, 0);
        }
        assert!(s.try_retry(&cfg, 0).0);
        assert!(s.try_retry(&cfg, 0).0);
        assert!(!s.try_retry(&cfg, 0).0, "20% of 10 calls is 2 retries");
        let mut t = cfg.fresh();
        for _ in 0..10 {
            t.on_call(&cfg, 0);
        }
        assert!(!t.try_retry(&cfg, 10_000).0, "deposits expire after the ttl");
        let mut b = cfg.fresh();
        for _ in 0..10 {
            b.on_call(&cfg, 5_000);
        }
        b.on_call(&cfg, 1_000);
        assert!(b.try_retry(&cfg, 0).0, "an earlier now keeps the newer deposits");
        assert_eq!(b, BudgetState::Ratio { slots: vec![(5, 11_000 - 5_000)] }, "and counts in the latest slot");
        let reserve = BudgetCfg::Ratio { percent: 20.0, min_per_second: 10, ttl: 10_000_000_000 };
        let mut r = reserve.fresh();
        let allowed = (0..200).filter(|_| r.try_retry(&reserve, 0).0).count();
        assert_eq!(allowed, 100, "10/s for 10s");
    }
}

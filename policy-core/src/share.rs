//! One key's state as compact bytes, for hosts that share state between engines.
//!
//! A proxy-wasm filter runs one engine per Envoy worker and keeps each key's state in the
//! proxy's shared data under compare-and-swap: before an operation on a key it imports the
//! bytes it read, after it exports them and writes them back with the version it read. The
//! whole-engine [`Engine::export_state`] is JSON for a restart; this is the per-key, per-request
//! form: a few dozen bytes, no allocation beyond the output, decoded without trusting it.
//!
//! Unlike the whole-engine state it carries the key's in-flight count, so that a bulkhead
//! counts the attempts of every engine that shares the key. Format version 1, integers as
//! LEB128 (signed ones zigzagged):
//!
//! ```text
//! 1, present (bit 0 breaker, 1 limiter, 2 budget), in_flight,
//! breaker: state, open_until, trips, epoch, issued, trial x3, last_now,
//!          permits (n, then call and issued-at), window (0 count: pos, n, ring bytes |
//!          1 time: n, then bucket, calls, failures, slow)
//! limiter: tat, last_now
//! budget:  0 token: tokens | 1 ratio: n, then slot and balance |
//!          2 aws: started, enabled, w_max, last_fail, measured, last_bucket, count, rate,
//!          last_refill, tokens (signed)
//! ```

use crate::breaker::{Breaker, HalfOpen, Trials, WindowState};
use crate::budget::BudgetState;
use crate::engine::{Engine, KeyState};
use crate::error::LoadError;
use crate::leb128::{put, put_i, Reader};
use crate::rate::Gcra;
use crate::types::BreakerState;

const VERSION: u8 = 1;
/// Most entries of any list in imported bytes (time buckets, budget slots).
const MAX_ENTRIES: u64 = 4096;

/// What the key-state bytes are called in errors.
const FORMAT: &str = "Levee key state";

fn bad(what: &str) -> LoadError {
    LoadError::new("", format!("not {FORMAT}: {what}"))
}

impl Engine {
    /// The state of one key of a policy as compact bytes (a fresh key's state when the
    /// key has none); `None` for an unknown policy.
    pub fn export_key(&self, policy: u32, key: &str) -> Option<Vec<u8>> {
        let p = self.policy(policy)?;
        let fresh;
        let s = match self.keys.get(policy as usize).and_then(|k| k.find(key).and_then(|i| k.get(i))).map(|(_, s)| s) {
            Some(s) => s,
            None => {
                fresh = KeyState::fresh(p, 0);
                &fresh
            }
        };
        let mut out = Vec::with_capacity(64);
        out.push(VERSION);
        let present = u8::from(s.breaker.is_some()) | u8::from(s.limiter.is_some()) << 1 | u8::from(s.budget.is_some()) << 2;
        out.push(present);
        put(&mut out, u64::from(s.in_flight));
        if let Some(b) = &s.breaker {
            put(&mut out, b.state as u64);
            let h = b.trials.get();
            for v in [b.open_until, u64::from(b.trips), b.epoch, u64::from(h.issued)] {
                put(&mut out, v);
            }
            for v in [h.trial.0, h.trial.1, h.trial.2] {
                put(&mut out, u64::from(v));
            }
            put(&mut out, b.last_now);
            put(&mut out, h.permits.len() as u64);
            for (call, at) in &h.permits {
                put(&mut out, *call);
                put(&mut out, *at);
            }
            match &b.window {
                WindowState::Count { ring, pos, .. } => {
                    out.push(0);
                    put(&mut out, u64::from(*pos));
                    put(&mut out, ring.len() as u64);
                    out.extend_from_slice(ring);
                }
                WindowState::Time { buckets } => {
                    out.push(1);
                    put(&mut out, buckets.len() as u64);
                    for (i, c, f, sl) in buckets {
                        for v in [*i, u64::from(*c), u64::from(*f), u64::from(*sl)] {
                            put(&mut out, v);
                        }
                    }
                }
            }
        }
        if let Some(g) = &s.limiter {
            put(&mut out, g.tat);
            put(&mut out, g.last_now);
        }
        match &s.budget {
            Some(BudgetState::Token { tokens }) => {
                out.push(0);
                put_i(&mut out, *tokens);
            }
            Some(BudgetState::Aws(a)) => {
                out.push(2);
                for v in [
                    u64::from(a.started),
                    u64::from(a.enabled),
                    a.w_max,
                    a.last_fail,
                    a.measured,
                    a.last_bucket,
                    a.count,
                    a.rate,
                    a.last_refill,
                ] {
                    put(&mut out, v);
                }
                put_i(&mut out, a.tokens);
            }
            Some(BudgetState::Ratio { slots }) => {
                out.push(1);
                put(&mut out, slots.len() as u64);
                for (slot, balance) in slots {
                    put(&mut out, *slot);
                    put_i(&mut out, *balance);
                }
            }
            None => {}
        }
        Some(out)
    }

    /// Replace the state of one key of a policy with bytes from [`Engine::export_key`]
    /// (possibly another engine's, under the same document); empty bytes mean a fresh key.
    /// What does not fit the policy is adopted as the whole-engine import does (a window of
    /// another shape starts empty, permits and levels are clamped). Garbage is an error and
    /// changes nothing. Live calls are untouched.
    pub fn import_key(&mut self, policy: u32, key: &str, bytes: &[u8]) -> Result<(), LoadError> {
        let pi = policy as usize;
        let p = self.policies.get(pi).ok_or_else(|| LoadError::new("", format!("no policy with index {policy}")))?;
        let tick = self.tick;
        let mut s = KeyState::fresh(p, tick);
        if !bytes.is_empty() {
            let mut r = Reader::new(bytes, FORMAT);
            let version = r.u64()?;
            if version != u64::from(VERSION) {
                return Err(bad("unknown version"));
            }
            let present = r.u64()?;
            s.in_flight = r.u32()?;
            if present & 1 != 0 {
                let state = BreakerState::from_index(r.u32()?).ok_or_else(|| bad("breaker state"))?;
                let (open_until, trips, epoch, issued) = (r.u64()?, r.u32()?, r.u64()?, r.u32()?);
                let trial = (r.u32()?, r.u32()?, r.u32()?);
                let last_now = r.u64()?;
                let n = r.len(MAX_ENTRIES, "list too long")?;
                let mut permits = Vec::with_capacity(n);
                for _ in 0..n {
                    permits.push((r.u64()?, r.u64()?));
                }
                let window = match r.u64()? {
                    0 => {
                        let pos = r.u32()?;
                        let n = r.len(MAX_ENTRIES * 16, "list too long")?;
                        let ring = r.take(n)?.to_vec();
                        if ring.iter().any(|b| *b > 3) {
                            return Err(bad("window entries are 0 to 3"));
                        }
                        let failures = ring.iter().filter(|b| *b & 1 != 0).count() as u32;
                        let slow = ring.iter().filter(|b| *b & 2 != 0).count() as u32;
                        let size = match p.breaker.as_ref().map(|c| &c.window) {
                            Some(crate::breaker::Window::Count(n)) => (*n).max(1),
                            _ => 1,
                        };
                        WindowState::Count { pos: pos % size, ring, failures, slow }
                    }
                    1 => {
                        let n = r.len(MAX_ENTRIES, "list too long")?;
                        let mut buckets = Vec::with_capacity(n);
                        for _ in 0..n {
                            buckets.push((r.u64()?, r.u32()?, r.u32()?, r.u32()?));
                        }
                        WindowState::Time { buckets }
                    }
                    _ => return Err(bad("window kind")),
                };
                let trials = Trials::new(HalfOpen { permits, issued, trial });
                let b = Breaker { state, open_until, trips, window, epoch, trials, last_now };
                if let Some(cfg) = &p.breaker {
                    s.breaker = Some(cfg.adopt(b, true));
                }
            }
            if present & 2 != 0 {
                let (tat, last_now) = (r.u64()?, r.u64()?);
                if let Some(cfg) = &p.rate_limit {
                    let ahead = cfg.interval().saturating_mul(u64::from(cfg.burst));
                    s.limiter = Some(Gcra { tat: tat.min(last_now.saturating_add(ahead)), last_now });
                }
            }
            if present & 4 != 0 {
                let state = match r.u64()? {
                    0 => BudgetState::Token { tokens: r.i64()? },
                    1 => {
                        let n = r.len(MAX_ENTRIES, "list too long")?;
                        let mut slots = Vec::with_capacity(n);
                        for _ in 0..n {
                            slots.push((r.u64()?, r.i64()?));
                        }
                        BudgetState::Ratio { slots }
                    }
                    2 => {
                        let mut w = [0u64; 9];
                        for x in w.iter_mut() {
                            *x = r.u64()?;
                        }
                        let [started, enabled, w_max, last_fail, measured, last_bucket, count, rate, last_refill] = w;
                        BudgetState::Aws(Box::new(crate::budget::AwsState {
                            started: started != 0,
                            enabled: enabled != 0,
                            w_max,
                            last_fail,
                            measured,
                            last_bucket,
                            count,
                            rate,
                            tokens: r.i64()?,
                            last_refill,
                        }))
                    }
                    _ => return Err(bad("budget kind")),
                };
                if let Some(cfg) = &p.budget {
                    let same = matches!(
                        (cfg, &state),
                        (crate::budget::BudgetCfg::Token { .. }, BudgetState::Token { .. })
                            | (crate::budget::BudgetCfg::Ratio { .. }, BudgetState::Ratio { .. })
                            | (crate::budget::BudgetCfg::AwsAdaptive(_), BudgetState::Aws(_))
                    );
                    s.budget = Some(if same { cfg.clamp(state) } else { cfg.fresh() });
                }
            }
            if !r.bytes.is_empty() {
                return Err(bad("trailing bytes"));
            }
        }
        // Made like any key (evicting the least recently used one at `keys.max`), touched.
        self.with_key_state(pi, key, |slot| {
            s.last_used = slot.last_used;
            *slot = s;
        })
        .ok_or_else(|| LoadError::new("", format!("no policy with index {policy}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::{OutcomeKind, VerdictKind};

    const DOC: &str = r#"{"policies": {"p": {"attempts": 3,
        "breaker": {"window": {"kind": "count", "size": 4}, "minimum-calls": 2, "failure-rate": 50, "open-duration": "1s"},
        "rate-limit": {"rate": 2, "per": "1s", "burst": 2},
        "bulkhead": {"max-concurrent": 1},
        "budget": {"kind": "token", "max-tokens": 10, "token-ratio": 0.1}}}}"#;

    #[test]
    fn two_engines_sharing_one_key_admit_what_one_would() {
        let mut a = Engine::load(DOC, 1).expect("doc");
        let mut b = Engine::load(DOC, 2).expect("doc");
        let mut shared = Vec::new();
        let mut admitted = 0;
        for i in 0..6u64 {
            let e = if i % 2 == 0 { &mut a } else { &mut b };
            e.import_key(0, "k", &shared).expect("import");
            let v = e.start(i + 1, 0, "k", 0, 10, 0, 0, 0);
            if v.kind() == Some(VerdictKind::Attempt) {
                admitted += 1;
                let r = e.report(i + 1, 11, 1, OutcomeKind::Success, 0, "", 0, 0);
                assert_eq!(r.kind(), Some(VerdictKind::Done));
            }
            shared = e.export_key(0, "k").expect("export");
        }
        // The burst of 2 holds across both engines.
        assert_eq!(admitted, 2);
    }

    #[test]
    fn bulkhead_and_breaker_travel_and_round_trip() {
        let mut a = Engine::load(DOC, 1).expect("doc");
        let mut b = Engine::load(DOC, 2).expect("doc");
        assert_eq!(a.start(1, 0, "k", 0, 0, 0, 0, 0).kind(), Some(VerdictKind::Attempt));
        let bytes = a.export_key(0, "k").expect("export");
        b.import_key(0, "k", &bytes).expect("import");
        assert_eq!(b.in_flight(0, "k"), 1);
        assert_eq!(b.export_key(0, "k"), Some(bytes.clone()));
        assert_eq!(b.start(2, 0, "k", 0, 0, 0, 0, 0).kind(), Some(VerdictKind::Fail), "the bulkhead is full across engines");
        // Garbage changes nothing.
        for cut in 0..bytes.len() {
            let _ = b.import_key(0, "k", bytes.get(..cut).unwrap_or_default());
        }
        assert!(b.import_key(0, "k", &[1, 7, 0, 99]).is_err());
        assert!(b.import_key(0, "k", &[2]).is_err());
        b.import_key(0, "k", &[]).expect("fresh");
        assert_eq!(b.in_flight(0, "k"), 0);
    }
}

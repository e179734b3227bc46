//! Worst cases of a policy, for `levee check`.

use crate::budget::BudgetCfg;
use crate::policy::Policy;

/// Worst cases of a policy (see the WIT `analysis` record).
#[derive(Clone, Debug, PartialEq)]
pub struct Analysis {
    /// Attempts in the worst case (the deadline can make it fewer than `attempts`).
    pub worst_attempts: u32,
    /// Worst-case latency in ns; `None` when nothing bounds it.
    pub worst_latency: Option<u64>,
    /// `worst_attempts ^ layers`: load on the deepest dependency when every attempt fails.
    pub amplification: f64,
    /// The same with the retry budget holding (long-run bound).
    pub amplification_with_budget: f64,
}

/// Analyse a policy for `layers` layers of callers each running it.
///
/// Worst case: every attempt runs to its timeout (or to the deadline) and fails retryably,
/// and every delay is the capped, un-jittered backoff (jitter only shortens it). A retry is
/// counted only if it starts before the deadline, as the engine guarantees.
///
/// With a budget, the long-run bound per layer under a total outage is: token throttling,
/// 1 (retries stop once tokens fall to half, and only successes refill them); ratio budget,
/// `1 + percent / 100` (the `min-per-second` reserve adds a fixed rate on top, not a factor).
pub fn analyze(p: &Policy, layers: u32) -> Analysis {
    let mut attempts = 0u32;
    let mut elapsed = 0u64;
    let mut prev = 0u64;
    let bounded = p.attempt_timeout.is_some() || p.deadline.is_some();
    loop {
        attempts = attempts.saturating_add(1);
        let run = match (p.attempt_timeout, p.deadline) {
            (Some(t), Some(d)) => t.min(d.saturating_sub(elapsed)),
            (Some(t), None) => t,
            (None, Some(d)) => d.saturating_sub(elapsed),
            (None, None) => 0,
        };
        elapsed = elapsed.saturating_add(run);
        if attempts >= p.attempts {
            break;
        }
        let delay = p.backoff.raw(attempts, prev);
        prev = delay;
        if let Some(d) = p.deadline {
            if elapsed.saturating_add(delay) >= d {
                break;
            }
        }
        elapsed = elapsed.saturating_add(delay);
    }
    let per_layer = f64::from(attempts);
    let amplification = per_layer.powi(layers.min(i32::MAX as u32) as i32);
    let with_budget = match &p.budget {
        None => amplification,
        Some(BudgetCfg::Token { .. }) => 1.0,
        Some(BudgetCfg::Ratio { percent, .. }) => (1.0 + percent / 100.0).min(per_layer).powi(layers.min(i32::MAX as u32) as i32),
    };
    Analysis {
        worst_attempts: attempts,
        worst_latency: bounded.then_some(match p.deadline {
            Some(d) => elapsed.min(d),
            None => elapsed,
        }),
        amplification,
        amplification_with_budget: with_budget,
    }
}

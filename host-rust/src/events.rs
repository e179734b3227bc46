//! The engine's events as `tracing` events (target `levee`) and as metrics through the
//! `metrics` facade: counters, and a gauge of each breaker's state.
//!
//! | metric | kind | labels |
//! |---|---|---|
//! | `levee_retries_total` | counter | `policy` |
//! | `levee_gave_up_total` | counter | `policy`, `reason` |
//! | `levee_rejections_total` | counter | `policy`, `reason` |
//! | `levee_budget_refused_total` | counter | `policy` |
//! | `levee_breaker_transitions_total` | counter | `policy`, `key`, `from`, `to` |
//! | `levee_breaker_state` | gauge | `policy`, `key`: 0 closed, 1 open, 2 half-open, 3 forced-open, 4 forced-closed, 5 disabled |
//! | `levee_fallbacks_total` | counter | `policy`, `fallback`, `reason` |
//! | `levee_rate_limit_waits_total` | counter | `policy` |
//! | `levee_key_evictions_total`, `levee_call_evictions_total`, `levee_permits_expired_total` | counter | `policy` |
//! | `levee_engine_traps_total` | counter | `operation` |

use levee_core::{Event, EventKind};

use crate::raw::Trap;

/// Emit one engine event; `policy` is the policy's name.
pub(crate) fn emit(e: &Event, policy: &str) {
    let p = policy.to_string();
    match e.kind {
        EventKind::RetryScheduled => {
            tracing::debug!(target: "levee", policy, key = %e.key, call = e.call, attempt = e.attempt, delay_ns = e.duration, "retry scheduled");
            metrics::counter!("levee_retries_total", "policy" => p).increment(1);
        }
        EventKind::GaveUp => {
            tracing::info!(target: "levee", policy, key = %e.key, call = e.call, attempt = e.attempt, reason = e.reason.name(), "gave up");
            metrics::counter!("levee_gave_up_total", "policy" => p, "reason" => e.reason.name()).increment(1);
        }
        EventKind::Rejected => {
            tracing::info!(target: "levee", policy, key = %e.key, call = e.call, reason = e.reason.name(), hint_ns = e.duration, "rejected");
            metrics::counter!("levee_rejections_total", "policy" => p, "reason" => e.reason.name()).increment(1);
        }
        EventKind::BudgetRefused => {
            tracing::info!(target: "levee", policy, key = %e.key, call = e.call, level = e.value, "retry budget refused a retry");
            metrics::counter!("levee_budget_refused_total", "policy" => p).increment(1);
        }
        EventKind::BreakerTransition => {
            tracing::warn!(target: "levee", policy, key = %e.key, from = e.state_from.name(), to = e.state_to.name(), "circuit breaker transition");
            metrics::counter!("levee_breaker_transitions_total", "policy" => p.clone(), "key" => e.key.clone(), "from" => e.state_from.name(), "to" => e.state_to.name())
                .increment(1);
            metrics::gauge!("levee_breaker_state", "policy" => p, "key" => e.key.clone()).set(f64::from(e.state_to as u8));
        }
        EventKind::FallbackChosen => {
            tracing::info!(target: "levee", policy, key = %e.key, call = e.call, fallback = %e.name, reason = e.reason.name(), "fallback chosen");
            metrics::counter!("levee_fallbacks_total", "policy" => p, "fallback" => e.name.clone(), "reason" => e.reason.name())
                .increment(1);
        }
        EventKind::RateLimitWait => {
            tracing::debug!(target: "levee", policy, key = %e.key, call = e.call, wait_ns = e.duration, "rate limiter asked to wait");
            metrics::counter!("levee_rate_limit_waits_total", "policy" => p).increment(1);
        }
        EventKind::KeyEvicted => {
            tracing::debug!(target: "levee", policy, key = %e.name, "key state evicted");
            metrics::counter!("levee_key_evictions_total", "policy" => p).increment(1);
        }
        EventKind::CallEvicted => {
            tracing::warn!(target: "levee", policy, call = e.call, "unfinished call evicted");
            metrics::counter!("levee_call_evictions_total", "policy" => p).increment(1);
        }
        EventKind::PermitExpired => {
            tracing::warn!(target: "levee", policy, key = %e.key, call = e.call, "half-open permit expired unreported");
            metrics::counter!("levee_permits_expired_total", "policy" => p).increment(1);
        }
    }
}

/// The engine trapped and was re-instantiated.
pub(crate) fn trap(t: &Trap, policy: &str) {
    tracing::error!(target: "levee", policy, operation = t.operation(), restored = t.restored(), error = %t.message(), "policy engine trapped; re-instantiated, the call proceeds as one attempt");
    metrics::counter!("levee_engine_traps_total", "operation" => t.operation()).increment(1);
}

//! The one place that names the engine the CLI drives.
//!
//! Every command goes through [`Engine`]: `levee::RawEngine` (the policy component run by
//! the Rust host), whose methods have exactly the names and signatures of
//! `levee_core::Engine` and return `levee_core` types (re-exported as `levee::core`).
//! Nothing here decides policy behaviour: the CLI only formats what the engine answers.

pub use levee::core;

/// The engine every command drives: the Levee policy component in wasmtime, through the
/// Rust host. Its methods have exactly the names and signatures of `levee_core::Engine`.
pub type Engine = levee::RawEngine;

use core::{Reason, Verdict, VerdictKind};

/// Load a document, or return every error with its field path. Always the component
/// (`Backend::Wasm`), whatever cargo features another crate of the build turns on.
pub fn load(document: &str, seed: u64) -> Result<Engine, Vec<core::LoadError>> {
    Engine::load_with(levee::Backend::Wasm, document, seed, levee::Limits::default())
}

/// The index of the policy named `name`, or an error that lists the document's policies
/// (with the nearest name when it looks like a typo).
pub fn policy_named(eng: &mut Engine, name: &str) -> Result<u32, String> {
    if let Some(i) = eng.policy_index(name) {
        return Ok(i);
    }
    let known: Vec<String> = (0..eng.policy_count()).filter_map(|i| eng.policy_info(i)).map(|p| p.name).collect();
    let known: Vec<&str> = known.iter().map(String::as_str).collect();
    let hint = core::doc::closest(name, &known).map(|n| format!("; did you mean `{n}`?")).unwrap_or_default();
    Err(format!("no policy named `{}` in the document{hint} (its policies: {})", core::policy::escape(name), core::doc::list(&known)))
}

/// A duration for people: `0`, `850us`, `142.3ms`, `1.25s`, `2m05s`.
pub fn human(ns: u64) -> String {
    const MS: u64 = 1_000_000;
    const S: u64 = 1_000_000_000;
    if ns == 0 {
        "0".to_string()
    } else if ns < MS {
        trim(format!("{:.1}", ns as f64 / 1e3)) + "us"
    } else if ns < S {
        trim(format!("{:.1}", ns as f64 / 1e6)) + "ms"
    } else if ns < 60 * S {
        trim(format!("{:.3}", ns as f64 / 1e9)) + "s"
    } else {
        let s = ns / S;
        format!("{}m{:02}s", s / 60, s % 60)
    }
}

fn trim(mut s: String) -> String {
    if s.contains('.') {
        while s.ends_with('0') {
            s.pop();
        }
        if s.ends_with('.') {
            s.pop();
        }
    }
    s
}

/// Parse a duration the way policy documents do (`250ms`, `1.5s`, `0`), or plain nanoseconds.
pub fn parse_duration(text: &str) -> Result<u64, String> {
    core::time::parse_duration(text)
}

/// A verdict in words.
pub fn describe(v: Verdict, fallbacks: &[String]) -> String {
    match v.kind() {
        Some(VerdictKind::Attempt) => match v.payload() {
            0 => format!("attempt {} (no timeout)", v.detail()),
            t => format!("attempt {} (timeout {})", v.detail(), human(t)),
        },
        Some(VerdictKind::Wait) => format!("wait {} ({})", human(v.payload()), v.reason()),
        Some(VerdictKind::Done) => "done".to_string(),
        Some(VerdictKind::Retry) => format!("retry after {}", human(v.payload())),
        Some(VerdictKind::Fallback) => {
            let name = usize::try_from(v.payload()).ok().and_then(|i| fallbacks.get(i)).map(String::as_str).unwrap_or("?");
            format!("fall back to `{name}` ({})", v.reason())
        }
        Some(VerdictKind::Fail) => match v.payload() {
            0 => format!("fail: {}", v.reason()),
            hint => format!("fail: {} (retry-after hint {})", v.reason(), human(hint)),
        },
        Some(VerdictKind::Hedge) => match v.payload() {
            0 => "hedged: attempt 1 (no timeout), then hedge-step".to_string(),
            t => format!("hedged: attempt 1 (timeout {}), then hedge-step", human(t)),
        },
        Some(VerdictKind::Invalid) => {
            let code = core::InvalidCode::from_index(u32::from(v.detail())).map(|c| c.name()).unwrap_or("?");
            format!("invalid: {code} (a protocol error of the caller)")
        }
        None => format!("unknown verdict {:#x}", v.0),
    }
}

/// Why the engine decided as it did, in one sentence (for `explain`).
pub fn reason_text(r: Reason) -> &'static str {
    match r {
        Reason::None => "",
        Reason::Deadline => "the total deadline has passed, or the next retry could not start before it",
        Reason::RetriesExhausted => "the last allowed attempt failed",
        Reason::NonRetryable => "the outcome is classified as never to be retried",
        Reason::Budget => "the retry budget refused the retry",
        Reason::BreakerOpen => "the circuit breaker is open",
        Reason::RateLimited => "the rate limiter has no token within the deadline and max-wait",
        Reason::BulkheadFull => "the concurrency limit is full",
        Reason::NonIdempotent => "retryable, but the operation is not idempotent and has no idempotency key",
        Reason::RetryAfterTooLong => "the server asked (Retry-After) for a wait above the policy's cap",
        Reason::Pushback => "gRPC pushback says do not retry",
        Reason::Cancelled => "the call was cancelled",
        Reason::FallbacksFailed => "every fallback of the chain failed",
    }
}

/// An event in words.
pub fn describe_event(e: &core::Event) -> String {
    use core::EventKind as K;
    match e.kind {
        K::RetryScheduled => format!("retry scheduled after attempt {} in {}", e.attempt, human(e.duration)),
        K::GaveUp => format!("gave up after attempt {}: {} ({})", e.attempt, e.reason, reason_text(e.reason)),
        K::Rejected => format!("attempt {} rejected: {} ({})", e.attempt, e.reason, reason_text(e.reason)),
        K::BudgetRefused => format!("retry budget refused the retry (level now {})", e.value),
        K::BreakerTransition => format!("breaker {} -> {}", e.state_from, e.state_to),
        K::FallbackChosen => format!("fallback `{}` chosen ({})", e.name, e.reason),
        K::RateLimitWait => format!("rate limiter: wait {}", human(e.duration)),
        K::KeyEvicted => format!("state of key `{}` evicted (key bound reached; it was at rest)", e.name),
        K::KeyOverflow => {
            format!("key `{}` got no state of its own (every key holds protection): decided against `{}`", e.name, e.key)
        }
        K::CallEvicted => format!("unfinished call {} evicted", e.call),
        K::PermitExpired => format!("half-open permit of call {} expired unreported", e.call),
        K::HedgeStarted => format!("hedge: attempt {} started", e.attempt),
    }
}

/// An event as a JSON object (the conformance vectors' shape).
pub fn event_json(e: &core::Event) -> serde_json::Value {
    serde_json::json!({
        "at": e.at, "kind": e.kind.name(), "policy": e.policy, "key": e.key, "call": e.call,
        "attempt": e.attempt, "reason": e.reason.name(), "duration": e.duration,
        "state_from": e.state_from.name(), "state_to": e.state_to.name(), "name": e.name, "value": e.value,
    })
}

/// A verdict as a JSON object (the conformance vectors' shape).
pub fn verdict_json(v: Verdict) -> serde_json::Value {
    serde_json::json!({
        "verdict": v.0, "kind": v.kind().map(VerdictKind::name).unwrap_or("?"),
        "detail": v.detail(), "payload": v.payload(), "events_pending": v.events_pending(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn human_durations() {
        assert_eq!(human(0), "0");
        assert_eq!(human(850_000), "850us");
        assert_eq!(human(142_300_000), "142.3ms");
        assert_eq!(human(1_250_000_000), "1.25s");
        assert_eq!(human(125_000_000_000), "2m05s");
    }
}

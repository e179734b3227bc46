//! What Envoy's router must be told so that its retries follow a Levee policy: the per-request
//! headers the filter sets and the route `retry_policy` that `levee envoy-config` prints.
//!
//! Everything here is read off the core's validated [`Policy`] and its classification (a code
//! is retriable when the core would retry it), so the filter and the printed route cannot
//! disagree with the document.

use levee_core::backoff::Kind;
use levee_core::classify::{Observed, Rule};
use levee_core::{OutcomeKind, Policy};

/// gRPC statuses the router can retry on by name (`x-envoy-retry-grpc-on`), by code.
const GRPC_RETRY_ON: [(i32, &str); 5] =
    [(1, "cancelled"), (4, "deadline-exceeded"), (8, "resource-exhausted"), (13, "internal"), (14, "unavailable")];

/// The router's view of a policy's classification.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RetryOn {
    /// `x-envoy-retry-on` / `retry_on` tokens.
    pub http: Vec<&'static str>,
    /// `x-envoy-retriable-status-codes` / `retriable_status_codes`: every status the core retries.
    pub status_codes: Vec<u16>,
    /// `x-envoy-retry-grpc-on` tokens.
    pub grpc: Vec<&'static str>,
    /// Rules with no router equivalent (named error classes, gRPC codes without a token).
    pub unmapped: Vec<String>,
}

fn status_retried(p: &Policy, code: u16) -> bool {
    let o = Observed { kind: OutcomeKind::HttpStatus, code: i32::from(code), class: "", has_pushback: false };
    p.retry_on.matches(&o) && !p.never_retry.matches(&o)
}

/// The router tokens for a policy's `retry-on` and `never-retry`.
pub fn retry_on(p: &Policy) -> RetryOn {
    let mut http = Vec::new();
    let mut grpc = Vec::new();
    let mut unmapped = Vec::new();
    let status_codes: Vec<u16> = (400..=599).filter(|c| status_retried(p, *c)).collect();
    let not_retried = |kind| !p.never_retry.matches(&Observed { kind, code: 0, class: "", has_pushback: false });
    for rule in &p.retry_on.0 {
        match rule {
            // `reset` covers no response at all: disconnect, reset and the per-try timeout.
            Rule::Timeout if not_retried(OutcomeKind::Timeout) => http.push("reset"),
            Rule::ConnectionError if not_retried(OutcomeKind::ConnectionError) => {
                http.extend(["connect-failure", "refused-stream", "reset"])
            }
            Rule::Http(..) => {}
            Rule::Grpc { code, .. } => match GRPC_RETRY_ON.iter().find(|(c, _)| c == code) {
                Some((_, name)) => grpc.push(*name),
                None => unmapped.push(rule.text()),
            },
            Rule::Error(_) => unmapped.push(rule.text()),
            _ => {}
        }
    }
    if !status_codes.is_empty() {
        http.push("retriable-status-codes");
    }
    http.sort_unstable();
    http.dedup();
    grpc.sort_unstable();
    grpc.dedup();
    RetryOn { http, status_codes, grpc, unmapped }
}

/// Milliseconds, rounded up, at least 1 (Envoy's durations in headers are whole ms).
pub fn ms_ceil(ns: u64) -> u64 {
    ns.div_ceil(1_000_000).max(1)
}

fn duration(ns: u64) -> String {
    // protobuf JSON Duration: seconds with up to 9 decimals.
    let secs = ns / 1_000_000_000;
    let frac = ns % 1_000_000_000;
    if frac == 0 {
        format!("{secs}s")
    } else {
        let digits = format!("{frac:09}");
        format!("{secs}.{}s", digits.trim_end_matches('0'))
    }
}

/// The request headers that say what [`route_yaml`] says for the policy (the router merges
/// them with the route's retry policy), so that a route without it still retries as the
/// policy says: the same for every request.
pub fn request_headers(p: &Policy, retry_on: &RetryOn) -> Vec<(&'static str, String)> {
    let mut h = Vec::new();
    if !retry_on.http.is_empty() {
        h.push(("x-envoy-retry-on", retry_on.http.join(",")));
    }
    if !retry_on.status_codes.is_empty() {
        let codes: Vec<String> = retry_on.status_codes.iter().map(u16::to_string).collect();
        h.push(("x-envoy-retriable-status-codes", codes.join(",")));
    }
    if !retry_on.grpc.is_empty() {
        h.push(("x-envoy-retry-grpc-on", retry_on.grpc.join(",")));
    }
    if let Some(t) = p.attempt_timeout {
        h.push(("x-envoy-upstream-rq-per-try-timeout-ms", ms_ceil(t).to_string()));
    }
    if let Some(d) = p.deadline {
        h.push(("x-envoy-upstream-rq-timeout-ms", ms_ceil(d).to_string()));
    }
    h
}

/// The route's `retry_policy` (and route `timeout`) matching a policy, as Envoy YAML under a
/// `route:` entry, with comments where Envoy cannot express the policy exactly.
pub fn route_yaml(p: &Policy) -> String {
    let r = retry_on(p);
    let mut out = String::new();
    let mut notes: Vec<String> = Vec::new();
    out.push_str(&format!("# Levee policy `{}`: paste under the route's `route:`.\n", p.name));
    out.push_str("# The levee filter sets x-envoy-max-retries per request from what the retry budget leaves.\n");
    match p.deadline {
        Some(d) => out.push_str(&format!("timeout: {}\n", duration(d))),
        None => out.push_str("timeout: 0s  # the policy has no deadline\n"),
    }
    out.push_str("retry_policy:\n");
    let mut tokens = r.http.clone();
    tokens.extend(r.grpc.iter().copied());
    out.push_str(&format!("  retry_on: \"{}\"\n", tokens.join(",")));
    out.push_str(&format!("  num_retries: {}\n", p.attempts.saturating_sub(1)));
    if let Some(t) = p.attempt_timeout {
        out.push_str(&format!("  per_try_timeout: {}\n", duration(t)));
    }
    if !r.status_codes.is_empty() {
        let codes: Vec<String> = r.status_codes.iter().map(u16::to_string).collect();
        out.push_str(&format!("  retriable_status_codes: [{}]\n", codes.join(", ")));
    }
    let b = &p.backoff;
    // Envoy's backoff is exponential, multiplier 2, full jitter, capped at max_interval.
    let max = match b.kind {
        Kind::Exponential | Kind::Decorrelated => b.cap,
        Kind::Constant | Kind::Linear => b.base,
    };
    out.push_str("  retry_back_off:\n");
    out.push_str(&format!("    base_interval: {}\n", duration(b.base.max(1_000_000))));
    out.push_str(&format!("    max_interval: {}\n", duration(max.max(b.base).max(1_000_000))));
    if b.kind != Kind::Exponential {
        notes.push(format!("backoff.kind {} has no Envoy equivalent: Envoy's exponential backoff is used", b.kind.name()));
    } else if b.multiplier != 2.0 {
        notes.push(format!("backoff.multiplier {} is 2 in Envoy", b.multiplier));
    }
    if b.jitter.name() != "full" {
        notes.push(format!("backoff.jitter {} is full jitter in Envoy", b.jitter.name()));
    }
    if p.retry_after.honor {
        out.push_str("  rate_limited_retry_back_off:\n");
        out.push_str("    reset_headers:\n");
        out.push_str("    - name: retry-after\n      format: SECONDS\n");
        out.push_str(&format!("    max_interval: {}\n", duration(p.retry_after.cap)));
    }
    for rule in &r.unmapped {
        notes.push(format!("retry-on rule {rule} has no router equivalent"));
    }
    for n in notes {
        out.push_str(&format!("# note: {n}\n"));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use levee_core::Engine;

    fn policy(doc: &str) -> Policy {
        let e = Engine::load(doc, 0).expect("doc");
        e.policy(0).expect("policy").clone()
    }

    #[test]
    fn default_classification_maps_to_router_tokens() {
        let p = policy(r#"{"policies": {"p": {}}}"#);
        let r = retry_on(&p);
        assert_eq!(r.http, vec!["connect-failure", "refused-stream", "reset", "retriable-status-codes"]);
        assert_eq!(r.status_codes, vec![429, 502, 503, 504]);
        assert_eq!(r.grpc, vec!["resource-exhausted", "unavailable"]);
    }

    #[test]
    fn never_retry_wins_in_the_codes() {
        let p = policy(r#"{"policies": {"p": {"retry-on": ["http:5xx"], "never-retry": ["http:501"]}}}"#);
        let r = retry_on(&p);
        assert!(r.status_codes.contains(&500) && !r.status_codes.contains(&501) && r.status_codes.contains(&599));
        assert_eq!(r.http, vec!["retriable-status-codes"]);
    }

    #[test]
    fn route_yaml_carries_backoff_timeouts_and_reset_headers() {
        let p = policy(
            r#"{"policies": {"p": {"attempts": 4, "attempt-timeout": "250ms", "deadline": "2s",
               "backoff": {"base": "25ms", "cap": "250ms"}, "retry-on": ["http:503", "error:X"]}}}"#,
        );
        let y = route_yaml(&p);
        for want in [
            "timeout: 2s\n",
            "num_retries: 3\n",
            "per_try_timeout: 0.25s\n",
            "retriable_status_codes: [503]\n",
            "base_interval: 0.025s\n",
            "max_interval: 0.25s\n",
            "format: SECONDS\n",
            "max_interval: 300s\n",
            "# note: retry-on rule error:X has no router equivalent\n",
        ] {
            assert!(y.contains(want), "{want:?} in\n{y}");
        }
    }
}

//! What Envoy's router must be told so that its retries follow a Levee policy: the per-request
//! headers the filter sets and the route `retry_policy` that `levee envoy-config` prints.
//!
//! Everything here is read off the core's validated [`Policy`] and its classification (a code
//! is retriable when the core would retry it), so the filter and the printed route cannot
//! disagree with the document.

use crate::headers::Headers;
use levee_core::backoff::Kind;
use levee_core::classify::{Observed, Rule};
use levee_core::{OutcomeKind, Policy};

/// gRPC statuses the router can retry on by name (`x-envoy-retry-grpc-on`), by code.
const GRPC_RETRY_ON: [(i32, &str); 5] =
    [(1, "cancelled"), (4, "deadline-exceeded"), (8, "resource-exhausted"), (13, "internal"), (14, "unavailable")];

/// The response header Envoy's router never retries on (unless the route's `retry_on` has
/// `envoy-ratelimited`, which no mapping here writes). Since Envoy 1.20 the router no longer
/// looks at `x-envoy-overloaded`: this is the one mark a response can carry that keeps it
/// from being retried, however the route retries statuses.
pub const NO_RETRY: (&str, &str) = ("x-envoy-ratelimited", "true");

/// What the filter in its upstream role adds to one attempt's response: [`NO_RETRY`] on a
/// response marked `x-envoy-overloaded` that lacks it, so that the router returns an
/// overloaded answer at once (Levee's rule for every layer: overload is never retried).
pub fn attempt_response_marks(response: &Headers) -> Option<(&'static str, &'static str)> {
    (response.get("x-envoy-overloaded").is_some() && response.get(NO_RETRY.0).is_none()).then_some(NO_RETRY)
}

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
    retried_rules(p).matches(&o) && !p.never_retry.matches(&o)
}

/// The rules the router's retries follow: `retry-on`, or for a hedged policy `hedge.non-fatal`
/// (the failures after which the next hedge is sent).
fn retried_rules(p: &Policy) -> &levee_core::classify::Rules {
    match &p.hedge {
        Some(h) => &h.non_fatal,
        None => &p.retry_on,
    }
}

/// The router tokens for a policy's `retry-on` (a hedged policy's `hedge.non-fatal`) and
/// `never-retry`.
pub fn retry_on(p: &Policy) -> RetryOn {
    let mut http = Vec::new();
    let mut grpc = Vec::new();
    let mut unmapped = Vec::new();
    let status_codes: Vec<u16> = (400..=599).filter(|c| status_retried(p, *c)).collect();
    let not_retried = |kind| !p.never_retry.matches(&Observed { kind, code: 0, class: "", has_pushback: false });
    for rule in &retried_rules(p).0 {
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

/// The router's `per_try_timeout`: the attempt timeout, or for a hedged policy the hedge delay
/// (Envoy hedges when an attempt has run that long, without ending it; the `envoy` preset's
/// delay is the attempt timeout). A delay of 0 has no per-try form: none.
fn per_try_timeout(p: &Policy) -> Option<u64> {
    match &p.hedge {
        Some(h) => Some(h.delay).filter(|d| *d > 0),
        None => p.attempt_timeout,
    }
}

/// The router's `num_retries`: `attempts - 1`, or for a hedged policy `hedge.attempts - 1`.
pub fn num_retries(p: &Policy) -> u32 {
    match &p.hedge {
        Some(h) => h.attempts.saturating_sub(1),
        None => p.attempts.saturating_sub(1),
    }
}

/// What Envoy's hedging cannot express of a hedged policy.
fn hedge_notes(p: &Policy, h: &levee_core::hedge::HedgeCfg, notes: &mut Vec<String>) {
    use levee_core::hedge::Preset;
    let name = match h.preset {
        Preset::Grpc => "grpc",
        Preset::Polly => "polly",
        Preset::Failsafe => "failsafe",
        Preset::Envoy => "envoy",
    };
    if h.delay == 0 {
        notes.push(
            "hedge.delay 0 (every attempt at once) has no Envoy equivalent (HedgePolicy.initial_requests is not implemented): \
             Envoy sends the next attempt only after a retriable failure"
                .into(),
        );
    }
    match h.preset {
        Preset::Envoy => {}
        Preset::Failsafe => notes.push(format!(
            "hedge.preset {name}: hedges go by time only in Levee; Envoy also sends the next one after a retriable failure (after retry_back_off)"
        )),
        Preset::Grpc | Preset::Polly => notes.push(format!(
            "hedge.preset {name}: a non-fatal failure sends the next hedge after retry_back_off ({}), not at once",
            duration(HEDGE_BACKOFF)
        )),
    }
    if h.preset == Preset::Polly {
        notes.push("hedge.preset polly: when every attempt fails, Envoy returns the last failure, not the primary's".into());
    }
    if let (Some(t), true) = (p.attempt_timeout, h.preset != Preset::Envoy) {
        notes.push(format!(
            "attempt-timeout {} is not enforced per attempt: when hedging, Envoy's per_try_timeout is the hedge delay and ends no attempt",
            duration(t)
        ));
    }
}

/// A hedged policy's `retry_back_off`: the shortest Envoy takes (the next hedge after a
/// non-fatal failure is sent at once in Levee).
const HEDGE_BACKOFF: u64 = 1_000_000;

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
    if let Some(t) = per_try_timeout(p) {
        h.push(("x-envoy-upstream-rq-per-try-timeout-ms", ms_ceil(t).to_string()));
    }
    if p.hedge.is_some() {
        h.push(("x-envoy-hedge-on-per-try-timeout", "true".to_string()));
    }
    if let Some(d) = p.deadline {
        h.push(("x-envoy-upstream-rq-timeout-ms", ms_ceil(d).to_string()));
    }
    h
}

/// What Envoy cannot express of a policy: the `# note:` lines of [`route_yaml`], which the
/// filter also logs as warnings when it loads the policy.
pub fn notes(p: &Policy) -> Vec<String> {
    route_yaml(p).lines().filter_map(|l| l.strip_prefix("# note: ")).map(str::to_string).collect()
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
        // No `timeout: 0s`: that would turn off Envoy's default route timeout.
        None => notes.push("the policy has no deadline: Envoy's default route timeout (15s) applies".into()),
    }
    if let Some(h) = &p.hedge {
        out.push_str("hedge_policy:\n  hedge_on_per_try_timeout: true\n");
        hedge_notes(p, h, &mut notes);
    }
    out.push_str("retry_policy:\n");
    let mut tokens = r.http.clone();
    tokens.extend(r.grpc.iter().copied());
    out.push_str(&format!("  retry_on: \"{}\"\n", tokens.join(",")));
    out.push_str(&format!("  num_retries: {}\n", num_retries(p)));
    if let Some(t) = per_try_timeout(p) {
        out.push_str(&format!("  per_try_timeout: {}\n", duration(t)));
    }
    if !r.status_codes.is_empty() {
        let codes: Vec<String> = r.status_codes.iter().map(u16::to_string).collect();
        out.push_str(&format!("  retriable_status_codes: [{}]\n", codes.join(", ")));
    }
    if p.hedge.is_some() {
        // Hedged calls are never retried: the backoff does not apply, a failed hedge's
        // successor goes at once.
        out.push_str("  retry_back_off:\n");
        out.push_str(&format!("    base_interval: {}\n    max_interval: {}\n", duration(HEDGE_BACKOFF), duration(HEDGE_BACKOFF)));
        return finish_route(out, p, &r, notes);
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
    finish_route(out, p, &r, notes)
}

fn finish_route(mut out: String, p: &Policy, r: &RetryOn, mut notes: Vec<String>) -> String {
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
    fn an_overloaded_attempt_is_marked_for_the_router_not_to_retry_it() {
        let h = |pairs: &[(&str, &str)]| Headers::new(crate::headers::serialize(pairs));
        assert_eq!(attempt_response_marks(&h(&[(":status", "503"), ("x-envoy-overloaded", "true")])), Some(NO_RETRY));
        assert_eq!(attempt_response_marks(&h(&[(":status", "503")])), None);
        assert_eq!(
            attempt_response_marks(&h(&[(":status", "503"), ("x-envoy-overloaded", "true"), ("x-envoy-ratelimited", "true")])),
            None
        );
    }

    #[test]
    fn no_deadline_keeps_envoys_route_timeout() {
        let y = route_yaml(&policy(r#"{"policies": {"p": {}}}"#));
        // `timeout: 0s` would turn off Envoy's default 15 s route timeout.
        assert!(!y.lines().any(|l| l.starts_with("timeout:")), "{y}");
        assert!(y.contains("# note: the policy has no deadline: Envoy's default route timeout (15s) applies"), "{y}");
    }

    #[test]
    fn hedging_maps_to_envoys_hedge_policy() {
        let p = policy(r#"{"policies": {"p": {"hedge": {"attempts": 3, "delay": "100ms"}}}}"#);
        let y = route_yaml(&p);
        for want in [
            "hedge_policy:\n  hedge_on_per_try_timeout: true\n",
            "num_retries: 2\n",
            "per_try_timeout: 0.1s\n",
            "# note: hedge.preset grpc: a non-fatal failure sends the next hedge after",
        ] {
            assert!(y.contains(want), "{want:?} in\n{y}");
        }
        let h = request_headers(&p, &retry_on(&p));
        assert!(h.contains(&("x-envoy-hedge-on-per-try-timeout", "true".into())), "{h:?}");
        // The filter warns of the same at configure time.
        assert!(notes(&p).iter().any(|n| n.starts_with("hedge.preset grpc:")), "{:?}", notes(&p));
        assert!(h.contains(&("x-envoy-upstream-rq-per-try-timeout-ms", "100".into())), "{h:?}");
        // The envoy preset is Envoy's own: no note but the budget's.
        let p = policy(r#"{"policies": {"p": {"attempt-timeout": "50ms", "hedge": {"preset": "envoy", "attempts": 2}}}}"#);
        let y = route_yaml(&p);
        assert!(y.contains("per_try_timeout: 0.05s\n") && y.contains("num_retries: 1\n") && !y.contains("hedge.preset"), "{y}");
        // What Envoy cannot do: every attempt at once, a per-attempt timeout besides the delay.
        let y = route_yaml(&policy(r#"{"policies": {"p": {"attempt-timeout": "1s", "hedge": {"delay": "0s"}}}}"#));
        assert!(y.contains("# note: hedge.delay 0"), "{y}");
        assert!(y.contains("# note: attempt-timeout"), "{y}");
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

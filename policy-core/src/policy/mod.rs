//! Policy documents: parsing, validation and defaults. Every error names its field path.
//!
//! ```yaml
//! policies:
//!   checkout:
//!     attempts: 3
//!     attempt-timeout: 2s
//!     deadline: 10s
//!     backoff: { kind: exponential, base: 100ms, multiplier: 2, cap: 5s, jitter: full }
//!     retry-on: [timeout, connection-error, "http:429", "http:502-504"]
//!     budget: { kind: token, max-tokens: 10, token-ratio: 0.1 }
//!     breaker: { window: { kind: count, size: 20 }, failure-rate: 50, minimum-calls: 10 }
//!     fallbacks: [{ name: cached, on: [breaker-open, retries-exhausted] }]
//! ```
//!
//! Each strategy parses, validates and defaults its own section (`crate::retry`,
//! `crate::breaker`, ...); this module holds the policy as a whole, and [`to_json`] writes it
//! back with every default filled in. `docs/policy.md` documents every field with its type,
//! default and meaning.

mod json;

pub use json::policy_to_json;

pub use crate::error::{escape, LoadError};
pub use crate::fallback::{FallbackCfg, FALLBACK_TRIGGERS};
pub use crate::retry::{AttemptsPreset, OverCap, RetryAfterCfg};

use crate::adaptive::{self, AdaptiveCfg};
use crate::breaker::{self, BreakerCfg};
use crate::budget::{self, BudgetCfg};
use crate::bulkhead::{self, BulkheadCfg};
use crate::classify::{self, Rules};
use crate::deadline;
use crate::doc::{self, Fields, Value};
use crate::fallback;
use crate::hedge::{self, HedgeCfg};
use crate::rate::{self, RateCfg};
use crate::read::{opt_duration, uint};
use crate::retry::{
    self,
    backoff::{self, Backoff},
};
use crate::scope::{self, Scope, Scopes};
use crate::time::SECOND;
use std::borrow::Cow;

/// The policy with every default filled in, as JSON text.
pub fn to_json(p: &Policy) -> String {
    doc::to_json(&policy_to_json(p))
}

/// A validated policy with every default filled in.
#[derive(Clone, Debug, PartialEq)]
pub struct Policy {
    /// The policy's name.
    pub name: String,
    /// Attempts, counting the first (default 3, at least 1).
    pub attempts: u32,
    /// Per-attempt timeout (default none).
    pub attempt_timeout: Option<u64>,
    /// Total deadline from the call's start (default none).
    pub deadline: Option<u64>,
    /// Backoff between attempts.
    pub backoff: Backoff,
    /// Retryable failures.
    pub retry_on: Rules,
    /// Failures never retried (wins over `retry_on`).
    pub never_retry: Rules,
    /// Bit `i` set: HTTP method number `i` is idempotent.
    pub idempotent_methods: u16,
    /// Server-directed delays.
    pub retry_after: RetryAfterCfg,
    /// Retry budget (default none).
    pub budget: Option<BudgetCfg>,
    /// Circuit breaker (default none).
    pub breaker: Option<BreakerCfg>,
    /// Rate limit (default none).
    pub rate_limit: Option<RateCfg>,
    /// Concurrency limit (default none).
    pub bulkhead: Option<BulkheadCfg>,
    /// Adaptive concurrency limit (default none; excludes `bulkhead`).
    pub concurrency: Option<AdaptiveCfg>,
    /// Fallback chain (default empty).
    pub fallbacks: Vec<FallbackCfg>,
    /// Most keys with state at once (default 1024).
    pub max_keys: u32,
    /// How the document's `attempts` was counted (`attempts` above is always normalised to
    /// count the first call).
    pub attempts_preset: AttemptsPreset,
    /// Durable calls under this policy.
    pub durable: DurableCfg,
    /// State shared across processes (default none: local only). See [`crate::fleet`].
    pub fleet: Option<crate::fleet::FleetCfg>,
    /// Hedged attempts (default none). A hedged call is never retried: `attempts` must be
    /// left out (it is 1). See [`crate::hedge`].
    pub hedge: Option<HedgeCfg>,
    /// What each stateful strategy's state is kept for (default: each key). See [`crate::scope`].
    pub scopes: Scopes,
}

/// Durable calls (records that survive a restart; see `crate::durable`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DurableCfg {
    /// How long a process holds a call's lease for an attempt before another may take it
    /// over (default 30s; the executor renews it while the attempt runs).
    pub lease: u64,
    /// Attempts cut off by a process death after which the call is given up as a poison
    /// call (default 3).
    pub max_crashes: u32,
}

/// Default lease of a durable call's attempt.
pub const DEFAULT_LEASE: u64 = 30 * SECOND;
/// Default attempts cut off by a process death before a call is given up.
pub const DEFAULT_MAX_CRASHES: u32 = 3;
/// Default most keys with state at once, per policy.
pub const DEFAULT_MAX_KEYS: u32 = 1024;
/// Most policies in a document.
pub const MAX_POLICIES: usize = 4096;

impl Default for DurableCfg {
    fn default() -> Self {
        DurableCfg { lease: DEFAULT_LEASE, max_crashes: DEFAULT_MAX_CRASHES }
    }
}

impl DurableCfg {
    fn parse(f: &mut Fields<'_>, errors: &mut Vec<LoadError>) -> DurableCfg {
        let Some(v) = f.take("durable") else { return DurableCfg::default() };
        let path = f.path_of("durable");
        let Some(mut d) = Fields::new(&path, v, errors) else { return DurableCfg::default() };
        let lease = opt_duration(&mut d, "lease", errors, true).unwrap_or(DEFAULT_LEASE);
        let max_crashes = uint(&mut d, "max-crashes", DEFAULT_MAX_CRASHES, 1, 1_000_000, errors);
        d.finish(&["lease", "max-crashes"], errors);
        DurableCfg { lease, max_crashes }
    }
}

fn parse_keys(f: &mut Fields<'_>, errors: &mut Vec<LoadError>) -> u32 {
    let Some(v) = f.take("keys") else { return DEFAULT_MAX_KEYS };
    let path = f.path_of("keys");
    let Some(mut k) = Fields::new(&path, v, errors) else { return DEFAULT_MAX_KEYS };
    let n = uint(&mut k, "max", DEFAULT_MAX_KEYS, 1, 1_000_000, errors);
    k.finish(&["max"], errors);
    n
}

const POLICY_FIELDS: &[&str] = &[
    "attempts",
    "attempt-timeout",
    "deadline",
    "backoff",
    "retry-on",
    "never-retry",
    "idempotent-methods",
    "retry-after",
    "budget",
    "breaker",
    "rate-limit",
    "bulkhead",
    "concurrency",
    "fallbacks",
    "keys",
    "attempts-preset",
    "durable",
    "fleet",
    "hedge",
];

/// Parse a whole document into its policies (in document order).
pub fn parse_document(text: &str) -> Result<Vec<Policy>, Vec<LoadError>> {
    let root = doc::parse(text).map_err(|e| vec![e])?;
    let mut errors = Vec::new();
    let Some(mut top) = Fields::new("", &root, &mut errors) else {
        return Err(errors);
    };
    if let Some(v) = top.take("version") {
        if !matches!(v, Value::Int(1)) {
            errors.push(LoadError::new("version", "the only document version is 1"));
        }
    }
    let mut policies = Vec::new();
    match top.take("policies") {
        None => errors.push(LoadError::new("policies", "is required: a mapping from policy names to policies")),
        Some(value) => {
            if let Some(mut map) = Fields::new("policies", value, &mut errors) {
                let entries = map.entries();
                if entries.is_empty() {
                    errors.push(LoadError::new("policies", "names no policy"));
                }
                if entries.len() > MAX_POLICIES {
                    errors.push(LoadError::new("policies", "holds more than 4096 policies"));
                }
                for (name, body) in entries.iter().take(MAX_POLICIES) {
                    let path = doc::join("policies", name);
                    if name.is_empty()
                        || name.len() > 128
                        || !name.bytes().all(|c| c.is_ascii_alphanumeric() || matches!(c, b'-' | b'_' | b'.'))
                    {
                        errors.push(LoadError::new(&path, "policy names are 1 to 128 characters of letters, digits, `-`, `_` and `.`"));
                        continue;
                    }
                    if let Some(p) = parse_policy(name, &path, body, &mut errors) {
                        policies.push(p);
                    }
                }
            }
        }
    }
    top.finish(&["version", "policies"], &mut errors);
    if errors.is_empty() {
        Ok(policies)
    } else {
        Err(errors)
    }
}

/// A stateful strategy's section, if the policy has it: its path, its `scope` (into `scope`),
/// and the rest of it, for the strategy to parse.
fn section<'v>(f: &mut Fields<'v>, field: &str, scope: &mut Scope, errors: &mut Vec<LoadError>) -> Option<(String, Cow<'v, Value>)> {
    let v = f.take(field)?;
    let path = f.path_of(field);
    let (s, rest) = scope::split(&path, v, errors);
    *scope = s;
    Some((path, rest))
}

fn parse_policy(name: &str, path: &str, body: &Value, errors: &mut Vec<LoadError>) -> Option<Policy> {
    let before = errors.len();
    let mut f = Fields::new(path, body, errors)?;
    let hedged = body.get("hedge").is_some();
    let retries_written = ["attempts", "attempts-preset"].into_iter().find(|k| body.get(k).is_some());
    let (attempts_preset, attempts) = retry::parse_attempts(&mut f, errors);
    let (attempt_timeout, deadline) = deadline::parse(&mut f, errors);
    let backoff = backoff::parse(&mut f, errors);
    let retry_on = classify::parse_rules(&mut f, "retry-on", classify::DEFAULT_RETRY_ON, errors);
    let never_retry = classify::parse_rules(&mut f, "never-retry", classify::DEFAULT_NEVER_RETRY, errors);
    let idempotent_methods = classify::parse_methods(&mut f, errors);
    let retry_after = RetryAfterCfg::parse(&mut f, errors);
    // Each stateful strategy's `scope` is read once (`crate::scope`); the strategy parses the rest.
    let mut scopes = Scopes::default();
    let budget = section(&mut f, "budget", &mut scopes.budget, errors).and_then(|(path, v)| budget::parse(&path, &v, errors));
    let breaker = section(&mut f, "breaker", &mut scopes.breaker, errors).and_then(|(path, v)| breaker::parse(&path, &v, errors));
    let rate_limit = section(&mut f, "rate-limit", &mut scopes.rate_limit, errors).and_then(|(path, v)| rate::parse(&path, &v, errors));
    let bulkhead = section(&mut f, "bulkhead", &mut scopes.limit, errors).and_then(|(path, v)| bulkhead::parse(&path, &v, errors));
    if matches!(budget, Some(BudgetCfg::AwsAdaptive(_))) && rate_limit.is_some() {
        errors.push(LoadError::new(
            &f.path_of("budget"),
            "`aws-adaptive` is a client rate limiter of its own: a policy with it has no `rate-limit`",
        ));
    }
    let mut limit = Scope::Key;
    let concurrency = section(&mut f, "concurrency", &mut limit, errors).and_then(|(path, v)| adaptive::parse(&path, &v, errors));
    if concurrency.is_some() {
        scopes.limit = limit;
    }
    if bulkhead.is_some() && concurrency.is_some() {
        errors.push(LoadError::new(
            &f.path_of("concurrency"),
            "a policy has one concurrency limit: `bulkhead` (fixed) or `concurrency` (adaptive), not both",
        ));
    }
    let fallbacks = f.take("fallbacks").map(|v| fallback::parse(&f.path_of("fallbacks"), v, errors)).unwrap_or_default();
    let max_keys = parse_keys(&mut f, errors);
    let durable = DurableCfg::parse(&mut f, errors);
    let fleet = f.take("fleet").and_then(|v| crate::fleet::parse(&f.path_of("fleet"), v, &breaker, &budget, errors));
    if fleet.is_some() && scopes.any() {
        errors.push(LoadError::new(
            &f.path_of("fleet"),
            "state shared across processes is kept per key: a policy with `scope: policy` has no `fleet` section yet",
        ));
    }
    let hedge = f.take("hedge").and_then(|v| hedge::parse(&f.path_of("hedge"), v, attempt_timeout, errors));
    if let (true, Some(field)) = (hedged, retries_written) {
        errors.push(LoadError::new(
            &f.path_of(field),
            "a hedged call is never retried: `hedge.attempts` counts its attempts, so leave `attempts` out",
        ));
    }
    // A hedged call makes one call-level attempt; its hedges are counted by `hedge`.
    let attempts = if hedged { 1 } else { attempts };
    f.finish(POLICY_FIELDS, errors);
    if errors.len() > before {
        return None;
    }
    Some(Policy {
        name: name.to_string(),
        attempts,
        attempt_timeout,
        deadline,
        backoff,
        retry_on,
        never_retry,
        idempotent_methods,
        retry_after,
        budget,
        breaker,
        rate_limit,
        bulkhead,
        concurrency,
        fallbacks,
        max_keys,
        attempts_preset,
        durable,
        fleet,
        hedge,
        scopes,
    })
}

impl Policy {
    /// Whether an HTTP method (by its `start` flags number) is idempotent under this policy.
    /// 0 (not an HTTP call) is; 15 (another method) is not.
    #[inline]
    pub fn method_idempotent(&self, method: u32) -> bool {
        classify::method_idempotent(self.idempotent_methods, method)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::needs_escape;

    fn errors(doc: &str) -> Vec<LoadError> {
        parse_document(doc).err().unwrap_or_default()
    }

    #[test]
    fn an_empty_value_is_an_error_in_every_field() {
        // Issue 14, item 15: `deadline:` with nothing after it was no deadline at all.
        let e = errors("policies:\n  p:\n    attempts:\n    deadline:\n");
        assert_eq!(
            e,
            vec![LoadError::new("policies.p.attempts", doc::EMPTY_VALUE), LoadError::new("policies.p.deadline", doc::EMPTY_VALUE),]
        );
        // Every field of every mapping, in block and flow syntax.
        let mut cases: Vec<(String, String)> = Vec::new();
        for f in POLICY_FIELDS {
            cases.push((format!("    {f}:\n"), (*f).to_string()));
            cases.push((format!("    {f}: ~\n"), (*f).to_string()));
        }
        let nested: &[(&str, &str, &[&str])] = &[
            ("backoff", "", &["kind", "base", "multiplier", "cap", "jitter", "jitter-ratio"]),
            ("retry-after", "", &["honor", "cap", "over-cap"]),
            ("budget", "kind: token, ", &["max-tokens", "token-ratio"]),
            ("budget", "kind: ratio, ", &["percent", "min-per-second", "ttl"]),
            ("budget", "", &["kind"]),
            (
                "breaker",
                "",
                &[
                    "window",
                    "failure-rate",
                    "slow-call-rate",
                    "slow-call-duration",
                    "minimum-calls",
                    "open-duration",
                    "open-duration-max",
                    "open-duration-multiplier",
                    "half-open-permits",
                    "half-open-permit-timeout",
                    "failure-on",
                ],
            ),
            ("rate-limit", "rate: 5, ", &["per", "burst", "max-wait"]),
            ("rate-limit", "", &["rate"]),
            ("bulkhead", "", &["max-concurrent"]),
            ("keys", "", &["max"]),
        ];
        for (field, others, inner) in nested {
            for i in *inner {
                cases.push((format!("    {field}: {{ {others}{i}: }}\n"), format!("{field}.{i}")));
            }
        }
        for (kind, inner) in [("count", ["kind", "size"]), ("time", ["size", "bucket"])] {
            for i in inner {
                let head = if i == "kind" { String::new() } else { format!("kind: {kind}, ") };
                cases.push((format!("    breaker: {{ window: {{ {head}{i}: }} }}\n"), format!("breaker.window.{i}")));
            }
        }
        cases.push(("    fallbacks: [{ name: a, on: }]\n".to_string(), "fallbacks[0].on".to_string()));
        cases.push(("    fallbacks: [{ name: }]\n".to_string(), "fallbacks[0].name".to_string()));
        for (body, path) in cases {
            let doc = format!("policies:\n  p:\n{body}");
            let e = errors(&doc);
            let want = format!("policies.p.{path}");
            assert!(e.iter().any(|e| e.path == want && e.message == doc::EMPTY_VALUE), "{doc}: {e:?}");
        }
        // A policy, the policies, the version: the same.
        assert_eq!(errors("policies:\n  p:\n"), vec![LoadError::new("policies.p", doc::EMPTY_VALUE)]);
        assert_eq!(errors("version:\npolicies: { p: {} }\n"), vec![LoadError::new("version", doc::EMPTY_VALUE)]);
        assert!(errors("policies:\n").iter().any(|e| e.path == "policies"));
        // `{}` is the way to ask for every default.
        assert!(parse_document("policies:\n  p: {}\n").is_ok());
        assert!(parse_document("policies:\n  p: { breaker: {} }\n").is_ok_and(|p| p.first().is_some_and(|p| p.breaker.is_some())));
    }

    #[test]
    fn nan_and_infinity_are_named() {
        let e = errors("policies:\n  p: { attempts: .nan, breaker: { failure-rate: .inf }, backoff: { multiplier: -.inf } }\n");
        let messages: Vec<&str> = e.iter().map(|e| e.message.as_str()).collect();
        assert_eq!(
            messages,
            [
                "must be a whole number from 1 to 4294967295, found .nan (not a number)",
                "must be a number from 1 to 1000, found -.inf (infinity)",
                "must be a number from 0.001 to 100, found .inf (infinity)",
            ]
        );
        assert!(e.iter().all(|e| !e.message.contains("null")));
    }

    #[test]
    fn control_and_bidi_characters_are_escaped_in_errors() {
        let e = errors("policies:\n  \"evil\\u202egnp.exe\": {}\n  ok: { \"att\\u0000empts\": 3, retry-on: [\"http:50\\u20663\"] }\n");
        assert!(!e.is_empty());
        for err in &e {
            let text = err.to_string();
            assert!(!text.chars().any(needs_escape), "{text:?}");
        }
        assert_eq!(e.first().map(|e| e.path.as_str()), Some("policies.evil\\u{202e}gnp.exe"));
        assert!(e.iter().any(|e| e.path == "policies.ok.att\\u{0}empts"), "{e:?}");
        assert!(e.iter().any(|e| e.message.contains("http:50\\u{2066}3")), "{e:?}");
        assert_eq!(escape("plain"), "plain");
        assert_eq!(escape("a\u{1b}[31mb"), "a\\u{1b}[31mb");
    }

    #[test]
    fn decorrelated_jitter_messages_say_what_is_wrong() {
        // Issue 14, item 14: `kind: decorrelated` with `jitter: full` said "use kind: decorrelated".
        let e = errors("policies:\n  p: { backoff: { kind: decorrelated, jitter: full } }\n");
        assert_eq!(e.len(), 1);
        let m = &e[0].message;
        assert!(!m.contains("use kind: decorrelated"), "{m}");
        assert!(m.contains("has its own jitter") && m.contains("`full`"), "{m}");
        let e = errors("policies:\n  p: { backoff: { kind: exponential, jitter: decorrelated } }\n");
        assert!(e.len() == 1 && e[0].message.contains("(use kind: decorrelated)"), "{e:?}");
        assert!(parse_document("policies:\n  p: { backoff: { kind: decorrelated, jitter: decorrelated } }\n").is_ok());
    }
}

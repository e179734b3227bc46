//! What a stateful strategy's state is kept for: each key of the policy (`scope: key`, the
//! default), or the policy as a whole (`scope: policy`), one state shared by the calls of
//! every key. A breaker per downstream host and one rate limit for the whole process then
//! live in one policy:
//!
//! ```yaml
//! policies:
//!   upstream:
//!     breaker: { minimum-calls: 20 }                  # one per key (a downstream host)
//!     rate-limit: { rate: 100, scope: policy }        # one for every key together
//! ```
//!
//! `scope` is read here, once, for every strategy that keeps state (`breaker`, `rate-limit`,
//! `budget`, and the concurrency limit, `bulkhead` or `concurrency`); each strategy parses
//! the rest of its section. A policy-scoped state is the state of the policy's unkeyed
//! entry (the key `""`), which unkeyed calls use as before; it is never evicted and does not
//! count against `keys.max` (docs/policy.md, "Scope").

use std::borrow::Cow;

use crate::doc::Value;
use crate::error::LoadError;

/// What a strategy's state is kept for.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Scope {
    /// One state per key (the default).
    #[default]
    Key,
    /// One state for the policy, shared by every key.
    Policy,
}

impl Scope {
    /// The name in a policy document.
    pub fn name(self) -> &'static str {
        match self {
            Scope::Key => "key",
            Scope::Policy => "policy",
        }
    }
}

/// The scope of each stateful strategy of a policy.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Scopes {
    /// The circuit breaker's.
    pub breaker: Scope,
    /// The rate limiter's (`rate-limit`).
    pub rate_limit: Scope,
    /// The retry budget's (`budget`, including `aws-adaptive`'s client rate).
    pub budget: Scope,
    /// The concurrency limit's (`bulkhead` with its queue, or `concurrency`), with the
    /// attempts in flight that it counts.
    pub limit: Scope,
}

impl Scopes {
    /// Whether any strategy keeps its state for the whole policy.
    #[inline]
    pub fn any(&self) -> bool {
        *self != Scopes::default()
    }
}

/// Split a strategy's section into its `scope` and the rest, which the strategy parses as
/// before (a section without `scope` is passed through as it is).
pub(crate) fn split<'v>(path: &str, v: &'v Value, errors: &mut Vec<LoadError>) -> (Scope, Cow<'v, Value>) {
    let Value::Map(entries) = v else { return (Scope::Key, Cow::Borrowed(v)) };
    let Some((_, s)) = entries.iter().find(|(k, _)| k == "scope") else { return (Scope::Key, Cow::Borrowed(v)) };
    let scope = match s.as_str() {
        Some("key") => Scope::Key,
        Some("policy") => Scope::Policy,
        _ => {
            let found = match s {
                Value::Str(t) => format!("`{}`", crate::error::escape(t)),
                Value::Null => crate::doc::EMPTY_VALUE.to_string(),
                other => other.type_name().to_string(),
            };
            errors.push(LoadError::new(
                &crate::doc::join(path, "scope"),
                format!("must be `key` (a state per key, the default) or `policy` (one state for every key), found {found}"),
            ));
            Scope::Key
        }
    };
    let rest = entries.iter().filter(|(k, _)| k != "scope").cloned().collect();
    (scope, Cow::Owned(Value::Map(rest)))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::indexing_slicing)]
    use crate::policy::parse_document;

    use super::*;

    fn errors(doc: &str) -> Vec<LoadError> {
        parse_document(doc).err().unwrap_or_default()
    }

    #[test]
    fn scope_is_read_for_every_stateful_strategy() {
        let doc = "policies:\n  p:\n    breaker: { scope: key }\n    rate-limit: { rate: 5, scope: policy }\n    budget: { kind: token, scope: policy }\n    bulkhead: { max-concurrent: 2, scope: policy }\n";
        let p = parse_document(doc).unwrap().remove(0);
        assert_eq!(p.scopes, Scopes { breaker: Scope::Key, rate_limit: Scope::Policy, budget: Scope::Policy, limit: Scope::Policy });
        assert!(p.scopes.any());
        let p = parse_document("policies:\n  p:\n    concurrency: { kind: adaptive, scope: policy }\n").unwrap().remove(0);
        assert_eq!(p.scopes.limit, Scope::Policy);
        let p = parse_document("policies:\n  p: { breaker: {} }\n").unwrap().remove(0);
        assert!(!p.scopes.any());
    }

    #[test]
    fn a_bad_scope_names_its_path() {
        let e = errors("policies:\n  p:\n    breaker: { scope: global }\n");
        assert_eq!(e.len(), 1, "{e:?}");
        assert_eq!(e[0].path, "policies.p.breaker.scope");
        assert!(e[0].message.contains("`key`") && e[0].message.contains("`global`"), "{}", e[0].message);
        let e = errors("policies:\n  p:\n    rate-limit: { rate: 1, scope: 3 }\n");
        assert_eq!(e[0].path, "policies.p.rate-limit.scope");
        assert!(e[0].message.ends_with("found an integer"), "{}", e[0].message);
        // Only the strategies that keep state have one.
        let e = errors("policies:\n  p:\n    backoff: { scope: policy }\n");
        assert_eq!(e[0].path, "policies.p.backoff.scope", "{e:?}");
    }

    #[test]
    fn scope_is_written_back_only_when_it_is_policy() {
        // A policy's JSON (and the hash of it that durable records carry) stays as it was
        // for every document without `scope: policy`.
        let plain = parse_document("policies:\n  p: { breaker: {}, rate-limit: { rate: 5, scope: key } }\n").unwrap().remove(0);
        assert!(!crate::policy::to_json(&plain).contains("scope"));
        let scoped = parse_document("policies:\n  p: { breaker: {}, rate-limit: { rate: 5, scope: policy } }\n").unwrap().remove(0);
        let json = crate::policy::to_json(&scoped);
        assert_eq!(json.matches("\"scope\":\"policy\"").count(), 1, "{json}");
    }

    use crate::types::{OutcomeKind, Reason, VerdictKind};
    use crate::Engine;

    fn start(e: &mut Engine, call: u64, key: &str, now: u64) -> (Option<VerdictKind>, Reason) {
        let v = e.start(call, 0, key, 0, now, 0, 0, 0);
        (v.kind(), v.reason())
    }

    fn ok(e: &mut Engine, call: u64, now: u64) {
        let v = e.report(call, now, 1, OutcomeKind::Success, 0, "", 0, 0);
        assert_eq!(v.kind(), Some(VerdictKind::Done));
    }

    #[test]
    fn a_shared_bulkhead_counts_every_keys_attempts_and_hedges() {
        // A hedge is one more attempt in flight: it is counted by the policy's one limit.
        let doc = "policies:\n  p:\n    hedge: { attempts: 2, delay: 10ms }\n    bulkhead: { max-concurrent: 2, scope: policy }\n";
        let mut e = Engine::load(doc, 7).unwrap();
        assert_eq!(e.start(1, 0, "a", 0, 0, 0, 0, 0).kind(), Some(VerdictKind::Hedge));
        assert_eq!(e.in_flight(0, "b"), 1, "the shared count, read through any key");
        let cmds = e.hedge_step(1, 10_000_000);
        assert!(cmds.iter().any(|c| matches!(c, crate::HedgeCommand::Start { attempt: 2, .. })), "{cmds:?}");
        assert_eq!(e.in_flight(0, ""), 2);
        assert_eq!(start(&mut e, 2, "b", 10_000_001), (Some(VerdictKind::Fail), Reason::BulkheadFull));
    }

    #[test]
    fn a_shared_limit_is_not_a_key_and_outlives_every_key() {
        let doc = "policies:\n  p:\n    attempts: 1\n    keys: { max: 2 }\n    rate-limit: { rate: 1, per: 1h, burst: 1, scope: policy }\n";
        let mut e = Engine::load(doc, 7).unwrap();
        assert_eq!(start(&mut e, 1, "a", 0).0, Some(VerdictKind::Attempt));
        ok(&mut e, 1, 1);
        for i in 0..100u64 {
            assert_eq!(start(&mut e, 10 + i, &format!("k{i}"), 2 + i), (Some(VerdictKind::Fail), Reason::RateLimited));
        }
        // Two keys of its own at most, and the shared entry beside them.
        assert_eq!(e.key_count(0), 3);
        // An unkeyed call is decided against the same state.
        assert_eq!(start(&mut e, 500, "", 200), (Some(VerdictKind::Fail), Reason::RateLimited));
    }

    #[test]
    fn a_reload_that_adds_scope_policy_adopts_the_unkeyed_state() {
        // The unkeyed key's breaker was opened before the reload; the reload makes the breaker
        // the policy's: that open breaker is now every key's, never a fresh closed one.
        let before =
            "policies:\n  p:\n    attempts: 1\n    breaker: { window: { kind: count, size: 2 }, minimum-calls: 2, open-duration: 1h }\n";
        let mut e = Engine::load(before, 7).unwrap();
        for call in 1..=2 {
            assert_eq!(start(&mut e, call, "", call).0, Some(VerdictKind::Attempt));
            e.report(call, call + 1, 1, OutcomeKind::ConnectionError, 0, "", 0, 0);
        }
        assert_eq!(start(&mut e, 3, "", 10), (Some(VerdictKind::Fail), Reason::BreakerOpen));
        assert_eq!(start(&mut e, 4, "x", 11).0, Some(VerdictKind::Attempt), "scope: key, a fresh key");
        ok(&mut e, 4, 12);
        e.reload(&before.replace("open-duration: 1h", "open-duration: 1h, scope: policy")).unwrap();
        assert_eq!(start(&mut e, 5, "y", 20), (Some(VerdictKind::Fail), Reason::BreakerOpen));
        assert_eq!(start(&mut e, 6, "", 21), (Some(VerdictKind::Fail), Reason::BreakerOpen));
    }
}

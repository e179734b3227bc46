//! A policy written back as JSON with every default filled in (`levee check`, `policy-json`):
//! each strategy writes its own section, beside its parser.

use super::Policy;
use crate::classify;
use crate::doc::{obj, Value};
use crate::fallback;
use crate::scope::Scope;
use crate::time::format_duration;

/// A policy with every default filled in, as a JSON tree (durations in their text form).
pub fn policy_to_json(p: &Policy) -> Value {
    let d = |ns: Option<u64>| Value::from(ns.map(format_duration));
    let or_null = |v: Option<Value>| v.unwrap_or(Value::Null);
    let mut out = obj([
        ("name", p.name.as_str().into()),
        ("attempts", p.attempts_preset.written(p.attempts).into()),
        ("attempts-preset", p.attempts_preset.name().into()),
        ("attempt-timeout", d(p.attempt_timeout)),
        ("deadline", d(p.deadline)),
        ("backoff", p.backoff.to_json()),
        ("retry-on", p.retry_on.texts().into()),
        ("never-retry", p.never_retry.texts().into()),
        ("idempotent-methods", classify::method_names(p.idempotent_methods).into()),
        ("retry-after", p.retry_after.to_json()),
        ("budget", or_null(p.budget.as_ref().map(|b| b.to_json()))),
        ("breaker", or_null(p.breaker.as_ref().map(|b| b.to_json()))),
        ("rate-limit", or_null(p.rate_limit.as_ref().map(|r| r.to_json()))),
        ("bulkhead", or_null(p.bulkhead.as_ref().map(|b| b.to_json()))),
        ("fallbacks", fallback::to_json(&p.fallbacks)),
        ("keys", obj([("max", p.max_keys.into())])),
        ("durable", obj([("lease", format_duration(p.durable.lease).into()), ("max-crashes", p.durable.max_crashes.into())])),
    ]);
    // Sections added after the first release appear only when a policy has them, so that a
    // policy's JSON, and the hash of it that durable records carry, stay as they were.
    if let (Value::Map(entries), Some(c)) = (&mut out, &p.concurrency) {
        entries.push(("concurrency".to_string(), c.to_json()));
    }
    if let (Value::Map(entries), Some(h)) = (&mut out, &p.hedge) {
        entries.push(("hedge".to_string(), h.to_json()));
    }
    // `scope` is written only where it is `policy`, for the same reason.
    let s = &p.scopes;
    for (field, scope) in
        [("breaker", s.breaker), ("rate-limit", s.rate_limit), ("budget", s.budget), ("bulkhead", s.limit), ("concurrency", s.limit)]
    {
        if scope != Scope::Policy {
            continue;
        }
        if let Value::Map(entries) = &mut out {
            if let Some((_, Value::Map(section))) = entries.iter_mut().find(|(k, _)| k == field) {
                section.push(("scope".to_string(), scope.name().into()));
            }
        }
    }
    out
}

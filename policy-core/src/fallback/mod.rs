//! Fallbacks: a chain of named fallbacks the host registered, each triggered by the reasons
//! it lists. When the retry loop stops without success, the first fallback whose triggers
//! include the reason is chosen; when it fails, the next one whose triggers include it.

use crate::doc::{self, obj, Fields, Value};
use crate::error::LoadError;
use crate::read::describe;
use crate::types::Reason;

/// Most fallbacks in a chain (a verdict names one by an index byte).
pub const MAX_FALLBACKS: usize = 255;
/// Longest fallback name.
pub const MAX_NAME: usize = 128;

/// A fallback of the chain.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FallbackCfg {
    /// The name the host registered the fallback under.
    pub name: String,
    /// The reasons that trigger it (default: every failure reason, [`FALLBACK_TRIGGERS`]).
    pub on: Vec<Reason>,
}

/// Reasons a fallback may be triggered by (`any` is all of them).
pub const FALLBACK_TRIGGERS: &[Reason] = &[
    Reason::Deadline,
    Reason::RetriesExhausted,
    Reason::NonRetryable,
    Reason::Budget,
    Reason::BreakerOpen,
    Reason::RateLimited,
    Reason::BulkheadFull,
    Reason::NonIdempotent,
    Reason::RetryAfterTooLong,
    Reason::Pushback,
];

/// The first fallback at or after `from` that `reason` triggers, with its index.
pub fn next(chain: &[FallbackCfg], from: usize, reason: Reason) -> Option<(usize, &FallbackCfg)> {
    chain.iter().enumerate().skip(from).find(|(_, f)| f.on.contains(&reason))
}

/// Parse `fallbacks`.
pub(crate) fn parse(path: &str, v: &Value, errors: &mut Vec<LoadError>) -> Vec<FallbackCfg> {
    let Value::List(items) = v else {
        errors.push(LoadError::new(path, format!("must be a list of fallbacks (names, or {{name, on}}), found {}", v.type_name())));
        return Vec::new();
    };
    if items.len() > MAX_FALLBACKS {
        errors.push(LoadError::new(path, "holds more than 255 fallbacks"));
        return Vec::new();
    }
    let mut out: Vec<FallbackCfg> = Vec::new();
    for (i, item) in items.iter().enumerate() {
        let ip = format!("{path}[{i}]");
        let fb = match item {
            Value::Str(name) => Some(FallbackCfg { name: name.clone(), on: FALLBACK_TRIGGERS.to_vec() }),
            other => Fields::new(&ip, other, errors).and_then(|mut f| {
                let name = match f.take("name") {
                    Some(Value::Str(s)) => Some(s.clone()),
                    Some(other) => {
                        errors.push(LoadError::new(&f.path_of("name"), format!("must be a string, found {}", describe(other))));
                        None
                    }
                    None => {
                        errors.push(LoadError::new(&f.path_of("name"), "is required"));
                        None
                    }
                };
                let on = match f.take("on") {
                    None => FALLBACK_TRIGGERS.to_vec(),
                    Some(v) => triggers(&f.path_of("on"), v, errors),
                };
                f.finish(&["name", "on"], errors);
                name.map(|name| FallbackCfg { name, on })
            }),
        };
        if let Some(fb) = fb {
            if fb.name.is_empty() || fb.name.len() > MAX_NAME {
                errors.push(LoadError::new(&ip, "a fallback name is 1 to 128 characters"));
            } else if out.iter().any(|o| o.name == fb.name) {
                errors.push(LoadError::new(&ip, format!("fallback `{}` is listed twice", fb.name)));
            } else {
                out.push(fb);
            }
        }
    }
    out
}

fn triggers(path: &str, v: &Value, errors: &mut Vec<LoadError>) -> Vec<Reason> {
    let Value::List(items) = v else {
        errors.push(LoadError::new(path, format!("must be a list of reasons, found {}", v.type_name())));
        return Vec::new();
    };
    let mut out = Vec::new();
    for (i, item) in items.iter().enumerate() {
        match item {
            Value::Str(s) if s == "any" => out.extend_from_slice(FALLBACK_TRIGGERS),
            Value::Str(s) => match Reason::from_name(s).filter(|r| FALLBACK_TRIGGERS.contains(r)) {
                Some(r) => out.push(r),
                None => {
                    let names: Vec<&str> = FALLBACK_TRIGGERS.iter().map(|r| r.name()).collect();
                    let hint = doc::closest(s, &names).map(|n| format!("; did you mean `{n}`?")).unwrap_or_default();
                    errors.push(LoadError::new(
                        &format!("{path}[{i}]"),
                        format!("`{s}` is not a fallback trigger{hint} (use any, {})", doc::list(&names)),
                    ));
                }
            },
            other => errors.push(LoadError::new(&format!("{path}[{i}]"), format!("must be a reason name, found {}", describe(other)))),
        }
    }
    // In the reasons' order, each once (a filter of the enum's cases, not a sort: the
    // component carries no sort of reasons for it).
    Reason::ALL.iter().copied().filter(|r| out.contains(r)).collect()
}

/// The chain as the policy's JSON shows it.
pub(crate) fn to_json(chain: &[FallbackCfg]) -> Value {
    Value::List(
        chain
            .iter()
            .map(|f| obj([("name", f.name.as_str().into()), ("on", Value::from(f.on.iter().map(|r| r.name()).collect::<Vec<_>>()))]))
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_chain_is_searched_from_an_index() {
        let chain = vec![
            FallbackCfg { name: "a".into(), on: vec![Reason::BreakerOpen] },
            FallbackCfg { name: "b".into(), on: FALLBACK_TRIGGERS.to_vec() },
        ];
        assert_eq!(next(&chain, 0, Reason::BreakerOpen).map(|(i, _)| i), Some(0));
        assert_eq!(next(&chain, 1, Reason::BreakerOpen).map(|(i, _)| i), Some(1));
        assert_eq!(next(&chain, 0, Reason::Deadline).map(|(i, _)| i), Some(1));
        assert_eq!(next(&chain, 2, Reason::Deadline), None);
    }
}

//! The core's own constants agree with `wit/constants.json` and the WIT's enumerations, the one
//! source from which every host's table is generated (`wit/gen_constants.py`).

use levee_core::classify::HTTP_METHODS;
use levee_core::types::{BreakerState, EventKind, InvalidCode, OutcomeKind, Reason, VerdictKind, PAYLOAD_MAX};
use levee_core::{FLAG_CALLER_NO_RETRY, FLAG_CALLER_RETRY, FLAG_IDEMPOTENCY_KEY, FLAG_NON_IDEMPOTENT, FLAG_OVERLOADED};
use serde_json::Value;

fn constants() -> Value {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../wit/constants.json");
    let text = std::fs::read_to_string(path).unwrap_or_default();
    serde_json::from_str(&text).unwrap_or(Value::Null)
}

fn at<'a>(v: &'a Value, path: &[&str]) -> &'a Value {
    path.iter().fold(v, |v, k| v.get(k).unwrap_or(&Value::Null))
}

fn wit_enum(name: &str) -> Vec<String> {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../wit/levee.wit");
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let head = format!("enum {name} {{");
    let Some(start) = text.find(&head) else { return Vec::new() };
    let body = text.get(start + head.len()..).unwrap_or("");
    let body = body.split('}').next().unwrap_or("");
    body.lines().map(|l| l.split("//").next().unwrap_or("").trim().trim_end_matches(',').to_string()).filter(|l| !l.is_empty()).collect()
}

#[test]
fn flags_and_verdict_layout_agree() {
    let c = constants();
    assert_eq!(at(&c, &["start_flags", "NON_IDEMPOTENT"]).as_u64(), Some(u64::from(FLAG_NON_IDEMPOTENT)));
    assert_eq!(at(&c, &["start_flags", "IDEMPOTENCY_KEY"]).as_u64(), Some(u64::from(FLAG_IDEMPOTENCY_KEY)));
    assert_eq!(at(&c, &["report_flags", "OVERLOADED"]).as_u64(), Some(u64::from(FLAG_OVERLOADED)));
    assert_eq!(at(&c, &["report_flags", "CALLER_RETRY"]).as_u64(), Some(u64::from(FLAG_CALLER_RETRY)));
    assert_eq!(at(&c, &["report_flags", "CALLER_NO_RETRY"]).as_u64(), Some(u64::from(FLAG_CALLER_NO_RETRY)));
    assert_eq!(at(&c, &["verdict", "PAYLOAD_MAX"]).as_u64(), Some(PAYLOAD_MAX));
    let kinds: Vec<&str> =
        at(&c, &["verdict", "kinds"]).as_array().map(|a| a.iter().filter_map(Value::as_str).collect()).unwrap_or_default();
    let all = [
        VerdictKind::Attempt,
        VerdictKind::Wait,
        VerdictKind::Done,
        VerdictKind::Retry,
        VerdictKind::Fallback,
        VerdictKind::Fail,
        VerdictKind::Invalid,
        VerdictKind::Hedge,
    ];
    let core: Vec<&str> = all.iter().map(|k| k.name()).collect();
    for (i, k) in all.iter().enumerate() {
        assert_eq!(*k as usize, i);
    }
    assert_eq!(kinds, core);
    for code in InvalidCode::ALL.iter().skip(1) {
        assert_eq!(at(&c, &["verdict", "invalid_codes", code.name()]).as_u64(), Some(*code as u64), "{}", code.name());
    }
    // A packed verdict puts the fields where the layout says.
    let v = levee_core::types::Verdict::new(VerdictKind::Retry, 9, 1234).with_events(true).with_wakes(true);
    let shift = |k: &str| at(&c, &["verdict", k]).as_u64().unwrap_or(99);
    assert_eq!(v.0 & shift("KIND_MASK"), VerdictKind::Retry as u64);
    assert_ne!(v.0 & shift("EVENTS_BIT"), 0);
    assert_ne!(v.0 & shift("WAKES_BIT"), 0);
    assert_eq!(shift("EVENTS_BIT") & shift("WAKES_BIT"), 0);
    assert_eq!(v.0 & shift("RESERVED_MASK"), 0);
    assert_eq!((v.0 >> shift("DETAIL_SHIFT")) & shift("DETAIL_MASK"), 9);
    assert_eq!(v.0 >> shift("PAYLOAD_SHIFT"), 1234);
}

#[test]
fn methods_agree() {
    let c = constants();
    for (code, name) in HTTP_METHODS.iter().enumerate().skip(1) {
        assert_eq!(at(&c, &["methods", "codes", name]).as_u64(), Some(code as u64), "{name}");
    }
    let listed = at(&c, &["methods", "codes"]).as_object().map(|m| m.len()).unwrap_or(0);
    assert_eq!(listed, HTTP_METHODS.len() - 1);
}

#[test]
fn enumerations_agree_with_the_wit() {
    let names = |all: Vec<&'static str>| all.into_iter().map(String::from).collect::<Vec<_>>();
    assert_eq!(wit_enum("reason"), names(Reason::ALL.iter().map(|r| r.name()).collect()));
    assert_eq!(wit_enum("outcome-kind"), names(OutcomeKind::ALL.iter().map(|r| r.name()).collect()));
    assert_eq!(wit_enum("breaker-state"), names(BreakerState::ALL.iter().map(|r| r.name()).collect()));
    assert_eq!(wit_enum("event-kind"), names(EventKind::ALL.iter().map(|r| r.name()).collect()));
}

#[test]
fn key_bound_agrees() {
    let c = constants();
    assert_eq!(at(&c, &["guards", "MAX_KEY_BYTES"]).as_u64(), Some(levee_core::MAX_KEY_BYTES as u64));
    assert_eq!(at(&c, &["guards", "STATE_PAGE_BYTES"]).as_u64(), Some(levee_core::STATE_PAGE_BYTES as u64));
}

#[test]
fn hedge_bound_agrees() {
    let c = constants();
    assert_eq!(at(&c, &["hedge", "MAX_ATTEMPTS"]).as_u64(), Some(u64::from(levee_core::hedge::MAX_ATTEMPTS_POLLY)));
}

#[test]
fn the_durable_executors_host_rules_agree() {
    let c = constants();
    let tries = at(&c, &["durable", "OPERATOR_TRIES"]).as_u64();
    assert_eq!(tries, Some(u64::from(levee_core::durable_exec::OPERATOR_TRIES)));
}

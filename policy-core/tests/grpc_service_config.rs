//! gRPC's service config both ways (`levee_core::grpc::service_config`), against the data in
//! `grpc/service-config/`:
//!
//! - every `NAME.json` imports to `NAME.levee.yaml` and exports back to `NAME.export.json`
//!   (pinned; `LEVEE_BLESS=1` rewrites them), the document loads in the core, and the export
//!   is the input as gRPC reads it (maxAttempts capped at 5, tokenRatio to 3 decimals, ...);
//! - export then import gives the same policies (a fixed point), and a policy written by hand
//!   keeps what gRPC can express;
//! - every case of `errors.json` fails with the JSON paths and reasons it lists;
//! - the imported A6 examples decide as gRFC A6 describes (retries, backoff, pushback,
//!   throttling, the hedging timeline), run through the engine.
#![allow(clippy::indexing_slicing, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeMap;
use std::path::PathBuf;

use levee_core::grpc::service_config::{export, import, parse_grpc_duration, MethodName, Select};
use levee_core::policy::parse_document;
use levee_core::time::{MILLISECOND as MS, SECOND};
use levee_core::{Engine, HedgeCommand, OutcomeKind, Reason, Verdict, VerdictKind};
use serde_json::Value;

fn data() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../grpc/service-config")
}

fn bless() -> bool {
    std::env::var_os("LEVEE_BLESS").is_some()
}

fn pinned(name: &str, got: &str) {
    let path = data().join(name);
    if bless() {
        std::fs::write(&path, got).unwrap();
        return;
    }
    let want = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e} (LEVEE_BLESS=1 writes it)", path.display()));
    assert_eq!(got, want, "{} differs from what the conversion gives (LEVEE_BLESS=1 rewrites it)", path.display());
}

fn inputs() -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(data())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".json") && !n.ends_with(".export.json") && n != "errors.json")
        .collect();
    names.sort();
    assert!(names.len() >= 3, "{names:?}");
    names
}

// ---------------------------------------------------------------------------------------
// The service config as gRPC reads it, computed here independently of the conversion.
// ---------------------------------------------------------------------------------------

fn field<'a>(o: &'a Value, name: &str) -> Option<&'a Value> {
    o.as_object()?.iter().find(|(k, _)| k.eq_ignore_ascii_case(name)).map(|(_, v)| v)
}

const NAMES: [&str; 17] = [
    "OK",
    "CANCELLED",
    "UNKNOWN",
    "INVALID_ARGUMENT",
    "DEADLINE_EXCEEDED",
    "NOT_FOUND",
    "ALREADY_EXISTS",
    "PERMISSION_DENIED",
    "RESOURCE_EXHAUSTED",
    "FAILED_PRECONDITION",
    "ABORTED",
    "OUT_OF_RANGE",
    "UNIMPLEMENTED",
    "INTERNAL",
    "UNAVAILABLE",
    "DATA_LOSS",
    "UNAUTHENTICATED",
];

fn codes(v: Option<&Value>) -> Vec<u64> {
    let mut out: Vec<u64> = v
        .and_then(Value::as_array)
        .map(|a| {
            a.iter()
                .map(|c| c.as_u64().unwrap_or_else(|| NAMES.iter().position(|n| Some(*n) == c.as_str()).unwrap() as u64))
                .filter(|c| *c != 0)
                .collect()
        })
        .unwrap_or_default();
    out.sort_unstable();
    out.dedup();
    out
}

fn dur(v: Option<&Value>) -> Option<u64> {
    v.map(|d| parse_grpc_duration(d.as_str().unwrap()).unwrap())
}

fn milli(x: f64) -> i64 {
    // gRPC reads 3 decimals; the inputs here are exact in decimal.
    let text = format!("{x:.6}");
    let (w, f) = text.split_once('.').unwrap();
    w.parse::<i64>().unwrap() * 1000 + f[..3].parse::<i64>().unwrap()
}

/// Per method name: (timeout, retry, hedging), and the throttling.
type Semantics = (BTreeMap<(String, String), String>, Option<(i64, i64)>);

fn as_grpc_reads(text: &str) -> Semantics {
    let sc: Value = serde_json::from_str(text).unwrap();
    let mut methods = BTreeMap::new();
    for mc in field(&sc, "methodConfig").and_then(Value::as_array).unwrap() {
        let timeout = dur(field(mc, "timeout"));
        let retry = field(mc, "retryPolicy").map(|r| {
            let initial = dur(field(r, "initialBackoff")).unwrap();
            let max = dur(field(r, "maxBackoff")).unwrap();
            format!(
                "retry attempts={} initial={} max={} multiplier={} codes={:?}",
                field(r, "maxAttempts").unwrap().as_u64().unwrap().min(5),
                initial.min(max),
                max,
                field(r, "backoffMultiplier").unwrap().as_f64().unwrap(),
                codes(field(r, "retryableStatusCodes"))
            )
        });
        let hedging = field(mc, "hedgingPolicy").map(|h| {
            format!(
                "hedging attempts={} delay={} codes={:?}",
                field(h, "maxAttempts").unwrap().as_u64().unwrap().min(5),
                dur(field(h, "hedgingDelay")).unwrap_or(0),
                codes(field(h, "nonFatalStatusCodes"))
            )
        });
        for n in field(mc, "name").and_then(Value::as_array).unwrap() {
            let s = |k| field(n, k).and_then(Value::as_str).unwrap_or("").to_string();
            methods.insert((s("service"), s("method")), format!("timeout={timeout:?} {retry:?} {hedging:?}"));
        }
    }
    let throttling = field(&sc, "retryThrottling")
        .map(|t| (milli(field(t, "maxTokens").unwrap().as_f64().unwrap()), milli(field(t, "tokenRatio").unwrap().as_f64().unwrap())));
    (methods, throttling)
}

// ---------------------------------------------------------------------------------------
// Pinned conversions and round trips
// ---------------------------------------------------------------------------------------

#[test]
fn every_config_imports_loads_and_exports_back_as_grpc_reads_it() {
    for name in inputs() {
        let stem = name.trim_end_matches(".json");
        let text = std::fs::read_to_string(data().join(&name)).unwrap();
        let imported = import(&text, &name).unwrap_or_else(|e| panic!("{name}: {e:?}"));
        pinned(&format!("{stem}.levee.yaml"), &imported.document);
        assert!(imported.document.starts_with(&format!("# A Levee policy document imported from the gRPC service config {name}\n")));
        // It loads in the core, every policy of it.
        let engine = Engine::load(&imported.document, 1).unwrap_or_else(|e| panic!("{name}: {e:?}"));
        assert_eq!(engine.policy_count() as usize, imported.policies.len(), "{name}");
        for (policy, pattern) in &imported.policies {
            assert!(engine.policy_index(policy).is_some(), "{name}: {policy}");
            assert_eq!(MethodName::from_policy_name(policy).as_ref(), Some(pattern), "{name}: {policy}");
        }
        // Import then export: the same service config, where a policy can say it.
        let exported = export(&imported.document, Select::All).unwrap_or_else(|e| panic!("{name}: {e:?}"));
        pinned(&format!("{stem}.export.json"), &exported.json);
        assert_eq!(as_grpc_reads(&exported.json), as_grpc_reads(&text), "{name}: the export is not the input as gRPC reads it");
        // Export then import: the same policies (a fixed point).
        let again = import(&exported.json, "again").unwrap();
        assert_eq!(parse_document(&again.document).unwrap(), parse_document(&imported.document).unwrap(), "{name}");
        assert_eq!(export(&again.document, Select::All).unwrap().json, exported.json, "{name}");
    }
}

#[test]
fn the_a6_retry_example_imports_as_written() {
    let text = std::fs::read_to_string(data().join("a6-retry.json")).unwrap();
    let p = parse_document(&import(&text, "a6-retry.json").unwrap().document).unwrap().remove(0);
    assert_eq!(p.name, "levee.flaky.v1.Flaky-Unary");
    assert_eq!(p.attempts, 4);
    assert_eq!((p.backoff.base, p.backoff.cap, p.backoff.multiplier), (100 * MS, SECOND, 2.0));
    assert_eq!(p.backoff.jitter.name(), "full");
    assert_eq!(p.retry_on.texts(), ["grpc:unavailable"]);
    assert_eq!(p.deadline, None);
    assert_eq!(format!("{:?}", p.budget), "Some(Token { max_milli: 10000, ratio_milli: 100 })");
    assert!(p.breaker.is_none() && p.rate_limit.is_none() && p.hedge.is_none());
}

#[test]
fn the_a6_hedging_example_imports_as_written() {
    let text = std::fs::read_to_string(data().join("a6-hedging.json")).unwrap();
    let p = parse_document(&import(&text, "a6-hedging.json").unwrap().document).unwrap().remove(0);
    let h = p.hedge.as_ref().unwrap();
    assert_eq!((h.attempts, h.delay, h.preset.name()), (4, 500 * MS, "grpc"));
    assert_eq!(h.non_fatal.texts(), ["grpc:aborted", "grpc:internal", "grpc:unavailable"]);
    assert_eq!(p.attempts, 1, "a hedged call is not retried");
}

#[test]
fn a_hand_written_policy_keeps_what_grpc_can_express() {
    let doc = r#"
policies:
  checkout:
    attempts: 4
    deadline: 3s
    attempt-timeout: 800ms
    backoff: { base: 50ms, cap: 2s, multiplier: 3 }
    retry-on: ["grpc:unavailable", "grpc:resource-exhausted+pushback", "grpc:aborted", timeout, "http:503", "error:Boom"]
    never-retry: ["grpc:aborted"]
    budget: { kind: token, max-tokens: 20, token-ratio: 0.25 }
    breaker: {}
    rate-limit: { rate: 10 }
    fallbacks: [cached]
"#;
    let out = export(doc, Select::Named("checkout")).unwrap();
    let sc: Value = serde_json::from_str(&out.json).unwrap();
    let want = serde_json::json!({
        "methodConfig": [{
            "name": [{}],
            "timeout": "3s",
            "retryPolicy": {
                "maxAttempts": 4,
                "initialBackoff": "0.05s",
                "maxBackoff": "2s",
                "backoffMultiplier": 3,
                "retryableStatusCodes": ["UNAVAILABLE"]
            }
        }],
        "retryThrottling": {"maxTokens": 20, "tokenRatio": 0.25}
    });
    assert_eq!(sc, want, "{}", out.json);
    let notes: Vec<String> = out.notes.iter().map(|n| format!("{}: {}", n.path, n.message)).collect();
    for want in [
        "policies.checkout.attempt-timeout: 800ms: gRPC has no per-attempt timeout",
        "policies.checkout.retry-on: grpc:resource-exhausted+pushback: gRPC retries a status when it is listed",
        "policies.checkout.retry-on: error:Boom: a named error class has no gRPC status",
        "policies.checkout.retry-on: timeout: gRPC has no per-attempt timeout",
        "policies.checkout.retry-after: gRPC honours a server pushback of any length",
        "policies.checkout.breaker: gRPC has no circuit breaker",
        "policies.checkout.rate-limit: gRPC has no client rate limit",
        "policies.checkout.fallbacks: gRPC has no fallbacks",
        "retryThrottling: gRPC keeps one token bucket per server for every method of the channel; Levee keeps one per policy and key",
    ] {
        assert!(notes.iter().any(|n| n.starts_with(want)), "{want:?} in {notes:#?}");
    }
    // Export then import: the policy `default`, with everything gRPC expressed kept.
    let back = parse_document(&import(&out.json, "x").unwrap().document).unwrap().remove(0);
    let p = parse_document(doc).unwrap().remove(0);
    assert_eq!(back.name, "default");
    assert_eq!((back.attempts, back.deadline, &back.budget), (p.attempts, p.deadline, &p.budget));
    assert_eq!(
        (back.backoff.base, back.backoff.cap, back.backoff.multiplier, back.backoff.jitter),
        (50 * MS, 2 * SECOND, 3.0, p.backoff.jitter)
    );
    assert_eq!(back.retry_on.texts(), ["grpc:unavailable"]);
    assert!(back.breaker.is_none() && back.rate_limit.is_none() && back.fallbacks.is_empty() && back.attempt_timeout.is_none());
}

#[test]
fn backoff_kinds_and_limits_grpc_lacks_are_approximated_with_a_note() {
    let note_of = |doc: &str, field: &str| {
        let out = export(doc, Select::First).unwrap();
        let sc: Value = serde_json::from_str(&out.json).unwrap();
        let note = out.notes.iter().find(|n| n.path == format!("policies.p.{field}")).map(|n| n.message.clone());
        (sc["methodConfig"][0].clone(), note)
    };
    // constant: exponential with multiplier 1 is the same backoff.
    let (mc, note) = note_of("policies:\n  p: { backoff: { kind: constant, base: 1s }, retry-on: [\"grpc:14\"] }\n", "backoff.kind");
    assert_eq!(mc["retryPolicy"]["backoffMultiplier"], 1);
    assert_eq!(mc["retryPolicy"]["maxBackoff"], "1s");
    assert_eq!(note, None);
    let (mc, note) =
        note_of("policies:\n  p: { attempts: 5, backoff: { kind: linear, base: 1s }, retry-on: [\"grpc:14\"] }\n", "backoff.kind");
    assert_eq!(mc["retryPolicy"]["backoffMultiplier"], 1.587);
    assert!(note.unwrap().starts_with("linear has no gRPC form"));
    let (_, note) = note_of("policies:\n  p: { backoff: { kind: decorrelated }, retry-on: [\"grpc:14\"] }\n", "backoff.kind");
    assert!(note.unwrap().starts_with("decorrelated has no gRPC form"));
    let (_, note) = note_of("policies:\n  p: { backoff: { jitter: equal }, retry-on: [\"grpc:14\"] }\n", "backoff.jitter");
    assert_eq!(note.unwrap(), "equal: gRPC's jitter is always full (a delay in [0, backoff])");
    let (mc, note) = note_of("policies:\n  p: { attempts: 9, retry-on: [\"grpc:14\"] }\n", "attempts");
    assert_eq!(mc["retryPolicy"]["maxAttempts"], 5);
    assert_eq!(note.unwrap(), "9: gRPC makes at most 5 attempts of a call");
    // No gRPC status retried: no retryPolicy.
    let (mc, note) = note_of("policies:\n  p: { retry-on: [\"http:503\"] }\n", "retry-on");
    assert!(mc.get("retryPolicy").is_none(), "{mc}");
    assert!(note.unwrap().starts_with("retries no gRPC status"));
    // Hedging: the preset's differences.
    let (mc, note) = note_of("policies:\n  p: { hedge: { attempts: 7, preset: polly, delay: 100ms } }\n", "hedge.preset");
    assert_eq!(mc["hedgingPolicy"]["maxAttempts"], 5);
    assert_eq!(mc["hedgingPolicy"]["hedgingDelay"], "0.1s");
    assert!(note.unwrap().contains("the primary's"));
    // A ratio budget has no gRPC form.
    let (_, note) = note_of("policies:\n  p: { budget: { kind: ratio } }\n", "budget");
    assert!(note.unwrap().starts_with("the ratio budget has no gRPC form"));
}

#[test]
fn a_document_exports_by_policy_names_and_refuses_names_that_are_not_patterns() {
    let doc = "policies:\n  default: { attempts: 1 }\n  a.B-C: { retry-on: [\"grpc:unavailable\"] }\n  a.B-D: { retry-on: [\"grpc:unavailable\"] }\n";
    let sc: Value = serde_json::from_str(&export(doc, Select::All).unwrap().json).unwrap();
    assert_eq!(sc["methodConfig"][0]["name"], serde_json::json!([{}]));
    assert_eq!(sc["methodConfig"][1]["name"], serde_json::json!([{"service": "a.B", "method": "C"}, {"service": "a.B", "method": "D"}]));
    let e = export("policies:\n  payment-api-v2: {}\n", Select::All).unwrap_err();
    assert_eq!(e[0].path, "policies.payment-api-v2");
    assert!(e[0].message.contains("(--policy payment-api-v2)"), "{e:?}");
    let e = export("policies:\n  p: {}\n", Select::Named("q")).unwrap_err();
    assert_eq!(e[0].message, "the document has no policy `q`");
    // An invalid document: the core's own errors, with their paths.
    let e = export("policies:\n  p: { attempts: 0 }\n", Select::All).unwrap_err();
    assert_eq!(e[0].path, "policies.p.attempts");
}

#[test]
fn policy_names_and_method_names_read_back() {
    for (s, m, name) in [("", "", "default"), ("pkg.v1.Svc", "", "pkg.v1.Svc"), ("Svc", "Get_2", "Svc-Get_2"), ("_x.y", "z", "_x.y-z")] {
        let n = MethodName { service: s.into(), method: m.into() };
        assert_eq!(n.policy_name(), name);
        assert_eq!(MethodName::from_policy_name(name), Some(n));
    }
    for bad in ["", "a-", "-a", "a-b-c", "a..b", "1a", "a.b-c.d", "checkout v2"] {
        assert_eq!(MethodName::from_policy_name(bad), None, "{bad}");
    }
}

// ---------------------------------------------------------------------------------------
// Errors, with their JSON paths
// ---------------------------------------------------------------------------------------

#[test]
fn every_error_case_names_its_json_path() {
    let cases: Value = serde_json::from_str(&std::fs::read_to_string(data().join("errors.json")).unwrap()).unwrap();
    let cases = cases.as_array().unwrap();
    assert!(cases.len() >= 20);
    for case in cases {
        let name = case["name"].as_str().unwrap();
        let text = match &case["config"] {
            Value::String(s) => s.clone(),
            v => v.to_string(),
        };
        let errors = import(&text, "case").err().unwrap_or_else(|| panic!("{name}: imported"));
        let got: Vec<(String, String)> = errors.iter().map(|e| (e.path.clone(), e.message.clone())).collect();
        let want = case["errors"].as_array().unwrap();
        assert_eq!(got.len(), want.len(), "{name}: {got:#?}");
        for (w, (path, message)) in want.iter().zip(&got) {
            assert_eq!(path, w["path"].as_str().unwrap(), "{name}: {got:#?}");
            let part = w["message"].as_str().unwrap();
            assert!(message.contains(part), "{name}: {message:?} does not say {part:?}");
        }
    }
}

#[test]
fn no_input_panics() {
    // Every prefix of every config, and each with one character left out: an answer, never a panic.
    for name in inputs() {
        let text = std::fs::read_to_string(data().join(&name)).unwrap();
        let chars: Vec<(usize, char)> = text.char_indices().collect();
        for (i, c) in &chars {
            let _ = import(&text[..*i], "p");
            let mut t = text.clone();
            t.replace_range(*i..*i + c.len_utf8(), "");
            let _ = import(&t, "p");
        }
    }
}

// ---------------------------------------------------------------------------------------
// The imported A6 examples decide as A6 describes
// ---------------------------------------------------------------------------------------

fn engine(name: &str, seed: u64) -> Engine {
    let text = std::fs::read_to_string(data().join(name)).unwrap();
    Engine::load(&import(&text, name).unwrap().document, seed).unwrap()
}

const UNAVAILABLE: i32 = 14;
const INVALID_ARGUMENT: i32 = 3;
const INTERNAL: i32 = 13;
const ABORTED: i32 = 10;

fn grpc(e: &mut Engine, call: u64, now: u64, code: i32, pushback: &str) -> Verdict {
    e.report(call, now, 10 * MS, OutcomeKind::GrpcStatus, code, pushback, 0, 0)
}

#[test]
fn a6_retry_retries_unavailable_with_full_jitter_backoff_up_to_4_attempts() {
    for seed in 0..50 {
        let mut e = engine("a6-retry.json", seed);
        let mut now = 0;
        assert_eq!(e.start(1, 0, "", 0, now, 0, 0, 0).kind(), Some(VerdictKind::Attempt));
        // Retry n waits U(0, min(0.1s * 2^(n-1), 1s)): below 100, 200, 400 ms.
        for (n, bound) in [(1, 100 * MS), (2, 200 * MS), (3, 400 * MS)] {
            now += 10 * MS;
            let v = grpc(&mut e, 1, now, UNAVAILABLE, "");
            assert_eq!(v.kind(), Some(VerdictKind::Retry), "seed {seed} retry {n}");
            assert!(v.payload() < bound, "seed {seed} retry {n}: {v:?}");
            now += v.payload();
            assert_eq!(e.acquire(1, now).kind(), Some(VerdictKind::Attempt));
        }
        // The fourth attempt was the last: maxAttempts counts the first.
        let v = grpc(&mut e, 1, now + 10 * MS, UNAVAILABLE, "");
        assert_eq!((v.kind(), v.reason()), (Some(VerdictKind::Fail), Reason::RetriesExhausted));
    }
}

#[test]
fn a6_retry_never_retries_a_status_it_does_not_list() {
    let mut e = engine("a6-retry.json", 1);
    e.start(1, 0, "", 0, 0, 0, 0, 0);
    let v = grpc(&mut e, 1, 5 * MS, INVALID_ARGUMENT, "");
    assert_eq!((v.kind(), v.reason()), (Some(VerdictKind::Fail), Reason::NonRetryable));
    // Nor RESOURCE_EXHAUSTED, even with a pushback: a pushback says when, not whether.
    e.start(2, 0, "", 0, 0, 0, 0, 0);
    let v = grpc(&mut e, 2, 5 * MS, 8, "10");
    assert_eq!((v.kind(), v.reason()), (Some(VerdictKind::Fail), Reason::NonRetryable));
}

#[test]
fn a6_retry_pushback_sets_the_delay_and_restarts_the_backoff() {
    for seed in 0..20 {
        let mut e = engine("a6-retry.json", seed);
        e.start(1, 0, "", 0, 0, 0, 0, 0);
        let v = grpc(&mut e, 1, 10 * MS, UNAVAILABLE, "");
        let mut now = 10 * MS + v.payload();
        e.acquire(1, now);
        // A pushback of 750 ms: exactly that long, whatever the backoff.
        now += 10 * MS;
        let v = grpc(&mut e, 1, now, UNAVAILABLE, "750");
        assert_eq!((v.kind(), v.payload()), (Some(VerdictKind::Retry), 750 * MS), "seed {seed}");
        now += v.payload();
        e.acquire(1, now);
        // "For subsequent retries, the delay period will be reset to the initialBackoff setting."
        now += 10 * MS;
        let v = grpc(&mut e, 1, now, UNAVAILABLE, "");
        assert!(v.kind() == Some(VerdictKind::Retry) && v.payload() < 100 * MS, "seed {seed}: {v:?}");
    }
    // A negative pushback: no retry.
    let mut e = engine("a6-retry.json", 1);
    e.start(1, 0, "", 0, 0, 0, 0, 0);
    let v = grpc(&mut e, 1, 10 * MS, UNAVAILABLE, "-1");
    assert_eq!((v.kind(), v.reason()), (Some(VerdictKind::Fail), Reason::Pushback));
}

#[test]
fn a6_throttling_allows_retries_only_above_half_the_tokens() {
    // maxTokens 10, tokenRatio 0.1: each retryable failure costs 1 token, a retry needs > 5.
    let mut e = engine("a6-retry.json", 1);
    let mut now = 0;
    for call in 1..=4 {
        e.start(call, 0, "", 0, now, 0, 0, 0);
        now += MS;
        let v = grpc(&mut e, call, now, UNAVAILABLE, "");
        assert_eq!(v.kind(), Some(VerdictKind::Retry), "call {call}: tokens {}", 11 - call);
        e.cancel(call, now);
    }
    assert_eq!(e.budget_tokens(0, ""), Some(6000));
    e.start(5, 0, "", 0, now, 0, 0, 0);
    now += MS;
    let v = grpc(&mut e, 5, now, UNAVAILABLE, "");
    assert_eq!((v.kind(), v.reason()), (Some(VerdictKind::Fail), Reason::Budget), "5 tokens are not more than half of 10");
    // A failure costs its token before the check: 10 successes bring 5 back to 6, and the
    // next failure to 5, not more than half: refused.
    let mut call = 10;
    let mut successes = |e: &mut Engine, n: u32, now: &mut u64| {
        for _ in 0..n {
            call += 1;
            e.start(call, 0, "", 0, *now, 0, 0, 0);
            *now += MS;
            assert_eq!(e.report(call, *now, MS, OutcomeKind::GrpcStatus, 0, "", 0, 0).kind(), Some(VerdictKind::Done));
        }
    };
    successes(&mut e, 10, &mut now);
    assert_eq!(e.budget_tokens(0, ""), Some(6000));
    e.start(6, 0, "", 0, now, 0, 0, 0);
    now += MS;
    assert_eq!(grpc(&mut e, 6, now, UNAVAILABLE, "").reason(), Reason::Budget);
    // 11 successes (0.1 each): 6.1, and the failure leaves 5.1, more than half: a retry.
    successes(&mut e, 11, &mut now);
    assert_eq!(e.budget_tokens(0, ""), Some(6100));
    e.start(7, 0, "", 0, now, 0, 0, 0);
    now += MS;
    assert_eq!(grpc(&mut e, 7, now, UNAVAILABLE, "").kind(), Some(VerdictKind::Retry));
    assert_eq!(e.budget_tokens(0, ""), Some(5100));
}

fn cmds(v: Vec<HedgeCommand>) -> String {
    v.iter()
        .map(|c| match c {
            HedgeCommand::Start { attempt, .. } => format!("start {attempt}"),
            HedgeCommand::Cancel { attempt } => format!("cancel {attempt}"),
            HedgeCommand::Wait { delay } => format!("wait {}ms", delay / MS),
            HedgeCommand::End { attempt, verdict } => {
                format!("end {attempt} {}", verdict.kind().map(VerdictKind::name).unwrap_or("?"))
            }
        })
        .collect::<Vec<_>>()
        .join(", ")
}

fn hedged(e: &mut Engine, call: u64, attempt: u32, now: u64, code: i32) -> String {
    cmds(e.report_attempt(call, attempt, now, 10 * MS, OutcomeKind::GrpcStatus, code, "", 0, 0))
}

#[test]
fn a6_hedging_follows_the_a6_timeline() {
    // A6: #1 at 0, #2 at 500, #1 fails UNAVAILABLE at 700 so #3 starts at 700, #2 succeeds at
    // 900 and #3 is cancelled; #4 never starts.
    let mut e = engine("a6-hedging.json", 1);
    assert_eq!(e.start(1, 0, "", 0, 0, 0, 0, 0).kind(), Some(VerdictKind::Hedge));
    assert_eq!(cmds(e.hedge_step(1, 0)), "wait 500ms");
    assert_eq!(cmds(e.hedge_step(1, 500 * MS)), "start 2, wait 500ms");
    assert_eq!(hedged(&mut e, 1, 1, 700 * MS, UNAVAILABLE), "start 3, wait 500ms");
    assert_eq!(hedged(&mut e, 1, 2, 900 * MS, 0), "cancel 3, end 2 done");
    assert_eq!(hedged(&mut e, 1, 3, 910 * MS, 1), "");
    assert_eq!(e.live_calls(), 0);
}

#[test]
fn a6_hedging_internal_and_aborted_are_non_fatal_the_rest_fatal() {
    let mut e = engine("a6-hedging.json", 1);
    e.start(1, 0, "", 0, 0, 0, 0, 0);
    e.hedge_step(1, 0);
    assert_eq!(hedged(&mut e, 1, 1, 100 * MS, INTERNAL), "start 2, wait 500ms");
    assert_eq!(hedged(&mut e, 1, 2, 200 * MS, ABORTED), "start 3, wait 500ms");
    // A fatal status ends the call and cancels the attempts in flight.
    assert_eq!(cmds(e.hedge_step(1, 700 * MS)), "start 4");
    assert_eq!(hedged(&mut e, 1, 3, 750 * MS, INVALID_ARGUMENT), "cancel 4, end 3 fail");
    // When every attempt fails non-fatally, the call fails: no retries after hedging.
    let mut e = engine("a6-hedging.json", 1);
    e.start(1, 0, "", 0, 0, 0, 0, 0);
    e.hedge_step(1, 0);
    let mut out = Vec::new();
    for (a, t) in [(1, 10), (2, 20), (3, 30), (4, 40)] {
        out.push(hedged(&mut e, 1, a, t * MS, UNAVAILABLE));
    }
    assert_eq!(out, ["start 2, wait 500ms", "start 3, wait 500ms", "start 4", "end 4 fail"]);
}

#[test]
fn a6_hedging_is_throttled_by_the_imported_tokens() {
    // Four non-fatal failures take 10 tokens to 6; two more to 4... A hedge needs > 5.
    let mut e = engine("a6-hedging.json", 1);
    e.start(1, 0, "", 0, 0, 0, 0, 0);
    e.hedge_step(1, 0);
    for (a, t) in [(1, 10), (2, 20), (3, 30), (4, 40)] {
        hedged(&mut e, 1, a, t * MS, UNAVAILABLE);
    }
    assert_eq!(e.budget_tokens(0, ""), Some(6000));
    e.start(2, 0, "", 0, 50 * MS, 0, 0, 0);
    e.hedge_step(2, 50 * MS);
    // 6 tokens: the failure costs one (5 left) and the next hedge is refused.
    assert_eq!(hedged(&mut e, 2, 1, 60 * MS, UNAVAILABLE), "end 1 fail");
    e.start(3, 0, "", 0, 70 * MS, 0, 0, 0);
    assert_eq!(cmds(e.hedge_step(3, 570 * MS)), "", "no hedge at 500 ms with 5 of 10 tokens");
}

//! Per-key state at production scale (docs/policy.md, "Keys"): eviction never forgets
//! protection, the recovery snapshot costs what the protected keys cost, and what the engine
//! exports it imports again.
#![allow(clippy::indexing_slicing, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use levee_core::{BreakerState, Engine, EventKind, OutcomeKind, Verdict, VerdictKind, OVERFLOW_KEY};
use proptest::prelude::*;

const MS: u64 = 1_000_000;
const S: u64 = 1_000 * MS;

/// A breaker per key (opens after 2 failures of 2), a spent-able limiter, a token budget, a
/// small key table.
const DOC: &str = "policies:\n  p:\n    attempts: 2\n    backoff: { kind: constant, base: 10ms, jitter: none }\n    \
                   breaker: { window: { kind: count, size: 2 }, minimum-calls: 2, open-duration: 1h }\n    \
                   rate-limit: { rate: 5, per: 1s, burst: 2 }\n    budget: { kind: token, max-tokens: 4, token-ratio: 0.5 }\n    \
                   keys: { max: 4 }\n";

fn fail(e: &mut Engine, id: u64, key: &str, now: u64) -> Verdict {
    let v = e.start(id, 0, key, 0, now, 0, 0, 0);
    if v.kind() != Some(VerdictKind::Attempt) {
        return v;
    }
    let v = e.report(id, now + 1, 1, OutcomeKind::HttpStatus, 503, "", 0, 0);
    e.cancel(id, now + 1);
    v
}

/// What key `a` decides at `now`: one call, reported as a failure, then its breaker state.
fn decisions_of_a(e: &mut Engine, id: u64, now: u64) -> (u64, Option<BreakerState>) {
    let v = fail(e, id, "a", now);
    (v.0 & !(3 << 4), e.breaker_state(0, "a", now + 2))
}

#[derive(Clone, Debug)]
enum Op {
    Call { key: u8, fail: bool, advance: u16 },
    Force { key: u8 },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (0u8..40, any::<bool>(), 0u16..400).prop_map(|(key, fail, advance)| Op::Call { key, fail, advance }),
        (0u8..40).prop_map(|key| Op::Force { key }),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, .. ProptestConfig::default() })]

    /// No sequence of operations on other keys changes what a protected key decides: key `a`
    /// (breaker open for an hour, limiter and budget spent) decides the same after any churn of
    /// other keys as with none.
    #[test]
    fn churn_on_other_keys_never_changes_a_protected_key(ops in prop::collection::vec(op(), 0..200), seed in any::<u64>()) {
        let mut quiet = Engine::load(DOC, seed).unwrap();
        let mut busy = Engine::load(DOC, seed).unwrap();
        for e in [&mut quiet, &mut busy] {
            fail(e, 1, "a", 0);
            fail(e, 2, "a", 1);
            prop_assert_eq!(e.breaker_state(0, "a", 2), Some(BreakerState::Open));
        }
        let mut now = 10;
        let mut id = 100;
        for o in &ops {
            match o {
                Op::Call { key, fail: f, advance } => {
                    now += u64::from(*advance) * MS;
                    id += 1;
                    let k = format!("k{key}");
                    let v = busy.start(id, 0, &k, 0, now, 0, 0, 0);
                    if v.kind() == Some(VerdictKind::Attempt) {
                        let (kind, code) = if *f { (OutcomeKind::HttpStatus, 503) } else { (OutcomeKind::Success, 0) };
                        busy.report(id, now + 1, 1, kind, code, "", 0, 0);
                    }
                    busy.cancel(id, now + 1);
                }
                Op::Force { key } => {
                    // An operator may force any key but one with no state of its own.
                    let _ = busy.set_breaker_state(0, &format!("k{key}"), BreakerState::ForcedClosed, now);
                }
            }
        }
        let at = now + 10 * MS;
        let _ = busy.drain_events();
        prop_assert_eq!(decisions_of_a(&mut quiet, 9_999, at), decisions_of_a(&mut busy, 9_999, at));
        for ev in busy.drain_events() {
            prop_assert!(!(ev.kind == EventKind::KeyEvicted && ev.name == "a"), "the protected key was evicted");
        }
    }
}

/// Keys held only by a limiter's debt go once it is repaid; until then a new key overflows.
#[test]
fn a_guarded_key_goes_once_its_protection_ends() {
    let mut e = Engine::load("policies:\n  p: { attempts: 1, rate-limit: { rate: 1, per: 1s, burst: 1 }, keys: { max: 1 } }\n", 3).unwrap();
    assert_eq!(e.start(1, 0, "a", 0, 0, 0, 0, 0).kind(), Some(VerdictKind::Attempt));
    e.report(1, 1, 1, OutcomeKind::Success, 0, "", 0, 0);
    assert_eq!(e.start(2, 0, "b", 0, 2, 0, 0, 0).kind(), Some(VerdictKind::Attempt), "b overflows, and the overflow entry admits");
    e.report(2, 3, 1, OutcomeKind::Success, 0, "", 0, 0);
    let kinds: Vec<EventKind> = e.drain_events().into_iter().map(|ev| ev.kind).collect();
    assert_eq!(kinds, [EventKind::KeyOverflow]);
    assert_eq!(e.start(3, 0, "c", 0, 4, 0, 0, 0).kind(), Some(VerdictKind::Fail), "c shares the overflow entry's spent limit");
    let _ = e.drain_events();
    // A second later a's debt is repaid: it is evicted for d.
    assert_eq!(e.start(4, 0, "d", 0, 2 * S, 0, 0, 0).kind(), Some(VerdictKind::Attempt));
    let evicted: Vec<String> = e.drain_events().into_iter().filter(|ev| ev.kind == EventKind::KeyEvicted).map(|ev| ev.name).collect();
    assert_eq!(evicted, ["a"]);
    assert_eq!(e.key_count(0), 2, "d and the overflow entry");
}

fn many_keys(n: usize, key_len: usize) -> Engine {
    let doc = "policies:\n  p:\n    attempts: 1\n    breaker: { window: { kind: count, size: 4 }, minimum-calls: 2, open-duration: 1h }\n    keys: { max: 1000000 }\n";
    let mut e = Engine::load(doc, 9).unwrap();
    for i in 0..n {
        let key = format!("{i:0>len$}", len = key_len);
        e.start(i as u64 + 1, 0, &key, 0, i as u64, 0, 0, 0);
        e.report(i as u64 + 1, i as u64, 1, OutcomeKind::Success, 0, "", 0, 0);
    }
    // One breaker open.
    for c in 0..2 {
        e.start(10_000_000 + c, 0, "open", 0, n as u64 + c, 0, 0, 0);
        e.report(10_000_000 + c, n as u64 + c, 1, OutcomeKind::Timeout, 0, "", 0, 0);
    }
    e.cancel(10_000_000, 0);
    e.cancel(10_000_001, 0);
    assert_eq!(e.breaker_state(0, "open", n as u64 + 5), Some(BreakerState::Open));
    e
}

/// The snapshot of 200,000 keys with one breaker open carries that key alone, and a fresh
/// engine that imports it keeps the breaker open.
#[test]
fn the_snapshot_carries_only_the_protected_keys() {
    let e = many_keys(200_000, 8);
    let snap = e.export_snapshot();
    assert!(snap.len() < 2_000, "snapshot of {} bytes", snap.len());
    let text = String::from_utf8(snap.clone()).unwrap();
    assert!(text.contains("\"open\"") && !text.contains("\"00000001\""), "{text}");
    let mut fresh = Engine::load(&String::from_utf8_lossy(b"policies:\n  p:\n    attempts: 1\n    breaker: { window: { kind: count, size: 4 }, minimum-calls: 2, open-duration: 1h }\n    keys: { max: 1000000 }\n"), 9).unwrap();
    fresh.import_state(&snap).unwrap();
    assert_eq!(fresh.breaker_state(0, "open", 300_000), Some(BreakerState::Open));
    assert_eq!(fresh.key_count(0), 1);
}

/// Whatever `export-state` gives for a large table, `import-state` reads: 100,000 keys of
/// the longest allowed length is about 110 MB, and 50,000 of them fit the bound.
#[test]
fn a_large_export_imports_again() {
    let e = many_keys(50_000, levee_core::MAX_KEY_BYTES);
    let state = e.export_state();
    assert!(state.len() <= levee_core::state::MAX_STATE_BYTES, "{} bytes", state.len());
    let mut fresh = Engine::load("policies:\n  p:\n    attempts: 1\n    breaker: { window: { kind: count, size: 4 }, minimum-calls: 2, open-duration: 1h }\n    keys: { max: 1000000 }\n", 9).unwrap();
    fresh.import_state(&state).unwrap();
    assert_eq!(fresh.key_count(0), 50_001);
    assert_eq!(fresh.breaker_state(0, "open", 60_000), Some(BreakerState::Open));
}

/// A key over the bound gets no state of its own, and the engine's state stays bounded.
#[test]
fn an_overlong_key_is_decided_against_the_overflow_entry() {
    let mut e = Engine::load("policies:\n  p: { attempts: 1 }\n", 1).unwrap();
    let long = "é".repeat(levee_core::MAX_KEY_BYTES); // 2 bytes each: twice the bound
    assert_eq!(e.start(1, 0, &long, 0, 0, 0, 0, 0).kind(), Some(VerdictKind::Attempt));
    let ev = e.drain_events();
    assert_eq!(ev.len(), 1);
    assert_eq!(ev[0].kind, EventKind::KeyOverflow);
    assert_eq!(ev[0].key, OVERFLOW_KEY);
    assert_eq!(ev[0].name.len(), levee_core::MAX_KEY_BYTES, "cut on a character boundary");
    assert_eq!(e.key_count(0), 1);
}

//! The engine's tables at their bounds: live-call eviction at `MAX_LIVE_CALLS` and key
//! eviction (idle keys first, least recently used first).
#![allow(clippy::indexing_slicing, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use levee_core::{Engine, EventKind, InvalidCode, OutcomeKind, VerdictKind, MAX_LIVE_CALLS};

#[test]
fn the_call_started_longest_ago_is_evicted_at_the_bound() {
    let mut e = Engine::load("policies:\n  p: { attempts: 2 }\n", 1).unwrap();
    // Ids need not follow start order: the order of the starts decides.
    let ids: Vec<u64> = (1..=MAX_LIVE_CALLS as u64).map(|i| if i == 1 { 10_000_000 } else { i }).collect();
    for (n, id) in ids.iter().enumerate() {
        let v = e.start(*id, 0, "", 0, n as u64, 0, 0, 0);
        assert_eq!(v.kind(), Some(VerdictKind::Attempt));
    }
    assert_eq!(e.live_calls(), MAX_LIVE_CALLS);
    let _ = e.drain_events();
    let v = e.start(20_000_000, 0, "", 0, 1 << 40, 0, 0, 0);
    assert_eq!(v.kind(), Some(VerdictKind::Attempt));
    assert_eq!(e.live_calls(), MAX_LIVE_CALLS);
    let events = e.drain_events();
    assert_eq!(events.len(), 1);
    assert_eq!(events[0].kind, EventKind::CallEvicted);
    assert_eq!(events[0].call, 10_000_000, "the first started, though its id is not the smallest");
    let gone = e.report(10_000_000, 1 << 40, 1, OutcomeKind::Success, 0, "", 0, 0);
    assert_eq!(gone.kind(), Some(VerdictKind::Invalid));
    assert_eq!(gone.detail(), InvalidCode::UnknownCall as u8);
    assert_eq!(e.report(2, 1 << 40, 1, OutcomeKind::Success, 0, "", 0, 0).kind(), Some(VerdictKind::Done));
}

#[test]
fn idle_keys_are_evicted_before_busy_ones_least_recently_used_first() {
    let doc = "policies:\n  p: { attempts: 1, bulkhead: { max-concurrent: 5 }, keys: { max: 3 } }\n";
    let mut e = Engine::load(doc, 1).unwrap();
    // a is busy (an attempt in flight); b and c are idle, b the least recently used.
    assert_eq!(e.start(1, 0, "a", 0, 1, 0, 0, 0).kind(), Some(VerdictKind::Attempt));
    for (call, key) in [(2, "b"), (3, "c")] {
        e.start(call, 0, key, 0, 2, 0, 0, 0);
        e.report(call, 0, 3, OutcomeKind::Success, 0, "", 0, 0);
    }
    let evicted = |e: &mut Engine| -> Vec<String> {
        e.drain_events().into_iter().filter(|ev| ev.kind == EventKind::KeyEvicted).map(|ev| ev.name).collect()
    };
    e.start(4, 0, "d", 0, 4, 0, 0, 0);
    e.report(4, 4, 1, OutcomeKind::Success, 0, "", 0, 0);
    assert_eq!(evicted(&mut e), ["b"], "a is older but busy");
    // Touch c; then the least recently used idle key is d.
    e.start(5, 0, "c", 0, 5, 0, 0, 0);
    e.report(5, 5, 1, OutcomeKind::Success, 0, "", 0, 0);
    e.start(6, 0, "e", 0, 6, 0, 0, 0);
    e.report(6, 6, 1, OutcomeKind::Success, 0, "", 0, 0);
    assert_eq!(evicted(&mut e), ["d"]);
    // a goes idle when its attempt ends: now it is the least recently used of all.
    e.report(1, 7, 1, OutcomeKind::Success, 0, "", 0, 0);
    e.start(7, 0, "f", 0, 8, 0, 0, 0);
    assert_eq!(evicted(&mut e), ["c"], "a was touched by its report, after c");
    assert_eq!(e.key_count(0), 3);
    assert_eq!(e.in_flight(0, "a"), 0);
}

//! Property tests: random policies and random traces, driven as a well-behaved host would,
//! with every invariant of the contract checked after every step.
// Tests may index and panic: the no-panic lints guard library code reachable from input.
#![allow(clippy::indexing_slicing, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::BTreeMap;

use levee_core::backoff::{Backoff, Jitter, Kind};
use levee_core::rng::Rng;
use levee_core::{BreakerState, Engine, EventKind, OutcomeKind, Verdict, VerdictKind};
use proptest::prelude::*;

const MS: u64 = 1_000_000;

#[derive(Clone, Debug)]
enum Op {
    Start { key: u8, advance: u32 },
    Step { pick: u8, outcome: u8, elapsed: u32, advance: u32 },
    Cancel { pick: u8 },
    Force { key: u8, state: u8 },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0u8..3, 0u32..200).prop_map(|(key, advance)| Op::Start { key, advance }),
        8 => (any::<u8>(), 0u8..8, 0u32..3000, 0u32..500).prop_map(|(pick, outcome, elapsed, advance)| Op::Step { pick, outcome, elapsed, advance }),
        1 => any::<u8>().prop_map(|pick| Op::Cancel { pick }),
        1 => (0u8..3, 0u8..4).prop_map(|(key, state)| Op::Force { key, state }),
    ]
}

fn document(attempts: u32, deadline_ms: u32, kind: u8, jitter: u8, with_limits: bool) -> String {
    let (kind, jitter) = match (kind % 4, jitter % 4) {
        (3, _) => ("decorrelated", "decorrelated"),
        (k, j) => (["constant", "linear", "exponential"][k as usize], ["none", "full", "equal", "proportional"][j as usize]),
    };
    let deadline = if deadline_ms == 0 { String::new() } else { format!("    deadline: {deadline_ms}ms\n") };
    let limits = if with_limits {
        "    bulkhead: { max-concurrent: 2 }\n    rate-limit: { rate: 20, per: 1s, burst: 3, max-wait: 100ms }\n"
    } else {
        ""
    };
    format!(
        "policies:\n  p:\n    attempts: {attempts}\n    attempt-timeout: 1s\n{deadline}    backoff: {{ kind: {kind}, base: 10ms, cap: 400ms, jitter: {jitter} }}\n    budget: {{ kind: token, max-tokens: 5, token-ratio: 0.5 }}\n    breaker: {{ window: {{ kind: count, size: 6 }}, minimum-calls: 3, open-duration: 300ms, half-open-permits: 2, half-open-permit-timeout: 200ms }}\n{limits}    fallbacks: [{{ name: fb, on: [breaker-open, bulkhead-full] }}]\n    keys: {{ max: 2 }}\n"
    )
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Phase {
    Sleeping(u64),
    InFlight,
    Fallback,
}

struct Host {
    engine: Engine,
    now: u64,
    next_id: u64,
    calls: BTreeMap<u64, (Phase, u32, &'static str)>,
    log: Vec<u64>,
}

fn outcome(o: u8) -> (OutcomeKind, i32, &'static str) {
    match o {
        0 | 1 => (OutcomeKind::Success, 0, ""),
        2 => (OutcomeKind::Timeout, 0, ""),
        3 => (OutcomeKind::ConnectionError, 0, ""),
        4 => (OutcomeKind::HttpStatus, 503, "1"),
        5 => (OutcomeKind::HttpStatus, 404, ""),
        6 => (OutcomeKind::GrpcStatus, 14, "-1"),
        _ => (OutcomeKind::HttpStatus, 429, "Sun, 06 Nov 1994 08:49:37 GMT"),
    }
}

impl Host {
    fn check(&mut self, call: u64, key: &'static str, v: Verdict, max_attempts: u32, deadline: Option<u64>) -> Result<(), TestCaseError> {
        self.log.push(v.0);
        let kind = v.kind();
        prop_assert!(kind.is_some() && kind != Some(VerdictKind::Invalid), "a well-behaved host got {v:?}");
        let entry = self.calls.get(&call).copied();
        match kind {
            Some(VerdictKind::Attempt) => {
                let attempts = entry.map(|(_, a, _)| a).unwrap_or(0) + 1;
                prop_assert!(attempts <= max_attempts, "attempt {attempts} above the maximum {max_attempts}");
                prop_assert_eq!(u32::from(v.detail()), attempts.min(255));
                self.calls.insert(call, (Phase::InFlight, attempts, key));
            }
            Some(VerdictKind::Retry) | Some(VerdictKind::Wait) => {
                let d = v.payload();
                if let (Some(dl), Some(VerdictKind::Retry)) = (deadline, kind) {
                    prop_assert!(self.now + d < dl, "retry at {} + {d} past the deadline {dl}", self.now);
                }
                let attempts = entry.map(|(_, a, _)| a).unwrap_or(0);
                self.calls.insert(call, (Phase::Sleeping(self.now + d), attempts, key));
            }
            Some(VerdictKind::Fallback) => {
                let attempts = entry.map(|(_, a, _)| a).unwrap_or(0);
                self.calls.insert(call, (Phase::Fallback, attempts, key));
            }
            _ => {
                self.calls.remove(&call);
            }
        }
        Ok(())
    }
}

fn run(doc: &str, seed: u64, ops: &[Op], max_attempts: u32, deadline_ms: u32, limits: bool) -> Result<Vec<u64>, TestCaseError> {
    let engine = Engine::load(doc, seed).map_err(|e| TestCaseError::fail(format!("{e:?}")))?;
    let mut h = Host { engine, now: 1, next_id: 1, calls: BTreeMap::new(), log: Vec::new() };
    let keys = ["a", "b", "c"];
    let mut deadlines: BTreeMap<u64, u64> = BTreeMap::new();
    let mut breaker_states: BTreeMap<&str, BreakerState> = BTreeMap::new();
    for op in ops {
        match op {
            Op::Start { key, advance } => {
                h.now += u64::from(*advance) * MS / 10;
                let id = h.next_id;
                h.next_id += 1;
                let k = keys[*key as usize % 3];
                let v = h.engine.start(id, 0, k, 0, h.now, 0, 0, 0);
                if deadline_ms > 0 {
                    deadlines.insert(id, h.now + u64::from(deadline_ms) * MS);
                }
                let dl = deadlines.get(&id).copied();
                h.check(id, k, v, max_attempts, dl)?;
            }
            Op::Step { pick, outcome: o, elapsed, advance } => {
                h.now += u64::from(*advance) * MS / 10;
                let live: Vec<u64> = h.calls.keys().copied().collect();
                if live.is_empty() {
                    continue;
                }
                let id = live[*pick as usize % live.len()];
                let dl = deadlines.get(&id).copied();
                let (phase, _, k) = h.calls[&id];
                let v = match phase {
                    Phase::InFlight => {
                        let (kind, code, text) = outcome(*o);
                        h.engine.report(id, h.now, u64::from(*elapsed) * MS / 10, kind, code, text, 784_111_700, 0)
                    }
                    Phase::Sleeping(until) => {
                        h.now = h.now.max(until);
                        h.engine.acquire(id, h.now)
                    }
                    Phase::Fallback => h.engine.report_fallback(id, h.now, *o % 2 == 0),
                };
                h.check(id, k, v, max_attempts, dl)?;
            }
            Op::Cancel { pick } => {
                let live: Vec<u64> = h.calls.keys().copied().collect();
                if let Some(id) = live.get(*pick as usize % live.len().max(1)) {
                    h.engine.cancel(*id, h.now);
                    h.calls.remove(id);
                }
            }
            Op::Force { key, state } => {
                let s =
                    [BreakerState::ForcedOpen, BreakerState::ForcedClosed, BreakerState::Disabled, BreakerState::Closed][*state as usize];
                // Refused only for a key that has no state of its own (the table is full of keys
                // holding protection): forcing the shared overflow entry would force them all.
                let k = keys[*key as usize % 3];
                if let Err(e) = h.engine.set_breaker_state(0, k, s, h.now) {
                    prop_assert!(e.contains("has no state of its own"), "{e}");
                }
            }
        }
        // Invariants after every step.
        for key in keys {
            let tokens = h.engine.budget_tokens(0, key).unwrap_or(0);
            prop_assert!((0..=5000).contains(&tokens), "budget tokens {tokens}");
            let in_flight = h.engine.in_flight(0, key);
            prop_assert!(in_flight <= 2, "in flight {in_flight}");
            // Slots are only ever held by attempts the host is running.
            let running = h.calls.iter().filter(|(_, (p, _, k))| *p == Phase::InFlight && *k == key).count() as u32;
            prop_assert!(!limits || in_flight <= running, "{in_flight} slots held for {running} running attempts");
            // Half-open never has more than its 2 permits out.
            let trials = h.engine.breaker_trials(0, key).unwrap_or(0);
            prop_assert!(trials <= 2, "{trials} half-open trials");
            if let Some(t) = h.engine.rate_tokens(0, key, h.now) {
                prop_assert!(t <= 3, "rate tokens {t}");
            }
        }
        // The bound (2), and the overflow entry new keys share when both hold protection.
        prop_assert!(h.engine.key_count(0) <= 3);
        for e in h.engine.drain_events() {
            if e.kind == EventKind::BreakerTransition {
                let key: &str = keys.iter().chain([&levee_core::OVERFLOW_KEY]).find(|k| **k == e.key).copied().unwrap_or("a");
                let before = breaker_states.get(key).copied().unwrap_or(BreakerState::Closed);
                prop_assert_eq!(e.state_from, before, "transition from a state the breaker was not in");
                use BreakerState::*;
                let legal = matches!((e.state_from, e.state_to), (Closed, Open) | (Open, HalfOpen) | (HalfOpen, Closed) | (HalfOpen, Open))
                    || matches!(e.state_to, ForcedOpen | ForcedClosed | Disabled)
                    || (e.state_to == Closed && matches!(e.state_from, ForcedOpen | ForcedClosed | Disabled | Open | HalfOpen));
                prop_assert!(legal, "illegal transition {:?} -> {:?}", e.state_from, e.state_to);
                // Automatic edges never leave a forced state.
                prop_assert!(!(matches!(e.state_from, ForcedOpen | ForcedClosed | Disabled) && matches!(e.state_to, Open | HalfOpen)));
                breaker_states.insert(key, e.state_to);
            }
            if e.kind == EventKind::KeyEvicted {
                breaker_states.remove(e.name.as_str());
            }
        }
    }
    Ok(h.log)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 192, .. ProptestConfig::default() })]

    #[test]
    fn traces_keep_every_invariant(
        attempts in 1u32..6, deadline_ms in prop_oneof![Just(0u32), 50u32..2000], kind in 0u8..4, jitter in 0u8..4,
        limits in any::<bool>(), seed in any::<u64>(), ops in prop::collection::vec(op(), 1..120)
    ) {
        let doc = document(attempts, deadline_ms, kind, jitter, limits);
        let first = run(&doc, seed, &ops, attempts, deadline_ms, limits)?;
        // Same seed, same trace: the same decisions, bit for bit.
        let second = run(&doc, seed, &ops, attempts, deadline_ms, limits)?;
        prop_assert_eq!(first, second);
    }

    #[test]
    fn delay_in_zero_cap_for_any_attempt(
        n in any::<u32>(), base in 0u64..10_000_000_000, extra in 0u64..100_000_000_000, m in 1.0f64..50.0,
        kind in 0usize..4, jitter in 0usize..4, prev in any::<u64>(), seed in any::<u64>()
    ) {
        let kind = [Kind::Constant, Kind::Linear, Kind::Exponential, Kind::Decorrelated][kind];
        let jitter = if kind == Kind::Decorrelated { Jitter::Decorrelated } else { [Jitter::None, Jitter::Full, Jitter::Equal, Jitter::Proportional][jitter] };
        let cap = base + extra;
        let b = Backoff { kind, base, multiplier: m, cap, jitter, jitter_ratio: 0.25 };
        let mut rng = Rng::new(seed);
        let d = b.delay(n, prev, &mut rng);
        prop_assert!(d <= cap, "{d} > cap {cap}");
        if kind == Kind::Exponential && jitter == Jitter::None && n > 200 && base > 0 && m >= 2.0 {
            prop_assert_eq!(d, cap);
        }
    }

    #[test]
    fn brooker_and_polly_jitter_bounds_over_many_seeds(seed in any::<u64>(), n in 1u32..64) {
        let mut rng = Rng::new(seed);
        let base = 5 * MS;
        let cap = 2_000 * MS;
        let full = Backoff { kind: Kind::Exponential, base, multiplier: 2.0, cap, jitter: Jitter::Full, jitter_ratio: 0.25 };
        let expo = full.raw(n, 0);
        prop_assert!(full.delay(n, 0, &mut rng) <= expo);
        let equal = Backoff { jitter: Jitter::Equal, ..full.clone() };
        let e = equal.delay(n, 0, &mut rng);
        prop_assert!(e >= expo / 2 && e <= expo);
        let dec = Backoff { kind: Kind::Decorrelated, jitter: Jitter::Decorrelated, ..full.clone() };
        let mut prev = base;
        for i in 1..n {
            let d = dec.delay(i, prev, &mut rng);
            prop_assert!(d >= base && d <= cap.min(prev.max(base) * 3));
            prev = d;
        }
        let polly = Backoff { kind: Kind::Constant, base: 1_000 * MS, jitter: Jitter::Proportional, ..full };
        let p = polly.delay(n, 0, &mut rng);
        prop_assert!((750 * MS..=1_250 * MS).contains(&p));
    }

    #[test]
    fn export_then_import_gives_identical_future_decisions(
        seed in any::<u64>(), before in prop::collection::vec(op(), 0..60), after in prop::collection::vec(op(), 1..60)
    ) {
        // Calls live across the round trip are not state; cancel them before exporting.
        let doc = document(3, 0, 2, 1, true);
        let mut a = Engine::load(&doc, seed).map_err(|e| TestCaseError::fail(format!("{e:?}")))?;
        let mut id = 1u64;
        let mut now = 1u64;
        for op in &before {
            if let Op::Start { key, advance } = op {
                now += u64::from(*advance) * MS;
                let v = a.start(id, 0, ["a", "b", "c"][*key as usize % 3], 0, now, 0, 0, 0);
                if v.kind() == Some(VerdictKind::Attempt) {
                    a.report(id, now + 1, 1, if id % 3 == 0 { OutcomeKind::Success } else { OutcomeKind::Timeout }, 0, "", 0, 0);
                }
                a.cancel(id, now + 2);
                id += 1;
            }
        }
        // Events are not state: a host drains them as it goes.
        a.drain_events();
        let mut b = Engine::load(&doc, seed).map_err(|e| TestCaseError::fail(format!("{e:?}")))?;
        prop_assert!(b.import_state(&a.export_state()).is_ok());
        prop_assert_eq!(a.export_state(), b.export_state());
        for op in &after {
            if let Op::Start { key, advance } = op {
                now += u64::from(*advance) * MS;
                let k = ["a", "b", "c"][*key as usize % 3];
                let va = a.start(id, 0, k, 0, now, 0, 0, 0);
                let vb = b.start(id, 0, k, 0, now, 0, 0, 0);
                prop_assert_eq!(va, vb);
                if va.kind() == Some(VerdictKind::Attempt) {
                    let ra = a.report(id, now + 1, 1, OutcomeKind::Timeout, 0, "", 0, 0);
                    let rb = b.report(id, now + 1, 1, OutcomeKind::Timeout, 0, "", 0, 0);
                    prop_assert_eq!(ra, rb);
                }
                id += 1;
            }
        }
    }

    #[test]
    fn any_document_text_is_an_answer_not_a_panic(text in ".{0,400}") {
        let _ = Engine::load(&text, 0);
    }

    #[test]
    fn any_state_bytes_are_an_answer_not_a_panic(bytes in prop::collection::vec(any::<u8>(), 0..300)) {
        let mut e = Engine::load("policies:\n  p: { breaker: {} }\n", 0).map_err(|e| TestCaseError::fail(format!("{e:?}")))?;
        let before = e.export_state();
        if e.import_state(&bytes).is_err() {
            prop_assert_eq!(before, e.export_state());
        }
    }
}

/// The state of 10,000 keys (about 2.5 MB, above the 1 MiB bound of a policy document) is
/// restored by `import-state`: hosts restore it after a trap (issue 14).
#[test]
fn the_state_of_ten_thousand_keys_is_imported_again() {
    let doc = "policies:\n  p:\n    attempts: 1\n    breaker: { window: { kind: count, size: 2 }, minimum-calls: 2, failure-rate: 50, open-duration: 60s }\n    keys: { max: 1000000 }\n";
    let Ok(mut a) = Engine::load(doc, 1) else { panic!("the document loads") };
    for i in 0..10_000u64 {
        let key = format!("host-{i}");
        let v = a.start(i + 1, 0, &key, 0, 1_000, 0, 0, 0);
        assert_eq!(v.kind(), Some(VerdictKind::Attempt));
        a.report(i + 1, 2_000, 10, OutcomeKind::ConnectionError, 0, "", 0, 0);
    }
    let state = a.export_state();
    assert!(state.len() > 1 << 20, "{} bytes", state.len());
    let Ok(mut b) = Engine::load(doc, 2) else { panic!("the document loads") };
    assert_eq!(b.import_state(&state), Ok(()));
    assert_eq!(b.breaker_state(0, "host-9999", 3_000), a.breaker_state(0, "host-9999", 3_000));
}

//! Property tests of hedged calls: random hedged policies and random traces, driven as a
//! well-behaved host would (every command carried out, attempts ending in any order, callers
//! cancelling), with the contract checked after every step:
//! * commands are well formed: a start names the next attempt and never more than the
//!   policy's `hedge.attempts`; a cancel names an attempt in flight; a call ends exactly once,
//!   and nothing but the reports of its cancelled attempts follows;
//! * slots: a key's attempts in flight never exceed the bulkhead, and they are exactly the
//!   attempts started and not yet reported closed (a cancelled one holds its slot until then);
//! * a call leaves the table once it has ended and its last attempt has closed;
//! * a badly behaved host (reports of attempts never started, twice, steps of unknown calls)
//!   gets `invalid` answers and changes nothing.
// Tests may index and panic: the no-panic lints guard library code reachable from input.
#![allow(clippy::indexing_slicing, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::{BTreeMap, BTreeSet};

use levee_core::{Engine, HedgeCommand, OutcomeKind, VerdictKind};
use proptest::prelude::*;

const MS: u64 = 1_000_000;

#[derive(Clone, Debug)]
enum Op {
    Start {
        flags: u8,
        advance: u32,
    },
    /// Report one of a call's open attempts (`pick` chooses the call and the attempt).
    Close {
        pick: u16,
        outcome: u8,
        advance: u32,
    },
    /// Let time pass and step every call whose wait is over.
    Tick {
        advance: u32,
    },
    Cancel {
        pick: u8,
    },
    /// A protocol error: report an attempt that is not open, or step an unknown call.
    Misuse {
        pick: u16,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0u8..4, 0u32..50).prop_map(|(flags, advance)| Op::Start { flags, advance }),
        8 => (any::<u16>(), 0u8..6, 0u32..80).prop_map(|(pick, outcome, advance)| Op::Close { pick, outcome, advance }),
        3 => (0u32..300).prop_map(|advance| Op::Tick { advance }),
        1 => any::<u8>().prop_map(|pick| Op::Cancel { pick }),
        1 => any::<u16>().prop_map(|pick| Op::Misuse { pick }),
    ]
}

fn document(attempts: u32, delay_ms: u32, preset: u8, bulkhead: u32, budget: bool, fallback: bool) -> String {
    let preset = ["grpc", "polly", "failsafe", "envoy"][usize::from(preset % 4)];
    let hedge = if preset == "envoy" {
        format!("    attempt-timeout: {}ms\n    hedge: {{ attempts: {attempts}, preset: envoy }}\n", delay_ms.max(1))
    } else {
        format!("    attempt-timeout: 1s\n    hedge: {{ attempts: {attempts}, delay: {delay_ms}ms, preset: {preset} }}\n")
    };
    let mut doc = format!("policies:\n  p:\n{hedge}    deadline: 3s\n    bulkhead: {{ max-concurrent: {bulkhead} }}\n    breaker: {{ window: {{ kind: count, size: 6 }}, minimum-calls: 3, open-duration: 300ms }}\n");
    if budget {
        doc.push_str("    budget: { kind: token, max-tokens: 4, token-ratio: 0.5 }\n");
    }
    if fallback {
        doc.push_str("    fallbacks: [fb]\n");
    }
    doc
}

fn outcome(o: u8) -> (OutcomeKind, i32) {
    match o {
        0 | 1 => (OutcomeKind::Success, 0),
        2 => (OutcomeKind::Timeout, 0),
        3 => (OutcomeKind::HttpStatus, 503),
        4 => (OutcomeKind::HttpStatus, 500),
        _ => (OutcomeKind::ConnectionError, 0),
    }
}

fn is_invalid(c: &[HedgeCommand]) -> bool {
    matches!(c, [HedgeCommand::End { attempt: 0, verdict }] if verdict.kind() == Some(VerdictKind::Invalid))
}

#[derive(Debug, Default)]
struct Live {
    /// Attempts started and not yet reported closed (with their start time).
    open: BTreeMap<u32, u64>,
    /// Attempts the core cancelled (a subset of `open`).
    cancelled: BTreeSet<u32>,
    started: u32,
    ended: bool,
    in_fallback: bool,
    /// When a `wait` command's time comes.
    wake: Option<u64>,
}

struct Host {
    engine: Engine,
    now: u64,
    next_id: u64,
    attempts: u32,
    bulkhead: u32,
    calls: BTreeMap<u64, Live>,
}

impl Host {
    fn carry_out(&mut self, call: u64, commands: &[HedgeCommand]) -> Result<(), TestCaseError> {
        let (now, max) = (self.now, self.attempts);
        let live = self.calls.get_mut(&call).expect("a call the host knows");
        for (i, c) in commands.iter().enumerate() {
            prop_assert!(!live.ended, "call {call}: a command after the end: {commands:?}");
            match *c {
                HedgeCommand::Start { attempt, .. } => {
                    prop_assert_eq!(attempt, live.started + 1, "call {}: starts go in order: {:?}", call, commands);
                    prop_assert!(attempt <= max, "call {call}: attempt {attempt} of {max}");
                    live.started = attempt;
                    live.open.insert(attempt, now);
                    live.wake = None;
                }
                HedgeCommand::Cancel { attempt } => {
                    prop_assert!(live.open.contains_key(&attempt) && !live.cancelled.contains(&attempt), "call {call}: cancel {attempt}");
                    live.cancelled.insert(attempt);
                }
                HedgeCommand::Wait { delay } => {
                    prop_assert!(delay > 0 || live.started < max, "call {call}: a wait of 0");
                    prop_assert_eq!(i, commands.len() - 1, "a wait comes last");
                    live.wake = Some(now + delay);
                }
                HedgeCommand::End { attempt, verdict } => {
                    prop_assert_eq!(i, commands.len() - 1, "the end comes last");
                    let kind = verdict.kind();
                    prop_assert!(
                        matches!(kind, Some(VerdictKind::Done | VerdictKind::Fail | VerdictKind::Fallback)),
                        "call {call}: a well-behaved host got {verdict:?}"
                    );
                    prop_assert!(attempt >= 1 && attempt <= live.started, "call {call}: ends with attempt {attempt}");
                    // Every attempt still open is cancelled by now: the caller does not wait for it.
                    for a in live.open.keys() {
                        prop_assert!(live.cancelled.contains(a), "call {call}: attempt {a} left running at the end");
                    }
                    live.ended = true;
                    live.in_fallback = kind == Some(VerdictKind::Fallback);
                    live.wake = None;
                }
            }
        }
        Ok(())
    }

    fn check(&mut self) -> Result<(), TestCaseError> {
        let open: usize = self.calls.values().map(|l| l.open.len()).sum();
        prop_assert_eq!(self.engine.in_flight(0, "") as usize, open, "slots are exactly the open attempts");
        prop_assert!(self.engine.in_flight(0, "") <= self.bulkhead);
        // A call is in the table while it has open attempts, or has not ended.
        for (id, l) in &self.calls {
            let in_table = self.engine.call_info(*id).is_some();
            prop_assert_eq!(in_table, !l.ended || !l.open.is_empty() || l.in_fallback, "call {} in the table", id);
        }
        Ok(())
    }

    fn forget_finished(&mut self) {
        self.calls.retain(|_, l| !l.ended || !l.open.is_empty() || l.in_fallback);
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn hedged_calls_keep_the_contract(
        attempts in 2u32..6,
        delay_ms in 0u32..120,
        preset in 0u8..4,
        bulkhead in 1u32..6,
        budget in any::<bool>(),
        fallback in any::<bool>(),
        ops in proptest::collection::vec(op(), 1..120),
    ) {
        let doc = document(attempts, delay_ms, preset, bulkhead, budget, fallback);
        let engine = Engine::load(&doc, 11).unwrap_or_else(|e| panic!("{doc}: {e:?}"));
        let mut h = Host { engine, now: 0, next_id: 1, attempts, bulkhead, calls: BTreeMap::new() };
        for op in ops {
            match op {
                Op::Start { flags, advance } => {
                    h.now += u64::from(advance) * MS;
                    let id = h.next_id;
                    h.next_id += 1;
                    let v = h.engine.start(id, 0, "", u32::from(flags & 3), h.now, 0, 0, 0);
                    match v.kind() {
                        Some(VerdictKind::Hedge) => {
                            prop_assert_eq!(v.detail(), 1);
                            let mut live = Live { started: 1, ..Live::default() };
                            live.open.insert(1, h.now);
                            h.calls.insert(id, live);
                            let c = h.engine.hedge_step(id, h.now);
                            h.carry_out(id, &c)?;
                        }
                        Some(VerdictKind::Fail | VerdictKind::Fallback) => {
                            if v.kind() == Some(VerdictKind::Fallback) {
                                let _ = h.engine.report_fallback(id, h.now, true);
                            }
                        }
                        other => prop_assert!(false, "start answered {other:?}"),
                    }
                }
                Op::Close { pick, outcome: o, advance } => {
                    h.now += u64::from(advance) * MS;
                    let open: Vec<(u64, u32, u64)> =
                        h.calls.iter().flat_map(|(id, l)| l.open.iter().map(move |(a, t)| (*id, *a, *t))).collect();
                    if open.is_empty() {
                        continue;
                    }
                    let (id, attempt, began) = open[usize::from(pick) % open.len()];
                    let (kind, code) = outcome(o);
                    let c = h.engine.report_attempt(id, attempt, h.now, h.now - began, kind, code, "", 0, 0);
                    let live = h.calls.get_mut(&id).unwrap();
                    live.open.remove(&attempt);
                    let was_cancelled = live.cancelled.remove(&attempt);
                    if was_cancelled || live.ended {
                        prop_assert!(c.is_empty(), "a cancelled attempt's report answers nothing: {c:?}");
                    }
                    h.carry_out(id, &c)?;
                    if h.calls[&id].in_fallback && h.calls[&id].open.is_empty() {
                        let v = h.engine.report_fallback(id, h.now, o % 2 == 0);
                        prop_assert!(matches!(v.kind(), Some(VerdictKind::Done | VerdictKind::Fail)), "{v:?}");
                        h.calls.get_mut(&id).unwrap().in_fallback = false;
                    }
                }
                Op::Tick { advance } => {
                    h.now += u64::from(advance) * MS;
                    let due: Vec<u64> = h.calls.iter().filter(|(_, l)| l.wake.is_some_and(|w| w <= h.now)).map(|(id, _)| *id).collect();
                    for id in due {
                        let c = h.engine.hedge_step(id, h.now);
                        h.calls.get_mut(&id).unwrap().wake = None;
                        h.carry_out(id, &c)?;
                    }
                }
                Op::Cancel { pick } => {
                    let ids: Vec<u64> = h.calls.keys().copied().collect();
                    if ids.is_empty() {
                        continue;
                    }
                    let id = ids[usize::from(pick) % ids.len()];
                    h.engine.cancel(id, h.now);
                    h.calls.remove(&id);
                }
                Op::Misuse { pick } => {
                    let unknown = 1_000_000 + u64::from(pick);
                    let c = h.engine.hedge_step(unknown, h.now);
                    prop_assert!(is_invalid(&c), "{:?}", c);
                    if let Some((&id, l)) = h.calls.iter().nth(usize::from(pick) % h.calls.len().max(1)) {
                        let never = l.started + 1 + u32::from(pick % 3);
                        let c = h.engine.report_attempt(id, never, h.now, 0, OutcomeKind::Success, 0, "", 0, 0);
                        prop_assert!(is_invalid(&c), "{:?}", c);
                    }
                }
            }
            h.forget_finished();
            h.check()?;
            let _ = h.engine.drain_events();
        }
        // Close everything: every call ends, and the table empties.
        for _ in 0..64 {
            if h.calls.is_empty() {
                break;
            }
            h.now += 2 * 1_000 * MS;
            let ids: Vec<u64> = h.calls.keys().copied().collect();
            for id in ids {
                let open: Vec<u32> = h.calls[&id].open.keys().copied().collect();
                for attempt in open {
                    let c = h.engine.report_attempt(id, attempt, h.now, 1, OutcomeKind::Success, 0, "", 0, 0);
                    let live = h.calls.get_mut(&id).unwrap();
                    live.open.remove(&attempt);
                    live.cancelled.remove(&attempt);
                    h.carry_out(id, &c)?;
                }
                if h.calls[&id].in_fallback {
                    let _ = h.engine.report_fallback(id, h.now, true);
                    h.calls.get_mut(&id).unwrap().in_fallback = false;
                }
                if !h.calls[&id].ended && h.calls[&id].open.is_empty() {
                    let c = h.engine.hedge_step(id, h.now);
                    h.carry_out(id, &c)?;
                }
            }
            h.forget_finished();
            h.check()?;
        }
        prop_assert!(h.calls.is_empty(), "calls never ended: {:?}", h.calls);
        prop_assert_eq!(h.engine.live_calls(), 0);
        prop_assert_eq!(h.engine.in_flight(0, ""), 0);
    }
}

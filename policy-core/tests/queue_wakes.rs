//! The bulkhead queue's wakes (docs/policy.md, "The queue"): a host that wakes only the calls
//! the core names (`take-wakes`) admits exactly the calls, in exactly the order and at exactly
//! the times, that a host waking every parked call on every report and cancel admits; every
//! call it wakes takes a slot at once; and the cost of a release does not grow with the queue.
// Tests may index and panic: the no-panic lints guard library code reachable from input.
#![allow(clippy::indexing_slicing, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::{BTreeMap, VecDeque};

use levee_core::{Engine, OutcomeKind, Verdict, VerdictKind};
use proptest::prelude::*;

const MS: u64 = 1_000_000;

#[derive(Clone, Debug)]
enum Op {
    /// Start a call on key `key` after `advance` ms.
    Start { key: u8, advance: u32 },
    /// Report the outcome (success, or a 503 that retries) of an attempt in flight.
    Report { pick: u8, fail: bool, advance: u32 },
    /// Cancel a live call (in flight, parked or sleeping before a retry).
    Cancel { pick: u8, advance: u32 },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0u8..2, 0u32..40).prop_map(|(key, advance)| Op::Start { key, advance }),
        5 => (any::<u8>(), any::<bool>(), 0u32..40).prop_map(|(pick, fail, advance)| Op::Report { pick, fail, advance }),
        1 => (any::<u8>(), 0u32..40).prop_map(|(pick, advance)| Op::Cancel { pick, advance }),
    ]
}

/// A host under virtual time: runs attempts, sleeps, parks queued calls. `wake_all`: the old
/// contract (every parked call acquires again after each report and cancel); otherwise only
/// the calls `take-wakes` names.
struct Host {
    engine: Engine,
    wake_all: bool,
    now: u64,
    /// Calls parked in a queue, in park order, with their park's generation.
    parked: VecDeque<(u64, u64)>,
    /// Timers: (due, seq) -> (call, generation): a parked call's wait, or a retry's sleep.
    timers: BTreeMap<(u64, u64), (u64, u64)>,
    generation: BTreeMap<u64, u64>,
    seq: u64,
    in_flight: Vec<u64>,
    live: Vec<u64>,
    /// Admissions: (now, call, attempt number).
    admitted: Vec<(u64, u64, u8)>,
    /// Acquires made because of a wake (not a timer).
    woken_acquires: usize,
}

impl Host {
    fn new(doc: &str, wake_all: bool) -> Host {
        Host {
            engine: Engine::load(doc, 7).unwrap(),
            wake_all,
            now: 0,
            parked: VecDeque::new(),
            timers: BTreeMap::new(),
            generation: BTreeMap::new(),
            seq: 0,
            in_flight: Vec::new(),
            live: Vec::new(),
            admitted: Vec::new(),
            woken_acquires: 0,
        }
    }

    fn timer(&mut self, call: u64, due: u64) -> u64 {
        let g = self.generation.entry(call).or_default();
        *g += 1;
        let g = *g;
        self.seq += 1;
        self.timers.insert((due, self.seq), (call, g));
        g
    }

    /// What the host does with a verdict.
    fn handle(&mut self, call: u64, v: Verdict) {
        match v.kind() {
            Some(VerdictKind::Attempt) => {
                self.in_flight.push(call);
                self.admitted.push((self.now, call, v.detail()));
            }
            Some(VerdictKind::Wait) => {
                let g = self.timer(call, self.now + v.payload());
                self.parked.push_back((call, g));
            }
            Some(VerdictKind::Retry) => {
                self.timer(call, self.now + v.payload());
            }
            Some(VerdictKind::Done | VerdictKind::Fail) => self.live.retain(|&c| c != call),
            other => panic!("unexpected verdict {other:?} for call {call}"),
        }
        if !self.wake_all && v.wakes_pending() {
            self.wake_named();
        }
    }

    fn unpark(&mut self, call: u64) -> bool {
        let before = self.parked.len();
        self.parked.retain(|&(c, _)| c != call);
        self.generation.entry(call).and_modify(|g| *g += 1);
        self.parked.len() != before
    }

    fn acquire(&mut self, call: u64) {
        let v = self.engine.acquire(call, self.now);
        self.handle(call, v);
    }

    /// Wake exactly the calls the core names: each takes a slot at once.
    fn wake_named(&mut self) {
        for call in self.engine.take_wakes() {
            if self.unpark(call) {
                self.woken_acquires += 1;
                let v = self.engine.acquire(call, self.now);
                assert_eq!(v.kind(), Some(VerdictKind::Attempt), "woken call {call} must take its slot");
                self.handle(call, v);
            }
        }
    }

    /// After a report or cancel: the old contract wakes every parked call, the new one the
    /// named ones.
    fn after_release(&mut self) {
        if self.wake_all {
            let _ = self.engine.take_wakes();
            let parked: Vec<(u64, u64)> = self.parked.drain(..).collect();
            for (call, _) in parked {
                self.generation.entry(call).and_modify(|g| *g += 1);
                self.woken_acquires += 1;
                self.acquire(call);
            }
        } else {
            self.wake_named();
        }
    }

    /// Advance virtual time, firing the timers due on the way, in order.
    fn advance(&mut self, ms: u32) {
        let until = self.now + u64::from(ms) * MS;
        while let Some((&(due, seq), &(call, g))) = self.timers.iter().next() {
            if due > until {
                break;
            }
            self.timers.remove(&(due, seq));
            if self.generation.get(&call) != Some(&g) {
                continue; // woken or cancelled since
            }
            self.now = self.now.max(due);
            self.parked.retain(|&(c, _)| c != call);
            self.acquire(call);
        }
        self.now = until;
    }

    fn run(&mut self, ops: &[Op]) {
        let mut next_id = 1;
        for op in ops {
            match *op {
                Op::Start { key, advance } => {
                    self.advance(advance);
                    let call = next_id;
                    next_id += 1;
                    self.live.push(call);
                    let v = self.engine.start(call, 0, ["", "k"][key as usize], 0, self.now, 0, 0, 0);
                    self.handle(call, v);
                }
                Op::Report { pick, fail, advance } => {
                    self.advance(advance);
                    if self.in_flight.is_empty() {
                        continue;
                    }
                    let call = self.in_flight.remove(pick as usize % self.in_flight.len());
                    let (kind, code) = if fail { (OutcomeKind::HttpStatus, 503) } else { (OutcomeKind::Success, 0) };
                    let v = self.engine.report(call, self.now, MS, kind, code, "", 0, 0);
                    self.handle(call, v);
                    self.after_release();
                }
                Op::Cancel { pick, advance } => {
                    self.advance(advance);
                    if self.live.is_empty() {
                        continue;
                    }
                    let call = self.live.remove(pick as usize % self.live.len());
                    self.in_flight.retain(|&c| c != call);
                    self.unpark(call);
                    self.engine.cancel(call, self.now);
                    self.after_release();
                }
            }
        }
        // Finish: every attempt succeeds, every wait and sleep runs out.
        for _ in 0..10_000 {
            if let Some(call) = self.in_flight.first().copied() {
                self.in_flight.remove(0);
                let v = self.engine.report(call, self.now, MS, OutcomeKind::Success, 0, "", 0, 0);
                self.handle(call, v);
                self.after_release();
            } else if self.timers.is_empty() {
                break;
            } else {
                self.advance(10);
            }
        }
    }
}

fn document(max: u32, queue: u32, timeout_ms: u32) -> String {
    format!(
        "policies:\n  p:\n    attempts: 3\n    backoff: {{ kind: constant, base: 15ms, jitter: none }}\n    bulkhead: {{ max-concurrent: {max}, queue: {queue}, queue-timeout: {timeout_ms}ms }}\n"
    )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, .. ProptestConfig::default() })]

    /// The same calls get the same slots in the same order at the same times, whether the host
    /// wakes every parked call or only the named ones; and every named call takes its slot.
    #[test]
    fn waking_only_the_named_calls_admits_what_waking_everyone_admits(
        ops in proptest::collection::vec(op(), 0..80),
        max in 1u32..4,
        queue in 1u32..6,
        timeout_ms in 20u32..300,
    ) {
        let doc = document(max, queue, timeout_ms);
        let mut all = Host::new(&doc, true);
        let mut named = Host::new(&doc, false);
        all.run(&ops);
        named.run(&ops);
        prop_assert_eq!(&all.admitted, &named.admitted);
        prop_assert!(named.woken_acquires <= all.woken_acquires);
        prop_assert_eq!(named.engine.live_calls(), 0);
        for key in ["", "k"] {
            prop_assert_eq!(named.engine.in_flight(0, key), 0);
        }
    }
}

/// One release wakes one call, whatever the length of the queue.
#[test]
fn a_release_names_one_call_whatever_the_queue_length() {
    for waiters in [10u64, 1_000, 50_000] {
        let doc = document(1, 100_000, 60_000);
        let mut e = Engine::load(&doc, 1).unwrap();
        assert_eq!(e.start(1, 0, "", 0, 0, 0, 0, 0).kind(), Some(VerdictKind::Attempt));
        for c in 2..2 + waiters {
            assert_eq!(e.start(c, 0, "", 0, 1, 0, 0, 0).kind(), Some(VerdictKind::Wait));
        }
        let mut running = 1;
        for _ in 0..waiters {
            let v = e.report(running, 2, 0, OutcomeKind::Success, 0, "", 0, 0);
            assert!(v.wakes_pending());
            let wakes = e.take_wakes();
            assert_eq!(wakes, [running + 1], "the oldest waiter, and only it");
            running = wakes[0];
            assert_eq!(e.acquire(running, 2).kind(), Some(VerdictKind::Attempt));
        }
        assert!(!e.report(running, 3, 0, OutcomeKind::Success, 0, "", 0, 0).wakes_pending());
    }
}

/// An evicted call (the live-call table is full) gives its slot, or its grant, to the oldest
/// waiter.
#[test]
fn an_evicted_call_gives_its_slot_to_the_oldest_waiter() {
    let doc =
        "policies:\n  p:\n    attempts: 1\n    bulkhead: { max-concurrent: 1, queue: 4, queue-timeout: 60s }\n  q:\n    attempts: 1\n";
    let mut e = Engine::load(doc, 1).unwrap();
    assert_eq!(e.start(1, 0, "", 0, 0, 0, 0, 0).kind(), Some(VerdictKind::Attempt));
    assert_eq!(e.start(2, 0, "", 0, 0, 0, 0, 0).kind(), Some(VerdictKind::Wait));
    assert_eq!(e.start(3, 0, "", 0, 0, 0, 0, 0).kind(), Some(VerdictKind::Wait));
    // Fill the table with calls of another policy (no bulkhead).
    for c in 0..levee_core::MAX_LIVE_CALLS as u64 - 3 {
        assert_eq!(e.start(100 + c, 1, "", 0, 0, 0, 0, 0).kind(), Some(VerdictKind::Attempt));
    }
    assert!(e.take_wakes().is_empty());
    // Call 1 (in flight), the oldest, is evicted by the next start: its slot goes to 2.
    assert!(e.start(1_000_000, 1, "", 0, 0, 0, 0, 0).wakes_pending());
    assert_eq!(e.take_wakes(), [2]);
    // Call 2 (granted) is evicted next: its grant goes to 3.
    assert!(e.start(1_000_001, 1, "", 0, 0, 0, 0, 0).wakes_pending());
    assert_eq!(e.take_wakes(), [3]);
    assert_eq!(e.acquire(3, 1).kind(), Some(VerdictKind::Attempt));
    assert_eq!(e.in_flight(0, ""), 1);
}

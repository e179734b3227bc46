//! Benchmarks live in `benches/`; run them with `cargo bench -p levee-benches`. This library
//! holds the loops more than one of them runs: the keyed call loop of the scaling benchmark,
//! which `examples/keys_component.rs` runs under callgrind.

use std::fmt::Write as _;

use levee_conformance::Target;
use levee_core::OutcomeKind;

/// The verdict kind `done`.
pub const SUCCESS: u64 = 2;

/// A per-client policy: a rate limit and a 20-call breaker per key, at most `max` keys
/// (1,000,000 for the keys benchmark, 1,024 for churn).
pub fn keys_policy(max: usize) -> String {
    format!(
        "policies:\n  per-client:\n    attempts: 3\n    rate-limit: {{ rate: 1000000 }}\n    breaker: {{ minimum-calls: 20, window: {{ kind: count, size: 20 }} }}\n    keys: {{ max: {max} }}\n"
    )
}

/// One call per step on a key drawn from a fixed list.
pub struct Keyed<T> {
    t: T,
    /// Distinct keys, named `client-0000000` on.
    distinct: usize,
    /// The key of the current call: a host has its key at hand (in cache), so the harness
    /// writes it into one buffer rather than reading it from a table of a million strings.
    name: String,
    x: u64,
    call: u64,
    now: u64,
    events: u32,
}

impl<T: Target> Keyed<T> {
    /// `distinct` keys, all made first when `prefill`.
    pub fn new(t: T, distinct: usize, prefill: bool) -> Self {
        let mut k = Keyed { t, distinct, name: String::with_capacity(16), x: 0x9E37_79B9_7F4A_7C15, call: 0, now: 0, events: 0 };
        if prefill {
            for i in 0..distinct {
                k.call_on(i);
            }
        }
        k
    }

    fn call_on(&mut self, i: usize) {
        self.call += 1;
        self.now += 10;
        self.name.clear();
        let _ = write!(self.name, "client-{i:07}");
        let v = self.t.start(self.call, 0, &self.name, 0, self.now, 0, 0, 0);
        debug_assert_eq!(v & 0xF, 0, "attempt");
        let d = self.t.report(self.call, self.now, 500, OutcomeKind::Success, 0, "", 0, 0);
        debug_assert_eq!(d & 0xF, SUCCESS);
        // A host drains events when verdicts say there are some (evictions, here).
        if d & (1 << 4) != 0 {
            self.events += 1;
            if self.events % 64 == 0 {
                std::hint::black_box(self.t.drain_events());
            }
        }
    }

    /// One call, on the next key of the sequence.
    pub fn step(&mut self) {
        // xorshift64: a fixed sequence of keys, the same in every run.
        self.x ^= self.x << 13;
        self.x ^= self.x >> 7;
        self.x ^= self.x << 17;
        let i = (self.x % self.distinct as u64) as usize;
        self.call_on(i);
    }
}

//! The core at production load, natively and through the component (issue 20).
//!
//! * **In flight**: N calls stay live; each step starts one call and reports the oldest, the
//!   order in which a server's calls finish and the worst case for an ordered table.
//! * **Keys**: each step is one call (start + report) on a random key among K, after all K
//!   keys were made.
//! * **Churn**: 100,000 client keys through `keys.max: 1024`, so that most calls make a key
//!   and evict the least recently used one (a per-client rate limit's shape).
//!
//! The target: at 10,000 in flight, at 10^6 keys and under churn, the cost per call stays
//! within 2x of the one-call, one-key figure. `cargo bench -p levee-benches --bench scaling`
//! runs it (`-- --quick` for a short run); `--bench memory` prints the bytes a live call and a
//! key cost.
#![allow(clippy::indexing_slicing, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::fmt::Write as _;
use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use levee_conformance::component::Wasm;
use levee_conformance::{Native, Target};
use levee_core::OutcomeKind;

/// The decision-cycle benchmark's policy: retries, an attempt timeout and a breaker.
const CALLS_POLICY: &str =
    "policies:\n  api:\n    attempts: 3\n    attempt-timeout: 1s\n    breaker: { minimum-calls: 20, window: { kind: count, size: 50 } }\n";

/// A per-client policy: a rate limit and a breaker per key, up to a million keys.
const KEYS_POLICY: &str = "policies:\n  per-client:\n    attempts: 3\n    rate-limit: { rate: 1000000 }\n    breaker: { minimum-calls: 20, window: { kind: count, size: 20 } }\n    keys: { max: 1000000 }\n";

/// The same, bounded at 1,024 keys.
const CHURN_POLICY: &str = "policies:\n  per-client:\n    attempts: 3\n    rate-limit: { rate: 1000000 }\n    breaker: { minimum-calls: 20, window: { kind: count, size: 20 } }\n    keys: { max: 1024 }\n";

const SUCCESS: u64 = 2; // verdict kind `done`

/// A call loop that keeps `n` calls live.
struct InFlight<T> {
    t: T,
    n: u64,
    next: u64,
    now: u64,
}

impl<T: Target> InFlight<T> {
    fn new(mut t: T, n: u64) -> Self {
        let mut now = 0;
        for call in 1..=n {
            now += 10;
            t.start(call, 0, "", 0, now, 0, 0, 0);
        }
        InFlight { t, n, next: n + 1, now }
    }

    fn step(&mut self) {
        self.now += 10;
        let call = self.next;
        self.next += 1;
        let v = self.t.start(call, 0, "", 0, self.now, 0, 0, 0);
        debug_assert_eq!(v & 0xF, 0, "attempt");
        let oldest = call - self.n;
        let d = self.t.report(oldest, self.now, 500, OutcomeKind::Success, 0, "", 0, 0);
        debug_assert_eq!(d & 0xF, SUCCESS);
        std::hint::black_box(d);
    }
}

/// One call per step on a key drawn from a fixed list.
struct Keyed<T> {
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
    fn new(t: T, distinct: usize, prefill: bool) -> Self {
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

    fn step(&mut self) {
        // xorshift64: a fixed sequence of keys, the same in every run.
        self.x ^= self.x << 13;
        self.x ^= self.x >> 7;
        self.x ^= self.x << 17;
        let i = (self.x % self.distinct as u64) as usize;
        self.call_on(i);
    }
}

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("in_flight");
    g.warm_up_time(Duration::from_millis(500)).measurement_time(Duration::from_secs(2));
    for n in [1u64, 100, 1_000, 10_000, 60_000] {
        let mut native = InFlight::new(Native::load(CALLS_POLICY, 1).unwrap(), n);
        g.bench_with_input(BenchmarkId::new("native", n), &n, |b, _| b.iter(|| native.step()));
        let mut wasm = InFlight::new(Wasm::load(CALLS_POLICY, 1).unwrap(), n);
        g.bench_with_input(BenchmarkId::new("wasm", n), &n, |b, _| b.iter(|| wasm.step()));
    }
    g.finish();

    let mut g = c.benchmark_group("keys");
    g.warm_up_time(Duration::from_millis(500)).measurement_time(Duration::from_secs(2));
    for k in [1usize, 1_000, 100_000, 1_000_000] {
        let mut native = Keyed::new(Native::load(KEYS_POLICY, 1).unwrap(), k, true);
        g.bench_with_input(BenchmarkId::new("native", k), &k, |b, _| b.iter(|| native.step()));
        drop(native);
        let mut wasm = Keyed::new(Wasm::load(KEYS_POLICY, 1).unwrap(), k, true);
        g.bench_with_input(BenchmarkId::new("wasm", k), &k, |b, _| b.iter(|| wasm.step()));
    }
    // 100,000 clients through keys.max 1024: nearly every call evicts a key.
    let churn = 100_000;
    let mut native = Keyed::new(Native::load(CHURN_POLICY, 1).unwrap(), churn, false);
    g.bench_with_input(BenchmarkId::new("native churn 1e5 through 1024", churn), &churn, |b, _| b.iter(|| native.step()));
    let mut wasm = Keyed::new(Wasm::load(CHURN_POLICY, 1).unwrap(), churn, false);
    g.bench_with_input(BenchmarkId::new("wasm churn 1e5 through 1024", churn), &churn, |b, _| b.iter(|| wasm.step()));
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);

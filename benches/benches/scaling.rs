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

use std::time::Duration;

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion};
use levee_benches::{keys_policy, Keyed, SUCCESS};
use levee_conformance::component::Wasm;
use levee_conformance::{Native, Target};
use levee_core::OutcomeKind;

/// The decision-cycle benchmark's policy: retries, an attempt timeout and a breaker.
const CALLS_POLICY: &str =
    "policies:\n  api:\n    attempts: 3\n    attempt-timeout: 1s\n    breaker: { minimum-calls: 20, window: { kind: count, size: 50 } }\n";

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
        let mut native = Keyed::new(Native::load(&keys_policy(1_000_000), 1).unwrap(), k, true);
        g.bench_with_input(BenchmarkId::new("native", k), &k, |b, _| b.iter(|| native.step()));
        drop(native);
        let mut wasm = Keyed::new(Wasm::load(&keys_policy(1_000_000), 1).unwrap(), k, true);
        g.bench_with_input(BenchmarkId::new("wasm", k), &k, |b, _| b.iter(|| wasm.step()));
    }
    // 100,000 clients through keys.max 1024: nearly every call evicts a key.
    let churn = 100_000;
    let mut native = Keyed::new(Native::load(&keys_policy(1024), 1).unwrap(), churn, false);
    g.bench_with_input(BenchmarkId::new("native churn 1e5 through 1024", churn), &churn, |b, _| b.iter(|| native.step()));
    let mut wasm = Keyed::new(Wasm::load(&keys_policy(1024), 1).unwrap(), churn, false);
    g.bench_with_input(BenchmarkId::new("wasm churn 1e5 through 1024", churn), &churn, |b, _| b.iter(|| wasm.step()));
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);

//! One full decision cycle of a call that succeeds first time (start + report success),
//! natively and through the component in wasmtime, under a policy with retry and breaker.
//! Also the same cycle with the success settled on the next start (one crossing per call),
//! through `engine.start` and through `start-unkeyed` (what hosts use for calls without a key).
// Tests may index and panic: the no-panic lints guard library code reachable from input.
#![allow(clippy::indexing_slicing, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use criterion::{criterion_group, criterion_main, Criterion};
use levee_conformance::component::{Wasm, WasmUnkeyed};
use levee_conformance::{Native, Target};
use levee_core::OutcomeKind;

const POLICY: &str =
    "policies:\n  api:\n    attempts: 3\n    attempt-timeout: 1s\n    breaker: { minimum-calls: 20, window: { kind: count, size: 50 } }\n";

fn cycle<T: Target>(t: &mut T, call: &mut u64, now: &mut u64) {
    *call += 1;
    *now += 1_000;
    let v = t.start(*call, 0, "", 0, *now, 0, 0, 0);
    debug_assert_eq!(v & 0xF, 0);
    let d = t.report(*call, *now + 500, 500, OutcomeKind::Success, 0, "", 0, 0);
    debug_assert_eq!(d & 0xF, 2);
    std::hint::black_box(d);
}

fn settled<T: Target>(t: &mut T, call: &mut u64, now: &mut u64) {
    *call += 1;
    *now += 1_000;
    let prev = *call - 1;
    let v = t.start(*call, 0, "", 0, *now, prev, *now - 500, 500);
    std::hint::black_box(v);
}

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("decision_cycle");
    let (mut call, mut now) = (0u64, 0u64);
    let Ok(mut native) = Native::load(POLICY, 1) else { return };
    g.bench_function("native start+report", |b| b.iter(|| cycle(&mut native, &mut call, &mut now)));
    let Ok(mut wasm) = Wasm::load(POLICY, 1) else { return };
    g.bench_function("wasm start+report", |b| b.iter(|| cycle(&mut wasm, &mut call, &mut now)));
    let Ok(mut native) = Native::load(POLICY, 1) else { return };
    let first = call + 1;
    native.start(first, 0, "", 0, now, 0, 0, 0);
    call = first;
    g.bench_function("native start(settle)", |b| b.iter(|| settled(&mut native, &mut call, &mut now)));
    let Ok(mut wasm) = Wasm::load(POLICY, 1) else { return };
    call += 1;
    wasm.start(call, 0, "", 0, now, 0, 0, 0);
    g.bench_function("wasm start(settle)", |b| b.iter(|| settled(&mut wasm, &mut call, &mut now)));
    let Ok(mut unkeyed) = WasmUnkeyed::load(POLICY, 1) else { return };
    call += 1;
    unkeyed.start(call, 0, "", 0, now, 0, 0, 0);
    g.bench_function("wasm start-unkeyed(settle)", |b| b.iter(|| settled(&mut unkeyed, &mut call, &mut now)));
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);

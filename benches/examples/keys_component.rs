//! Instructions per call on a random key among K through the component (wasmtime), for
//! callgrind, as `policy-core/examples/keys.rs` counts them natively: `valgrind --tool=callgrind
//! target/release/examples/keys_component K STEPS [MAX]`, minus the run with STEPS = 0, divided
//! by STEPS. `native` as a fourth argument runs the same loop on the native core through the
//! same harness (`levee_conformance::Native`), for a side-by-side count.
#![allow(clippy::unwrap_used, clippy::print_stdout)]

use std::fmt::Write as _;

use levee_conformance::component::Wasm;
use levee_conformance::{Native, Target};
use levee_core::OutcomeKind;

fn run<T: Target>(k: u64, steps: u64, max: u64) -> u64 {
    let doc = format!(
        "policies:\n  per-client:\n    attempts: 3\n    rate-limit: {{ rate: 1000000 }}\n    breaker: {{ minimum-calls: 20, window: {{ kind: count, size: 20 }} }}\n    keys: {{ max: {max} }}\n"
    );
    let mut t = T::load(&doc, 1).unwrap();
    let (mut name, mut call, mut sum, mut x) = (String::new(), 0u64, 0u64, 0x9E37_79B9_7F4A_7C15u64);
    let mut one = |t: &mut T, i: u64| {
        call += 1;
        name.clear();
        let _ = write!(name, "client-{i:07}");
        sum = sum.wrapping_add(t.start(call, 0, &name, 0, call * 10, 0, 0, 0));
        sum = sum.wrapping_add(t.report(call, call * 10, 500, OutcomeKind::Success, 0, "", 0, 0));
        if call % 64 == 0 {
            sum = sum.wrapping_add(t.drain_events().len() as u64);
        }
    };
    if max >= k {
        for i in 0..k {
            one(&mut t, i);
        }
    }
    for _ in 0..steps {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        one(&mut t, x % k);
    }
    sum
}

fn main() {
    let arg = |i: usize, default: u64| std::env::args().nth(i).and_then(|a| a.parse().ok()).unwrap_or(default);
    let (k, steps, max) = (arg(1, 1).max(1), arg(2, 100_000), arg(3, 1_000_000));
    let sum = if std::env::args().nth(4).as_deref() == Some("native") { run::<Native>(k, steps, max) } else { run::<Wasm>(k, steps, max) };
    println!("{sum}");
}

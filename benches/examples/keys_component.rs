//! Instructions per call of the scaling benchmark's keys loop (`levee_benches::Keyed`: one
//! call on a random key among K) through the component, for callgrind, as
//! `policy-core/examples/keys.rs` counts a keyed call natively: `valgrind --tool=callgrind
//! target/release/examples/keys_component K STEPS [MAX]`, minus the run with STEPS = 0, divided
//! by STEPS. All K keys are made first unless MAX (`keys.max`, default 1,000,000) is below K
//! (churn). `native` as a fourth argument runs the same loop on the native core through the
//! same harness (`levee_conformance::Native`), for a side-by-side count.
#![allow(clippy::unwrap_used)]

use levee_benches::{keys_policy, Keyed};
use levee_conformance::component::Wasm;
use levee_conformance::{Native, Target};

fn run<T: Target>(k: usize, steps: usize, max: usize) {
    let mut keyed = Keyed::new(T::load(&keys_policy(max), 1).unwrap(), k, max >= k);
    for _ in 0..steps {
        keyed.step();
    }
}

fn main() {
    let arg = |i: usize, default: usize| std::env::args().nth(i).and_then(|a| a.parse().ok()).unwrap_or(default);
    let (k, steps, max) = (arg(1, 1).max(1), arg(2, 100_000), arg(3, 1_000_000));
    if std::env::args().nth(4).as_deref() == Some("native") {
        run::<Native>(k, steps, max);
    } else {
        run::<Wasm>(k, steps, max);
    }
}

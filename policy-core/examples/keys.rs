//! Instructions per call on a random key among K, for callgrind: `valgrind --tool=callgrind
//! target/release/examples/keys K STEPS [MAX]`, minus the run with STEPS = 0, divided by STEPS.
//! All K keys are made first (unless MAX, the policy's `keys.max`, is below K: churn).
use std::fmt::Write as _;

use levee_core::{Engine, OutcomeKind};

fn main() {
    let arg = |i: usize, default: u64| std::env::args().nth(i).and_then(|a| a.parse().ok()).unwrap_or(default);
    let (k, steps, max) = (arg(1, 1).max(1), arg(2, 100_000), arg(3, 1_000_000));
    let doc = format!(
        "policies:\n  per-client:\n    attempts: 3\n    rate-limit: {{ rate: 1000000 }}\n    breaker: {{ minimum-calls: 20, window: {{ kind: count, size: 20 }} }}\n    keys: {{ max: {max} }}\n"
    );
    let Ok(mut e) = Engine::load(&doc, 1) else { return };
    let (mut name, mut call, mut sum, mut x) = (String::new(), 0u64, 0u64, 0x9E37_79B9_7F4A_7C15u64);
    let mut one = |e: &mut Engine, i: u64| {
        call += 1;
        name.clear();
        let _ = write!(name, "client-{i:07}");
        sum = sum.wrapping_add(e.start(call, 0, &name, 0, call * 10, 0, 0, 0).0);
        sum = sum.wrapping_add(e.report(call, call * 10, 500, OutcomeKind::Success, 0, "", 0, 0).0);
        if call % 64 == 0 {
            sum = sum.wrapping_add(e.drain_events().len() as u64);
        }
    };
    if max >= k {
        for i in 0..k {
            one(&mut e, i);
        }
    }
    for _ in 0..steps {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        one(&mut e, x % k);
    }
    println!("{sum}");
}

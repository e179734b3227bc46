//! Instructions per call with N calls in flight, for callgrind (noise-free, unlike wall time):
//! `valgrind --tool=callgrind target/release/examples/inflight N STEPS`, then subtract the run
//! with STEPS = 0 (the set-up) and divide by STEPS. Each step starts one call and reports the
//! oldest, so N calls stay live.
use levee_core::{Engine, OutcomeKind};

fn main() {
    let doc = "policies:\n  api:\n    attempts: 3\n    attempt-timeout: 1s\n    breaker: { minimum-calls: 20, window: { kind: count, size: 50 } }\n";
    let Ok(mut e) = Engine::load(doc, 1) else { return };
    let arg = |i: usize, default: u64| std::env::args().nth(i).and_then(|a| a.parse().ok()).unwrap_or(default);
    let (n, steps) = (arg(1, 1).max(1), arg(2, 100_000));
    let mut sum = 0u64;
    for call in 1..=n {
        sum = sum.wrapping_add(e.start(call, 0, "", 0, call * 10, 0, 0, 0).0);
    }
    for call in n + 1..=n + steps {
        let now = call * 10;
        sum = sum.wrapping_add(e.start(call, 0, "", 0, now, 0, 0, 0).0);
        sum = sum.wrapping_add(e.report(call - n, now, 500, OutcomeKind::Success, 0, "", 0, 0).0);
    }
    println!("{sum}");
}

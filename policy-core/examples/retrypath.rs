//! A retry loop (an attempt fails with 503, is retried after its backoff, then succeeds), for
//! profilers: `valgrind --tool=callgrind target/release/examples/retrypath 100000`. It walks
//! the retry decision ladder, the budget and the jitter draw on every call.
use levee_core::{Engine, OutcomeKind};

fn main() {
    let doc = "policies:\n  api:\n    attempts: 3\n    attempt-timeout: 1s\n    deadline: 10s\n    budget: { kind: token, max-tokens: 1000, token-ratio: 1 }\n    breaker: { minimum-calls: 20, window: { kind: count, size: 50 } }\n";
    let Ok(mut e) = Engine::load(doc, 1) else { return };
    let n: u64 = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(200_000);
    let mut sum = 0u64;
    for call in 1..n {
        let now = call * 1_000_000_000;
        sum = sum.wrapping_add(e.start(call, 0, "", 0, now, 0, 0, 0).0);
        let v = e.report(call, now + 1_000, 1_000, OutcomeKind::HttpStatus, 503, "", 0, 0);
        sum = sum.wrapping_add(v.0);
        sum = sum.wrapping_add(e.acquire(call, now + 1_000 + v.payload()).0);
        sum = sum.wrapping_add(e.report(call, now + 2_000 + v.payload(), 1_000, OutcomeKind::Success, 0, "", 0, 0).0);
        if e.has_events() {
            e.drain_events();
        }
    }
    println!("{sum}");
}

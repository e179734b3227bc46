//! A first-time-success loop (start with the previous success settled), for profilers:
//! `valgrind --tool=callgrind target/release/examples/hotpath`.
use levee_core::Engine;

fn main() {
    let doc = "policies:\n  api:\n    attempts: 3\n    attempt-timeout: 1s\n    breaker: { minimum-calls: 20, window: { kind: count, size: 50 } }\n";
    let Ok(mut e) = Engine::load(doc, 1) else { return };
    let n: u64 = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(200_000);
    let mut sum = 0u64;
    e.start(1, 0, "api.example.com", 0, 1, 0, 0, 0);
    for call in 2..n {
        let now = call * 1_000;
        sum = sum.wrapping_add(e.start(call, 0, "api.example.com", 0, now, call - 1, now - 500, 500).0);
    }
    println!("{sum}");
}

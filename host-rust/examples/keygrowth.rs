//! The slowest calls while one key table grows to N keys (default 999,999), in the component:
//! `cargo run --release -p levee-resilience --example keygrowth [N]`. Prints every `start`
//! over 5 ms with the number of keys it met, then the slowest. A call that makes the table
//! grow pays for the growth (docs/performance.md, "Growth of the key table").
use std::time::{Duration, Instant};

use levee::core::OutcomeKind;
use levee::{Backend, Limits, LoadErrors, RawEngine};

const DOC: &str = "policies:\n  p:\n    attempts: 1\n    keys: { max: 1000000 }\n";

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let n: u64 = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(999_999);
    // no time bound on a call: the point is to see how long the slowest takes
    let limits = Limits { checkpoint_interval: 0, call_ticks: u64::MAX / 2, ..Limits::default() };
    let mut e = RawEngine::load_with(Backend::Wasm, DOC, 1, limits).map_err(LoadErrors)?;
    let mut slowest = (0, Duration::ZERO);
    for i in 0..n {
        let key = format!("{i:0>8}");
        let t = Instant::now();
        e.try_start(i + 1, 0, &key, 0, 1_000 + i, 0, 0, 0)?;
        let took = t.elapsed();
        if took > Duration::from_millis(5) {
            println!("{i:>9} keys: {:>8.2} ms", took.as_secs_f64() * 1e3);
        }
        if took > slowest.1 {
            slowest = (i, took);
        }
        e.try_report(i + 1, 1_000 + i, 10, OutcomeKind::Success, 0, "", 0, 0)?;
    }
    println!("slowest start: {:.2} ms, at {} keys", slowest.1.as_secs_f64() * 1e3, slowest.0);
    Ok(())
}

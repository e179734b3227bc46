//! What the recovery snapshot costs at many keys (issue 41), natively: `export-state` (the
//! whole table) against `export-snapshot` (the keys holding protection), and one caller cycling
//! over 1,000 keys for a fixed time while a host's snapshot rule runs (once per second of the
//! engine's clock, and after a breaker transition).
//!
//! `cargo run --release -p levee-benches --example snapshot [SECONDS]`

use std::time::{Duration, Instant};

use levee_core::{Engine, OutcomeKind};

const DOC: &str = "policies:\n  p:\n    attempts: 1\n    breaker: { window: { kind: count, size: 4 }, minimum-calls: 2, open-duration: 1h }\n    keys: { max: 1000000 }\n";

/// An engine with `n` keys at rest and one open breaker (key "open").
fn filled(n: u64) -> (Engine, u64) {
    let mut e = Engine::load(DOC, 7).unwrap_or_else(|_| std::process::exit(2));
    let mut id = 0;
    for i in 0..n {
        id += 1;
        let key = format!("k{i}");
        e.start(id, 0, &key, 0, i, 0, 0, 0);
        e.report(id, i, 1, OutcomeKind::Success, 0, "", 0, 0);
    }
    for _ in 0..2 {
        id += 1;
        e.start(id, 0, "open", 0, n, 0, 0, 0);
        e.report(id, n, 1, OutcomeKind::Timeout, 0, "", 0, 0);
        e.cancel(id, n);
    }
    let _ = e.drain_events();
    (e, id)
}

/// One caller over k0..k999 for `secs` of wall time, the engine's clock following it, with a
/// snapshot at most once per second of that clock: (calls, slowest call).
fn cycle(e: &mut Engine, mut id: u64, secs: f64, snapshot: fn(&Engine) -> Vec<u8>) -> (u64, Duration) {
    let t0 = Instant::now();
    let (mut calls, mut slowest, mut next_snapshot) = (0u64, Duration::ZERO, 0u64);
    let mut kept = Vec::new();
    while t0.elapsed().as_secs_f64() < secs {
        let c0 = Instant::now();
        let now = 1_000_000_000_000 + t0.elapsed().as_nanos() as u64;
        id += 1;
        let key = format!("k{}", calls % 1000);
        e.start(id, 0, &key, 0, now, 0, 0, 0);
        e.report(id, now, 1, OutcomeKind::Success, 0, "", 0, 0);
        if now >= next_snapshot {
            kept = snapshot(e);
            next_snapshot = now + 1_000_000_000;
        }
        calls += 1;
        slowest = slowest.max(c0.elapsed());
    }
    std::hint::black_box(kept);
    (calls, slowest)
}

fn main() {
    let secs: f64 = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(3.0);
    println!("| keys | fill | export-state | bytes | export-snapshot | bytes | calls in {secs} s (ratio to 1 key), slowest: with export-state | with export-snapshot |");
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|");
    let mut base: [u64; 2] = [0, 0];
    for n in [1u64, 100_000, 1_000_000] {
        let f0 = Instant::now();
        let (mut e, id) = filled(n);
        let fill = f0.elapsed();
        let t = Instant::now();
        let full = e.export_state();
        let full_t = t.elapsed();
        let t = Instant::now();
        let snap = e.export_snapshot();
        let snap_t = t.elapsed();
        let mut cells = Vec::new();
        for (i, f) in [Engine::export_state as fn(&Engine) -> Vec<u8>, Engine::export_snapshot].into_iter().enumerate() {
            let (calls, slowest) = cycle(&mut e, id + (i as u64 + 1) * 100_000_000, secs, f);
            let b = base.get_mut(i).map(|b| {
                if n == 1 {
                    *b = calls.max(1);
                }
                *b
            });
            let ratio = calls as f64 / b.unwrap_or(1) as f64;
            cells.push(format!("{calls} ({ratio:.2}), {:.2} ms", slowest.as_secs_f64() * 1e3));
        }
        println!(
            "| {n} | {:.1} s | {:.1} ms | {} | {:.3} ms | {} | {} | {} |",
            fill.as_secs_f64(),
            full_t.as_secs_f64() * 1e3,
            full.len(),
            snap_t.as_secs_f64() * 1e3,
            snap.len(),
            cells.first().map_or("", String::as_str),
            cells.get(1).map_or("", String::as_str)
        );
    }
}

//! The filter's own work per request, natively (no proxy-wasm host calls): admission and
//! feedback through an in-memory shared-data store, with the benchmark's policy.
//!
//! `cargo run --release -p levee-proxy-wasm --example gate_cost [N] [WORKERS] [EVICT_MIB]`; in V8, as Envoy
//! runs the filter: `node proxy-wasm/bench/v8.mjs` (after building it for wasm32-wasip1).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::time::{Duration, Instant};

use levee_proxy_wasm::gate::{Admit, Gate, MemoryStore, Response};

const DOC: &str = r#"{"policies": {"edge": {"attempts": 3, "backoff": {"base": "25ms", "cap": "250ms"},
  "retry-on": ["http:503", "connection-error"], "budget": {"kind": "token", "max-tokens": 100, "token-ratio": 0.1},
  "breaker": {"window": {"kind": "count", "size": 100}, "minimum-calls": 20, "failure-rate": 50, "open-duration": "5s"}}}}"#;

/// `n` requests through `workers` gates sharing one store, taking turns (one request each):
/// with two, every operation finds the other worker's bytes and imports them, as two Envoy
/// workers sharing a key do. With `evict` (MiB), a buffer that size is written one byte per
/// 4 KiB page before each request, out of the time measured: the request then starts with
/// cold caches and TLB, as one does in a proxy that did other work since the last.
fn run(workers: u64, n: u64, evict: usize) -> f64 {
    let mut gates: Vec<Gate> = (1..=workers).map(|w| Gate::new(levee_proxy_wasm::config::parse(DOC).expect("config"), w)).collect();
    let store = MemoryStore::default();
    let mut junk = vec![0u8; evict << 20];
    let mut spent = Duration::ZERO;
    for i in 0..n {
        for b in junk.iter_mut().step_by(4096) {
            *b = b.wrapping_add(1);
        }
        std::hint::black_box(&mut junk);
        let t = Instant::now();
        let g = gates.get_mut((i % workers) as usize).expect("gate");
        let now = 1_000_000_000 + i * 1000;
        let (a, call) = g.admit(&store, now, "backend", "GET", None);
        assert!(matches!(a, Admit::Forward(_)));
        let mut c = call.expect("call");
        g.complete(&store, now + 500, &mut c, &Response { status: 200, attempts: 1, ..Default::default() }, 1);
        spent += t.elapsed();
    }
    spent.as_nanos() as f64 / n as f64
}

/// `gate_cost [N] [WORKERS] [EVICT_MIB]`: N requests (default 200,000); WORKERS 1 or 2 (default:
/// both, in turn); EVICT_MIB a buffer written through before each request (default 0: a hot loop).
fn main() {
    let arg = |i: usize| std::env::args().nth(i).and_then(|a| a.parse::<u64>().ok());
    let n = arg(1).unwrap_or(200_000);
    let only = arg(2).filter(|w| *w != 0);
    let evict = arg(3).unwrap_or(0) as usize;
    // Warm up first (untimed): in V8 a function is compiled on its first call.
    run(2, 20_000, 0);
    let how = if evict == 0 { "a hot loop".to_string() } else { format!("caches cold: {evict} MiB written before each") };
    for workers in [1u64, 2].into_iter().filter(|w| only.is_none_or(|o| o == *w)) {
        let per = run(workers, n, evict);
        println!("admit + complete, {workers} worker(s) taking turns: {per:.0} ns per request ({how}; in-memory store)");
    }
}

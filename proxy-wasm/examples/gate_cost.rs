//! The filter's own work per request, natively (no proxy-wasm host calls): admission and
//! feedback through an in-memory shared-data store, with the benchmark's policy.
//!
//! `cargo run --release -p levee-proxy-wasm --example gate_cost`
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::cell::RefCell;
use std::collections::HashMap;
use std::time::Instant;

use levee_proxy_wasm::gate::{Admit, Gate, Response, Store};

type Versioned = HashMap<String, (Vec<u8>, u32)>;

#[derive(Default)]
struct Mem(RefCell<(Versioned, u32)>);

impl Store for Mem {
    fn get(&self, key: &str) -> (Option<Vec<u8>>, u32) {
        let m = self.0.borrow();
        m.0.get(key).map(|(v, c)| (Some(v.clone()), *c)).unwrap_or((None, 0))
    }
    fn set(&self, key: &str, value: &[u8], cas: u32) -> Result<(), bool> {
        let mut m = self.0.borrow_mut();
        m.1 += 1;
        let next = m.1;
        match m.0.get_mut(key) {
            Some(e) if cas != 0 && e.1 != cas => Err(true),
            Some(e) => {
                *e = (value.to_vec(), next);
                Ok(())
            }
            None => {
                m.0.insert(key.to_string(), (value.to_vec(), next));
                Ok(())
            }
        }
    }
}

const DOC: &str = r#"{"policies": {"edge": {"attempts": 3, "backoff": {"base": "25ms", "cap": "250ms"},
  "retry-on": ["http:503", "connection-error"], "budget": {"kind": "token", "max-tokens": 100, "token-ratio": 0.1},
  "breaker": {"window": {"kind": "count", "size": 100}, "minimum-calls": 20, "failure-rate": 50, "open-duration": "5s"}}}}"#;

/// `n` requests through `workers` gates sharing one store, taking turns (one request each):
/// with two, every operation finds the other worker's bytes and imports them, as two Envoy
/// workers sharing a key do.
fn run(workers: u64, n: u64) -> f64 {
    let mut gates: Vec<Gate> = (1..=workers).map(|w| Gate::new(levee_proxy_wasm::config::parse(DOC).expect("config"), w)).collect();
    let store = Mem::default();
    let t = Instant::now();
    for i in 0..n {
        let g = gates.get_mut((i % workers) as usize).expect("gate");
        let now = 1_000_000_000 + i * 1000;
        let (a, call) = g.admit(&store, now, "backend", "GET", None);
        assert!(matches!(a, Admit::Forward(_)));
        let mut c = call.expect("call");
        g.complete(&store, now + 500, &mut c, &Response { status: 200, attempts: 1, ..Default::default() }, 1);
    }
    t.elapsed().as_nanos() as f64 / n as f64
}

/// `gate_cost [N] [WORKERS]`: N requests (default 200,000); WORKERS 1 or 2 (default: both, in turn).
fn main() {
    let n: u64 = std::env::args().nth(1).and_then(|a| a.parse().ok()).unwrap_or(200_000);
    let only: Option<u64> = std::env::args().nth(2).and_then(|a| a.parse().ok());
    for workers in [1u64, 2].into_iter().filter(|w| only.is_none_or(|o| o == *w)) {
        let per = run(workers, n);
        println!("admit + complete, {workers} worker(s) taking turns: {per:.0} ns per request (native, in-memory store)");
    }
}

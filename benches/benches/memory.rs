//! Bytes per live call and per key, natively, measured by a counting allocator: what the
//! engine keeps (net of frees) after making 50,000 of each. `cargo bench -p levee-benches
//! --bench memory`. Through the component the figures are the same data in linear memory
//! (talc's overhead aside), which grows and never shrinks.
#![allow(clippy::indexing_slicing, clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::alloc::System;

use levee_conformance::{Native, Target};
use levee_core::OutcomeKind;
use stats_alloc::{Region, StatsAlloc, INSTRUMENTED_SYSTEM};

#[global_allocator]
static GLOBAL: &StatsAlloc<System> = &INSTRUMENTED_SYSTEM;

const N: usize = 50_000;

/// Net bytes allocated by `make`, per item.
fn per_item<R>(make: impl FnOnce() -> R) -> (f64, R) {
    let region = Region::new(GLOBAL);
    let kept = make();
    let s = region.change();
    ((s.bytes_allocated as f64 - s.bytes_deallocated as f64) / N as f64, kept)
}

fn report(what: &str, doc: &str, keyed: bool) {
    let names: Vec<String> = (0..N).map(|i| format!("client-{i:07}")).collect();
    let engine = Native::load(doc, 1).unwrap();
    let (bytes, engine) = per_item(move || {
        let mut t = engine;
        for (i, name) in names.iter().enumerate() {
            let call = i as u64 + 1;
            t.start(call, 0, if keyed { name } else { "" }, 0, 10, 0, 0, 0);
            if keyed {
                t.report(call, 10, 1, OutcomeKind::Success, 0, "", 0, 0);
            }
        }
        t
    });
    if keyed {
        assert_eq!(engine.0.key_count(0), N);
    } else {
        assert_eq!(engine.0.live_calls(), N);
    }
    println!("{what}: {bytes:.0} bytes");
}

fn main() {
    report(
        "per live call (retries, attempt timeout, breaker)",
        "policies:\n  api: { attempts: 3, attempt-timeout: 1s, breaker: {} }\n",
        false,
    );
    report("per key, bare (14-byte names)", "policies:\n  api: { keys: { max: 1000000 } }\n", true);
    report("per key, rate limit", "policies:\n  api: { rate-limit: { rate: 100 }, keys: { max: 1000000 } }\n", true);
    report(
        "per key, rate limit + 20-call breaker",
        "policies:\n  api: { rate-limit: { rate: 100 }, breaker: { window: { kind: count, size: 20 } }, keys: { max: 1000000 } }\n",
        true,
    );
    report("per key, 100-call breaker (the default window)", "policies:\n  api: { breaker: {}, keys: { max: 1000000 } }\n", true);
    report("per key, token budget", "policies:\n  api: { budget: { kind: token }, keys: { max: 1000000 } }\n", true);
}

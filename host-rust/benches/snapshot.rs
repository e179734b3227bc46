//! What the recovery snapshot costs the call path at many keys (issue 41, docs/performance.md,
//! "Snapshots at many keys"). For each N: one engine (the wasm backend, the async handle on a
//! current-thread runtime) with policy `p` (a breaker, `keys: { max: 1000000 }`), N keys
//! `k0..k{N-1}` filled with successful calls, the breaker of key `open` opened (so a snapshot is
//! due), then one caller cycles over `k0..k999` for T seconds of the real clock, counting calls
//! and the slowest call. The periodic snapshot is taken once a second of the engine's clock on
//! the call path.
//!
//! Columns: calls in T, their ratio to the first size's, the slowest call, one snapshot of the
//! mode's kind timed on its own after the run (the fastest of three: on a busy machine a slow call
//! may be the scheduler's), and how many periodic `export-state` snapshots trapped.
//!
//! Two modes, in the same run: `export-snapshot` (the host as it is: the engine's own periodic
//! snapshot, `export-snapshot`, the protected keys only) and `export-state` (the host as it was:
//! the engine's periodic snapshot off, and the caller taking `export-state` once a second
//! inside the call that crosses the second, as the engine did before issue 41).
//!
//! ```sh
//! cargo bench -p levee-resilience --bench snapshot                                  # N = 1, 10^5, 10^6; T = 3 s
//! cargo bench -p levee-resilience --bench snapshot -- --sizes 1000,20000 --seconds 0.5   # smoke run
//! ```
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stdout)]

use std::time::{Duration, Instant};

use levee::core::{BreakerState, Reason};
use levee::{Backend, Levee, Limits};

const DOC: &str = "policies:\n  p:\n    attempts: 1\n    breaker: { window: { kind: count, size: 4 }, minimum-calls: 2, open-duration: 1h }\n    keys: { max: 1000000 }\n";

struct Run {
    /// Snapshots that trapped (the engine recovered from the last good snapshot).
    failed: u64,
    /// One snapshot of the mode's kind taken on its own after the run (the fastest of three).
    snapshot: Duration,
    calls: u64,
    slowest: Duration,
    fill: Duration,
}

async fn run(n: usize, seconds: f64, old: bool) -> Run {
    let limits = if old { Limits { checkpoint_interval: 0, ..Limits::default() } } else { Limits::default() };
    let l = Levee::builder().backend(Backend::Wasm).seed(1).limits(limits).load(DOC).expect("loads");
    let t0 = Instant::now();
    for i in 0..n {
        l.call::<u32, std::io::Error>("p").key(format!("k{i}")).run(|_| async { Ok(1) }).await.expect("fills");
    }
    let fill = t0.elapsed();
    for _ in 0..2 {
        let r = l
            .call::<u32, std::io::Error>("p")
            .key("open")
            .run(|_| async { Err(std::io::Error::from(std::io::ErrorKind::ConnectionRefused)) })
            .await;
        assert!(r.is_err());
    }
    assert_eq!(l.breaker_state("p", "open"), Some(BreakerState::Open));
    let err = l.call::<u32, std::io::Error>("p").key("open").run(|_| async { Ok(1) }).await.expect_err("open");
    assert_eq!(err.reason, Reason::BreakerOpen);

    let keys: Vec<String> = (0..n.clamp(1, 1000)).map(|i| format!("k{i}")).collect();
    let (mut calls, mut slowest) = (0u64, Duration::ZERO);
    let start = Instant::now();
    let end = start + Duration::from_secs_f64(seconds);
    let mut last_snapshot = start;
    let mut failed = 0u64;
    loop {
        let t = Instant::now();
        if t >= end {
            break;
        }
        let key = keys.get(calls as usize % keys.len()).map_or("k0", String::as_str);
        if old && t.duration_since(last_snapshot) >= Duration::from_secs(1) {
            // The periodic snapshot as it was: the whole state, on the call that crossed the second.
            last_snapshot = t;
            if l.with_raw(|r| r.try_export_state()).is_err() {
                failed += 1;
            }
        }
        l.call::<u32, std::io::Error>("p").key(key).run(|_| async { Ok(1) }).await.expect("runs");
        slowest = slowest.max(t.elapsed());
        calls += 1;
    }
    let snapshot = (0..3)
        .map(|_| {
            let t = Instant::now();
            let _ = l.with_raw(|r| if old { r.try_export_state() } else { r.try_export_snapshot() });
            t.elapsed()
        })
        .min()
        .unwrap_or_default();
    Run { failed, snapshot, calls, slowest, fill }
}

fn arg<T: std::str::FromStr>(args: &[String], name: &str) -> Option<T> {
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).and_then(|v| v.parse().ok())
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let sizes: Vec<usize> = arg::<String>(&args, "--sizes")
        .map(|s| s.split(',').filter_map(|v| v.trim().parse().ok()).collect())
        .unwrap_or_else(|| vec![1, 100_000, 1_000_000]);
    let seconds: f64 = arg(&args, "--seconds").unwrap_or(3.0);
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    println!(
        "{:<16} {:>9} {:>10} {:>6} {:>11} {:>12} {:>7} {:>7}",
        "snapshot", "N", "calls", "ratio", "slowest ms", "snapshot ms", "trapped", "fill s"
    );
    for mode in ["export-state", "export-snapshot"] {
        let mut base = None;
        for &n in &sizes {
            let r = rt.block_on(run(n, seconds, mode == "export-state"));
            let base = *base.get_or_insert(r.calls);
            println!(
                "{mode:<16} {n:>9} {:>10} {:>6.2} {:>11.2} {:>12.2} {:>7} {:>7.1}",
                r.calls,
                r.calls as f64 / base as f64,
                r.slowest.as_secs_f64() * 1e3,
                r.snapshot.as_secs_f64() * 1e3,
                r.failed,
                r.fill.as_secs_f64()
            );
        }
    }
}

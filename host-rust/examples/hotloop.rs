//! First-time-success loops for profilers, e.g.
//! `valgrind --tool=callgrind target/release/examples/hotloop wasm handle 20000` or
//! `perf record -g target/release/examples/hotloop native handle 2000000`.
//! Modes: `handle` (the async handle, as users call it), `raw` (`RawEngine::try_start` settling
//! the previous success), `empty` (a guest call that does nothing: the crossing alone),
//! `backon` (the peer of `benches/overhead.rs` with the same policy; the backend is ignored).
//! Prints the mean time per call; the criterion bench (`benches/overhead.rs`) is the measurement.
use std::time::Instant;

use levee::{Backend, Levee, Limits, LoadErrors, RawEngine};

const DOC: &str = "policies:\n  api:\n    attempts: 3\n    attempt-timeout: 1s\n    backoff: {kind: exponential, base: 10ms, cap: 1s}\n";

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let backend = if args.first().map(String::as_str) == Some("native") { Backend::Native } else { Backend::Wasm };
    let mode = args.get(1).map(String::as_str).unwrap_or("handle");
    let n: u64 = args.get(2).and_then(|a| a.parse().ok()).unwrap_or(1_000_000);
    let started;
    match mode {
        "raw" | "empty" => {
            let mut raw = RawEngine::load_with(backend, DOC, 1, Limits::default()).map_err(LoadErrors)?;
            started = Instant::now();
            for call in 1..=n {
                let _ = if mode == "raw" {
                    raw.try_start(call, 0, "", 0, call * 1000, call - 1, call * 1000, 10).map(|v| v.0)
                } else {
                    raw.try_cancel(call, call * 1000).map(|()| 0)
                };
            }
        }
        "backon" => {
            use backon::{ExponentialBuilder, Retryable};
            let rt = tokio::runtime::Builder::new_current_thread().enable_time().build()?;
            started = Instant::now();
            rt.block_on(async {
                for i in 0..n {
                    let _ = (|| async move {
                        tokio::time::timeout(std::time::Duration::from_secs(1), async move { Ok::<_, std::io::Error>(i) })
                            .await
                            .map_err(std::io::Error::other)?
                    })
                    .retry(
                        ExponentialBuilder::default()
                            .with_min_delay(std::time::Duration::from_millis(10))
                            .with_max_delay(std::time::Duration::from_secs(1))
                            .with_max_times(2)
                            .with_jitter(),
                    )
                    .sleep(tokio::time::sleep)
                    .await;
                }
            });
        }
        _ => {
            let rt = tokio::runtime::Builder::new_current_thread().enable_time().build()?;
            let levee = Levee::builder().backend(backend).seed(1).load(DOC)?;
            started = Instant::now();
            rt.block_on(async {
                for i in 0..n {
                    let _ = levee.call("api").run(|_| async move { Ok::<_, std::io::Error>(i) }).await;
                }
            });
        }
    }
    println!("{backend} {mode}: {:.0} ns per call", started.elapsed().as_nanos() as f64 / n as f64);
    Ok(())
}

//! Per-call overhead of a call that succeeds first time: bare, under Levee (wasm and native
//! backends), the raw engine alone, and the peer `backon` with the same policy (3 attempts,
//! exponential backoff, a 1 s per-attempt timeout). `cargo bench -p levee-resilience --bench overhead`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::hint::black_box;
use std::time::Duration;

use backon::{ExponentialBuilder, Retryable};
use criterion::{criterion_group, criterion_main, Criterion};
use levee::core::OutcomeKind;
use levee::{Backend, Levee, Limits, RawEngine};

const DOC: &str = "policies:\n  api:\n    attempts: 3\n    attempt-timeout: 1s\n    backoff: {kind: exponential, base: 10ms, cap: 1s}\n";

async fn work(x: u64) -> Result<u64, std::io::Error> {
    Ok(black_box(x) + 1)
}

fn bench(c: &mut Criterion) {
    let rt = tokio::runtime::Builder::new_current_thread().enable_time().build().expect("runtime");
    let mut g = c.benchmark_group("success_first_time");

    g.bench_function("bare", |b| b.to_async(&rt).iter(|| work(1)));

    g.bench_function("bare_with_timeout", |b| {
        b.to_async(&rt).iter(|| async { tokio::time::timeout(Duration::from_secs(1), work(1)).await })
    });

    for backend in [Backend::Wasm, Backend::Native] {
        let l = Levee::builder().backend(backend).seed(1).load(DOC).expect("loads");
        g.bench_function(format!("levee_{backend}"), |b| {
            b.to_async(&rt).iter(|| {
                let l = &l;
                async move { l.call("api").run(|_| work(1)).await }
            })
        });
    }

    g.bench_function("backon", |b| {
        b.to_async(&rt).iter(|| async {
            (|| async { tokio::time::timeout(Duration::from_secs(1), work(1)).await.map_err(std::io::Error::other)? })
                .retry(
                    ExponentialBuilder::default()
                        .with_min_delay(Duration::from_millis(10))
                        .with_max_delay(Duration::from_secs(1))
                        .with_max_times(2)
                        .with_jitter(),
                )
                .sleep(tokio::time::sleep)
                .await
        })
    });

    for backend in [Backend::Wasm, Backend::Native] {
        let mut e = RawEngine::load_with(backend, DOC, 1, Limits::default()).expect("loads");
        let mut call = 0u64;
        g.bench_function(format!("raw_{backend}_start_settle"), |b| {
            b.iter(|| {
                call += 1;
                let settle = call.saturating_sub(1);
                black_box(e.start(call, 0, "", 0, call * 1000, settle, call * 1000, 10))
            })
        });
        // Flush the last one so the engine is left clean.
        let _ = e.report(call, call * 1000 + 1, 10, OutcomeKind::Success, 0, "", 0, 0);
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);

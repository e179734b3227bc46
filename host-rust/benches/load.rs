//! CPU time per call at production load: N tokio tasks share one `Levee` and each makes ROUNDS
//! calls of a function that waits 5 ms, so about N calls are in flight at any time; the peer is
//! `backon` with the same policy (3 attempts, exponential backoff, a 1 s per-attempt timeout).
//! CPU time is the process's CPU time (CLOCK_PROCESS_CPUTIME_ID: user + system, all threads) over the whole level divided by the
//! calls made; every contender runs at every level in this one process, so the ratios of one run
//! are comparable. The contender `bare` calls the function under no policy: a library's own cost
//! per call is its figure less bare's.
//!
//! ```sh
//! cargo bench -p levee-resilience --bench load                                   # 1, 1,000, 10,000, 40,000
//! cargo bench -p levee-resilience --bench load -- --levels 1,100 --rounds 5 --single 20   # smoke run
//! cargo bench -p levee-resilience --bench load -- --threads 2 --wait-ms 0 --levels 2 --rounds 200000
//! ```
//! `--coldstart` times one engine load instead (run it in fresh processes; `LEVEE_CACHE_DIR`
//! names the compiled-component cache, `off` disables it).
//! `--only levee_wasm,backon` runs only the contenders named (for a profile of one of them);
//! `--callgrind` reads no CPU time (for `valgrind --tool=callgrind`, which counts instructions).
//! `SIZES=1` in the environment prints the size of one call's future, levee's and backon's.
//! `--threads T` runs a multi-thread runtime with T workers (default: current-thread).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stdout)]

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::time::{Duration, Instant};

use backon::{ExponentialBuilder, Retryable};
use levee::{Backend, Levee};

const DOC: &str = "policies:\n  api:\n    attempts: 3\n    attempt-timeout: 1s\n    backoff: {kind: exponential, base: 10ms, cap: 1s}\n";

/// `--callgrind`: no CPU-time readings (rustix's vDSO lookup crashes under valgrind; callgrind
/// counts instructions itself).
static NO_CPU: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

fn cpu() -> Duration {
    if NO_CPU.load(std::sync::atomic::Ordering::Relaxed) {
        return Duration::ZERO;
    }
    // the process's CPU time (all threads, user + system), as getrusage counts it
    let t = rustix::time::clock_gettime(rustix::time::ClockId::ProcessCPUTime);
    Duration::new(t.tv_sec as u64, t.tv_nsec as u32)
}

/// The process's peak RSS in MiB (VmHWM in /proc/self/status; Linux).
fn max_rss_mib() -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<f64>().ok())
        .map_or(f64::NAN, |kb| kb / 1024.0)
}

type Fut = Pin<Box<dyn Future<Output = u64> + Send>>;
type Call = Arc<dyn Fn(Duration) -> Fut + Send + Sync>;

async fn work(wait: Duration) -> Result<u64, std::io::Error> {
    if !wait.is_zero() {
        tokio::time::sleep(wait).await;
    }
    Ok(1)
}

fn contenders() -> Vec<(String, Call)> {
    let mut out: Vec<(String, Call)> = Vec::new();
    for backend in [Backend::Wasm, Backend::Native] {
        let l = Levee::builder().backend(backend).seed(1).load(DOC).expect("loads");
        if std::env::var_os("SIZES").is_some() {
            let f = l.call("api").run(|_| work(Duration::ZERO));
            eprintln!(
                "levee future {} bytes (the attempt's future: {} bytes)",
                std::mem::size_of_val(&f),
                std::mem::size_of_val(&work(Duration::ZERO))
            );
            let b = (|| async { tokio::time::timeout(Duration::from_secs(1), work(Duration::ZERO)).await.map_err(std::io::Error::other)? })
                .retry(ExponentialBuilder::default())
                .sleep(tokio::time::sleep);
            eprintln!("backon future {} bytes", std::mem::size_of_val(&b));
        }
        out.push((
            format!("levee_{backend}"),
            Arc::new(move |wait| {
                let l = l.clone();
                Box::pin(async move { l.call("api").run(|_| work(wait)).await.expect("succeeds") })
            }),
        ));
    }
    out.push((
        "backon".into(),
        Arc::new(|wait| {
            Box::pin(async move {
                (|| async { tokio::time::timeout(Duration::from_secs(1), work(wait)).await.map_err(std::io::Error::other)? })
                    .retry(
                        ExponentialBuilder::default()
                            .with_min_delay(Duration::from_millis(10))
                            .with_max_delay(Duration::from_secs(1))
                            .with_max_times(2)
                            .with_jitter(),
                    )
                    .sleep(tokio::time::sleep)
                    .await
                    .expect("succeeds")
            })
        }),
    ));
    // the function alone, under no policy: what every contender pays anyway (the task, the
    // wait's timer, the runtime), so a library's own cost per call is its figure less this one
    out.push(("bare".into(), Arc::new(|wait| Box::pin(async move { work(wait).await.expect("succeeds") }))));
    out
}

async fn level(call: &Call, n: usize, rounds: usize, wait: Duration) -> (f64, Duration) {
    let c0 = cpu();
    let w0 = Instant::now();
    let tasks: Vec<_> = (0..n)
        .map(|_| {
            let call = call.clone();
            tokio::spawn(async move {
                let mut s = 0;
                for _ in 0..rounds {
                    s += call(wait).await;
                }
                s
            })
        })
        .collect();
    for t in tasks {
        assert_eq!(t.await.expect("task"), rounds as u64);
    }
    let per = (cpu() - c0).as_secs_f64() * 1e6 / (n * rounds) as f64;
    (per, w0.elapsed())
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let arg = |name: &str, dflt: &str| -> String {
        args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).map_or(dflt.to_string(), Clone::clone)
    };
    if args.iter().any(|a| a == "--coldstart") {
        // one load in a fresh process: component compile, instantiation, document parse
        let t0 = Instant::now();
        let l = Levee::builder().backend(Backend::Wasm).seed(1).load(DOC).expect("loads");
        let load = t0.elapsed();
        drop(l);
        println!("rust: load {:.1} ms, max RSS {:.1} MB", load.as_secs_f64() * 1e3, max_rss_mib());
        return;
    }
    let levels: Vec<usize> = arg("--levels", "1,1000,10000,40000").split(',').map(|s| s.parse().expect("level")).collect();
    let rounds: usize = arg("--rounds", "20").parse().expect("rounds");
    let single: usize = arg("--single", "400").parse().expect("single");
    let threads: usize = arg("--threads", "0").parse().expect("threads");
    let wait = Duration::from_secs_f64(arg("--wait-ms", "5").parse::<f64>().expect("wait-ms") / 1e3);
    let rt = if threads == 0 {
        tokio::runtime::Builder::new_current_thread().enable_time().build()
    } else {
        tokio::runtime::Builder::new_multi_thread().worker_threads(threads).enable_time().build()
    }
    .expect("runtime");
    NO_CPU.store(args.iter().any(|a| a == "--callgrind"), std::sync::atomic::Ordering::Relaxed);
    let only: Vec<String> = arg("--only", "").split(',').filter(|s| !s.is_empty()).map(str::to_string).collect();
    rt.block_on(async {
        let cs: Vec<_> = contenders().into_iter().filter(|(name, _)| only.is_empty() || only.contains(name)).collect();
        for (_, c) in &cs {
            level(c, 10, 10, Duration::ZERO).await; // warm up
        }
        println!(
            "# levee (tokio {}), {:?} wait, CPU time (user+system) per call",
            if threads == 0 { "current-thread".to_string() } else { format!("{threads} workers") },
            wait
        );
        println!("{:<10} {:<12} {:>9} {:>10} {:>12} {:>10}", "in flight", "contender", "calls", "wall", "CPU us/call", "levee/this");
        for &n in &levels {
            let r = if n == 1 { single } else { rounds };
            let mut first = 0.0;
            for (name, c) in &cs {
                let (per, wall) = level(c, n, r, wait).await;
                if first == 0.0 {
                    first = per;
                }
                println!("{n:<10} {name:<12} {:>9} {:>10.3?} {per:>12.3} {:>10.2}", n * r, wall, first / per);
            }
        }
    });
}

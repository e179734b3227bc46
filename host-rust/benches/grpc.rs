//! CPU time per unary gRPC call over a local connection (issue 43): a tonic client on a plain
//! channel, the same channel through Levee's layer (`LeveeLayer::grpc`) on the component
//! (wasmtime) and on the native core, side by side in one process, interleaved in rounds. The
//! server (tests/common/flaky.rs's service, answering at once) runs on its own runtime thread;
//! the client on a current-thread runtime on the main thread, so the main thread's CPU time is
//! the client's (tonic, hyper, the layer) and the process's adds the server's.
//!
//! The peer: tonic has no retry of its own (no service-config `retryPolicy`; its channel sends
//! each request once), and `tower::retry` cannot retry a tonic request (its body is a stream,
//! not `Clone`), so there is no built-in retry to set beside Levee's.
//!
//! ```sh
//! cargo bench -p levee-resilience --features grpc --bench grpc                 # 5,000 calls x 5 rounds
//! cargo bench -p levee-resilience --features grpc --bench grpc -- --calls 2000 --rounds 2
//! # one contender alone (plain, wasm or native), e.g. under callgrind for instructions per call:
//! cargo bench -p levee-resilience --features grpc --bench grpc -- --only native --calls 2000 --rounds 1
//! ```
//!
//! Instructions per call (callgrind counts the whole process, client and server; the
//! difference of two call counts removes the setup), each contender alone:
//! ```sh
//! for n in 1000 3000; do valgrind --tool=callgrind --callgrind-out-file=/dev/null \
//!   target/release/deps/grpc-* --only native --calls $n --rounds 1 --warmup 200 --no-clock; done
//! ```
//!
//! Each round runs every contender in turn (a line on stderr per round shows it is alive); the
//! table gives the medians over the rounds. `--warmup N` calls per contender first (default
//! `calls / 10`).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::print_stdout, clippy::indexing_slicing)]

#[allow(clippy::all, clippy::pedantic, missing_docs, unused_qualifications)]
#[path = "../tests/common/flaky.rs"]
mod flaky;

use std::time::Duration;

use flaky::flaky_client::FlakyClient;
use flaky::flaky_server::{Flaky, FlakyServer};
use flaky::{Reply, Request, StatsReply, StatsRequest};
use levee::layer::LeveeLayer;
use levee::{Backend, Levee};
use tonic::{Response, Status};
use tower::Layer;

const DOC: &str = "policies:\n  api:\n    attempts: 3\n    attempt-timeout: 1s\n    backoff: {kind: exponential, base: 10ms, cap: 1s}\n";

struct Echo;

#[tonic::async_trait]
impl Flaky for Echo {
    async fn unary(&self, req: tonic::Request<Request>) -> Result<Response<Reply>, Status> {
        Ok(Response::new(Reply { attempt: 1, payload: req.into_inner().payload, ..Reply::default() }))
    }
    type ServerStreamStream = tokio_stream::Empty<Result<Reply, Status>>;
    async fn server_stream(&self, _: tonic::Request<Request>) -> Result<Response<Self::ServerStreamStream>, Status> {
        Ok(Response::new(tokio_stream::empty()))
    }
    async fn client_stream(&self, _: tonic::Request<tonic::Streaming<Request>>) -> Result<Response<Reply>, Status> {
        Err(Status::unimplemented("bench"))
    }
    async fn stats(&self, _: tonic::Request<StatsRequest>) -> Result<Response<StatsReply>, Status> {
        Err(Status::unimplemented("bench"))
    }
}

/// `--no-clock`: read no CPU clock (for a run under valgrind, which rustix's vDSO lookup trips).
static NO_CLOCK: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

fn clock(id: rustix::time::ClockId) -> Duration {
    if NO_CLOCK.load(std::sync::atomic::Ordering::Relaxed) {
        return Duration::ZERO;
    }
    let t = rustix::time::clock_gettime(id);
    Duration::new(t.tv_sec as u64, t.tv_nsec as u32)
}

fn flag(name: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    args.iter().position(|a| a == name).and_then(|i| args.get(i + 1)).cloned()
}

fn arg(name: &str, default: usize) -> usize {
    flag(name).and_then(|v| v.parse().ok()).unwrap_or(default)
}

enum Contender {
    Plain(FlakyClient<tonic::transport::Channel>),
    Layered(FlakyClient<levee::grpc::GrpcService<tonic::transport::Channel>>),
}

impl Contender {
    async fn run(&mut self, calls: usize) -> (f64, f64) {
        match self {
            Contender::Plain(c) => run(c, calls).await,
            Contender::Layered(c) => run(c, calls).await,
        }
    }
}

/// `calls` sequential unary calls through `client`; (process CPU, this thread's CPU) per call, in µs.
async fn run<T>(client: &mut FlakyClient<T>, calls: usize) -> (f64, f64)
where
    T: tonic::client::GrpcService<tonic::body::Body>,
    T::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
    T::ResponseBody: http_body::Body<Data = bytes::Bytes> + Send + 'static,
    <T::ResponseBody as http_body::Body>::Error: Into<Box<dyn std::error::Error + Send + Sync>> + Send,
{
    use rustix::time::ClockId::{ProcessCPUTime, ThreadCPUTime};
    let (p0, t0) = (clock(ProcessCPUTime), clock(ThreadCPUTime));
    for _ in 0..calls {
        let r = client.unary(Request { payload: vec![7; 16], ..Request::default() }).await.expect("the echo answers");
        assert_eq!(r.get_ref().attempt, 1);
    }
    let per = |d: Duration| d.as_secs_f64() * 1e6 / calls as f64;
    (per(clock(ProcessCPUTime) - p0), per(clock(ThreadCPUTime) - t0))
}

fn main() {
    let (calls, rounds) = (arg("--calls", 5_000), arg("--rounds", 5));
    let warmup = arg("--warmup", calls / 10 + 1);
    NO_CLOCK.store(std::env::args().any(|a| a == "--no-clock"), std::sync::atomic::Ordering::Relaxed);
    // `--only plain|wasm|native`: that contender alone.
    let only = flag("--only");
    let wanted = |name: &str| only.as_deref().is_none_or(|o| name.contains(o));
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    listener.set_nonblocking(true).unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(async move {
            let listener = tokio::net::TcpListener::from_std(listener).unwrap();
            tonic::transport::Server::builder()
                .serve_with_incoming_shutdown(FlakyServer::new(Echo), tokio_stream::wrappers::TcpListenerStream::new(listener), async {
                    let _ = stopped.await;
                })
                .await
                .unwrap();
        });
    });
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let url = format!("http://{addr}");
    let results = rt.block_on(async {
        let channel = tonic::transport::Endpoint::from_shared(url.clone()).unwrap().connect().await.unwrap();
        // A backend this build does not have (the component without the `wasm` feature) is left out.
        let layered = |backend: Backend| {
            let levee = Levee::builder().backend(backend).seed(1).load(DOC).ok()?;
            let svc = LeveeLayer::new(levee, "api").unwrap().grpc().layer(channel.clone());
            Some(FlakyClient::with_origin(svc, url.parse().unwrap()))
        };
        let mut contenders: Vec<(&str, Contender)> = Vec::new();
        if wanted("tonic, plain channel") {
            contenders.push(("tonic, plain channel", Contender::Plain(FlakyClient::new(channel.clone()))));
        }
        for (name, b) in [("levee layer, wasm", Backend::Wasm), ("levee layer, native", Backend::Native)] {
            if let Some(c) = wanted(name).then(|| layered(b)).flatten() {
                contenders.push((name, Contender::Layered(c)));
            }
        }
        // Warm up every contender (connections, the component's first calls).
        for (_, c) in &mut contenders {
            c.run(warmup).await;
        }
        let mut results: Vec<Vec<(&str, (f64, f64))>> = Vec::new();
        for i in 0..rounds {
            let mut round = Vec::new();
            for (name, c) in &mut contenders {
                round.push((*name, c.run(calls).await));
            }
            eprintln!(
                "round {}/{rounds}: {}",
                i + 1,
                round.iter().map(|(n, (_, t))| format!("{n} {t:.1} us")).collect::<Vec<_>>().join(", ")
            );
            results.push(round);
        }
        results
    });
    // The client's runtime first: its connection to the server closes with it. The server's
    // graceful shutdown waits for its connections, so stopping it while the client's runtime
    // still held the channel hung here, before anything was printed.
    drop(rt);
    let _ = stop.send(());
    server.join().unwrap();
    let median = |i: usize, f: fn(&(f64, f64)) -> f64| {
        let mut v: Vec<f64> = results.iter().map(|r| f(&r[i].1)).collect();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    println!("unary calls over 127.0.0.1: {calls} per contender per round, {rounds} rounds, medians (µs of CPU per call)");
    println!("{:<22} {:>12} {:>12} {:>16}", "contender", "client", "process", "client vs plain");
    let Some(first) = results.first() else { return };
    let base = (first[0].0 == "tonic, plain channel").then(|| median(0, |r| r.1));
    for (i, (name, _)) in first.iter().enumerate() {
        let (client, process) = (median(i, |r| r.1), median(i, |r| r.0));
        match base {
            Some(b) => println!("{name:<22} {client:>12.2} {process:>12.2} {:>15.2}x", client / b),
            None => println!("{name:<22} {client:>12.2} {process:>12.2} {:>16}", "-"),
        }
    }
}

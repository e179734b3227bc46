//! gRPC end to end (feature `grpc`): tonic clients through `LeveeLayer::grpc` against the
//! scripted server of grpc/flaky.proto, written here with tonic and started on 127.0.0.1 (a
//! port the OS picks) by each test, stopped when the test ends. tonic has no retry of its own,
//! so Levee is the only layer that retries. Times are small and real; the assertions are on
//! order and counts (a lower bound where a wait is the point), never on speed.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic, clippy::indexing_slicing)]

#[allow(clippy::all, clippy::pedantic, missing_docs, unused_qualifications)]
#[path = "common/flaky.rs"]
mod flaky;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use flaky::flaky_client::FlakyClient;
use flaky::flaky_server::{Flaky, FlakyServer};
use flaky::{Reply, Request, StatsReply, StatsRequest, Step};
use levee::core::Reason;
use levee::grpc::GrpcService;
use levee::layer::LeveeLayer;
use levee::LeveeError;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;
use tonic::{Code, Status};
use tower::Layer;

const DOC: &str = r#"
policies:
  flaky:
    attempts: 3
    attempt-timeout: 2s
    backoff: {base: 5ms, cap: 10ms}
  limited:
    attempts: 1
    rate-limit: {rate: 1, per: 1h}
  breaker:
    attempts: 1
    breaker:
      window: {kind: count, size: 2}
      minimum-calls: 2
      failure-rate: 50
      open-duration: 1h
  hedged:
    attempt-timeout: 2s
    hedge: {attempts: 2, delay: 50ms}
  stream-breaker:
    attempts: 3
    backoff: {base: 5ms, cap: 10ms}
    breaker:
      window: {kind: count, size: 4}
      minimum-calls: 2
      failure-rate: 50
      open-duration: 1h
  stream-slot:
    attempts: 1
    bulkhead: {max-concurrent: 1}
  short:
    attempts: 2
    attempt-timeout: 300ms
    backoff: {base: 5ms, cap: 10ms}
"#;

// ---- the scripted server ----

#[derive(Default)]
struct Script {
    next: u32,
    stats: StatsReply,
}

#[derive(Clone, Default)]
struct Server {
    scripts: Arc<Mutex<HashMap<String, Script>>>,
}

/// Counts an attempt finished when dropped after `done`, cancelled when dropped before.
struct Attempt {
    server: Server,
    script: String,
    done: bool,
}

impl Drop for Attempt {
    fn drop(&mut self) {
        let mut m = self.server.scripts.lock().unwrap();
        let s = &mut m.entry(self.script.clone()).or_default().stats;
        if self.done {
            s.finished += 1;
        } else {
            s.cancelled += 1;
        }
    }
}

impl Server {
    /// Start attempt N of the request's script: its number and step.
    fn begin(&self, req: &Request) -> (Attempt, u32, Step) {
        let mut m = self.scripts.lock().unwrap();
        let s = m.entry(req.script.clone()).or_default();
        s.next += 1;
        s.stats.started += 1;
        let n = s.next;
        let step = req.steps.get((n as usize).min(req.steps.len()).saturating_sub(1)).cloned().unwrap_or_default();
        (Attempt { server: self.clone(), script: req.script.clone(), done: false }, n, step)
    }
}

fn status_of(step: &Step) -> Status {
    let mut s = Status::new(Code::from(step.code as i32), step.message.clone());
    if let Some(p) = &step.pushback {
        s.metadata_mut().insert("grpc-retry-pushback-ms", p.parse().unwrap());
    }
    s
}

fn reply<T>(req: &tonic::Request<T>, attempt: u32) -> Reply {
    let md = req.metadata();
    let text = |k: &str| md.get(k).and_then(|v| v.to_str().ok()).unwrap_or("").to_string();
    let deadline_ms = md
        .get("grpc-timeout")
        .and_then(|v| levee::grpc::parse_timeout(&v.to_str().unwrap().parse().unwrap()))
        .map_or(-1, |d| d.as_millis() as i64);
    Reply {
        attempt,
        previous_attempts: text("grpc-previous-rpc-attempts"),
        deadline_ms,
        authority: text("x-authority"),
        ..Reply::default()
    }
}

type ReplyStream = Pin<Box<dyn tokio_stream::Stream<Item = Result<Reply, Status>> + Send>>;

#[tonic::async_trait]
impl Flaky for Server {
    async fn unary(&self, req: tonic::Request<Request>) -> Result<tonic::Response<Reply>, Status> {
        let (mut guard, n, step) = self.begin(req.get_ref());
        tokio::time::sleep(Duration::from_millis(step.delay_ms.into())).await;
        guard.done = true;
        if step.code != 0 {
            return Err(status_of(&step));
        }
        let mut r = reply(&req, n);
        r.payload = req.get_ref().payload.clone();
        Ok(tonic::Response::new(r))
    }

    type ServerStreamStream = ReplyStream;

    async fn server_stream(&self, req: tonic::Request<Request>) -> Result<tonic::Response<ReplyStream>, Status> {
        let (guard, n, step) = self.begin(req.get_ref());
        let first = reply(&req, n);
        let (tx, rx) = mpsc::channel(1);
        tokio::spawn(async move {
            let mut guard = guard; // the whole guard, not only its field
            for _ in 0..step.messages {
                tokio::select! {
                    () = tokio::time::sleep(Duration::from_millis(step.delay_ms.into())) => {}
                    () = tx.closed() => return,
                }
                if tx.send(Ok(first.clone())).await.is_err() {
                    return;
                }
            }
            // The status comes after the head (and the messages): trailers, not trailers-only.
            guard.done = true;
            if step.code != 0 {
                let _ = tx.send(Err(status_of(&step))).await;
            }
        });
        Ok(tonic::Response::new(Box::pin(ReceiverStream::new(rx))))
    }

    async fn client_stream(&self, req: tonic::Request<tonic::Streaming<Request>>) -> Result<tonic::Response<Reply>, Status> {
        let md = tonic::Request::from_parts(req.metadata().clone(), Default::default(), ());
        let mut stream = req.into_inner();
        let mut first: Option<Request> = None;
        let mut received = 0;
        while let Some(m) = stream.message().await? {
            received += 1;
            first.get_or_insert(m);
        }
        let first = first.unwrap_or_default();
        let (mut guard, n, step) = self.begin(&first);
        tokio::time::sleep(Duration::from_millis(step.delay_ms.into())).await;
        guard.done = true;
        if step.code != 0 {
            return Err(status_of(&step));
        }
        Ok(tonic::Response::new(Reply { received, ..reply(&md, n) }))
    }

    async fn stats(&self, req: tonic::Request<StatsRequest>) -> Result<tonic::Response<StatsReply>, Status> {
        let m = self.scripts.lock().unwrap();
        Ok(tonic::Response::new(m.get(&req.get_ref().script).map(|s| s.stats).unwrap_or_default()))
    }
}

/// A server on 127.0.0.1, stopped when dropped.
struct Running {
    addr: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
}

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
    }
}

async fn start() -> Running {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    // The request's `:authority`, for `Reply.authority`.
    let authority = tower::util::MapRequestLayer::new(|mut r: http::Request<tonic::body::Body>| {
        if let Some(a) = r.uri().authority().and_then(|a| a.as_str().parse().ok()) {
            r.headers_mut().insert("x-authority", a);
        }
        r
    });
    let server = tonic::transport::Server::builder().layer(authority).serve_with_incoming_shutdown(
        FlakyServer::new(Server::default()),
        tokio_stream::wrappers::TcpListenerStream::new(listener),
        async {
            let _ = stopped.await;
        },
    );
    tokio::spawn(server);
    Running { addr, stop: Some(stop) }
}

impl Running {
    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// A plain client (no Levee), for `Stats`.
    async fn plain(&self) -> FlakyClient<Channel> {
        FlakyClient::connect(self.url()).await.unwrap()
    }

    async fn stats(&self, script: &str) -> StatsReply {
        self.plain().await.stats(StatsRequest { script: script.into() }).await.unwrap().into_inner()
    }

    /// The stats once `done` holds of them (the server counts a cancellation when it sees the
    /// reset, after the client has moved on); the last seen after 5 s.
    async fn stats_when(&self, script: &str, done: impl Fn(&StatsReply) -> bool) -> StatsReply {
        let t0 = Instant::now();
        loop {
            let s = self.stats(script).await;
            if done(&s) || t0.elapsed() > Duration::from_secs(5) {
                return s;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
}

fn levee() -> levee::Levee {
    levee::Levee::builder().seed(7).load(DOC).expect("the document loads")
}

type Client = FlakyClient<GrpcService<Channel>>;

/// A client of `server` through Levee's layer under `policy` (keyed by the server's authority).
fn client(l: &levee::Levee, policy: &str, server: &Running) -> Client {
    let channel = tonic::transport::Endpoint::from_shared(server.url()).unwrap().connect_lazy();
    let svc = LeveeLayer::new(l.clone(), policy).unwrap().grpc().layer(channel);
    FlakyClient::with_origin(svc, server.url().parse().unwrap())
}

fn step(code: Code) -> Step {
    Step { code: code as u32, ..Step::default() }
}

fn script(name: &str, steps: Vec<Step>) -> Request {
    Request { script: name.into(), steps, ..Request::default() }
}

fn levee_error(s: &Status) -> &LeveeError<Status> {
    std::error::Error::source(s).and_then(|e| e.downcast_ref::<LeveeError<Status>>()).expect("the LeveeError is the source")
}

// ---- the tests ----

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unavailable_is_retried_with_the_attempt_count() {
    let server = start().await;
    let mut c = client(&levee(), "flaky", &server);
    let mut req = script("unavailable", vec![step(Code::Unavailable), step(Code::Unavailable), step(Code::Ok)]);
    req.payload = b"hello".to_vec();
    let r = c.unary(req).await.expect("the third attempt succeeds").into_inner();
    assert_eq!(r.attempt, 3);
    assert_eq!(r.previous_attempts, "2", "A6: attempts already sent");
    assert_eq!(r.payload, b"hello", "the buffered request is sent again whole");
    assert_eq!(r.authority, server.addr.to_string());
    assert_eq!(server.stats("unavailable").await.started, 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_argument_is_not_retried() {
    let server = start().await;
    let mut c = client(&levee(), "flaky", &server);
    let mut bad = step(Code::InvalidArgument);
    bad.message = "no such thing".into();
    let e = c.unary(script("invalid", vec![bad, step(Code::Ok)])).await.expect_err("not retried");
    assert_eq!(e.code(), Code::InvalidArgument);
    assert_eq!(e.message(), "no such thing", "the server's own status reaches the caller");
    assert_eq!(server.stats("invalid").await.started, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pushback_is_honoured_and_a_negative_one_stops_retries() {
    let server = start().await;
    let mut c = client(&levee(), "flaky", &server);
    let pushed = Step { code: Code::ResourceExhausted as u32, pushback: Some("200".into()), ..Step::default() };
    let t0 = Instant::now();
    let r = c.unary(script("pushback", vec![pushed, step(Code::Ok)])).await.expect("retried after the pushback").into_inner();
    assert_eq!(r.attempt, 2);
    assert!(t0.elapsed() >= Duration::from_millis(200), "the retry came {:?} after the first attempt", t0.elapsed());

    let stop = Step { code: Code::Unavailable as u32, pushback: Some("-1".into()), ..Step::default() };
    let e = c.unary(script("negative", vec![stop, step(Code::Ok)])).await.expect_err("a negative pushback stops retries");
    assert_eq!(e.code(), Code::Unavailable);
    assert_eq!(server.stats("negative").await.started, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_rate_limit_rejects_locally_with_resource_exhausted() {
    let server = start().await;
    let mut c = client(&levee(), "limited", &server);
    c.unary(script("limit", vec![step(Code::Ok)])).await.expect("the first call is within the limit");
    let e = c.unary(script("limit", vec![step(Code::Ok)])).await.expect_err("the second is over it");
    assert_eq!(e.code(), Code::ResourceExhausted);
    let le = levee_error(&e);
    assert_eq!(le.reason, Reason::RateLimited);
    assert!(le.is_rejected());
    assert_eq!(server.stats("limit").await.started, 1, "the rejected call never reached the server");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_breaker_opens_per_target() {
    let (down, up) = (start().await, start().await);
    let l = levee();
    let (mut to_down, mut to_up) = (client(&l, "breaker", &down), client(&l, "breaker", &up));
    for _ in 0..2 {
        let e = to_down.unary(script("down", vec![step(Code::Unavailable)])).await.expect_err("the server fails");
        assert_eq!(e.code(), Code::Unavailable);
    }
    let e = to_down.unary(script("down", vec![step(Code::Unavailable)])).await.expect_err("the breaker is open");
    assert_eq!(e.code(), Code::Unavailable);
    assert_eq!(levee_error(&e).reason, Reason::BreakerOpen);
    assert_eq!(down.stats("down").await.started, 2, "the open breaker sent nothing");
    // The other target has its own breaker (the key is the authority).
    let r = to_up.unary(script("up", vec![step(Code::Ok)])).await.expect("the other target passes");
    assert_eq!(r.into_inner().attempt, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hedge_wins_over_a_slow_attempt_which_is_cancelled_at_the_server() {
    let server = start().await;
    let mut c = client(&levee(), "hedged", &server);
    let slow = Step { delay_ms: 2_000, ..Step::default() };
    let r = c.unary(script("hedge", vec![slow, step(Code::Ok)])).await.expect("the hedge answers").into_inner();
    assert_eq!(r.attempt, 2);
    assert_eq!(r.previous_attempts, "1");
    let s = server.stats_when("hedge", |s| s.cancelled == 1).await;
    assert_eq!((s.started, s.finished, s.cancelled), (2, 1, 1), "the slow attempt was cancelled: {s:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_deadline_is_the_attempt_timeout_or_the_callers_if_earlier() {
    let server = start().await;
    let mut c = client(&levee(), "short", &server);
    let r = c.unary(script("deadline", vec![step(Code::Ok)])).await.unwrap().into_inner();
    assert!((0..=300).contains(&r.deadline_ms), "the server saw a deadline of {} ms", r.deadline_ms);
    assert!(r.deadline_ms > 100, "the whole attempt timeout is granted: {} ms", r.deadline_ms);

    let mut req = tonic::Request::new(script("caller", vec![step(Code::Ok)]));
    req.set_timeout(Duration::from_millis(100));
    let r = c.unary(req).await.unwrap().into_inner();
    assert!((0..=100).contains(&r.deadline_ms), "the caller's deadline bounds the attempt's: {} ms", r.deadline_ms);

    // The caller's deadline also bounds the whole call: no retry after it. Three timers end
    // the attempt at the same instant (within a timer tick): the layer's for the caller's
    // deadline (DEADLINE_EXCEEDED), tonic's channel's for the attempt's `grpc-timeout`, and the
    // tonic server's for the same header, which answers CANCELLED ("Timeout expired"); when the
    // server's answer comes first, the caller gets it as the server's status.
    let mut req = tonic::Request::new(script("expired", vec![Step { delay_ms: 1_000, ..Step::default() }]));
    req.set_timeout(Duration::from_millis(100));
    let e = c.unary(req).await.expect_err("the deadline passes");
    let from_layer = std::error::Error::source(&e).and_then(|s| s.downcast_ref::<LeveeError<Status>>()).is_some();
    match e.code() {
        Code::DeadlineExceeded => assert!(from_layer, "{e:?}"),
        Code::Cancelled => assert!(!from_layer, "the server's own deadline answer: {e:?}"),
        other => panic!("{other:?}: {e:?}"),
    }
    let s = server.stats_when("expired", |s| s.cancelled == 1).await;
    assert_eq!((s.started, s.cancelled), (1, 1), "{s:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_stream_is_retried_only_before_its_first_message() {
    let server = start().await;
    let mut c = client(&levee(), "flaky", &server);
    // Attempt 1 fails before any message (its status comes in the trailers): retried. Attempt
    // 2 sends two messages and then fails: committed, the failure is the caller's.
    let before = step(Code::Unavailable);
    let after = Step { code: Code::Unavailable as u32, messages: 2, delay_ms: 5, ..Step::default() };
    let mut stream = c.server_stream(script("stream", vec![before, after, step(Code::Ok)])).await.expect("committed").into_inner();
    let mut got = Vec::new();
    let end = loop {
        match stream.message().await {
            Ok(Some(m)) => got.push(m.attempt),
            Ok(None) => break None,
            Err(e) => break Some(e.code()),
        }
    };
    assert_eq!(got, vec![2, 2], "both messages of the second attempt");
    assert_eq!(end, Some(Code::Unavailable), "the failure after the commit is final");
    assert_eq!(server.stats("stream").await.started, 2, "no attempt after the commit");
}

/// Read a server stream to its end: the messages' attempt numbers and the final status (`None`: OK).
async fn drain(stream: &mut tonic::Streaming<Reply>) -> (Vec<u32>, Option<Code>) {
    let mut got = Vec::new();
    loop {
        match stream.message().await {
            Ok(Some(m)) => got.push(m.attempt),
            Ok(None) => return (got, None),
            Err(e) => return (got, Some(e.code())),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_failing_after_its_first_message_is_reported_and_opens_the_breaker() {
    let server = start().await;
    let mut c = client(&levee(), "stream-breaker", &server);
    // Each call's stream sends one message, then fails: committed at the message, so the
    // failure is the attempt's outcome, final (not retried), and counted by the breaker. The
    // first call's stream is whole when its message arrives (read at once); the second's
    // second message comes 30 ms after its first (the stream is still open at the commit).
    let whole = Step { code: Code::Unavailable as u32, messages: 1, ..Step::default() };
    let open = Step { code: Code::Unavailable as u32, messages: 2, delay_ms: 30, ..Step::default() };
    for (n, step, expect) in [(1, whole, vec![1]), (2, open.clone(), vec![2, 2])] {
        let mut stream = c.server_stream(script("half", vec![step])).await.expect("committed").into_inner();
        assert_eq!(drain(&mut stream).await, (expect, Some(Code::Unavailable)), "call {n}");
        assert_eq!(server.stats("half").await.started, n, "the failure after the commit is not retried");
    }
    // Two failures of two calls: the breaker is open, and the next call never reaches the server.
    let e = c.server_stream(script("half", vec![open])).await.expect_err("the breaker is open");
    assert_eq!(e.code(), Code::Unavailable);
    assert_eq!(levee_error(&e).reason, Reason::BreakerOpen);
    assert_eq!(server.stats("half").await.started, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_dropped_by_its_caller_is_a_cancellation_not_a_failure() {
    let server = start().await;
    let mut c = client(&levee(), "stream-breaker", &server);
    let slow = Step { messages: 3, delay_ms: 100, ..Step::default() };
    // Twice: read the first message, then drop the stream (the caller's cancellation).
    for n in 1..=2 {
        let mut stream = c.server_stream(script("dropped", vec![slow.clone()])).await.expect("committed").into_inner();
        assert_eq!(stream.message().await.unwrap().map(|m| m.attempt), Some(n));
        drop(stream);
        let s = server.stats_when("dropped", |s| s.cancelled == n).await;
        assert_eq!((s.started, s.cancelled), (n, n), "the server saw the cancellation, and no retry: {s:?}");
    }
    // Not failures: the breaker (two failures in two calls would open it) is still closed.
    let ok = Step { messages: 1, ..Step::default() };
    let mut stream = c.server_stream(script("dropped", vec![ok])).await.expect("the breaker is closed").into_inner();
    assert_eq!(drain(&mut stream).await, (vec![3], None));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_streams_bulkhead_slot_is_held_until_the_stream_ends() {
    let server = start().await;
    let mut c = client(&levee(), "stream-slot", &server);
    let slow = Step { messages: 2, delay_ms: 50, ..Step::default() };
    let mut stream = c.server_stream(script("slot", vec![slow])).await.expect("committed").into_inner();
    assert!(stream.message().await.unwrap().is_some());
    // The stream is open: its attempt holds the one slot.
    let e = c.unary(script("slot-other", vec![step(Code::Ok)])).await.expect_err("the bulkhead is full");
    assert_eq!(e.code(), Code::ResourceExhausted);
    assert_eq!(levee_error(&e).reason, Reason::BulkheadFull);
    assert_eq!(drain(&mut stream).await, (vec![1], None));
    // Ended: the slot is free.
    c.unary(script("slot-other", vec![step(Code::Ok)])).await.expect("the slot is free again");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_committed_stream_outliving_its_attempt_timeout_ends_and_is_not_retried() {
    let server = start().await;
    let mut c = client(&levee(), "short", &server);
    // A message every 100 ms, five of them: the attempt timeout (300 ms) passes mid-stream.
    let long = Step { messages: 5, delay_ms: 100, ..Step::default() };
    let mut stream = c.server_stream(script("outlived", vec![long])).await.expect("committed").into_inner();
    let (got, end) = drain(&mut stream).await;
    assert!(!got.is_empty() && got.len() < 5 && got.iter().all(|&a| a == 1), "{got:?}");
    assert_eq!(end, Some(Code::DeadlineExceeded));
    let s = server.stats_when("outlived", |s| s.cancelled == 1).await;
    assert_eq!((s.started, s.cancelled), (1, 1), "the stream was reset, and not retried: {s:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_callers_deadline_ends_a_committed_stream() {
    let server = start().await;
    let mut c = client(&levee(), "flaky", &server);
    let long = Step { messages: 5, delay_ms: 100, ..Step::default() };
    let mut req = tonic::Request::new(script("caller-stream", vec![long]));
    req.set_timeout(Duration::from_millis(250));
    let mut stream = c.server_stream(req).await.expect("committed").into_inner();
    let (got, end) = drain(&mut stream).await;
    assert!(!got.is_empty() && got.len() < 5, "{got:?}");
    assert_eq!(end, Some(Code::DeadlineExceeded));
    let s = server.stats_when("caller-stream", |s| s.cancelled == 1).await;
    assert_eq!((s.started, s.cancelled), (1, 1), "{s:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hedged_stream_commits_to_the_first_attempt_with_a_message() {
    let server = start().await;
    let mut c = client(&levee(), "hedged", &server);
    // Attempt 1 waits 2 s before its message; the hedge (after 50 ms) sends two at once.
    let slow = Step { messages: 1, delay_ms: 2_000, ..Step::default() };
    let fast = Step { messages: 2, delay_ms: 10, ..Step::default() };
    let mut stream = c.server_stream(script("hedged-stream", vec![slow, fast])).await.expect("the hedge commits").into_inner();
    assert_eq!(drain(&mut stream).await, (vec![2, 2], None));
    let s = server.stats_when("hedged-stream", |s| s.cancelled == 1).await;
    assert_eq!((s.started, s.finished, s.cancelled), (2, 1, 1), "the slow attempt was cancelled: {s:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_buffered_client_stream_is_replayed_and_a_live_one_is_not() {
    let server = start().await;
    let mut c = client(&levee(), "flaky", &server);
    let msgs: Vec<Request> = (0..3).map(|_| script("buffered", vec![step(Code::Unavailable), step(Code::Ok)])).collect();
    let r = c.client_stream(tokio_stream::iter(msgs)).await.expect("replayed").into_inner();
    assert_eq!((r.attempt, r.received), (2, 3), "the second attempt got every message again");

    // Messages from a channel are not all there when the call starts: sent once, not retried.
    let (tx, rx) = mpsc::channel(4);
    let call = tokio::spawn(async move { c.client_stream(ReceiverStream::new(rx)).await });
    for _ in 0..3 {
        tokio::time::sleep(Duration::from_millis(5)).await;
        tx.send(script("live", vec![step(Code::Unavailable), step(Code::Ok)])).await.unwrap();
    }
    drop(tx);
    let e = call.await.unwrap().expect_err("not retried");
    // The server's own status: the policy gave up after a response (as the HTTP layer returns a last 503).
    assert_eq!(e.code(), Code::Unavailable);
    assert_eq!(server.stats("live").await.started, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_cancelled_by_its_caller_is_not_retried_and_the_server_sees_it() {
    let server = start().await;
    let mut c = client(&levee(), "flaky", &server);
    let call = tokio::spawn(async move { c.unary(script("cancel", vec![Step { delay_ms: 5_000, ..Step::default() }])).await });
    let s = server.stats_when("cancel", |s| s.started == 1).await;
    assert_eq!(s.started, 1);
    call.abort();
    assert!(call.await.unwrap_err().is_cancelled());
    let s = server.stats_when("cancel", |s| s.cancelled == 1).await;
    assert_eq!((s.started, s.cancelled), (1, 1), "{s:?}");
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert_eq!(server.stats("cancel").await.started, 1, "no retry after the cancellation");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_connection_is_unavailable_and_retried() {
    // A port nobody listens on: bound, then closed.
    let addr = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    let dead = Running { addr, stop: None };
    let mut c = client(&levee(), "flaky", &dead);
    let e = c.unary(script("dead", vec![step(Code::Ok)])).await.expect_err("nobody listens");
    assert_eq!(e.code(), Code::Unavailable);
    let le = levee_error(&e);
    assert_eq!((le.reason, le.attempts), (Reason::RetriesExhausted, 3));
}

/// The README's gRPC example ("gRPC (feature `grpc`)"), as written there.
mod readme {
    use super::flaky;

    use levee::layer::LeveeLayer;
    use tower::Layer;
    // Your tonic-build client; here the one of grpc/flaky.proto (tests/common/flaky.rs).
    use flaky::{flaky_client::FlakyClient, Request};

    async fn ask(levee: levee::Levee, url: &str) -> Result<u32, tonic::Status> {
        // policies: { grpc-api: { attempts: 3, attempt-timeout: 500ms, deadline: 2s } }
        let channel = tonic::transport::Endpoint::from_shared(url.to_string()).expect("a URL").connect_lazy();
        let layer = LeveeLayer::new(levee, "grpc-api").expect("a policy of the document").grpc();
        // `with_origin`: the requests then carry the authority, which is each call's key.
        let mut client = FlakyClient::with_origin(layer.layer(channel), url.parse().expect("a URI"));
        let mut request = tonic::Request::new(Request { script: "readme".into(), ..Request::default() });
        request.set_timeout(std::time::Duration::from_secs(1)); // the caller's deadline, if it has one
        let reply = client.unary(request).await?; // retried as the policy says
        Ok(reply.into_inner().attempt)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_readme_example_runs() {
        let server = super::start().await;
        let levee = levee::Levee::builder().load("policies: { grpc-api: { attempts: 3, attempt-timeout: 500ms, deadline: 2s } }").unwrap();
        assert_eq!(ask(levee, &server.url()).await.unwrap(), 1);
    }
}
